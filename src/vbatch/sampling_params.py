"""SamplingParams: how one request samples and when it stops; validated at construction and on
every attribute assignment, then trusted (the core decodes it as a typed struct)."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import msgspec

from vbatch.errors import SamplingParamsError
from vbatch.structured import (
    GuidedDecodingParams,
    StructuredOutput,
    StructuredOutputsParams,
    check_compatible,
    coerce_structured,
)

__all__ = [
    "CHANGES_ARGMAX",
    "GuidedDecodingParams",
    "SamplingParams",
    "StructuredOutputsParams",
    "trust_decoded",
]

MAX_LOGPROBS = 20
# NOTE: a request's samples are n sequences in the core and n detokenizers in the client, so n
# bounds one request's memory and time; 256 covers pass@k-style sampling (OpenAI allows 128).
MAX_N = 256
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# NOTE: the largest finite float32; the sampler computes in float32, so a larger value would be
# inf there (and e.g. -inf / inf is nan).
FLOAT32_MAX = 3.4028234663852886e38

_INT_FIELDS = ("n", "min_tokens", "top_k")
_OPTIONAL_INT_FIELDS = ("max_tokens", "best_of", "truncate_prompt_tokens")
TRUNCATE = "truncate_prompt_tokens"
# NOTE: vLLM's list fields default to None, which ported code passes on (stop=args.stop).
_NONE_IS_EMPTY = ("stop", "stop_token_ids", "bad_words")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


# NOTE: whether a field, away from its default, can move a greedy row off the raw argmax of the
# model's logits (vLLM's is_argmax_invariant, negated). The greedy shortcut in
# SamplingMetadata.build reads it through `argmax_changers`; a field missing here is a test
# failure. Temperature decides greediness itself; top-k/top-p/min-p always keep the top token.
CHANGES_ARGMAX: dict[str, bool] = {
    "n": False,
    "max_tokens": False,
    "min_tokens": True,
    "temperature": False,
    "top_p": False,
    "top_k": False,
    "min_p": False,
    "presence_penalty": True,
    "frequency_penalty": True,
    "repetition_penalty": True,
    "seed": False,
    "stop": False,
    "stop_token_ids": False,
    "ignore_eos": False,
    "logprobs": False,
    "include_stop_str_in_output": False,
    "skip_special_tokens": False,
    "structured": True,
    "logit_bias": True,
    "allowed_token_ids": True,
    "bad_words": True,
    "bad_words_token_ids": True,
    "best_of": False,
    "truncate_prompt_tokens": False,
    "structured_outputs": True,
    "guided_decoding": True,
    "prompt_logprobs": False,
    "detokenize": False,
    "logits_processors": False,
    "spaces_between_special_tokens": False,
}

_trusted = False


def trust_decoded() -> None:
    """Skip validation when this process decodes SamplingParams (the engine core: its client
    validated them where the row entered, and msgspec checks the types on decode)."""
    global _trusted
    _trusted = True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _float32(value: float) -> float:
    """`value` rounded to float32, as the sampler sees it (|value| <= FLOAT32_MAX)."""
    return struct.unpack("f", struct.pack("f", value))[0]


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per-request sampling settings. Also the wire form sent to the engine core.

    Invariants after validate() (run at construction and after every attribute assignment, as
    vLLM scripts set fields after construction; a failed assignment is undone): every value has
    its field's type and is in range (see `validate`); float fields hold Python floats; `stop`
    is a list of non-empty strings; `top_k <= 0` means disabled; `temperature == 0` means
    greedy. `n` is at most MAX_N (256). `max_tokens=None` runs up to the model length.
    vLLM's `structured_outputs` / `guided_decoding` are folded into `structured` (and read None
    after it); assigning any of the three replaces the constraint, None clears it; `bad_words`
    are tokenized on submission into `bad_words_token_ids`.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    best_of: int | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: GuidedDecodingParams | None = None
    # NOTE: with k, each prompt token's logprob and its k most likely alternatives
    # (RequestOutput.prompt_logprobs), from a prefill-only pass that reads nothing from the
    # prefix cache (it needs every position's hidden state) and leaves the prompt's full blocks
    # there for the generation's prefill.
    prompt_logprobs: int | None = None
    # NOTE: vLLM's fields at the only values vbatch runs (their defaults; validate names what
    # else to use), so ported code that passes them keeps working.
    detokenize: bool = True
    logits_processors: Any = None
    # NOTE: vLLM applies this only with a slow tokenizer; vbatch's are fast, as most of vLLM's.
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not _trusted:
            self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        # NOTE: the three constraint fields are one setting: assigning any of them replaces
        # the constraint (None clears it).
        names = _STRUCTURED_FIELDS if name in _STRUCTURED_FIELDS else (name,)
        old = {n: getattr(self, n) for n in names}
        for n in names:
            _set(self, n, None)
        _set(self, name, value)
        if name == "bad_words":
            _set(self, "bad_words_token_ids", [])
        try:
            self.validate()
        except SamplingParamsError:
            for n, v in old.items():
                _set(self, n, v)
            raise

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `clone`)."""
        return msgspec.convert(msgspec.to_builtins(self), SamplingParams)

    def argmax_changers(self) -> frozenset[str]:
        """The fields away from their defaults that can change a greedy row's token."""
        return frozenset(
            name for name in _ARGMAX_FIELDS if getattr(self, name) != getattr(_DEFAULTS, name)
        )

    def max_token_id(self) -> int:
        """The largest token id a field names (-1: none), to check against the vocabulary."""
        ids = [*self.stop_token_ids, *(self.allowed_token_ids or ()), *(self.logit_bias or ())]
        ids.extend(t for word in self.bad_words_token_ids for t in word)
        return max(ids, default=-1)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the repetition, frequency or presence penalty is on."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Check every field's type and range; raise SamplingParamsError naming the first bad one.

        Types are strict: a bool is not an integer or a number, a string is not a number, and a
        float is not a token id. Integers fit int64 (the wire's range). Normalizes in place: a
        `stop` string becomes a one-item list, tuples become lists, integer values of float
        fields become floats, `structured_outputs`/`guided_decoding` move to `structured`. With
        `vocab_size`, every token id a field names must also be below it (`check_vocab`). Ranges:

        - n in [1, MAX_N]; max_tokens None or >= 1; min_tokens in [0, max_tokens]; top_k -1, 0
          or > 0; best_of None or n; truncate_prompt_tokens None, >= 1, or -1 (as vLLM: the
          model's maximum length).
        - Floats are finite and stay finite in float32 (|x| <= 3.4e38), as the sampler computes
          in float32. temperature >= 0; top_p in (0, 1] and still > 0 in float32 (1e-46 rounds
          to 0 there, which would keep no token); min_p in [0, 1]; presence and frequency
          penalties in [-2, 2]; repetition_penalty > 0, also in float32.
        - seed is None or in int64 ([-2**63, 2**63)); each sample's generator is seeded with
          (seed + index) mod 2**64.
        - stop: non-empty strings encodable as UTF-8; stop_token_ids: integers in [0, 2**63);
          None for stop, stop_token_ids or bad_words is no entries (vLLM's default).
        - logprobs is None or an integer in [0, MAX_LOGPROBS]; ignore_eos,
          include_stop_str_in_output and skip_special_tokens are bools.
        - logit_bias maps token ids to values in [-100, 100]; allowed_token_ids is None or a
          non-empty list of token ids; bad_words are non-empty strings.
        """

        def fail(msg: str) -> NoReturn:
            raise SamplingParamsError(msg)

        self._fold_structured(fail)
        for name in _NONE_IS_EMPTY:
            if getattr(self, name) is None:
                _set(self, name, [])

        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value):
                fail(f"{name} must be an integer, got {value!r:.80}")
            if not INT64_MIN <= value <= INT64_MAX:
                fail(f"{name} must fit in a 64-bit signed integer, got {value!r:.80}")
        for name in _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                fail(f"{name} must be an integer or null, got {value!r:.80}")
            if value is not None and value > INT64_MAX:
                fail(f"{name} must fit in a 64-bit signed integer, got {value!r:.80}")
            if value is not None and value < 1 and not (name == TRUNCATE and value == -1):
                also = ", -1 (the model's length)" if name == TRUNCATE else ""
                fail(f"{name} must be at least 1{also} (or null), got {value!r:.80}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                fail(f"{name} must be a number, got {value!r:.80}")
            number = value
            if type(value) is not float:
                try:
                    number = float(value)
                except OverflowError:
                    number = math.inf
            if not -FLOAT32_MAX <= number <= FLOAT32_MAX:
                fail(
                    f"{name} must be finite and at most {FLOAT32_MAX:.4g} in magnitude (the "
                    f"float32 range), got {value!r:.80}"
                )
            if number is not value:
                _set(self, name, number)
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                fail(f"{name} must be true or false, got {value!r:.80}")
        if self.n < 1:
            fail(f"n must be at least 1, got {self.n}")
        if self.n > MAX_N:
            fail(f"n must be at most {MAX_N} (vbatch's cap on samples per request), got {self.n}")
        if self.min_tokens < 0 or self.min_tokens > (self.max_tokens or INT64_MAX):
            fail(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.best_of is not None and self.best_of != self.n:
            fail(
                f"best_of={self.best_of} with n={self.n} is not supported: vbatch returns every "
                "sample it draws; ask for n samples (best_of equal to n, or unset) and rank them "
                "by CompletionOutput.cumulative_logprob"
            )
        if self.temperature < 0.0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if _float32(self.top_p) == 0.0:
            fail(
                f"top_p must be at least 1.4e-45: {self.top_p} is 0 in float32, in which the "
                "sampler computes, and would keep no token"
            )
        if self.top_k < -1:
            fail(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if _float32(self.repetition_penalty) <= 0.0:
            fail(
                f"repetition_penalty must be > 0 (also in float32, in which the sampler "
                f"divides by it), got {self.repetition_penalty}"
            )
        seed = self.seed
        if seed == -1 and _is_int(seed):
            # NOTE: vLLM's "no seed".
            seed = None
            _set(self, "seed", None)
        if seed is not None:
            if not _is_int(seed):
                fail(f"seed must be an integer or null, got {seed!r:.80}")
            if not INT64_MIN <= seed <= INT64_MAX:
                fail(f"seed must fit in a 64-bit signed integer [-2**63, 2**63), got {seed!r:.80}")
        self._validate_stops(fail)
        self._validate_token_lists(fail)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                # NOTE: strict about types (issue 12), where vLLM reads True as 1.
                fail(f"{name} must be null or an integer, got True: pass 1, as vLLM reads True")
        logprobs = self.logprobs
        if logprobs == -1 and _is_int(logprobs):
            fail(
                f"logprobs=-1 (the whole vocabulary) is not supported: vbatch returns the "
                f"sampled token's logprob and at most {MAX_LOGPROBS} top ones; pass 0 to "
                f"{MAX_LOGPROBS}"
            )
        if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
            fail(f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None and (
            not _is_int(prompt_logprobs) or not 0 <= prompt_logprobs <= MAX_LOGPROBS
        ):
            fail(
                f"prompt_logprobs must be null or an integer in [0, {MAX_LOGPROBS}], "
                f"got {prompt_logprobs!r}"
            )
        self._validate_vllm_only(fail)
        check_compatible(self.structured, self.ignore_eos, self.min_tokens)
        if vocab_size is not None:
            self.check_vocab(vocab_size)
        return self

    def _validate_vllm_only(self, fail: Callable[[str], NoReturn]) -> None:
        if self.detokenize is not True:
            fail(
                f"detokenize must be true, got {self.detokenize!r:.40}: vbatch always returns "
                "the text, with the token ids in CompletionOutput.token_ids"
            )
        if self.logits_processors:
            fail(
                "per-request logits_processors are not supported (nor in vLLM's V1 engine); "
                "use logit_bias, allowed_token_ids, bad_words or a structured output"
            )
        _set(self, "logits_processors", None)
        if not isinstance(self.spaces_between_special_tokens, bool):
            fail(
                "spaces_between_special_tokens must be true or false, got "
                f"{self.spaces_between_special_tokens!r:.40}"
            )

    def _fold_structured(self, fail: Callable[[str], NoReturn]) -> None:
        given = [name for name in _STRUCTURED_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            fail(f"give one of structured, structured_outputs, guided_decoding, not {given}")
        structured = self.structured
        for name in ("structured_outputs", "guided_decoding"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, Mapping):
                    # NOTE: vLLM's guided_decoding fields include its backend.
                    kind = (
                        GuidedDecodingParams
                        if name == "guided_decoding"
                        else StructuredOutputsParams
                    )
                    try:
                        value = kind(**value)
                    except TypeError as e:
                        fail(f"{name}: {e}")
                if not isinstance(value, StructuredOutputsParams):
                    fail(
                        f"{name} must be a StructuredOutputsParams or its fields, got {value!r:.80}"
                    )
                structured = value.to_structured()
                _set(self, name, None)
        _set(self, "structured", coerce_structured(structured))

    def _validate_token_lists(self, fail: Callable[[str], NoReturn]) -> None:
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                fail(f"logit_bias must map token ids to numbers, got {bias!r:.80}")
            clean = {}
            for token, value in bias.items():
                token_id = int(token) if isinstance(token, str) and token.isdigit() else token
                if not _is_int(token_id) or not 0 <= token_id <= INT64_MAX:
                    fail(f"logit_bias keys must be token ids (integers >= 0), got {token!r:.80}")
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    fail(f"logit_bias values must be numbers, got {value!r:.80}")
                # NOTE: as vLLM's constructor, any finite bias (its from_optional and the
                # OpenAI API take [-100, 100]).
                if not -FLOAT32_MAX <= value <= FLOAT32_MAX:
                    fail(
                        f"logit_bias values must be finite in float32 (|x| <= {FLOAT32_MAX:.4g}), "
                        f"got {value!r:.80}"
                    )
                clean[token_id] = float(value)
            _set(self, "logit_bias", clean)
        allowed = self.allowed_token_ids
        if allowed is not None:
            if isinstance(allowed, tuple):
                allowed = list(allowed)
                _set(self, "allowed_token_ids", allowed)
            if not isinstance(allowed, list) or not allowed:
                fail(f"allowed_token_ids must be null or a non-empty list, got {allowed!r:.80}")
            if not all(_is_int(t) and 0 <= t <= INT64_MAX for t in allowed):
                fail(f"allowed_token_ids must hold token ids (integers >= 0), got {allowed!r:.80}")
        words = self.bad_words
        if isinstance(words, tuple):
            words = list(words)
            _set(self, "bad_words", words)
        if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
            fail(f"bad_words must be a list of non-empty strings, got {words!r:.200}")
        ids = self.bad_words_token_ids
        if not isinstance(ids, list) or not all(
            isinstance(w, list) and w and all(_is_int(t) and 0 <= t <= INT64_MAX for t in w)
            for w in ids
        ):
            fail(f"bad_words_token_ids must be lists of token ids, got {ids!r:.200}")

    def _validate_stops(self, fail: Callable[[str], NoReturn]) -> None:
        stop = self.stop
        if isinstance(stop, str):
            stop = [stop]
            _set(self, "stop", stop)
        elif isinstance(stop, tuple):
            stop = list(stop)
            _set(self, "stop", stop)
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            fail(f"stop must be a string or a list of non-empty strings, got {stop!r:.200}")
        for s in stop:
            if not s.isascii():
                try:
                    s.encode()
                except UnicodeEncodeError:
                    fail(f"stop strings must be valid Unicode (no lone surrogates), got {s!r:.80}")
        ids = self.stop_token_ids
        if isinstance(ids, tuple):
            ids = list(ids)
            _set(self, "stop_token_ids", ids)
        if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids):
            fail(f"stop_token_ids must be a list of integers in [0, 2**63), got {ids!r:.200}")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise SamplingParamsError if a token id field names an id outside the vocabulary."""
        if self.max_token_id() >= vocab_size:
            raise SamplingParamsError(
                f"token ids in stop_token_ids, logit_bias, allowed_token_ids and bad_words must "
                f"be below the vocabulary size {vocab_size}, got {self.max_token_id()}"
            )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return cls.__struct_fields__

    def to_dict(self) -> dict[str, Any]:
        """Every field, as plain values (the job manifest keeps this)."""
        return {name: msgspec.to_builtins(getattr(self, name)) for name in self.field_names()}

    def updated(self, overrides: Mapping[str, Any]) -> SamplingParams:
        """Return a copy with `overrides` applied; unknown keys are an error."""
        unknown = sorted(set(overrides) - set(self.field_names()))
        if unknown:
            raise SamplingParamsError(
                f"unknown sampling parameter(s) {', '.join(unknown)}; "
                f"valid ones are {', '.join(self.field_names())}"
            )
        merged = self.to_dict()
        if any(name in overrides for name in _STRUCTURED_FIELDS):
            # NOTE: a constraint given as any of its three fields replaces this one's.
            merged.update(dict.fromkeys(_STRUCTURED_FIELDS))
        merged.update(overrides)
        try:
            return SamplingParams(**merged)
        except TypeError as exc:
            raise SamplingParamsError(str(exc)) from None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        return cls().updated(values)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """vLLM's `from_optional`: None means the field's default, and logit_bias values are
        clamped to [-100, 100]."""
        given = {name: value for name, value in kwargs.items() if value is not None}
        bias = given.get("logit_bias")
        if isinstance(bias, Mapping):
            given["logit_bias"] = {
                token: min(100.0, max(-100.0, value))
                if isinstance(value, (int, float)) and not isinstance(value, bool)
                else value
                for token, value in bias.items()
            }
        return cls(**given)

    def update_from_generation_config(
        self, generation_config: Mapping[str, Any], model_eos_token_id: int | None = None
    ) -> None:
        """vLLM's: the EOS ids of a `generation_config` other than the model's own become stop
        token ids (unless ignore_eos), so a sample that ends on one reports it as stop_reason."""
        eos = generation_config.get("eos_token_id")
        if eos is None or self.ignore_eos:
            return
        ids = [eos] if isinstance(eos, int) else list(eos)
        extra = [t for t in ids if t != model_eos_token_id and t not in self.stop_token_ids]
        if extra:
            self.stop_token_ids = [*self.stop_token_ids, *extra]


_set = msgspec.Struct.__setattr__
_STRUCTURED_FIELDS = ("structured", "structured_outputs", "guided_decoding")
_ARGMAX_FIELDS = tuple(name for name, changes in CHANGES_ARGMAX.items() if changes)
_DEFAULTS = SamplingParams()
