"""Sampler: one step's logits to next tokens (allowed tokens, logit bias, penalties, bans,
min-p/top-k/top-p, seeds, logprobs)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vbatch.engine.grammar import StepMask
from vbatch.engine.sampling_metadata import MIN_TEMPERATURE, SamplingMetadata, to_host
from vbatch.engine.sequence import Sequence
from vbatch.protocol import TokenLogprobs

# NOTE: the largest logit a bias or repetition penalty may leave (half float32's largest over
# the smallest temperature, a margin for rounding), so that no later division by a temperature
# overflows to inf, whose softmax is NaN (a repetition_penalty of 1e-38 divides a seen token's
# logit past float32).
LOGIT_LIMIT = torch.finfo(torch.float32).max * MIN_TEMPERATURE / 2
# NOTE: top-p rows whose nucleus is wider than the first NUM_CANDIDATES tokens retry with this
# many times as many, up to a full sort. 128 * 6 = 768 keeps the second try on torch's cheaper
# heap top-k (k <= vocab / 64).
CANDIDATE_GROWTH = 6
DRAW_BLOCK = 256


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
    grammar: StepMask | None = None  # the constrained rows, whose matchers take the tokens
    chosen_ranks: torch.Tensor | None = None  # [m] int64, 1 + tokens more likely than chosen
    # NOTE: [n] bool, rows whose allowed tokens and bans left no token (their id reads 0); None
    # when no row has either. `to_host` lists them in `exhausted_rows`.
    exhausted: torch.Tensor | None = None
    exhausted_rows: list[int] = field(default_factory=list)
    row_seqs: list[Sequence] | None = None  # each row's seq, where `exhausted` is set

    def dead_ends(self) -> list[Sequence]:
        """After to_host and the grammar's accept: the seqs left with no token to sample, by
        their grammar or by their allowed tokens and bans."""
        dead = list(self.grammar.dead_ends) if self.grammar is not None else []
        if self.exhausted_rows:
            assert self.row_seqs is not None
            dead += [self.row_seqs[row] for row in self.exhausted_rows]
        return list({id(seq): seq for seq in dead}.values())

    @classmethod
    def of_token_ids(cls, token_ids: torch.Tensor) -> SamplerOutput:
        """The output of a step that samples ids only (plain greedy)."""
        return cls(token_ids, None, None, None, [], [])

    def to_host(self) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """The sampled token ids and per-row logprobs (None: no row asked), as Python values."""
        tensors = [self.token_ids]
        if self.exhausted is not None:
            tensors.append(self.exhausted)
        if self.chosen_logprobs is not None:
            assert self.top_logprobs is not None and self.top_token_ids is not None
            assert self.chosen_ranks is not None
            tensors += [self.chosen_logprobs, self.top_logprobs, self.top_token_ids]
            tensors.append(self.chosen_ranks)
        host = [t.tolist() for t in to_host(tensors)]
        token_ids = host.pop(0)
        if self.exhausted is not None:
            self.exhausted_rows = [row for row, is_empty in enumerate(host.pop(0)) if is_empty]
        if self.chosen_logprobs is None:
            return token_ids, None
        chosen, top_vals, top_ids, ranks = host
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        for j, (row, k) in enumerate(zip(self.logprob_rows_cpu, self.num_logprobs, strict=True)):
            logprobs[row] = TokenLogprobs(chosen[j], top_ids[j][:k], top_vals[j][:k], ranks[j])
        return token_ids, logprobs


class Sampler:
    """Stateless: a call reads `logits` and `meta` only and never writes to `logits`.

    Order (vLLM V1's): allowed tokens, logit bias, penalties, min_tokens and bad-word bans,
    then greedy argmax, or temperature, min-p, top-k, top-p (over the mass min-p and top-k
    keep, renormalised), and an inverse-CDF draw over kept tokens in id order. A row left with
    no token reads token 0 and is flagged in `exhausted`.
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
        logits = _apply_transforms(logits, meta)
        token_ids = logits.argmax(dim=-1) if meta.is_all_greedy else _sample(logits, meta)
        exhausted = None
        if meta.allowed is not None or meta.banned is not None:
            exhausted = torch.isneginf(logits.amax(dim=-1))
            token_ids = token_ids.masked_fill(exhausted, 0)
        out = SamplerOutput(token_ids, None, None, None, meta.logprob_rows_cpu, meta.num_logprobs)
        out.exhausted = exhausted
        if raw_logprobs is not None:
            assert meta.logprob_rows is not None
            chosen_ids = token_ids.index_select(0, meta.logprob_rows).unsqueeze(1)
            out.chosen_logprobs = raw_logprobs.gather(1, chosen_ids).squeeze(1)
            out.chosen_ranks = (raw_logprobs > out.chosen_logprobs.unsqueeze(1)).sum(dim=1) + 1
            # [m, max_num], descending
            out.top_logprobs, out.top_token_ids = raw_logprobs.topk(max(meta.num_logprobs), dim=-1)
        return out


def _apply_transforms(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """A float32 copy with allowed tokens, bias, penalties and bans applied, in that order (the
    bias before the multiplicative repetition penalty, as vLLM); `logits` itself (as float32)
    when there are none."""
    pen = meta.penalties
    if pen is None and meta.banned is None and meta.logit_bias is None and meta.allowed is None:
        return logits.float()
    logits = logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
    if meta.allowed is not None:
        rows, mask = meta.allowed
        logits[rows] = logits[rows].masked_fill(~mask, -math.inf)
    if meta.logit_bias is not None:
        rows, ids, values = meta.logit_bias
        logits.index_put_((rows, ids), values, accumulate=True)
        logits[rows, ids] = logits[rows, ids].clamp_(max=LOGIT_LIMIT)
    if pen is not None:
        flat = logits.view(-1)
        seen = flat[pen.keys]
        seen = torch.where(seen > 0, seen / pen.repetition, seen * pen.repetition)
        flat[pen.keys] = (seen - pen.subtract).clamp_(max=LOGIT_LIMIT)
    if meta.banned is not None:
        # NOTE: a Python scalar as index_put_'s value is copied from the host, a sync on CUDA.
        logits.index_put_(meta.banned, logits.new_full((), -math.inf))
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
    full_mass = None  # [n, 1]: sum over the vocab of p / p_max, of the tokens min-p keeps
    if meta.needs_full_mass:
        weights = ((logits - logits.amax(dim=-1, keepdim=True)) / meta.temperature).exp_()
        if meta.min_p is not None:
            weights.masked_fill_(weights < meta.min_p, 0.0)
        full_mass = weights.sum(dim=-1, keepdim=True)
        del weights
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
    """Which descending candidates survive min-p, top-k and top-p (over the mass of the first
    two); which rows are short.

    `weights` are exp((logit - max) / temperature) of the candidates of `rows`; a row is short
    when its top-p nucleus may extend past its candidates. None: no row can be (no top-p, or
    the candidates are the whole vocab).
    """
    assert meta.top_k is not None
    width = weights.shape[1]
    top_k = meta.top_k[rows]
    keep = torch.arange(width, device=weights.device) < top_k  # [rows, width]
    if meta.min_p is not None:
        keep &= weights >= meta.min_p[rows]
    is_short = None
    if meta.top_p is not None:
        top_p = meta.top_p[rows]
        cdf = (weights * keep).cumsum(dim=-1)
        mass = cdf[:, -1:]
        if full_mass is not None:
            mass = torch.where(top_k <= width, mass, full_mass[rows])
        keep &= F.pad(cdf[:, :-1], (1, 0)) < top_p * mass
        if width < meta.vocab_size:
            is_short = ((cdf[:, -1:] < top_p * mass) & (top_k > width) & keep[:, -1:]).squeeze(1)
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
