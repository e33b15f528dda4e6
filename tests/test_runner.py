"""Tests for `run` / `resume` / `status` on the tiny random model, through one shared engine."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import SharedLLM, add_to_hub_cache, write_jsonl

from vbatch.errors import ConfigError, InputError, JobStateError, ModelLoadError
from vbatch.job.paths import job_dir_for
from vbatch.job.rows import ColumnOptions
from vbatch.job.runner import JobSpec, RunOptions, job_status, resume_job, start_job

QUIET = RunOptions(display="quiet", commit_every_rows=5)
SAMPLING = {"max_tokens": 4, "temperature": 0.0}


def read_output(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def spec(tmp_path: Path, input_path: Path, output_name: str, model: Path, **kwargs: Any) -> JobSpec:
    return JobSpec(
        input_path, tmp_path / output_name, model=str(model), sampling=SAMPLING, **kwargs
    )


MIXED_ROWS = [
    {"id": "p0", "prompt": "hello there"},
    {"id": "m1", "messages": [{"role": "user", "content": "hi"}]},
    {"id": "o2", "prompt": "override", "sampling_params": {"max_tokens": 2}},
    {"id": "e3", "prompt": ""},
    {"id": "e4", "text": "no prompt column"},
    {"id": "e5", "prompt": "x", "sampling_params": {"temperature": -1}},
    {"id": "e6", "prompt": 12},
    {"id": "p7", "prompt": "word " * 700},
]


@pytest.mark.parametrize("output_name", ["out.jsonl", "out.parquet"])
def test_jsonl_input_round_trip_with_error_rows(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any], output_name: str
) -> None:
    input_path = write_jsonl(tmp_path / "in.jsonl", MIXED_ROWS)
    with input_path.open("ab") as f:
        f.write(b'{"id": "broken", \n')
    outcome = start_job(
        spec(tmp_path, input_path, output_name, tiny_model_dir), QUIET, llm_factory=shared_llm
    )
    assert outcome.exit_code == 0
    # NOTE: a malformed line has no readable id, so its id is null (never a value that could
    # clash with a real id); its index and the error's line number identify it.
    rows = {r["id"] or f"#{r['index']}": r for r in read_output(tmp_path / output_name)}
    assert set(rows) == {"p0", "m1", "o2", "e3", "e4", "e5", "e6", "p7", "#8"}
    assert rows["#8"]["id"] is None
    errored = {i for i, r in rows.items() if r["finish_reason"] == "error"}
    assert errored == {"e3", "e4", "e5", "e6", "p7", "#8"}
    assert all(r["error"] is not None for i, r in rows.items() if i in errored)
    assert "line 9: invalid JSON" in rows["#8"]["error"]
    assert rows["p7"]["error"].startswith("line 8: ") and rows["p7"]["prompt_tokens"] > 512
    assert rows["o2"]["completion_tokens"] == 2 and rows["p0"]["completion_tokens"] == 4
    assert rows["m1"]["finish_reason"] == "length" and isinstance(rows["m1"]["text"], str)
    assert [r["index"] for r in read_output(tmp_path / output_name)] != [] and all(
        rows[i]["index"] == n for n, i in enumerate(["p0", "m1", "o2", "e3", "e4", "e5", "e6"])
    )
    status = job_status(tmp_path / output_name)
    assert (status["complete"], status["done"], status["errored"]) == (True, 9, 6)
    assert status["remaining"] == 0 and status["last_commit_time"] is not None
    assert sorted(p.name for p in job_dir_for(tmp_path / output_name).iterdir()) == [
        "journal.jsonl",
        "lock",
        "manifest.json",
    ]


def test_parquet_in_ordered_out_with_kept_columns(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    input_path = tmp_path / "in.parquet"
    table = pa.table(
        {
            "key": [f"k{i}" for i in range(40)],
            "q": [f"question {i}" for i in range(40)],
            "topic": [i % 3 for i in range(40)],
        }
    )
    pq.write_table(table, input_path, row_group_size=7)
    columns = ColumnOptions(prompt_column="q", id_column="key", keep_columns=("topic",))
    job = spec(tmp_path, input_path, "out.parquet", tiny_model_dir, columns=columns, ordered=True)
    assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column("index").to_pylist() == list(range(40))
    assert out.column("id").to_pylist() == [f"k{i}" for i in range(40)]
    assert out.column("topic").to_pylist() == [i % 3 for i in range(40)]
    assert out.schema.field("topic").type == pa.int64()


def test_openai_batch_round_trip(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    chat = {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
    }
    text = {
        "custom_id": "t2",
        "method": "POST",
        "url": "/v1/completions",
        "body": {
            "prompt": "once upon",
            "max_tokens": 2,
            "n": 2,
            "temperature": 0.8,
            "seed": 5,
        },
    }
    bad = {"custom_id": "b3", "method": "POST", "url": "/v1/completions", "body": {"n": 2}}
    input_path = write_jsonl(tmp_path / "batch.jsonl", [chat, text, bad])
    job = spec(tmp_path, input_path, "results.jsonl", tiny_model_dir, ordered=True)
    assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    lines = read_output(tmp_path / "results.jsonl")
    assert [line["custom_id"] for line in lines] == ["c1", "t2", "b3"]
    body = lines[0]["response"]["body"]
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3
    assert len(body["choices"][0]["logprobs"]["content"]) == 3
    assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert lines[1]["response"]["body"]["object"] == "text_completion"
    assert lines[1]["response"]["body"]["usage"]["completion_tokens"] == 4
    choices = lines[1]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["finish_reason"] for c in choices] == ["length", "length"]
    assert lines[2]["response"] is None and "body.prompt" in lines[2]["error"]["message"]


def test_refusals_before_any_work(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    input_path = write_jsonl(
        tmp_path / "in.jsonl",
        [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}],
    )
    job = spec(tmp_path, input_path, "out.jsonl", tiny_model_dir)
    with pytest.raises(InputError, match="duplicate id 'a' at line 3 \\(first at line 1\\)"):
        start_job(job, QUIET, llm_factory=shared_llm)
    assert not job_dir_for(job.output_path).exists()
    with pytest.raises(InputError, match="does not exist"):
        start_job(spec(tmp_path, tmp_path / "missing.jsonl", "o.jsonl", tiny_model_dir), QUIET)
    with pytest.raises(InputError, match="output format"):
        start_job(spec(tmp_path, input_path, "out.csv", tiny_model_dir), QUIET)
    with pytest.raises(InputError, match="would overwrite output fields"):
        start_job(
            spec(
                tmp_path,
                input_path,
                "o.jsonl",
                tiny_model_dir,
                columns=ColumnOptions(keep_columns=("text",)),
            ),
            QUIET,
        )
    good_input = write_jsonl(tmp_path / "good.jsonl", [{"id": "a", "prompt": "x"}])
    (tmp_path / "fake.gguf").write_text("x\n")
    (tmp_path / "notes.txt").write_text("x\n")
    models = ("no-such-model", "", "fake.gguf", "notes.txt")
    for bad_model in (tmp_path / name for name in models):
        bad = spec(tmp_path, good_input, "bad-model.jsonl", bad_model)
        with pytest.raises(ModelLoadError, match=str(bad_model)):
            start_job(bad, QUIET)
        assert not job_dir_for(bad.output_path).exists()
    bad = spec(tmp_path, good_input, "bad-engine.jsonl", tiny_model_dir)
    bad.engine_args["quantization"] = "int4"
    with pytest.raises(ConfigError, match="quantization must be one of"):
        start_job(bad, QUIET)
    assert not job_dir_for(bad.output_path).exists()


def test_existing_job_refusal_resume_checks_retry_errors_and_force(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    records = [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(12)]
    records[4] = {"id": "r4", "prompt": ""}
    input_path = write_jsonl(tmp_path / "in.jsonl", records)
    job = spec(tmp_path, input_path, "out.jsonl", tiny_model_dir)
    assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    with pytest.raises(JobStateError, match=r"vbatch resume .*--overwrite"):
        start_job(job, QUIET, llm_factory=shared_llm)
    metrics_file = tmp_path / "metrics" / "m.json"
    again = resume_job(
        job.output_path,
        {"display": "quiet", "metrics_file": metrics_file},
        llm_factory=shared_llm,
    )
    assert again.exit_code == 0 and "already complete" in again.message
    metrics = orjson.loads(metrics_file.read_bytes())
    assert metrics["state"] == "done" and metrics["total_rows"] == 12, metrics
    assert metrics["num_rows_done"] == 12 and metrics["num_rows_errored"] == 1, metrics
    assert start_job(job, QUIET, overwrite=True, llm_factory=shared_llm).exit_code == 0

    # NOTE: an unfinished job whose input is then fixed: refused, then resumed with --force.
    job_dir = job_dir_for(job.output_path)
    journal = job_dir / "journal.jsonl"
    journal.write_bytes(journal.read_bytes().splitlines(keepends=True)[0])
    records[4] = {"id": "r4", "prompt": "fixed now"}
    write_jsonl(input_path, records)
    with pytest.raises(JobStateError, match=r"changed size.*--force"):
        resume_job(job.output_path, {"display": "quiet"}, llm_factory=shared_llm)
    done = resume_job(
        job.output_path, {"display": "quiet"}, force=True, retry_errors=True, llm_factory=shared_llm
    )
    assert done.exit_code == 0
    rows = read_output(job.output_path)
    assert sorted(r["id"] for r in rows) == sorted(f"r{i}" for i in range(12))
    assert [r["error"] for r in rows if r["id"] == "r4"] == [None]
    assert done.status["errored"] == 0


def test_resume_refuses_a_moved_hub_snapshot_until_forced(
    tmp_path: Path,
    tiny_model_dir: Path,
    shared_llm: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    add_to_hub_cache(tmp_path / "hub", "org/tiny", tiny_model_dir, "1" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    records = [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(6)]
    input_path = write_jsonl(tmp_path / "in.jsonl", records)
    job = JobSpec(input_path, tmp_path / "out.jsonl", model="org/tiny", sampling=SAMPLING)
    loaded: list[str] = []

    def factory(model: str, **kwargs: Any) -> Any:
        loaded.append(model)
        return shared_llm(model, **kwargs)

    assert start_job(job, QUIET, llm_factory=factory).exit_code == 0
    assert loaded == ["org/tiny@" + "1" * 40]
    manifest = orjson.loads((job_dir_for(job.output_path) / "manifest.json").read_bytes())
    assert (manifest["model"]["repo_id"], manifest["model"]["commit"]) == ("org/tiny", "1" * 40)
    add_to_hub_cache(tmp_path / "hub", "org/tiny", tiny_model_dir, "2" * 40)
    with pytest.raises(JobStateError, match=r"org/tiny now resolves to snapshot 2{40}.*--force"):
        resume_job(job.output_path, {"display": "quiet"}, llm_factory=shared_llm)
    journal = job_dir_for(job.output_path) / "journal.jsonl"
    journal.write_bytes(journal.read_bytes().splitlines(keepends=True)[0])
    forced = resume_job(job.output_path, {"display": "quiet"}, force=True, llm_factory=factory)
    assert forced.exit_code == 0
    assert loaded[1:] == ["org/tiny@" + "2" * 40]
    manifest = orjson.loads((job_dir_for(job.output_path) / "manifest.json").read_bytes())
    assert manifest["model"]["commit"] == "2" * 40


def test_max_errors_stops_the_job_and_keeps_committed_rows(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    records = [{"prompt": "ok"}] * 5 + [{"prompt": ""}] * 30 + [{"prompt": "ok"}] * 5
    input_path = write_jsonl(tmp_path / "in.jsonl", records)
    options = RunOptions(display="quiet", max_errors=0.25)
    job = spec(tmp_path, input_path, "out.jsonl", tiny_model_dir)
    with pytest.raises(InputError, match=r"11 rows errored, more than --max-errors 0\.25"):
        start_job(job, options, llm_factory=shared_llm)
    status = job_status(job.output_path)
    assert status["errored"] == 11 and not status["complete"]
    assert len(read_output(job.output_path)) == status["done"]
    # NOTE: a plain resume keeps the job's limit, which its committed errors are over: it
    # once ran every row left and finished with 30 errors.
    with pytest.raises(InputError, match=r"11 rows errored, more than --max-errors 0\.25"):
        resume_job(job.output_path, {"display": "quiet"}, llm_factory=shared_llm)
    assert job_status(job.output_path)["done"] == status["done"]
    done = resume_job(
        job.output_path, {"display": "quiet", "max_errors": None}, llm_factory=shared_llm
    )
    assert done.exit_code == 0 and done.status["errored"] == 30
    assert len(read_output(job.output_path)) == 40


def test_max_errors_crossed_by_the_last_row_names_both_ways_to_complete_the_job(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    input_path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": ""}] * 3)
    job = spec(tmp_path, input_path, "out.jsonl", tiny_model_dir)
    with pytest.raises(InputError, match=r"all 3 rows are committed, but 3 errored") as error:
        start_job(job, RunOptions(display="quiet", max_errors=2), llm_factory=shared_llm)
    assert "--retry-errors" in str(error.value) and "--max-errors 3`" in str(error.value)
    assert not job_status(job.output_path)["complete"]
    done = resume_job(
        job.output_path, {"display": "quiet", "max_errors": 3}, llm_factory=shared_llm
    )
    assert done.exit_code == 0 and done.status["complete"] and done.status["errored"] == 3


class SignallingLLM(SharedLLM):
    """The shared engine, whose stream sends this process `signals` after `after` results.

    Every later result takes `slow_s` more seconds, as rows still in flight would on a big model:
    a drain deadline shorter than that must cut the drain off.
    """

    def __init__(self, llm: Any, signals: list[int], after: int, slow_s: float = 2.0) -> None:
        super().__init__(llm)
        self.signals, self.after, self.slow_s = signals, after, slow_s

    def stream(self, inputs: Any, sampling_params: Any = None, **kwargs: Any) -> Iterator[Any]:
        results = (r for r in self.llm.stream(inputs, sampling_params, **kwargs) if r is not None)
        for n, result in enumerate(results, start=1):
            if n > self.after:
                time.sleep(self.slow_s)
            if n == self.after:
                for signum in self.signals:
                    os.kill(os.getpid(), signum)
            yield result


@pytest.mark.parametrize(
    ("signals", "drain_timeout_s"),
    [([signal.SIGINT, signal.SIGINT], 60.0), ([signal.SIGTERM], 0.001)],
    ids=["second-sigint", "drain-timeout"],
)
def test_hard_stop_commits_finished_rows_and_resumes(
    tmp_path: Path,
    tiny_model_dir: Path,
    shared_llm: Callable[..., Any],
    signals: list[int],
    drain_timeout_s: float,
) -> None:
    records = [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(60)]
    input_path = write_jsonl(tmp_path / "in.jsonl", records)
    job = spec(tmp_path, input_path, "out.jsonl", tiny_model_dir)
    llm = shared_llm().llm
    options = RunOptions(display="quiet", drain_timeout_s=drain_timeout_s, max_in_flight=16)
    sigint_before = signal.getsignal(signal.SIGINT)  # ignored under nohup, so not the default
    outcome = start_job(job, options, llm_factory=lambda *a, **k: SignallingLLM(llm, signals, 5))
    assert outcome.exit_code == 75 and "vbatch resume" in outcome.message
    # NOTE: the stop came with 16 rows in flight (and the 5th result in hand): not committed.
    assert 4 <= outcome.status["done"] <= 5
    assert signal.getsignal(signal.SIGINT) == sigint_before
    done = resume_job(job.output_path, {"display": "quiet"}, llm_factory=shared_llm)
    assert done.exit_code == 0
    assert sorted(r["id"] for r in read_output(job.output_path)) == sorted(r["id"] for r in records)


def test_the_core_starts_before_the_input_is_scanned_and_stops_with_a_refused_job(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an llm_factory the engine core is spawned before the scan (its start-up overlaps
    the client's work); a job the scan refuses stops it at once."""
    from vbatch.job import runner

    real_scan = runner.scan_input
    pattern = os.path.join(tempfile.gettempdir(), f"vbatch-{os.getpid()}-*")
    # NOTE: other tests' shared LLM keeps its own socket directory.
    before = set(glob.glob(pattern))
    core_dirs: list[set[str]] = []

    def scan(*args: Any, **kwargs: Any) -> Any:
        core_dirs.append(set(glob.glob(pattern)) - before)
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(runner, "scan_input", scan)
    rows = [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}]
    job = spec(tmp_path, write_jsonl(tmp_path / "in.jsonl", rows), "out.jsonl", tiny_model_dir)
    job.engine_args.update(device="cpu", num_threads=1)
    with pytest.raises(InputError, match="duplicate id"):
        start_job(job, QUIET)
    assert len(core_dirs) == 1 and len(core_dirs[0]) == 1
    assert not os.path.exists(core_dirs[0].pop())


def test_the_manifest_records_the_kernels_the_engine_chose(
    tmp_path: Path, shared_llm: Callable[..., Any]
) -> None:
    job = JobSpec(write_jsonl(tmp_path / "in.jsonl", [{"prompt": "ok"}]), tmp_path / "out.jsonl")
    kernels: list[list[str]] = []

    def factory(model: str, **kwargs: Any) -> Any:
        llm = shared_llm(model, **kwargs)
        kernels.append(llm.engine_info.kernels)
        return llm

    assert start_job(job, QUIET, llm_factory=factory).exit_code == 0
    if not kernels[0]:
        pytest.skip("no kernel choice on this machine (no native kernels)")
    manifest = orjson.loads((job_dir_for(job.output_path) / "manifest.json").read_bytes())
    assert manifest["kernels"] == kernels[0]
    assert "greedy_screen" not in manifest["engine"]  # auto: chosen by measurement, not recorded


def test_a_new_job_interrupted_before_its_signal_handling_runs_leaves_nothing(
    tmp_path: Path,
    tiny_model_dir: Path,
    shared_llm: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between the manifest and the job's own handlers a Ctrl-C left a job that ran nothing,
    whose rerun was refused, and a SIGTERM killed the command without a word."""
    import vbatch.job.execution as execution

    handlers: list[Any] = []
    opened = execution.open_writer

    def interrupted_open(*args: Any) -> Any:
        handlers.append(signal.getsignal(signal.SIGTERM))
        if len(handlers) == 1:
            raise KeyboardInterrupt
        return opened(*args)

    monkeypatch.setattr(execution, "open_writer", interrupted_open)
    input_path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    job = spec(tmp_path, input_path, "out.jsonl", tiny_model_dir)
    with pytest.raises(KeyboardInterrupt):
        start_job(job, QUIET, llm_factory=shared_llm)
    assert not job_dir_for(job.output_path).exists() and not job.output_path.exists()
    assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    # NOTE: SIGTERM interrupts as SIGINT does until the job's handlers take over.
    assert [h.__name__ for h in handlers] == ["_raise_interrupt"] * 2
