"""Tests for the dashboard renderables and the plain line, on recorded consoles (80, 120 cols)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from rich.console import Console, RenderableType

from vbatch.engine_sets.base import EngineReport, EngineState, sum_stats
from vbatch.job.dashboard import (
    Sparkline,
    fmt_bytes,
    fmt_duration,
    plain_line,
    render_dashboard,
    render_summary,
)
from vbatch.job.metrics import JobMetrics, JobSnapshot
from vbatch.protocol import Ready, SchedulerStats

LONG_PATH = "/data/" + "very-long-directory-name/" * 8 + "prompts.jsonl"
READY = Ready(
    max_model_len=8192, num_kv_blocks=2048, block_size=16, device="cpu", dtype="float32",
    vocab_size=49152, kv_cache_bytes=64 << 20, attention_backend="torch", pid=1,
)  # fmt: skip


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def running_job(*, rows_done_before: int = 0, num_errors: int = 0) -> tuple[JobMetrics, FakeClock]:
    """A job 30 s into running 2000 rows: engine stats, some truncated rows, one commit."""
    clock = FakeClock()
    metrics = JobMetrics(
        total_rows=2000,
        rows_done_before=rows_done_before,
        model="SmolLM2-135M-Instruct.Q4_1.gguf",
        input_path=LONG_PATH,
        output_path="out.parquet",
        clock=clock,
    )
    metrics.set_engine_info(READY)
    metrics.set_state("running")
    for i in range(120):
        clock.now += 0.25
        reason = "length" if i % 10 == 0 else "stop"
        metrics.on_result(finish_reason=reason, prompt_tokens=40, completion_tokens=30)
        stats = SchedulerStats(
            num_running=64, num_waiting=120, kv_usage=0.87, num_kv_blocks=2048,
            prefix_cache_queries=2 * i, prefix_cache_hits=i, num_preemptions=2,
            num_steps=10 * i, step_time_s=0.45 * i, num_scheduled_tokens=3000 * i,
            num_prompt_tokens=200 * i, num_generation_tokens=150 * i,
        )  # fmt: skip
        metrics.on_engine_stats(stats)
    for _ in range(num_errors):
        metrics.on_result(
            finish_reason="error",
            prompt_tokens=0,
            completion_tokens=0,
            error_kind="prompt_too_long",
        )
    metrics.on_commit(rows_committed=rows_done_before + 100)
    clock.now += 3.0
    return metrics, clock


def render(renderable: RenderableType, width: int) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width
    return text


@pytest.mark.parametrize("width", [80, 120])
def test_running_job_shows_every_section_within_the_width(width: int) -> None:
    metrics, _ = running_job()
    text = render(render_dashboard(metrics.snapshot()), width)
    for label in (
        "vbatch running",
        "SmolLM2-135M-Instruct",
        "cpu · float32",
        "ETA",
        "rows/s",
        "120/2,000",
        "Rows",
        "errored",
        "remaining",
        "length 12",
        "truncated",
        "Throughput",
        "prompt tok/s",
        "gen tok/s",
        "Engine",
        "64 running · 120 waiting",
        "tokens/step",
        "300",
        "45.0 ms",
        "KV cache",
        "87% used",
        "prefix hit",
        "50%",
        "preempted",
        "Checkpoint",
        "3s ago",
        "durable rows",
    ):
        assert label in text, label
    assert "grace left" not in text
    assert "…" in text  # the long input path is cut, not wrapped past the border
    assert "█" in text  # the generated tok/s sparkline


def test_the_engine_panel_shows_the_kernels_chosen() -> None:
    metrics, _ = running_job()
    kernels = ["greedy screen off (measured at batch 1 and 32: screen 9.10 ms, fp32 head 4.20 ms)"]
    metrics.set_engine_info(msgspec.structs.replace(READY, kernels=kernels))
    text = render(render_dashboard(metrics.snapshot()), 200)
    (line,) = [line for line in text.splitlines() if "kernels" in line]
    assert line.strip("│ ").split(None, 1) == ["kernels", kernels[0]]


@pytest.mark.parametrize("width", [80, 120])
def test_draining_job_shows_the_grace_time_left(width: int) -> None:
    metrics, clock = running_job()
    metrics.set_state("draining")
    metrics.set_drain_deadline(clock.now + 12.0)
    clock.now += 2.0
    text = render(render_dashboard(metrics.snapshot()), width)
    assert "vbatch draining" in text
    assert "grace left" in text and "10s" in text


@pytest.mark.parametrize("width", [80, 120])
def test_job_with_errors_shows_counts(width: int) -> None:
    metrics, _ = running_job(num_errors=3)
    snap = metrics.snapshot()
    text = render(render_dashboard(snap), width)
    assert "error 3" in text
    assert "errored      3" in text
    summary = render(render_summary(snap), width)
    assert "prompt_too_long: 3" in summary
    assert "out.parquet" in summary


@pytest.mark.parametrize("width", [80, 120])
def test_resumed_job_progress_counts_earlier_rows(width: int) -> None:
    metrics, _ = running_job(rows_done_before=1000)
    snap = metrics.snapshot()
    text = render(render_dashboard(snap), width)
    assert "56% 1,120/2,000" in text
    assert "1,000 rows done earlier" in text
    assert "880" in text  # remaining
    assert "1,000 from earlier runs" in render(render_summary(snap), width)


@pytest.mark.parametrize("width", [80, 120])
def test_startup_shows_the_current_stage(width: int) -> None:
    metrics = JobMetrics(total_rows=None, model="m.gguf", output_path="o.jsonl")
    metrics.set_state("loading model")
    metrics.set_startup_stage("converting GGUF")
    text = render(render_dashboard(metrics.snapshot()), width)
    assert "loading model: converting GGUF" in text
    assert "waiting for engine stats" in text
    assert "ETA" not in text


def test_narrow_terminal_stacks_the_columns() -> None:
    metrics, _ = running_job()
    text = render(render_dashboard(metrics.snapshot()), 50)
    lines = text.splitlines()
    row_of = {label: next(i for i, line in enumerate(lines) if label in line) for label in (
        "Rows", "Throughput", "Engine", "Checkpoint")}  # fmt: skip
    assert row_of["Rows"] < row_of["Throughput"] < row_of["Engine"] < row_of["Checkpoint"]


def test_finished_summary_has_totals_and_throughput() -> None:
    metrics, _ = running_job()
    metrics.set_state("done")
    text = render(render_summary(metrics.snapshot()), 120)
    for label in ("vbatch job summary", "done", "rows done", "120/2,000", "finish reasons"):
        assert label in text, label
    assert "prompt 4,800 · generated 3,600" in text
    assert "wall time" in text and "33s" in text


def test_a_resumed_jobs_summary_says_which_figures_are_this_runs() -> None:
    """Rows errored counted every run, finish reasons, errors and tokens this run only, side by
    side and unmarked: they did not add up, nor match the output file."""
    fresh, _ = running_job(num_errors=2)
    fresh.set_state("done")
    text = render(render_summary(fresh.snapshot()), 120)
    assert "this run" not in text
    metrics = JobMetrics(total_rows=10, rows_done_before=4, rows_errored_before=3)
    metrics.on_result(finish_reason="stop", prompt_tokens=5, completion_tokens=3)
    metrics.on_result(finish_reason="error", prompt_tokens=0, completion_tokens=0, error_kind="x")
    metrics.set_state("done")
    text = render(render_summary(metrics.snapshot()), 120)
    assert "4 from earlier runs" in text and "4 (1 in this run)" in text
    for label in ("finish reasons (this run)", "error (this run)", "tokens (this run)"):
        assert label in text, label


def test_plain_line_has_the_numbers_and_no_control_characters() -> None:
    metrics, clock = running_job(num_errors=2)
    metrics.set_state("draining")
    metrics.set_drain_deadline(clock.now + 5.0)
    line = plain_line(metrics.snapshot())
    assert all(ch.isprintable() for ch in line), repr(line)
    for part in ("122/2,000", "rows/s", "ETA", "errors 2", "truncated 12", "commit 3s ago"):
        assert part in line, part
    assert "grace 5s left" in line
    startup = JobMetrics(total_rows=None)
    startup.set_startup_stage("loading\x1b[31m model\n")
    line = plain_line(startup.snapshot())
    assert line.startswith("vbatch starting: loading")
    assert "\x1b" not in line and "\n" not in line


def test_sparkline_scales_to_the_peak_and_keeps_the_newest() -> None:
    console = Console(record=True, width=3, color_system=None)
    console.print(Sparkline((9.0, 0.0, 5.0, 10.0)))
    assert console.export_text() == " ▄█\n"
    console = Console(record=True, width=3, color_system=None)
    console.print(Sparkline((-4.0, 5.0, 10.0)))
    assert console.export_text() == " ▄█\n"


def test_formatters() -> None:
    assert [fmt_duration(s) for s in (None, 4.4, 125, 3725)] == ["--", "4s", "2m05s", "1h02m05s"]
    assert [fmt_bytes(n) for n in (512, 64 << 20, 3 << 30)] == ["512 B", "64.0 MiB", "3.0 GiB"]


def test_snapshot_is_renderable_without_engine_or_total() -> None:
    snap: JobSnapshot = JobMetrics(total_rows=None).snapshot()
    text = render(render_dashboard(snap), 80)
    assert "vbatch starting" in text
    snap_running = JobMetrics(total_rows=None)
    snap_running.set_state("running")
    assert "0/?" in render(render_dashboard(snap_running.snapshot()), 80)


def engine_set_job() -> JobMetrics:
    """The running job above, over two engine cores: core 1 slower and dead."""
    metrics, _ = running_job()
    stats = [
        SchedulerStats(num_running=40, num_waiting=3, kv_usage=0.62, num_steps=200,
                       step_time_s=9.0, num_generation_tokens=9000),
        SchedulerStats(num_running=24, kv_usage=0.97, num_steps=100, step_time_s=12.5,
                       num_generation_tokens=9000),
    ]  # fmt: skip
    reports = [
        EngineReport("core 0", EngineState.LIVE, stats[0], 43),
        EngineReport("core 1", EngineState.DEAD, stats[1], 24),
    ]
    metrics.set_stats_source(lambda: sum_stats(stats), lambda: reports)
    return metrics


@pytest.mark.parametrize("width", [80, 120])
def test_an_engine_set_shows_a_row_per_engine(width: int) -> None:
    text = render(render_dashboard(engine_set_job().snapshot()), width)
    assert "Engines" in text
    core0 = next(line for line in text.splitlines() if "core 0" in line).split()
    core1 = next(line for line in text.splitlines() if "core 1" in line).split()
    assert core0[3:10] == ["live", "43", "40", "3", "45.0", "ms", "62%"]
    assert core1[3:10] == ["dead", "24", "24", "0", "125.0", "ms", "97%"]
    line = plain_line(engine_set_job().snapshot())
    assert "core 0 live step 45.0 ms KV 62% | core 1 dead step 125.0 ms KV 97%" in line


def test_one_engine_shows_no_engine_rows() -> None:
    metrics, _ = running_job()
    metrics.set_stats_source(
        lambda: None, lambda: [EngineReport("core 0", EngineState.LIVE, None, 4)]
    )
    snap = metrics.snapshot()
    assert "Engines" not in render(render_dashboard(snap), 120)
    assert "core 0" not in plain_line(snap)


def test_a_pooling_job_shows_its_task_rows_and_prompt_tokens() -> None:
    metrics, _ = running_job()
    snap = dataclasses.replace(metrics.snapshot(), task="embed")
    text = render(render_dashboard(snap), 120)
    assert "task" in text and "embed" in text
    assert "prompt tok/s" in text and "rows/s" in text and "gen tok/s" not in text
    plain = render(render_dashboard(metrics.snapshot()), 120)
    assert "gen tok/s" in plain and "embed" not in plain


@pytest.mark.parametrize("width", [20, 30])
def test_a_narrow_terminal_s_summary_shows_every_value(width: int) -> None:
    """Before, the table's label column took every column and the values showed empty."""
    metrics, _ = running_job(num_errors=3)
    snap = metrics.snapshot()
    text = "".join(render(render_summary(snap), width).split())
    for value in (snap.state, f"{snap.num_rows_errored:,}", "prompt_too_long:3", "out.parquet"):
        assert value in text, (value, text)
    assert all(len(line) <= width for line in render(render_summary(snap), width).splitlines())
