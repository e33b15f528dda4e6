"""Sampler: one step's logits to next tokens (penalties, top-k/top-p/min-p, seeds, logprobs)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vbatch.engine.sequence import Sequence
from vbatch.protocol import TokenLogprobs

# NOTE: top-p first looks for each row's nucleus among this many top tokens; rows whose nucleus
# is wider retry with CANDIDATE_GROWTH times as many, up to a full sort. The result is exact.
# 128 * 6 = 768 keeps the second try on torch's cheaper heap top-k (k <= vocab / 64).
NUM_CANDIDATES = 128
CANDIDATE_GROWTH = 6
DRAW_BLOCK = 256
# NOTE: temperatures below this sample greedily, as in vLLM: the rest differs only on near-ties.
MIN_TEMPERATURE = 1e-5


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
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) by min_tokens
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

    @property
    def is_plain_greedy(self) -> bool:
        """Every row takes the raw argmax: greedy, no penalties, bans or logprobs."""
        return (
            self.is_all_greedy
            and self.penalties is None
            and self.banned is None
            and self.logprob_rows is None
        )

    @classmethod
    def build(
        cls,
        seqs: list[Sequence],
        device: torch.device,
        vocab_size: int,
        generators: dict[int, torch.Generator],
        eos_token_ids: Collection[int] = (),
    ) -> SamplingMetadata:
        """Metadata for `seqs` in logits row order; draws this step's seeded uniforms.

        `generators` (seq_id -> CPU generator) persists across steps; missing ones are created
        from `seed + seq.index`. `eos_token_ids` are barred, with each row's stop_token_ids,
        until the row has min_tokens output tokens.
        """
        n = len(seqs)
        assert n > 0
        # NOTE: one pass settles the common batch (greedy, nothing else): a few hundred ns a seq.
        for seq in seqs:
            p = seq.params
            if (
                p.temperature >= MIN_TEMPERATURE
                or p.logprobs is not None
                or p.has_penalties
                or (p.min_tokens > 0 and seq.num_output_tokens < p.min_tokens)
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
                    gen = torch.Generator().manual_seed((p.seed + seq.index) % 2**64)
                    generators[seq.seq_id] = gen
                uniforms[i] = torch.rand((), generator=gen)
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


def free_generators(generators: dict[int, torch.Generator], seq_ids: Iterable[int]) -> None:
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
        if seq.num_output_tokens < p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            rows.extend([i] * len(ids))
            token_ids.extend(ids)
    if not rows:
        return None
    return to_device(torch.tensor(rows), device), to_device(torch.tensor(token_ids), device)


@dataclass
class SamplerOutput:
    """One step's samples, still on the logits' device; `to_host` is the step's one wait."""

    token_ids: torch.Tensor  # [n] int64
    # NOTE: the next three are None when no row asked for logprobs; m = len(logprob_rows_cpu)
    chosen_logprobs: torch.Tensor | None  # [m] float32, of each logprob row's sampled token
    top_logprobs: torch.Tensor | None  # [m, max(num_logprobs)] float32, descending
    top_token_ids: torch.Tensor | None  # [m, max(num_logprobs)] int64
    logprob_rows_cpu: list[int]
    num_logprobs: list[int]

    @classmethod
    def of_token_ids(cls, token_ids: torch.Tensor) -> SamplerOutput:
        """The output of a step that samples ids only (plain greedy)."""
        return cls(token_ids, None, None, None, [], [])

    def to_host(self) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """The sampled token ids and per-row logprobs (None: no row asked), as Python values."""
        if self.chosen_logprobs is None:
            return to_host([self.token_ids])[0].tolist(), None
        assert self.top_logprobs is not None and self.top_token_ids is not None
        tensors = [self.token_ids, self.chosen_logprobs, self.top_logprobs, self.top_token_ids]
        token_ids, chosen, top_vals, top_ids = (t.tolist() for t in to_host(tensors))
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        for j, (row, k) in enumerate(zip(self.logprob_rows_cpu, self.num_logprobs, strict=True)):
            logprobs[row] = TokenLogprobs(chosen[j], top_ids[j][:k], top_vals[j][:k])
        return token_ids, logprobs


class Sampler:
    """Stateless: a call reads `logits` and `meta` only and never writes to `logits`.

    Order: penalties and min_tokens bans, then greedy argmax, or temperature, top-k, top-p (over
    the top-k renormalised mass), min-p, and an inverse-CDF draw over kept tokens in id order.
    Logprobs are of the raw model output, before any of these transforms (as vLLM V1 does).
    A call never waits for the device, except top-p's check of its candidate widths.
    """

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        assert logits.shape == (meta.num_rows, meta.vocab_size), logits.shape
        raw_logprobs = None
        if meta.logprob_rows is not None:
            raw_logprobs = torch.log_softmax(
                logits.index_select(0, meta.logprob_rows).float(), dim=-1
            )
        logits = _apply_penalties(logits, meta)
        token_ids = logits.argmax(dim=-1) if meta.is_all_greedy else _sample(logits, meta)
        out = SamplerOutput(token_ids, None, None, None, meta.logprob_rows_cpu, meta.num_logprobs)
        if raw_logprobs is not None:
            assert meta.logprob_rows is not None
            chosen_ids = token_ids.index_select(0, meta.logprob_rows).unsqueeze(1)
            out.chosen_logprobs = raw_logprobs.gather(1, chosen_ids).squeeze(1)
            # [m, max_num], descending
            out.top_logprobs, out.top_token_ids = raw_logprobs.topk(max(meta.num_logprobs), dim=-1)
        return out


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """A float32 copy with penalties and bans applied; `logits` itself when there are none."""
    pen = meta.penalties
    if pen is None and meta.banned is None:
        return logits.float()
    logits = logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
    if pen is not None:
        flat = logits.view(-1)
        seen = flat[pen.keys]
        seen = torch.where(seen > 0, seen / pen.repetition, seen * pen.repetition)
        flat[pen.keys] = seen - pen.subtract
    if meta.banned is not None:
        logits[meta.banned] = -math.inf
    return logits


def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Draw one token per row from the temperature-scaled, filtered distribution."""
    assert meta.uniforms is not None
    if meta.top_k is None:
        return _sample_full_vocab(logits, meta, None)
    token_ids = torch.empty(meta.num_rows, dtype=torch.int64, device=logits.device)
    for rows, weights, ids in _nucleus_groups(logits, meta):
        # NOTE: kept tokens are drawn in id order so that a seeded row's draw does not depend on
        # the candidate width its batch gives it.
        ids, order = ids.sort(dim=-1)
        draws = _draw(weights.gather(1, order), meta.uniforms[rows])
        token_ids[rows] = ids.gather(1, draws).squeeze(1)
    if meta.unrestricted_rows is not None:
        rows = meta.unrestricted_rows
        token_ids[rows] = _sample_full_vocab(logits.index_select(0, rows), meta, rows)
    return token_ids


def _sample_full_vocab(
    logits: torch.Tensor, meta: SamplingMetadata, rows: torch.Tensor | None
) -> torch.Tensor:
    """Draw from temperature and min-p over the whole vocab for `rows` (all rows when None)."""
    assert meta.temperature is not None and meta.uniforms is not None

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t[rows]

    probs = torch.softmax(logits / pick(meta.temperature), dim=-1)  # [rows, vocab]
    if meta.min_p is not None:
        min_probs = pick(meta.min_p) * probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < min_probs, 0.0)
    return _draw(probs, pick(meta.uniforms)).squeeze(1)


def _nucleus_groups(
    logits: torch.Tensor, meta: SamplingMetadata
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(rows, weights, ids) of the restricted rows, one group per candidate width tried.

    Candidates are each row's top tokens; outside its kept set a weight is 0 and an id is
    vocab_size. A row leaves at the first width that holds its whole nucleus.
    """
    assert meta.top_k is not None and meta.temperature is not None
    vocab_size = meta.vocab_size
    all_rows = torch.arange(meta.num_rows, device=logits.device)
    rows = all_rows if meta.restricted_rows is None else meta.restricted_rows
    full_mass = None  # [n, 1]: sum over the vocab of p / p_max
    if meta.needs_full_mass:
        # NOTE: sum of p / p_max is 1 / p_max; softmax is the cheapest full pass that gives it.
        full_mass = torch.softmax(logits / meta.temperature, dim=-1).amax(dim=-1, keepdim=True)
        full_mass.reciprocal_()
    width = meta.num_candidates
    while True:
        vals, ids = (logits if rows is all_rows else logits.index_select(0, rows)).topk(
            width, dim=-1
        )
        # [rows, width], descending; p / p_max
        weights = ((vals - vals[:, :1]) / meta.temperature[rows]).exp_()
        keep, is_short = _keep_prefix(weights, meta, rows, full_mass)
        weights.masked_fill_(~keep, 0.0)
        ids.masked_fill_(~keep, vocab_size)
        if is_short is None:
            yield rows, weights, ids
            return
        # NOTE: the one wait for the device inside a sampler call, and only with top-p.
        num_short = int(is_short.sum())
        if num_short < len(rows):
            done = ~is_short
            yield rows[done], weights[done], ids[done]
        if num_short == 0:
            return
        rows = rows[is_short]
        width *= CANDIDATE_GROWTH
        # NOTE: past a quarter of the vocab a full sort is no dearer than a partial one.
        width = vocab_size if width > vocab_size // 4 else width


def _keep_prefix(
    weights: torch.Tensor,
    meta: SamplingMetadata,
    rows: torch.Tensor,
    full_mass: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Which descending candidates survive top-k, top-p and min-p; which rows are short.

    `weights` are exp((logit - max) / temperature) of the candidates of `rows`; a row is short
    when its top-p nucleus may extend past its candidates. None: no row can be (no top-p, or
    the candidates are the whole vocab).
    """
    assert meta.top_k is not None
    width = weights.shape[1]
    top_k = meta.top_k[rows]
    keep = torch.arange(width, device=weights.device) < top_k  # [rows, width]
    is_short = None
    if meta.top_p is not None:
        top_p = meta.top_p[rows]
        cdf = (weights * keep).cumsum(dim=-1)
        mass = cdf[:, -1:]
        if full_mass is not None:
            mass = torch.where(top_k <= width, mass, full_mass[rows])
        keep &= F.pad(cdf[:, :-1], (1, 0)) < top_p * mass
        if width < meta.vocab_size:
            is_short = ((cdf[:, -1:] < top_p * mass) & (top_k > width)).squeeze(1)
    if meta.min_p is not None:
        keep &= weights >= meta.min_p[rows]
        if is_short is not None:
            is_short &= keep[:, -1]
    return keep, is_short


def _draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[n, 1] column indices drawn with probability proportional to `weights` [n, width].

    Two-level inverse CDF: pick a block of DRAW_BLOCK columns by block sums, then a column
    inside it; exact, and far cheaper than a cumsum over the whole vocab.
    """
    n, width = weights.shape
    if width % DRAW_BLOCK:
        weights = F.pad(weights, (0, DRAW_BLOCK - width % DRAW_BLOCK))
    blocks = weights.view(n, -1, DRAW_BLOCK)  # [n, num_blocks, DRAW_BLOCK]
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [n, num_blocks]
    targets = uniforms.unsqueeze(1) * block_cdf[:, -1:]
    block = _search(block_cdf, targets)
    targets -= F.pad(block_cdf, (1, 0)).gather(1, block)
    inner_cdf = blocks[torch.arange(n, device=weights.device), block.squeeze(1)].cumsum(dim=-1)
    return block * DRAW_BLOCK + _search(inner_cdf, targets)


def _search(cdf: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[n, 1] first column whose `cdf` exceeds `targets`, never past the last positive weight."""
    index = torch.searchsorted(cdf, targets, right=True)
    # NOTE: rounding can put a target at or past the total; the last column that raises the
    # cdf is the first one equal to the total.
    return torch.minimum(index, (cdf < cdf[:, -1:]).sum(dim=-1, keepdim=True))
