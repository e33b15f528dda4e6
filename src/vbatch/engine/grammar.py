"""Structured output in the core: xgrammar grammars compiled once per constraint in worker
threads, and each step's token bitmask, filled in another while the forward pass runs."""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vbatch.engine.sampling_metadata import to_device
from vbatch.engine.sequence import Sequence
from vbatch.grammar_text import constraint_ebnf
from vbatch.structured import (
    EXTRA_HINT,
    StructuredOutput,
    xgrammar_message,
)

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar, GrammarCompiler, GrammarMatcher

MAX_CACHED_GRAMMARS = 1024
# NOTE: compile workers: one long compile leaves another for the rest, smallest first.
NUM_COMPILE_WORKERS = 2
COMPILE_BUDGET_S = 120.0
_STRICT_HINT = (
    " (with strict, the default, only declared properties are generated; give "
    '"strict": false in response_format.json_schema for JSON Schema\'s own defaults)'
)


class GrammarError(Exception):
    """A constraint that cannot be compiled; its message is the row's error."""


class GrammarCache:
    """Compiles constraints in worker threads, each distinct one once (by content, LRU).

    Waiting compiles run smallest first, so a small schema is not queued behind a big one while
    a worker is free. A compile that has used `budget_s` seconds of CPU fails its requests, and a
    fresh worker takes its place while it runs on. Workers run at the lowest CPU priority, so they
    never slow the engine's own threads; the budget counts CPU, not wall time, so that whether a
    constraint fails does not depend on how busy the machine is.
    The tokenizer's vocabulary is read on the first compile, so a job without structured output
    never pays for it. A failed compile's future raises GrammarError.
    """

    def __init__(
        self,
        hf_dir: Path,
        vocab_size: int,
        eos_token_ids: Collection[int],
        budget_s: float = COMPILE_BUDGET_S,
    ) -> None:
        self._hf_dir = hf_dir
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self.budget_s = budget_s
        self._compiler: GrammarCompiler | None = None
        self._futures: OrderedDict[bytes, Future[CompiledGrammar]] = OrderedDict()
        self._queue: list[tuple[int, int, StructuredOutput, Future[CompiledGrammar]]] = []
        self._lock = threading.Condition()
        self._compiler_lock = threading.Lock()
        self._count = itertools.count()
        # NOTE: each running compile's thread clock and its reading at the start (None while the
        # tokenizer is being read).
        self._running: dict[Future[CompiledGrammar], tuple[Callable[[], float], float] | None] = {}
        self._num_workers = 0
        # NOTE: workers still computing a compile the budget failed; they take no queued work.
        self._num_late = 0
        self._closed = False

    def get(self, spec: StructuredOutput) -> Future[CompiledGrammar]:
        key = spec.key
        future = self._futures.get(key)
        if future is not None:
            self._futures.move_to_end(key)
            return future
        future = Future()
        with self._lock:
            heapq.heappush(self._queue, (len(key), next(self._count), spec, future))
            self._start_workers()
            self._lock.notify()
        self._futures[key] = future
        while len(self._futures) > MAX_CACHED_GRAMMARS:
            oldest_key, oldest = next(iter(self._futures.items()))
            if not oldest.done():
                break
            del self._futures[oldest_key]
        return future

    def check_budget(self) -> None:
        """Fail each compile that has used its budget; a new worker replaces its own."""
        with self._lock:
            late = [
                f
                for f, started in self._running.items()
                if started is not None and started[0]() - started[1] > self.budget_s
            ]
            for future in late:
                del self._running[future]
                self._num_late += 1
            if late:
                self._start_workers()
        for future in late:
            _settle(
                future,
                error=GrammarError(
                    f"the constraint did not compile within the {self.budget_s:g} s compile "
                    "budget per constraint (CPU seconds of its compile thread)"
                ),
            )

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            for _, _, _, future in self._queue:
                future.cancel()
            self._queue.clear()
            self._lock.notify_all()

    def _start_workers(self) -> None:
        wanted = min(NUM_COMPILE_WORKERS, len(self._queue) + len(self._running))
        while self._num_workers - self._num_late < wanted:
            self._num_workers += 1
            threading.Thread(target=self._work, name="vbatch-grammar", daemon=True).start()

    def _work(self) -> None:
        _lowest_priority()
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    is_spare = self._num_workers - self._num_late > NUM_COMPILE_WORKERS
                    if is_spare or (not self._lock.wait(5.0) and not self._queue):
                        self._num_workers -= 1
                        return
                if self._closed:
                    self._num_workers -= 1
                    return
                _, _, spec, future = heapq.heappop(self._queue)
                self._running[future] = None
            try:
                _settle(future, result=self._compile(spec, future))
            except GrammarError as e:
                _settle(future, error=e)
            with self._lock:
                if future in self._running:
                    del self._running[future]
                else:
                    # NOTE: the budget failed this compile and let a new worker take its place.
                    self._num_late -= 1

    def _compile(self, spec: StructuredOutput, future: Future[CompiledGrammar]) -> CompiledGrammar:
        with self._compiler_lock:
            compiler = self._compiler or self._make_compiler()
        clock = _thread_cpu_clock()
        with self._lock:
            if future in self._running:
                self._running[future] = (clock, clock())
        try:
            return compiler.compile_grammar(constraint_ebnf(spec))
        except Exception as e:
            message = xgrammar_message(e)
            if spec.strict and "additional properties aren't allowed" in message:
                message += _STRICT_HINT
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


def _settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Set a compile's outcome unless the budget already failed it (or it was cancelled)."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _thread_cpu_clock() -> Callable[[], float]:
    """A clock, readable from any thread, of the CPU seconds the calling thread has used (wall
    time where the platform has no per-thread CPU clock)."""
    try:
        clock_id = time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return time.monotonic
    return functools.partial(time.clock_gettime, clock_id)


def _lowest_priority() -> None:
    """Give the calling thread the lowest CPU priority (Linux: niceness is per thread)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


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
        return StepMask(rows, [seqs[i] for i in rows], bitmask, fill)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StepMask:
    """One step's constrained rows: their seqs and the bitmask being filled for them. After
    accept(), `dead_ends` holds the seqs that had no token left to sample (see accept)."""

    def __init__(
        self,
        rows: list[int],
        seqs: list[Sequence],
        bitmask: torch.Tensor,
        fill: Future[Any],
    ) -> None:
        self.rows = rows
        self.seqs = seqs
        self.bitmask = bitmask
        self._fill = fill
        self.dead_ends: list[Sequence] = []

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of every token a constrained row's grammar forbids to -inf."""
        self._fill.result()
        if logits.device.type == "cpu":
            import xgrammar

            xgrammar.apply_token_bitmask_inplace(logits, self.bitmask, indices=self.rows)
            return
        apply_bitmask_torch(logits, self.bitmask, self.rows)

    def accept(self, token_ids: list[int]) -> None:
        """Advance each constrained row's matcher by its sampled token. A row whose token its
        grammar forbids had every token masked (the grammar's together with the request's
        allowed_token_ids or bans): its seq goes to `dead_ends`, for the caller to
        end; a forbidden token anywhere else is a bug, and raises."""
        for row, seq in zip(self.rows, self.seqs, strict=True):
            token = token_ids[row]
            assert seq.grammar is not None
            if seq.grammar.accept_token(token):
                continue
            word = (
                int(self.bitmask[row, token >> 5]) if 0 <= token < self.bitmask.shape[1] * 32 else 0
            )
            if (word >> (token & 31)) & 1:
                raise RuntimeError(f"the grammar rejected token {token} it allowed")
            self.dead_ends.append(seq)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """xgrammar's CPU kernel in torch ops, for logits on any device: bit j of word w of a row's
    host `bitmask` allows token 32 w + j; forbidden tokens of `rows` get -inf."""
    device = logits.device
    index = to_device(torch.tensor(rows), device)
    words = to_device(bitmask[rows], device)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1).bool()
    forbidden = ~allowed[:, : logits.shape[1]]
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
