"""SamplingParams: how one request samples and when it stops; validated at construction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from vbatch.errors import SamplingParamsError
from vbatch.structured import StructuredOutput, check_compatible, coerce_structured

MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per-request sampling settings. Also the wire form sent to the engine core.

    Invariants after construction: every value is in range; `stop` is a list of non-empty
    strings; `top_k <= 0` means disabled; `temperature == 0` means greedy.
    """

    n: int = 1
    max_tokens: int = 16
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.structured = coerce_structured(self.structured)
        self.validate()

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

    def validate(self) -> None:
        def fail(msg: str) -> None:
            raise SamplingParamsError(msg)

        for name in ("n", "max_tokens", "min_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                fail(f"{name} must be an integer, got {value!r}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                fail(f"{name} must be a number, got {value!r}")
        if self.n < 1:
            fail(f"n must be at least 1, got {self.n}")
        if self.max_tokens < 1:
            fail(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            fail(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.temperature < 0.0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            fail(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            fail(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            fail(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            fail(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        check_compatible(self.structured, self.ignore_eos, self.min_tokens)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return cls.__struct_fields__

    def to_dict(self) -> dict[str, Any]:
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
        merged.update(overrides)
        try:
            return SamplingParams(**merged)
        except TypeError as exc:
            raise SamplingParamsError(str(exc)) from None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        return cls().updated(values)
