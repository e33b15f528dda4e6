"""Tests for JobMetrics: counts, window and overall rates on a fake clock, engine stats deltas."""

from __future__ import annotations

import threading

import pytest

from vbatch.engine_sets.base import EngineReport, EngineState, sum_stats
from vbatch.job.metrics import WINDOW_S, JobMetrics
from vbatch.job.progress import snapshot_to_json
from vbatch.protocol import Ready, SchedulerStats


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def feed_rows(metrics: JobMetrics, clock: FakeClock, seconds: float, rows_per_s: int) -> None:
    """Rows with 50 prompt and 20 completion tokens each, evenly spaced (binary-exact steps)."""
    step = 1.0 / rows_per_s
    for _ in range(round(seconds * rows_per_s)):
        clock.now += step
        metrics.on_result(finish_reason="stop", prompt_tokens=50, completion_tokens=20)


def test_counts_finish_reasons_and_errors() -> None:
    metrics = JobMetrics(total_rows=10, rows_done_before=2, rows_errored_before=1)
    metrics.on_result(finish_reason="stop", prompt_tokens=5, completion_tokens=3, cached_tokens=4)
    metrics.on_result(finish_reason="length", prompt_tokens=5, completion_tokens=8)
    metrics.on_result(finish_reason="error", prompt_tokens=0, completion_tokens=0, error_kind="x")
    metrics.on_result(finish_reason="error", prompt_tokens=0, completion_tokens=0)
    snap = metrics.snapshot()
    assert snap.num_rows_done == 6
    assert snap.num_rows_errored == 3
    assert snap.num_rows_remaining == 4
    assert snap.finish_reasons == {"stop": 1, "length": 1, "abort": 0, "error": 2}
    assert snap.errors_by_kind == {"x": 1, "error": 1}
    assert snap.num_truncated == 1
    assert (snap.num_prompt_tokens, snap.num_completion_tokens, snap.num_cached_tokens) == (
        10,
        11,
        4,
    )


def test_a_failed_job_counts_only_its_committed_rows_as_done() -> None:
    """Its rows finished after the last commit are dropped and rerun on resume: the summary of
    a job stopped by a full disk said 1350 done where 1300 were committed."""
    metrics = JobMetrics(total_rows=10, rows_done_before=2)
    for _ in range(5):
        metrics.on_result(finish_reason="stop", prompt_tokens=5, completion_tokens=3)
    metrics.on_commit(rows_committed=5)
    assert metrics.snapshot().num_rows_done == 7
    metrics.set_state("failed")
    snap = metrics.snapshot()
    assert (snap.num_rows_done, snap.num_rows_remaining) == (5, 5)


def test_window_and_overall_rates_follow_the_clock() -> None:
    clock = FakeClock()
    metrics = JobMetrics(total_rows=1000, clock=clock)
    clock.now += 30.0  # model loading must not count towards the rates
    metrics.set_state("running")
    feed_rows(metrics, clock, seconds=20, rows_per_s=8)
    snap = metrics.snapshot()
    assert snap.rows_per_s == pytest.approx(8.0)
    assert snap.prompt_tps == pytest.approx(400.0)
    assert snap.gen_tps == pytest.approx(160.0)
    assert snap.rows_per_s_overall == pytest.approx(8.0)
    assert snap.eta_s == pytest.approx((1000 - 160) / 8.0)

    feed_rows(metrics, clock, seconds=WINDOW_S + 2, rows_per_s=32)
    snap = metrics.snapshot()
    assert snap.rows_per_s == pytest.approx(32.0)
    assert snap.gen_tps == pytest.approx(640.0)
    assert snap.rows_per_s_overall == pytest.approx((160 + 32 * 12) / 32.0)
    assert snap.gen_tps_history[-1] == pytest.approx(640.0)
    assert snap.gen_tps_history[0] == pytest.approx(160.0)
    assert snap.running_s == pytest.approx(32.0)
    assert snap.elapsed_s == pytest.approx(62.0)


def test_window_rate_decays_when_rows_stop() -> None:
    clock = FakeClock()
    metrics = JobMetrics(total_rows=None, clock=clock)
    metrics.set_state("running")
    feed_rows(metrics, clock, seconds=5, rows_per_s=4)
    for _ in range(4 * int(WINDOW_S) + 8):
        clock.now += 0.25
        metrics.snapshot()
    snap = metrics.snapshot()
    assert snap.rows_per_s == 0.0
    assert snap.eta_s is None
    assert snap.num_rows_remaining is None
    assert snap.rows_per_s_overall > 0


def test_rates_in_the_first_instant_are_not_absurd() -> None:
    clock = FakeClock()
    metrics = JobMetrics(total_rows=100, clock=clock)
    metrics.set_state("running")
    clock.now += 0.001
    for _ in range(5):
        metrics.on_result(finish_reason="stop", prompt_tokens=10, completion_tokens=10)
    snap = metrics.snapshot()
    assert snap.rows_per_s == pytest.approx(5.0)
    assert snap.gen_tps_overall == pytest.approx(50.0)


def test_resumed_job_counts_earlier_rows_but_not_in_rates() -> None:
    clock = FakeClock()
    metrics = JobMetrics(total_rows=500, rows_done_before=300, rows_errored_before=7, clock=clock)
    metrics.set_state("running")
    feed_rows(metrics, clock, seconds=10, rows_per_s=4)
    snap = metrics.snapshot()
    assert snap.num_rows_done == 340
    assert snap.num_rows_errored == 7
    assert snap.num_rows_remaining == 160
    assert snap.rows_per_s == pytest.approx(4.0)
    assert snap.eta_s == pytest.approx(40.0)
    assert snap.rows_committed == 300


def test_engine_stats_gauges_and_counter_deltas() -> None:
    clock = FakeClock()
    metrics = JobMetrics(total_rows=None, clock=clock)
    metrics.set_state("running")
    steps = tokens = gen = prompt = queries = hits = 0
    step_time = 0.0
    for i in range(80):  # 40 s of stats every 0.5 s; the step gets slower after 20 s
        clock.now += 0.5
        slow = i >= 40
        steps += 10
        step_time += 10 * (0.05 if slow else 0.02)
        tokens += 10 * 256
        gen += 10 * 200
        prompt += 10 * 56
        queries += 4
        hits += 3 if slow else 1
        stats = SchedulerStats(
            num_running=7, num_waiting=3, kv_usage=0.5, num_kv_blocks=100,
            prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=i // 10,
            num_steps=steps, step_time_s=step_time, num_scheduled_tokens=tokens,
            num_prompt_tokens=prompt, num_generation_tokens=gen,
        )  # fmt: skip
        metrics.on_engine_stats(stats)
    snap = metrics.snapshot()
    assert (snap.num_running, snap.num_waiting, snap.kv_usage) == (7, 3, 0.5)
    assert snap.num_preemptions == 7
    assert snap.tokens_per_step == pytest.approx(256.0)
    assert snap.step_time_s == pytest.approx(0.05)
    assert snap.prefix_hit_rate == pytest.approx(0.75)
    assert snap.gen_tps == pytest.approx(4000.0)
    assert snap.prompt_tps == pytest.approx(1120.0)
    assert snap.gen_tps_overall == pytest.approx(gen / 40.0)
    assert snap.stats_age_s == 0.0
    clock.now += 3.0
    assert metrics.snapshot().stats_age_s == pytest.approx(3.0)


def test_snapshot_pulls_fresh_stats_while_no_row_finishes() -> None:
    clock = FakeClock()
    metrics = JobMetrics(total_rows=10, clock=clock)
    metrics.set_state("running")
    latest: list[SchedulerStats | None] = [None]
    metrics.set_stats_source(lambda: latest[0])
    assert metrics.snapshot().stats_age_s is None
    for i in range(1, 41):  # 20 s of engine stats, no finished row at all
        clock.now += 0.5
        latest[0] = SchedulerStats(
            num_running=4, num_steps=i, step_time_s=0.1 * i, num_generation_tokens=40 * i
        )
        snap = metrics.snapshot()
    assert snap.num_rows_done == 0
    assert snap.stats_age_s == 0.0
    assert snap.num_running == 4
    assert snap.gen_tps == pytest.approx(80.0)
    metrics.set_stats_source(None)
    clock.now += 2.0
    assert metrics.snapshot().stats_age_s == pytest.approx(2.0)


def test_overall_rates_never_fall_below_the_rows_own_counts() -> None:
    """Stats that lag the rows (a Ray replica's last poll came before its last steps): the
    overall rates count at least the rows' generated and computed prompt tokens."""
    clock = FakeClock()
    metrics = JobMetrics(total_rows=None, clock=clock)
    metrics.set_state("running")
    metrics.on_engine_stats(SchedulerStats(num_prompt_tokens=40, num_generation_tokens=10))
    clock.now += 2.0
    for _ in range(10):
        metrics.on_result(
            finish_reason="length", prompt_tokens=50, completion_tokens=20, cached_tokens=10
        )
    snap = metrics.snapshot()
    assert snap.gen_tps_overall == pytest.approx(200 / 2.0)
    assert snap.prompt_tps_overall == pytest.approx(400 / 2.0)


def test_step_figures_fall_back_to_totals_when_the_window_has_no_steps() -> None:
    clock = FakeClock()
    metrics = JobMetrics(total_rows=None, clock=clock)
    stats = SchedulerStats(
        num_steps=4, step_time_s=0.4, num_scheduled_tokens=40, prefix_cache_queries=2
    )
    metrics.on_engine_stats(stats)
    clock.now += 30.0
    metrics.on_engine_stats(stats)
    snap = metrics.snapshot()
    assert snap.tokens_per_step == pytest.approx(10.0)
    assert snap.step_time_s == pytest.approx(0.1)
    assert snap.prefix_hit_rate == 0.0
    assert JobMetrics(total_rows=None).snapshot().tokens_per_step is None


def test_states_commit_drain_and_engine_info() -> None:
    clock = FakeClock()
    metrics = JobMetrics(total_rows=3, model="m", input_path="in", output_path="out", clock=clock)
    assert metrics.snapshot().state == "starting"
    metrics.set_state("loading model")
    metrics.set_startup_stage("converting GGUF")
    metrics.set_engine_info(
        Ready(
            max_model_len=2048, num_kv_blocks=64, block_size=16, device="cpu", dtype="float32",
            vocab_size=10, kv_cache_bytes=1 << 20, attention_backend="torch", pid=1,
        )
    )  # fmt: skip
    snap = metrics.snapshot()
    assert (snap.state, snap.startup_stage, snap.device, snap.num_kv_blocks) == (
        "loading model",
        "converting GGUF",
        "cpu",
        64,
    )
    assert snap.since_commit_s is None and snap.drain_left_s is None
    metrics.set_state("running")
    clock.now += 5.0
    metrics.on_commit(rows_committed=2)
    metrics.set_state("draining")
    metrics.set_drain_deadline(clock.now + 30.0)
    clock.now += 4.0
    snap = metrics.snapshot()
    assert snap.since_commit_s == pytest.approx(4.0)
    assert snap.rows_committed == 2
    assert snap.drain_left_s == pytest.approx(26.0)
    metrics.set_total_rows(4)
    metrics.set_state("interrupted")
    clock.now += 100.0
    snap = metrics.snapshot()
    assert snap.total_rows == 4
    assert snap.elapsed_s == pytest.approx(9.0)
    assert snap.is_finished


def test_concurrent_writers_and_reader_lose_nothing() -> None:
    metrics = JobMetrics(total_rows=None)
    num_threads, num_each = 4, 5000

    def write() -> None:
        for _ in range(num_each):
            metrics.on_result(finish_reason="stop", prompt_tokens=1, completion_tokens=2)

    threads = [threading.Thread(target=write) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        snap = metrics.snapshot()
        assert snap.num_completion_tokens == 2 * snap.num_rows_done
    for thread in threads:
        thread.join()
    snap = metrics.snapshot()
    assert snap.num_rows_done == num_threads * num_each
    assert snap.num_prompt_tokens == num_threads * num_each


def test_an_engine_set_gets_per_engine_figures_and_one_engine_none() -> None:
    clock = FakeClock()
    metrics = JobMetrics(total_rows=10, clock=clock)
    metrics.set_state("running")
    reports: list[EngineReport] = []
    metrics.set_stats_source(lambda: sum_stats([r.stats for r in reports]), lambda: reports)
    for i in range(1, 41):  # 20 s: core 0 steps in 10 ms, core 1 in 30 ms, then core 1 dies
        clock.now += 0.5
        state = EngineState.LIVE if i < 40 else EngineState.DEAD
        reports[:] = [
            EngineReport("core 0", EngineState.LIVE, SchedulerStats(
                num_running=3, kv_usage=0.5, num_kv_blocks=100, num_steps=10 * i,
                step_time_s=0.1 * i, num_scheduled_tokens=40 * i,
            ), 7),
            EngineReport("core 1", state, SchedulerStats(
                num_running=1, num_waiting=2, kv_usage=0.25, num_kv_blocks=300, num_steps=5 * i,
                step_time_s=0.15 * i, num_scheduled_tokens=50 * i,
            ), 3),
        ]  # fmt: skip
        snap = metrics.snapshot()
    core0, core1 = snap.engines
    assert (core0.name, core0.state, core0.num_in_flight, core0.num_running) == (
        "core 0",
        "live",
        7,
        3,
    )
    assert core0.step_time_s == pytest.approx(0.01) and core0.tokens_per_step == pytest.approx(4)
    assert (core1.state, core1.num_waiting, core1.kv_usage) == ("dead", 2, 0.25)
    assert core1.step_time_s == pytest.approx(0.03) and core1.tokens_per_step == pytest.approx(10)
    # NOTE: the job's own figures are the sum: 15 steps of 40 + 50 tokens per half second.
    assert snap.num_running == 4 and snap.kv_usage == pytest.approx(0.3125)
    assert snap.tokens_per_step == pytest.approx(6)
    data = snapshot_to_json(snap)
    assert [e["name"] for e in data["engines"]] == ["core 0", "core 1"]
    assert data["engines"][1]["step_time_s"] == pytest.approx(0.03)
    # NOTE: once the job has ended its engines hold no requests, as the job's own gauges say,
    # and the one that was up is stopped, not live.
    metrics.set_state("failed")
    ended = metrics.snapshot()
    assert (ended.num_running, ended.num_waiting) == (0, 0)
    assert [(e.state, e.num_in_flight, e.num_running, e.num_waiting) for e in ended.engines] == [
        ("stopped", 0, 0, 0),
        ("dead", 0, 0, 0),
    ]
    assert ended.engines[0].step_time_s == pytest.approx(0.01)
    reports[:] = reports[:1]
    assert metrics.snapshot().engines == ()


def test_an_ended_job_shows_no_requests_in_flight_and_no_start_up_stage() -> None:
    clock = FakeClock()
    metrics = JobMetrics(total_rows=4, clock=clock)
    metrics.set_startup_stage("sizing KV cache")
    metrics.set_state("running")
    assert metrics.snapshot().startup_stage == ""
    metrics.on_engine_stats(SchedulerStats(num_running=3, num_waiting=2, num_prompt_tokens=9))
    assert (metrics.snapshot().num_running, metrics.snapshot().num_waiting) == (3, 2)
    clock.now += 1.0
    metrics.set_state("failed")
    snap = metrics.snapshot()
    assert (snap.num_running, snap.num_waiting) == (0, 0)


def test_window_and_job_prompt_rates_both_leave_out_cached_tokens() -> None:
    """A job shorter than the window: both prompt rates count computed tokens only."""
    clock = FakeClock()
    metrics = JobMetrics(total_rows=8, clock=clock)
    metrics.set_state("running")
    for _ in range(8):
        clock.now += 0.5
        metrics.on_result(
            finish_reason="stop", prompt_tokens=50, completion_tokens=20, cached_tokens=30
        )
    snap = metrics.snapshot()
    assert snap.prompt_tps == pytest.approx(snap.prompt_tps_overall) == pytest.approx(40.0)


def test_prompt_rates_leave_out_the_prompts_of_rows_that_errored() -> None:
    """Rows refused before the engine (a prompt too long) name their prompt's length; half the
    rows of 2000 tokens so refused made a 40-token/s job read 40,000."""
    clock = FakeClock()
    metrics = JobMetrics(total_rows=8, clock=clock)
    metrics.set_state("running")
    for i in range(8):
        clock.now += 0.5
        if i % 2:
            metrics.on_result(
                finish_reason="error", prompt_tokens=2000, completion_tokens=0, error_kind="input"
            )
        else:
            metrics.on_result(finish_reason="stop", prompt_tokens=40, completion_tokens=20)
    snap = metrics.snapshot()
    assert snap.prompt_tps == pytest.approx(snap.prompt_tps_overall) == pytest.approx(40.0)
    assert snap.num_prompt_tokens == 4 * 2040
