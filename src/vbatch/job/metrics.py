"""JobMetrics: the thread-safe tally of a batch job, read by the dashboard and the metrics file."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from vbatch.engine_sets.base import EngineReport, EngineState
from vbatch.protocol import Ready, SchedulerStats

FINISH_REASONS = ("stop", "length", "abort", "error")
TERMINAL_STATES = ("done", "failed", "interrupted")
# NOTE: an engine that was up when its job ended (engine_sets.base.EngineState has no such state).
STOPPED = "stopped"
WINDOW_S = 10.0
SAMPLE_PERIOD_S = 1.0
MIN_RATE_SPAN_S = 1.0
MAX_HISTORY = 120


@dataclass(frozen=True)
class EngineSnapshot:
    """One engine of a set: its state, rows in flight, gauges, and per-step figures over the
    window (like JobSnapshot's)."""

    name: str
    state: str
    num_in_flight: int
    num_running: int
    num_waiting: int
    kv_usage: float
    tokens_per_step: float | None
    step_time_s: float | None
    prefix_hit_rate: float | None


@dataclass(frozen=True)
class JobSnapshot:
    """Plain numbers and strings describing a job at one instant; safe to read from any thread.

    Row counts named `num_rows_*` include rows finished by earlier runs of a resumed job;
    `finish_reasons`, `errors_by_kind` and token totals cover this run only. Rates without a
    suffix are over the last WINDOW_S seconds, `*_overall` over this run's running time.
    """

    state: str
    startup_stage: str
    model: str
    input_path: str
    output_path: str
    device: str
    dtype: str
    attention_backend: str
    max_model_len: int | None
    num_kv_blocks: int | None
    kv_cache_bytes: int | None
    elapsed_s: float
    running_s: float
    total_rows: int | None
    num_rows_done: int
    num_rows_errored: int
    num_rows_remaining: int | None
    rows_done_before: int
    finish_reasons: dict[str, int]
    errors_by_kind: dict[str, int]
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    rows_per_s: float
    rows_per_s_overall: float
    eta_s: float | None
    prompt_tps: float
    gen_tps: float
    prompt_tps_overall: float
    gen_tps_overall: float
    gen_tps_history: tuple[float, ...]
    has_engine_stats: bool
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    tokens_per_step: float | None
    step_time_s: float | None
    prefix_hit_rate: float | None
    stats_age_s: float | None
    rows_committed: int
    since_commit_s: float | None
    drain_left_s: float | None
    engines: tuple[EngineSnapshot, ...] = ()
    kernels: tuple[str, ...] = ()
    notices: tuple[str, ...] = ()
    task: str = "generate"  # --task: a pooling job generates no tokens

    @property
    def num_truncated(self) -> int:
        return self.finish_reasons.get("length", 0)

    @property
    def is_finished(self) -> bool:
        return self.state in TERMINAL_STATES


class _Sample(NamedTuple):
    t: float
    num_rows: int
    prompt_tokens: int  # computed ones: the prefix cache's are not prompt throughput
    completion_tokens: int
    stats: SchedulerStats | None
    reports: tuple[EngineReport, ...]


def _engine_tokens(stats: SchedulerStats) -> tuple[int, int]:
    return stats.num_prompt_tokens, stats.num_generation_tokens


class JobMetrics:
    """Accumulates results, engine stats and commits; `snapshot()` turns them into rates.

    Invariants: every mutation holds `_lock` and does O(1) work; `_samples` is time-ordered,
    one sample at most every SAMPLE_PERIOD_S, and its first sample is the newest one taken at or
    before `now - WINDOW_S` (so window rates span the whole window once it has filled).
    SchedulerStats gauges (num_running, num_waiting, kv_usage) are shown as they are; its
    counters (tokens, steps, step_time_s, prefix-cache queries/hits) are cumulative since the
    core started, and per-step or per-second figures come from their deltas between samples.
    """

    def __init__(
        self,
        *,
        total_rows: int | None,
        rows_done_before: int = 0,
        rows_errored_before: int = 0,
        model: str = "",
        input_path: str = "",
        output_path: str = "",
        clock: Callable[[], float] = time.monotonic,
        task: str = "generate",
    ) -> None:
        self._clock = clock
        self._task = task
        self._lock = threading.Lock()
        self._model = model
        self._input_path = input_path
        self._output_path = output_path
        self._total_rows = total_rows
        self._rows_done_before = rows_done_before
        self._rows_errored_before = rows_errored_before
        self._state = "starting"
        self._startup_stage = ""
        self._notices: list[str] = []
        self._info: Ready | None = None
        self._start_t = clock()
        self._run_start_t: float | None = None
        self._end_t: float | None = None
        self._num_rows = 0
        self._finish_reasons = dict.fromkeys(FINISH_REASONS, 0)
        self._errors_by_kind: dict[str, int] = {}
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._cached_tokens = 0
        # NOTE: the prompt tokens rows that ran computed: an error row (a prompt too long, a bad
        # parameter) mostly never reached the engine, though it names its prompt's length.
        self._computed_prompt_tokens = 0
        self._stats: SchedulerStats | None = None
        self._stats_t = 0.0
        self._stats_source: Callable[[], SchedulerStats | None] | None = None
        self._reports: tuple[EngineReport, ...] = ()
        self._reports_source: Callable[[], list[EngineReport]] | None = None
        self._rows_committed = rows_done_before
        self._last_commit_time: float | None = None
        self._drain_deadline: float | None = None
        self._samples: deque[_Sample] = deque([self._take_sample(self._start_t)])
        self._gen_tps_history: deque[float] = deque(maxlen=MAX_HISTORY)

    def set_state(self, state: str) -> None:
        now = self._clock()
        with self._lock:
            self._state = state
            if state == "running":
                self._startup_stage = ""
            if state == "running" and self._run_start_t is None:
                # NOTE: start the rate window here so model loading does not dilute it.
                self._run_start_t = now
                self._samples = deque([self._take_sample(now)])
            if state in TERMINAL_STATES and self._end_t is None:
                self._end_t = now

    def set_startup_stage(self, stage: str) -> None:
        with self._lock:
            self._startup_stage = stage

    def add_notice(self, text: str) -> None:
        """A line for the user about how the job runs (e.g. which Ray cluster it uses)."""
        with self._lock:
            self._notices.append(text)

    def set_engine_info(self, info: Ready) -> None:
        with self._lock:
            self._info = info

    def set_total_rows(self, total: int | None) -> None:
        with self._lock:
            self._total_rows = total

    def on_result(
        self,
        *,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        error_kind: str | None = None,
    ) -> None:
        """Count one finished row. A row is errored when its finish_reason is "error"."""
        now = self._clock()
        with self._lock:
            self._num_rows += 1
            self._finish_reasons[finish_reason] = self._finish_reasons.get(finish_reason, 0) + 1
            if finish_reason == "error":
                kind = error_kind or "error"
                self._errors_by_kind[kind] = self._errors_by_kind.get(kind, 0) + 1
            self._prompt_tokens += prompt_tokens
            self._completion_tokens += completion_tokens
            self._cached_tokens += cached_tokens
            if finish_reason != "error":
                self._computed_prompt_tokens += prompt_tokens - cached_tokens
            if now - self._samples[-1].t >= SAMPLE_PERIOD_S:
                self._add_sample(now)

    def on_engine_stats(self, stats: SchedulerStats) -> None:
        now = self._clock()
        with self._lock:
            self._stats = stats
            self._stats_t = now
            if now - self._samples[-1].t >= SAMPLE_PERIOD_S:
                self._add_sample(now)

    def set_stats_source(
        self,
        source: Callable[[], SchedulerStats | None] | None,
        reports: Callable[[], list[EngineReport]] | None = None,
    ) -> None:
        """Where snapshot() pulls the engines' latest periodic stats from, so they stay fresh
        while no row finishes (e.g. `lambda: llm.latest_stats`), and each engine's report
        (`llm.engine_reports`)."""
        self._stats_source = source
        self._reports_source = reports

    def on_commit(self, *, rows_committed: int) -> None:
        """Record a durable commit; `rows_committed` counts all durable rows so far."""
        now = self._clock()
        with self._lock:
            self._rows_committed = rows_committed
            self._last_commit_time = now

    def set_drain_deadline(self, deadline: float | None) -> None:
        """While draining: the deadline in this object's clock (time.monotonic by default)."""
        with self._lock:
            self._drain_deadline = deadline

    def _take_sample(self, now: float) -> _Sample:
        return _Sample(
            now,
            self._num_rows,
            self._computed_prompt_tokens,
            self._completion_tokens,
            self._stats,
            self._reports,
        )

    def _add_sample(self, now: float) -> None:
        prev = self._samples[-1]
        sample = self._take_sample(now)
        self._samples.append(sample)
        if sample.stats is not None and prev.stats is not None:
            num_gen = sample.stats.num_generation_tokens - prev.stats.num_generation_tokens
        else:
            num_gen = sample.completion_tokens - prev.completion_tokens
        self._gen_tps_history.append(_rate(num_gen, now - prev.t))
        while len(self._samples) >= 2 and self._samples[1].t <= now - WINDOW_S:
            self._samples.popleft()

    def snapshot(self) -> JobSnapshot:
        source = self._stats_source
        if source is not None:
            stats = source()
            if stats is not None and stats is not self._stats:
                self.on_engine_stats(stats)
        reports_source = self._reports_source
        if reports_source is not None:
            reports = tuple(reports_source())
            with self._lock:
                self._reports = reports
        now = self._clock()
        with self._lock:
            if self._end_t is None and now - self._samples[-1].t >= SAMPLE_PERIOD_S:
                self._add_sample(now)
            return self._build_snapshot(now)

    def _build_snapshot(self, now: float) -> JobSnapshot:
        end = self._end_t if self._end_t is not None else now
        run_start = self._run_start_t if self._run_start_t is not None else self._start_t
        running_s = max(end - run_start, 0.0)
        base = self._samples[0]
        window_s = end - base.t
        stats = self._stats
        ended = self._state in TERMINAL_STATES
        rows_per_s = _rate(self._num_rows - base.num_rows, window_s)
        # NOTE: prompt rates count computed tokens (the engine's own count), not cached ones.
        computed_prompt = self._computed_prompt_tokens
        if stats is not None and base.stats is not None:
            prompt_now, gen_now = _engine_tokens(stats)
            prompt_base, gen_base = _engine_tokens(base.stats)
        else:
            prompt_now, gen_now = computed_prompt, self._completion_tokens
            prompt_base, gen_base = base.prompt_tokens, base.completion_tokens
        # NOTE: the engine's counters may lag the rows (a Ray replica's come with its polls, and
        # a short job can end before its first fresh ones), so the rows' own counts bound them.
        prompt_total, gen_total = (
            (
                max(stats.num_prompt_tokens, computed_prompt),
                max(stats.num_generation_tokens, self._completion_tokens),
            )
            if stats
            else (computed_prompt, self._completion_tokens)
        )
        # NOTE: a failed job drops its rows finished since the last commit; resume reruns them.
        num_done = (
            self._rows_committed
            if self._state == "failed"
            else self._rows_done_before + self._num_rows
        )
        remaining = None if self._total_rows is None else max(self._total_rows - num_done, 0)
        if remaining == 0:
            eta_s: float | None = 0.0
        else:
            eta_s = remaining / rows_per_s if remaining is not None and rows_per_s > 0 else None
        info = self._info
        return JobSnapshot(
            state=self._state,
            startup_stage=self._startup_stage,
            notices=tuple(self._notices),
            model=self._model,
            input_path=self._input_path,
            output_path=self._output_path,
            device=info.device if info else "",
            dtype=info.dtype if info else "",
            attention_backend=info.attention_backend if info else "",
            max_model_len=info.max_model_len if info else None,
            num_kv_blocks=info.num_kv_blocks if info else None,
            kv_cache_bytes=info.kv_cache_bytes if info else None,
            kernels=tuple(info.kernels) if info else (),
            elapsed_s=end - self._start_t,
            running_s=running_s,
            total_rows=self._total_rows,
            num_rows_done=num_done,
            num_rows_errored=self._rows_errored_before + self._finish_reasons["error"],
            num_rows_remaining=remaining,
            rows_done_before=self._rows_done_before,
            finish_reasons=dict(self._finish_reasons),
            errors_by_kind=dict(self._errors_by_kind),
            num_prompt_tokens=self._prompt_tokens,
            num_completion_tokens=self._completion_tokens,
            num_cached_tokens=self._cached_tokens,
            rows_per_s=rows_per_s,
            rows_per_s_overall=_rate(self._num_rows, running_s),
            eta_s=eta_s,
            prompt_tps=_rate(prompt_now - prompt_base, window_s),
            gen_tps=_rate(gen_now - gen_base, window_s),
            prompt_tps_overall=_rate(prompt_total, running_s),
            gen_tps_overall=_rate(gen_total, running_s),
            gen_tps_history=tuple(self._gen_tps_history),
            has_engine_stats=stats is not None,
            # NOTE: the engine's last gauges are not the state of a job that has ended.
            num_running=stats.num_running if stats and not ended else 0,
            num_waiting=stats.num_waiting if stats and not ended else 0,
            kv_usage=stats.kv_usage if stats else 0.0,
            num_preemptions=stats.num_preemptions if stats else 0,
            **_step_figures(stats, base.stats),
            stats_age_s=now - self._stats_t if stats else None,
            rows_committed=self._rows_committed,
            since_commit_s=now - self._last_commit_time
            if self._last_commit_time is not None
            else None,
            drain_left_s=(
                max(self._drain_deadline - now, 0.0) if self._drain_deadline is not None else None
            ),
            engines=_engine_snapshots(self._reports, base.reports, ended),
            task=self._task,
        )


def _engine_snapshots(
    reports: tuple[EngineReport, ...], base: tuple[EngineReport, ...], ended: bool
) -> tuple[EngineSnapshot, ...]:
    """Each engine as shown, its per-step figures over the window since `base` (matched by
    name); empty for a single engine, whose figures are the job's own. Once the job has ended,
    as the job's own gauges, no engine has requests, and one that was up is "stopped"."""
    if len(reports) < 2:
        return ()
    base_stats = {report.name: report.stats for report in base}
    snapshots = []
    for report in reports:
        stats = report.stats if not ended else None
        state = report.state.value
        if ended and report.state is not EngineState.DEAD:
            state = STOPPED
        snapshots.append(
            EngineSnapshot(
                name=report.name,
                state=state,
                num_in_flight=report.num_in_flight if not ended else 0,
                num_running=stats.num_running if stats else 0,
                num_waiting=stats.num_waiting if stats else 0,
                kv_usage=report.stats.kv_usage if report.stats else 0.0,
                **_step_figures(report.stats, base_stats.get(report.name)),
            )
        )
    return tuple(snapshots)


def _rate(count: float, seconds: float) -> float:
    # NOTE: a floor on the span keeps the first instants of a job from showing absurd rates.
    return count / max(seconds, MIN_RATE_SPAN_S)


def _step_figures(
    stats: SchedulerStats | None, base: SchedulerStats | None
) -> dict[str, float | None]:
    """Tokens and seconds per step and the prefix-cache hit rate over the window, or since the
    core started when the window holds no steps (no prefix-cache queries)."""
    if stats is None:
        return {"tokens_per_step": None, "step_time_s": None, "prefix_hit_rate": None}
    zero = SchedulerStats()
    step_base = base if base is not None and stats.num_steps > base.num_steps else zero
    num_steps = stats.num_steps - step_base.num_steps
    query_base = (
        base
        if base is not None and stats.prefix_cache_queries > base.prefix_cache_queries
        else zero
    )
    num_queries = stats.prefix_cache_queries - query_base.prefix_cache_queries
    num_tokens = stats.num_scheduled_tokens - step_base.num_scheduled_tokens
    step_time_s = stats.step_time_s - step_base.step_time_s
    num_hits = stats.prefix_cache_hits - query_base.prefix_cache_hits
    return {
        "tokens_per_step": num_tokens / num_steps if num_steps > 0 else None,
        "step_time_s": step_time_s / num_steps if num_steps > 0 else None,
        "prefix_hit_rate": num_hits / num_queries if num_queries > 0 else None,
    }
