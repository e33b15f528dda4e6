"""Structured output in the core: xgrammar grammars compiled once per constraint in a worker
thread, and each step's token bitmask, filled in another while the forward pass runs."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vbatch.engine.sequence import Sequence
from vbatch.structured import EXTRA_HINT, StructuredOutput

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar, GrammarCompiler, GrammarMatcher

MAX_CACHED_GRAMMARS = 1024
# NOTE: xgrammar's messages start with "[15:09:35] /project/cpp/regex_converter.cc:94: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(Exception):
    """A constraint that cannot be compiled; its message is the row's error."""


class GrammarCache:
    """Compiles constraints in one worker thread, each distinct one once (by content, LRU).

    The tokenizer's vocabulary is read on the first compile, in the worker, so a job without
    structured output never pays for it. A failed compile's future raises GrammarError.
    """

    def __init__(self, hf_dir: Path, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self._hf_dir = hf_dir
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._futures: OrderedDict[bytes, Future[CompiledGrammar]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    def get(self, spec: StructuredOutput) -> Future[CompiledGrammar]:
        key = spec.key
        future = self._futures.get(key)
        if future is not None:
            self._futures.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="vbatch-grammar")
        future = self._pool.submit(self._compile, spec)
        self._futures[key] = future
        while len(self._futures) > MAX_CACHED_GRAMMARS:
            oldest_key, oldest = next(iter(self._futures.items()))
            if not oldest.done():
                break
            del self._futures[oldest_key]
        return future

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        compiler = self._compiler or self._make_compiler()
        try:
            if spec.json_schema is not None:
                assert isinstance(spec.json_schema, str)
                schema = _escaped_bounded_strings(json.loads(spec.json_schema))
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            if spec.json_object:
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                alternatives = " | ".join(json.dumps(choice) for choice in spec.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            assert spec.grammar is not None
            return compiler.compile_grammar(spec.grammar)
        except Exception as e:
            message = _LOG_PREFIX.sub("", str(e).strip())
            raise GrammarError(f"invalid {spec.kind}: {message}") from None

    def _make_compiler(self) -> GrammarCompiler:
        try:
            import xgrammar
        except ImportError:
            raise GrammarError(EXTRA_HINT) from None
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self._hf_dir)
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._eos_token_ids
            )
        except Exception as e:
            raise GrammarError(
                f"structured output cannot use this model's tokenizer: {e}"
            ) from None
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler


def _escaped_bounded_strings(node: Any) -> Any:
    """`node` with each length-bounded string schema given the pattern of its length, over
    characters JSON lets a string hold unescaped.

    NOTE: xgrammar 0.2.9 compiles minLength/maxLength into a rule that admits raw control
    characters, which no strict JSON parser accepts (xgrammar issue #800); a pattern does not.
    """
    if isinstance(node, list):
        return [_escaped_bounded_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _escaped_bounded_strings(value) for key, value in node.items()}
    low, high = node.get("minLength", 0), node.get("maxLength", "")
    if (
        node.get("type") == "string"
        and ("minLength" in node or "maxLength" in node)
        and not {"pattern", "format", "enum", "const"} & node.keys()
        and isinstance(low, int)
        and isinstance(high, (int, str))
    ):
        node["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
        node.pop("minLength", None)
        node.pop("maxLength", None)
    return node


def new_matcher(grammar: CompiledGrammar) -> GrammarMatcher:
    import xgrammar

    return xgrammar.GrammarMatcher(grammar)


class GrammarMasks:
    """The token bitmasks of one engine's steps, filled in a worker thread.

    Use: start() before the forward pass; apply() to its logits; accept() with the sampled ids.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vbatch-mask")
        self._bitmask = torch.empty(0, dtype=torch.int32)
        self._filler: Any = None  # an xgrammar.BatchGrammarMatcher, made on first use

    def start(self, seqs: list[Sequence]) -> StepMask | None:
        """Begin filling the bitmask rows of the constrained `seqs` (logits row order); None
        when no seq is constrained."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return None
        import xgrammar

        matchers = [seqs[i].grammar for i in rows]
        words = (self.vocab_size + 31) // 32
        if self._bitmask.shape[0] < len(seqs):
            self._bitmask = torch.empty(len(seqs), words, dtype=torch.int32)
        bitmask = self._bitmask[: len(seqs)]
        if self._filler is None:
            self._filler = xgrammar.BatchGrammarMatcher(max_threads=1)
        fill = self._pool.submit(
            self._filler.batch_fill_next_token_bitmask, matchers, bitmask, rows
        )
        return StepMask(rows, matchers, bitmask, fill)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StepMask:
    """One step's constrained rows: their matchers and the bitmask being filled for them."""

    def __init__(
        self,
        rows: list[int],
        matchers: list[GrammarMatcher],
        bitmask: torch.Tensor,
        fill: Future[Any],
    ) -> None:
        self.rows = rows
        self.matchers = matchers
        self.bitmask = bitmask
        self._fill = fill

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of every token a constrained row's grammar forbids to -inf."""
        self._fill.result()
        if logits.device.type == "cpu":
            import xgrammar

            xgrammar.apply_token_bitmask_inplace(logits, self.bitmask, indices=self.rows)
            return
        apply_bitmask_torch(logits, self.bitmask, self.rows)

    def accept(self, token_ids: list[int]) -> None:
        """Advance each constrained row's matcher by its sampled token."""
        for row, matcher in zip(self.rows, self.matchers, strict=True):
            if not matcher.accept_token(token_ids[row]):
                raise RuntimeError(f"the grammar rejected token {token_ids[row]} it allowed")


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """xgrammar's CPU kernel in torch ops, for logits on any device: bit j of word w of a row's
    host `bitmask` allows token 32 w + j; forbidden tokens of `rows` get -inf."""
    device = logits.device
    index = torch.tensor(rows, device=device)
    words = bitmask[rows].to(device, non_blocking=True)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1).bool()
    forbidden = ~allowed[:, : logits.shape[1]]
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
