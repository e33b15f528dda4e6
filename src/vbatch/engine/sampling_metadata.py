"""SamplingMetadata: one step's sampling inputs built on the host and sent to the logits' device
(penalties, logit bias, allowed tokens, min_tokens and bad-word bans, temperatures,
top-k/top-p/min-p, seeded draws, logprob rows)."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import torch

from vbatch.engine.sequence import Sequence

# NOTE: top-p first looks for each row's nucleus among this many top tokens; the sampler retries
# rows whose nucleus is wider (see CANDIDATE_GROWTH there), so the result is exact.
NUM_CANDIDATES = 128
# NOTE: temperatures below this sample greedily, as in vLLM: the rest differs only on near-ties.
MIN_TEMPERATURE = 1e-5
# NOTE: min_tokens changes the argmax only while a seq has fewer output tokens than it.
_MIN_TOKENS_ONLY = frozenset({"min_tokens"})


@dataclass
class Penalties:
    """Penalty terms at the (row, token) pairs a penalised row has seen; other logits are kept."""

    keys: torch.Tensor  # [m] int64, unique: row * vocab_size + token id
    repetition: torch.Tensor  # [m] the row's repetition penalty (prompt and output tokens)
    subtract: torch.Tensor  # [m] frequency * output count + presence * (output count > 0)


@dataclass
class SamplingMetadata:
    """One step's sampling inputs, one row per sampling sequence, on the logits' device.

    Invariants: an optional field is None (a list field empty) exactly when no row needs it, so
    the sampler skips that transform; greedy rows (temperature < MIN_TEMPERATURE) get temperature
    1 and top_k 1 and draw nothing from their generator; `uniforms` holds one draw per row, a
    seeded row's from its own generator. Every tensor was built on the host and sent without
    waiting, so building never waits for the device.
    """

    num_rows: int
    vocab_size: int
    logprob_rows_cpu: list[int] = field(default_factory=list)  # rows that asked for logprobs
    num_logprobs: list[int] = field(default_factory=list)  # top logprobs per logprob row
    logprob_rows: torch.Tensor | None = None  # [m] int64, logprob_rows_cpu on device
    penalties: Penalties | None = None
    # (rows, token ids) banned by min_tokens and bad_words
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, bias
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # rows [r], mask [r, vocab] bool
    is_all_greedy: bool = True
    temperature: torch.Tensor | None = None  # [n, 1]; None when all greedy
    uniforms: torch.Tensor | None = None  # [n] in [0, 1); None when all greedy
    top_k: torch.Tensor | None = None  # [n, 1] int64, vocab_size if off; None: no row limited
    top_p: torch.Tensor | None = None  # [n, 1], 1.0 where disabled
    min_p: torch.Tensor | None = None  # [n, 1], 0 where disabled
    restricted_rows: torch.Tensor | None = None  # rows top-k/top-p/greedy limit; None: all
    unrestricted_rows: torch.Tensor | None = None  # the other rows; None: no row
    num_candidates: int = 0  # width of the first top-k candidate set
    needs_full_mass: bool = False  # a top-p row without top-k: its mass spans the whole vocab
    # NOTE: a row has a bad word of several tokens, whose last one is banned only once the
    # others end its output: a later step may ban what this one does not.
    bans_may_start: bool = False
    # NOTE: a row's frequency or presence penalty subtracts nothing until it has an output token.
    penalties_may_start: bool = False

    @property
    def is_plain_greedy(self) -> bool:
        """Every row takes the raw argmax, in this step and the steps that continue it: greedy,
        no penalties, bias, bans (nor bans to come) or logprobs."""
        return (
            self.is_all_greedy
            and not self.bans_may_start
            and not self.penalties_may_start
            and self.penalties is None
            and self.banned is None
            and self.logit_bias is None
            and self.allowed is None
            and self.logprob_rows is None
        )

    @classmethod
    def build(
        cls,
        seqs: list[Sequence],
        device: torch.device,
        vocab_size: int,
        generators: dict[int, SeededUniforms],
        eos_token_ids: Collection[int] = (),
    ) -> SamplingMetadata:
        """Metadata for `seqs` in logits row order; draws this step's seeded uniforms.

        `generators` (seq_id -> its SeededUniforms) persists across steps; missing ones are
        created from `seed + seq.index`. `eos_token_ids` are barred, with each row's stop_token_ids,
        until the row has min_tokens output tokens.
        """
        n = len(seqs)
        assert n > 0
        # NOTE: one pass settles the common batch (greedy, nothing else): a few hundred ns a seq.
        # A row leaves the shortcut by sampling, asking for logprobs, or setting a field that
        # declares it can change the argmax (SamplingParams.CHANGES_ARGMAX).
        for seq in seqs:
            p = seq.params
            changers = seq.argmax_changers
            if (
                p.temperature >= MIN_TEMPERATURE
                or p.logprobs is not None
                or (
                    changers
                    and (changers != _MIN_TOKENS_ONLY or seq.num_output_tokens < p.min_tokens)
                )
            ):
                break
        else:
            return cls(num_rows=n, vocab_size=vocab_size)
        logprob_rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        meta = cls(
            num_rows=n,
            vocab_size=vocab_size,
            logprob_rows_cpu=logprob_rows,
            num_logprobs=[k for seq in seqs if (k := seq.params.logprobs) is not None],
            logprob_rows=to_device(torch.tensor(logprob_rows), device) if logprob_rows else None,
            penalties=_build_penalties(seqs, device, vocab_size),
            banned=_build_banned(seqs, device, eos_token_ids),
            logit_bias=_build_logit_bias(seqs, device),
            allowed=_build_allowed(seqs, device, vocab_size),
            bans_may_start=any(
                len(word) > 1 for seq in seqs for word in seq.params.bad_words_token_ids
            ),
            penalties_may_start=any(seq.params.has_penalties for seq in seqs),
        )
        is_greedy = [seq.params.temperature < MIN_TEMPERATURE for seq in seqs]
        meta.is_all_greedy = all(is_greedy)
        if meta.is_all_greedy:
            return meta
        uniforms = torch.rand(n)
        row_params = []  # (temperature, top_k, top_p, min_p); greedy rows sample top-1
        for i, seq in enumerate(seqs):
            p = seq.params
            if is_greedy[i]:
                row_params.append((1.0, 1, 1.0, 0.0))
                continue
            top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
            row_params.append((p.temperature, top_k, p.top_p, p.min_p))
            if p.seed is not None:
                gen = generators.get(seq.seq_id)
                if gen is None:
                    gen = SeededUniforms(p.seed + seq.index)
                    generators[seq.seq_id] = gen
                uniforms[i] = gen.next()
        temperature, top_k, top_p, min_p = (list(values) for values in zip(*row_params))

        def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype).view(n, 1), device)

        def indices(flags: list[bool]) -> torch.Tensor:
            return to_device(torch.tensor([i for i, flag in enumerate(flags) if flag]), device)

        meta.temperature = column(temperature, torch.float32)
        meta.uniforms = to_device(uniforms, device)
        if max(min_p) > 0.0:
            meta.min_p = column(min_p, torch.float32)
        restricted = [k < vocab_size or q < 1.0 for k, q in zip(top_k, top_p, strict=True)]
        if not any(restricted):
            return meta
        meta.top_k = column(top_k, torch.int64)
        if not all(restricted):
            meta.restricted_rows = indices(restricted)
            meta.unrestricted_rows = indices([not r for r in restricted])
        max_top_k = max((k for k in top_k if k < vocab_size), default=0)
        no_top_k = [q < 1.0 and k >= vocab_size for k, q in zip(top_k, top_p, strict=True)]
        meta.num_candidates = min(
            vocab_size, max(NUM_CANDIDATES if any(no_top_k) else 0, max_top_k)
        )
        if min(top_p) < 1.0:
            meta.top_p = column(top_p, torch.float32)
            meta.needs_full_mass = any(no_top_k)
        return meta


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`; to a GPU through pinned memory, queued without waiting for the copy."""
    if device.type == "cpu":
        return host
    # NOTE: torch's pinned-memory cache keeps the block until the queued copy has read it.
    return host.pin_memory().to(device, non_blocking=True)


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of `tensors` (all on one device); from a GPU with a single wait for them all."""
    if tensors[0].device.type == "cpu":
        return tensors
    hosts = [
        torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        for t in tensors
    ]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return hosts


class SeededUniforms:
    """A seeded sample's stream of uniforms in [0, 1), one a step, from all 64 bits of its seed
    (torch's CPU generator keeps only the low 32: seeds 5 and 5 + 2**32 drew the same samples).

    SplitMix64 (Steele, Lea and Flood, 2014) from the seed's own SplitMix64 mix, so nearby seeds
    (a request's samples take seed + i) start far apart; each uniform is the top 24 bits of an
    output, as many as a float32 holds."""

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = _mix64(seed % 2**64)

    def next(self) -> float:
        self._state = (self._state + _GOLDEN_GAMMA) & _MASK64
        return (_mix64(self._state) >> 40) / 2**24


_MASK64 = 2**64 - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def free_generators(generators: dict[int, SeededUniforms], seq_ids: Iterable[int]) -> None:
    """Forget the generators of finished sequences."""
    for seq_id in seq_ids:
        generators.pop(seq_id, None)


def _build_penalties(
    seqs: list[Sequence], device: torch.device, vocab_size: int
) -> Penalties | None:
    # NOTE: sparse over the tokens each row has seen, not dense [n, vocab]: cost follows the
    # number of tokens, not batch * vocab.
    output_lists, prompt_lists = [], []
    for seq in seqs:
        p = seq.params
        output_lists.append(seq.output_token_ids if p.has_penalties else [])
        prompt_lists.append(seq.prompt_token_ids if p.repetition_penalty != 1 else [])
    if not any(output_lists) and not any(prompt_lists):
        return None

    def flat_keys(token_lists: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
        lengths = torch.tensor([len(ids) for ids in token_lists])
        return ids + torch.arange(len(seqs)).mul_(vocab_size).repeat_interleave(lengths)

    output_keys = flat_keys(output_lists)
    prompt_keys = flat_keys(prompt_lists)
    keys = torch.unique(torch.cat([output_keys, prompt_keys]))  # sorted
    counts = torch.zeros(len(keys)).scatter_add_(
        0, torch.searchsorted(keys, output_keys), torch.ones(len(output_keys))
    )
    row_values = torch.tensor(
        [
            [s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty]
            for s in seqs
        ]
    )[keys // vocab_size]  # [m, 3]
    subtract = row_values[:, 1] * counts + row_values[:, 2] * (counts > 0)
    return Penalties(
        to_device(keys, device), to_device(row_values[:, 0], device), to_device(subtract, device)
    )


def _build_banned(
    seqs: list[Sequence], device: torch.device, eos_token_ids: Collection[int]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    token_ids: list[int] = []
    for i, seq in enumerate(seqs):
        p = seq.params
        ids: set[int] = set()
        if seq.num_output_tokens < p.min_tokens:
            # NOTE: EOS too under ignore_eos, as vLLM's min_tokens bans every stop id it knows.
            ids = set(p.stop_token_ids) | set(eos_token_ids)
        if p.bad_words_token_ids:
            ids |= _bad_word_bans(seq)
        rows.extend([i] * len(ids))
        token_ids.extend(ids)
    if not rows:
        return None
    return to_device(torch.tensor(rows), device), to_device(torch.tensor(token_ids), device)


def _bad_word_bans(seq: Sequence) -> set[int]:
    """The last token of each bad word whose other tokens end the output so far (as vLLM)."""
    output = seq.output_token_ids
    bans = set()
    for word in seq.params.bad_words_token_ids:
        prefix_len = len(word) - 1
        if prefix_len == 0 or (
            len(output) >= prefix_len and output[len(output) - prefix_len :] == word[:-1]
        ):
            bans.add(word[-1])
    return bans


def _build_logit_bias(
    seqs: list[Sequence], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if bias:
            rows.extend([i] * len(bias))
            token_ids.extend(bias)
            values.extend(bias.values())
    if not rows:
        return None
    return (
        to_device(torch.tensor(rows), device),
        to_device(torch.tensor(token_ids), device),
        to_device(torch.tensor(values, dtype=torch.float32), device),
    )


def _build_allowed(
    seqs: list[Sequence], device: torch.device, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = [i for i, seq in enumerate(seqs) if seq.params.allowed_token_ids is not None]
    if not rows:
        return None
    mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for j, i in enumerate(rows):
        mask[j, seqs[i].params.allowed_token_ids] = True
    return to_device(torch.tensor(rows), device), to_device(mask, device)
