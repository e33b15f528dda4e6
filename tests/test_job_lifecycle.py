"""Job lifecycle hardening (issue 12 §4): output onto input, the job lock under --overwrite and
concurrent runs, idle-time commits, signals during finalize, resume edge cases, input pre-flight.

Real `vbatch` processes where the behaviour is about processes (locks, signals); the tiny model
and CliRunner elsewhere.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from helpers import SharedLLM, read_jsonl, write_jsonl
from typer.testing import CliRunner

from vbatch.cli import app
from vbatch.errors import InputError, JobStateError
from vbatch.job.journal import JOURNAL_NAME, read_journal
from vbatch.job.paths import job_dir_for
from vbatch.job.runner import JobSpec, RunOptions, job_status, resume_job, start_job

TIMEOUT_S = 240
SAMPLING = {"max_tokens": 4, "temperature": 0.0}
QUIET = RunOptions(display="quiet", commit_every_rows=5)


# NOTE: child processes import the same vbatch as this test process (a checkout, not whichever
# copy is installed).
SRC_DIR = str(Path(__import__("vbatch").__file__).parents[1])
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")])}


def vbatch(*args: str) -> list[str]:
    return [sys.executable, "-m", "vbatch", *args]


def start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    return proc.returncode, stderr


def one_line_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


def run_args(model: Path, output: str, *extra: str) -> list[str]:
    return vbatch(
        "run", "in.jsonl", "-o", output, "--model", str(model), "--max-tokens", "6",
        "--num-threads", "1", "-q", *extra,
    )  # fmt: skip


# --- 1. the output is the input --------------------------------------------------------------


def test_run_refuses_an_output_that_is_the_input(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    data = b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n'
    (tmp_path / "in.jsonl").write_bytes(data)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "in.jsonl")
    os.link(tmp_path / "in.jsonl", tmp_path / "hard.jsonl")
    runner = CliRunner()
    cases = [
        ("in.jsonl", "in.jsonl"),
        ("in.jsonl", "sub/../in.jsonl"),
        ("in.jsonl", str(tmp_path / "in.jsonl")),
        ("in.jsonl", "link.jsonl"),
        ("link.jsonl", "in.jsonl"),
        ("in.jsonl", "hard.jsonl"),
    ]
    for input_name, output_name in cases:
        for extra in (["--overwrite"], []):
            args = ["run", input_name, "-o", output_name, "--model", str(tiny_model_dir), *extra]
            result = runner.invoke(app, args)
            assert result.exit_code == 1, (args, result.output)
            assert "is the input file" in result.output, (args, result.output)
            assert "Traceback" not in result.output
            assert (tmp_path / "in.jsonl").read_bytes() == data, args
            assert not job_dir_for(tmp_path / output_name).exists()


def test_a_metrics_file_that_is_the_input_the_output_or_in_the_job_is_refused(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    data = b'{"id": "a", "prompt": "x"}\n'
    (tmp_path / "in.jsonl").write_bytes(data)
    runner = CliRunner()
    flags = ["--model", str(tiny_model_dir), "--max-tokens", "2", "--num-threads", "1", "-q"]
    for metrics, clash in (
        ("in.jsonl", "is the input file"),
        ("out.jsonl", "is the metrics file"),
        ("out.jsonl.vbatch/journal.jsonl", "is inside the job directory"),
    ):
        result = runner.invoke(
            app, ["run", "in.jsonl", "-o", "out.jsonl", *flags, "--metrics-file", metrics]
        )
        assert result.exit_code == 1 and clash in result.output, (metrics, result.output)
        assert (tmp_path / "in.jsonl").read_bytes() == data
        assert (
            not (tmp_path / "out.jsonl").exists()
            and not job_dir_for(tmp_path / "out.jsonl").exists()
        )
    assert runner.invoke(app, ["run", "in.jsonl", "-o", "out.jsonl", *flags]).exit_code == 0
    written = (tmp_path / "out.jsonl").read_bytes()
    for metrics in ("in.jsonl", "out.jsonl"):
        result = runner.invoke(app, ["resume", "out.jsonl", "-q", "--metrics-file", metrics])
        assert result.exit_code == 1 and "is the" in result.output, result.output
    assert (tmp_path / "in.jsonl").read_bytes() == data
    assert (tmp_path / "out.jsonl").read_bytes() == written


# --- 2, 3. the job lock: --overwrite and concurrent runs -------------------------------------


def test_a_running_job_refuses_run_overwrite_and_resume(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    records = [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(40)]
    write_jsonl(tmp_path / "in.jsonl", records)
    job_dir = tmp_path / "out.jsonl.vbatch"
    first = start(run_args(tiny_model_dir, "out.jsonl"), tmp_path)
    deadline = time.monotonic() + TIMEOUT_S
    # NOTE: the journal is opened under the job's lock: from then on the lock is held.
    while not (job_dir / JOURNAL_NAME).exists():
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)
    try:
        for args in (
            run_args(tiny_model_dir, "out.jsonl"),
            run_args(tiny_model_dir, "out.jsonl", "--overwrite"),
            vbatch("resume", "out.jsonl", "-q"),
            vbatch("resume", "out.jsonl", "-q", "--force"),
        ):
            code, stderr = finish(start(args, tmp_path))
            assert code == 1, (args, stderr)
            assert "another vbatch process is running the job" in one_line_error(stderr), args
            assert (job_dir / JOURNAL_NAME).exists()
    finally:
        first.send_signal(signal.SIGCONT)
    code, stderr = finish(first)
    assert code == 0, stderr
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "out.jsonl")) == sorted(
        r["id"] for r in records
    )


SLOW_SCAN_SCRIPT = textwrap.dedent(
    """
    import sys, time

    import vbatch.job.runner as runner
    from vbatch.cli import main

    scan_input = runner.scan_input

    def slow_scan_input(*args, **kwargs):
        time.sleep(2.0)
        return scan_input(*args, **kwargs)

    if __name__ == "__main__":
        runner.scan_input = slow_scan_input
        sys.argv = ["vbatch", *sys.argv[1:]]
        main()
    """
)


def test_two_runs_started_together_one_wins_one_gets_one_line(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    records = [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(8)]
    write_jsonl(tmp_path / "in.jsonl", records)
    # NOTE: a slow input scan (a big input) holds both runs between "is there a job?" and
    # "make the job directory" at the same time; only the lock, taken first, keeps them apart.
    script = tmp_path / "slow_scan.py"
    script.write_text(SLOW_SCAN_SCRIPT)
    args = [sys.executable, str(script), *run_args(tiny_model_dir, "out.jsonl")[3:]]
    procs = [start(args, tmp_path) for _ in range(2)]
    results = [finish(p) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    loser = next(stderr for code, stderr in results if code == 1)
    assert "another vbatch process is running the job" in one_line_error(loser)
    assert len(read_jsonl(tmp_path / "out.jsonl")) == len(records)


def test_lock_survives_overwrite_and_is_taken_before_reading(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    """A lock held by another process (a real one) refuses `run`, `run --overwrite`, `resume`."""
    input_path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    job = JobSpec(input_path, tmp_path / "out.jsonl", model=str(tiny_model_dir), sampling=SAMPLING)
    assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    job_dir = job_dir_for(job.output_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('locked', flush=True); sys.stdin.read()",
            str(job_dir / "lock"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        before = job.output_path.read_bytes()
        with pytest.raises(JobStateError, match="another vbatch process is running the job"):
            start_job(job, QUIET, overwrite=True, llm_factory=shared_llm)
        with pytest.raises(JobStateError, match="another vbatch process is running the job"):
            resume_job(job.output_path, {"display": "quiet"}, llm_factory=shared_llm)
        assert job.output_path.read_bytes() == before
        assert (job_dir / "manifest.json").exists()
    finally:
        holder.communicate("", timeout=30)
    # NOTE: --overwrite keeps the lock file (its inode is what a second process locks).
    inode = (job_dir / "lock").stat().st_ino
    assert start_job(job, QUIET, overwrite=True, llm_factory=shared_llm).exit_code == 0
    assert (job_dir / "lock").stat().st_ino == inode


def test_a_job_directory_without_manifest_is_no_job(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    """What a crash part way through --overwrite leaves (the manifest goes first) is cleared."""
    records = [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(6)]
    input_path = write_jsonl(tmp_path / "in.jsonl", records)
    job = JobSpec(input_path, tmp_path / "out.jsonl", model=str(tiny_model_dir), sampling=SAMPLING)
    assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    job_dir = job_dir_for(job.output_path)
    (job_dir / "manifest.json").unlink()
    job.output_path.unlink()
    assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    assert sorted(r["id"] for r in read_jsonl(job.output_path)) == sorted(r["id"] for r in records)


def test_clean_removes_the_job_directory_and_a_new_run_starts_fresh(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    input_path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    job = JobSpec(input_path, tmp_path / "out.jsonl", model=str(tiny_model_dir), sampling=SAMPLING)
    clean = RunOptions(display="quiet", clean=True)
    assert start_job(job, clean, llm_factory=shared_llm).exit_code == 0
    assert job.output_path.exists() and not job_dir_for(job.output_path).exists()
    assert start_job(job, clean, overwrite=True, llm_factory=shared_llm).exit_code == 0
    assert [r["id"] for r in read_jsonl(job.output_path)] == ["a"]


# --- 4. the time-based commit fires while no row finishes ------------------------------------


class StallingLLM(SharedLLM):
    """The shared engine; after `after` results, its core is stopped (SIGSTOP) for `stall_s`."""

    def __init__(self, llm: Any, after: int, stall_s: float, journal: Path) -> None:
        super().__init__(llm)
        self.after, self.stall_s, self.journal = after, stall_s, journal
        self.num_yielded = 0
        self.seen: dict[str, Any] = {}

    def _resume_core(self, pid: int) -> None:
        # NOTE: what the journal holds at the end of the stall, with the core still stopped.
        state, _ = read_journal(self.journal)
        self.seen.update(committed=len(state.committed), yielded=self.num_yielded)
        self.seen["commit_times"] = [
            orjson.loads(line[9:])["time"] for line in self.journal.read_bytes().splitlines()
        ]
        os.kill(pid, signal.SIGCONT)

    def stream(self, inputs: Any, sampling_params: Any = None, **kwargs: Any) -> Iterator[Any]:
        pid = self.llm.engine_info.pid
        for result in self.llm.stream(inputs, sampling_params, **kwargs):
            if result is not None:
                self.num_yielded += 1
                if self.num_yielded == self.after:
                    os.kill(pid, signal.SIGSTOP)
                    self.seen["stalled_at"] = time.time()
                    threading.Timer(self.stall_s, self._resume_core, (pid,)).start()
            yield result


def test_time_based_commit_fires_while_no_row_finishes(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    records = [
        {"id": f"quick{i}", "prompt": f"row {i}", "sampling_params": {"max_tokens": 1}}
        for i in range(3)
    ]
    records += [
        {
            "id": f"long{i}",
            "prompt": f"row {i}",
            "sampling_params": {"max_tokens": 400, "ignore_eos": True},
        }
        for i in range(2)
    ]
    input_path = write_jsonl(tmp_path / "in.jsonl", records)
    job = JobSpec(input_path, tmp_path / "out.jsonl", model=str(tiny_model_dir), sampling=SAMPLING)
    journal = job_dir_for(job.output_path) / JOURNAL_NAME
    llm = StallingLLM(shared_llm().llm, after=3, stall_s=4.0, journal=journal)
    options = RunOptions(display="quiet", commit_every_rows=1000, commit_every_seconds=1.0)
    outcome = start_job(job, options, llm_factory=lambda *a, **k: llm)
    assert outcome.exit_code == 0
    # NOTE: the quick rows came back, the core then stalled with the long rows in flight: they
    # must be committed within about commit-every-s, while the stall lasts.
    assert llm.seen["yielded"] == 3
    assert llm.seen["committed"] == 3
    assert llm.seen["commit_times"][0] - llm.seen["stalled_at"] < 2.5
    assert len(read_jsonl(job.output_path)) == 5


# --- 5. SIGTERM / SIGINT during finalize -----------------------------------------------------

FINALIZE_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys

    import vbatch.job.finalize as finalize
    from vbatch.cli import main

    write_jsonl = finalize._write_jsonl

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), int(os.environ["SIGNAL"]))
        return write_jsonl(*args, **kwargs)

    if __name__ == "__main__":
        finalize._write_jsonl = interrupted
        sys.argv = ["vbatch", *sys.argv[1:]]
        main()
    """
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_signal_during_finalize_prints_the_resume_hint(
    tmp_path: Path, tiny_model_dir: Path, signum: int
) -> None:
    records = [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(10)]
    write_jsonl(tmp_path / "in.jsonl", records)
    script = tmp_path / "interrupt_finalize.py"
    script.write_text(FINALIZE_SCRIPT)
    args = [sys.executable, str(script), *run_args(tiny_model_dir, "out.jsonl", "--ordered")[3:]]
    proc = subprocess.Popen(
        args,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, "SIGNAL": str(int(signum))},
    )
    code, stderr = finish(proc)
    assert code == 75, stderr
    assert "vbatch resume out.jsonl" in stderr and "Traceback" not in stderr
    assert "10 rows are committed" in stderr
    code, stderr = finish(start(vbatch("resume", "out.jsonl", "-q"), tmp_path))
    assert code == 0, stderr
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == [r["id"] for r in records]


# --- 6. resume of a completed job whose output is gone ---------------------------------------


def test_resume_complete_job_whose_output_was_deleted(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    input_path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    for name in ("out.jsonl", "out.parquet"):
        job = JobSpec(input_path, tmp_path / name, model=str(tiny_model_dir), sampling=SAMPLING)
        assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
        job.output_path.unlink()
        with pytest.raises(JobStateError, match=r"no longer exists.*--overwrite") as error:
            resume_job(job.output_path, {"display": "quiet"}, llm_factory=shared_llm)
        assert "already complete" not in str(error.value)
        assert start_job(job, QUIET, overwrite=True, llm_factory=shared_llm).exit_code == 0
        assert job.output_path.exists()


# --- 7. resume --force after rows were inserted ----------------------------------------------

TEN_ROWS = [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(10)]


def finished_job(
    input_path: Path, output: Path, model_dir: Path, llm_factory: Callable[..., Any], cut: bool
) -> tuple[JobSpec, int]:
    """TEN_ROWS run to the end into `output`; with `cut`, its journal cut back to the first
    commit, as a job killed part way. Returns the job and its committed row count."""
    write_jsonl(input_path, TEN_ROWS)
    job = JobSpec(input_path, output, model=str(model_dir), sampling=SAMPLING)
    assert start_job(job, QUIET, llm_factory=llm_factory).exit_code == 0
    journal = job_dir_for(output) / JOURNAL_NAME
    if cut:
        journal.write_bytes(journal.read_bytes().splitlines(keepends=True)[0])
    committed = len(read_journal(journal)[0].committed)
    assert 0 < committed < 10 if cut else committed == 10
    return job, committed


def test_resume_force_on_a_changed_input_warns_about_index_matching(
    tmp_path: Path,
    tiny_model_dir: Path,
    shared_llm: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    input_path = tmp_path / "in.jsonl"
    job, committed = finished_job(
        input_path, tmp_path / "out.jsonl", tiny_model_dir, shared_llm, cut=True
    )
    write_jsonl(input_path, [{"id": "new0", "prompt": "new"}, *TEN_ROWS])
    capsys.readouterr()
    done = resume_job(job.output_path, {"display": "quiet"}, force=True, llm_factory=shared_llm)
    assert done.exit_code == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "matched" in err and "by position" in err
    assert f"{committed} committed rows" in err and "10 -> 11 rows" in err
    assert "--overwrite" in err


def test_resume_force_with_only_the_model_changed_does_not_warn(
    tmp_path: Path,
    tiny_model_dir: Path,
    shared_llm: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    job, _ = finished_job(
        tmp_path / "in.jsonl", tmp_path / "out.jsonl", tiny_model_dir, shared_llm, cut=True
    )
    job_dir = job_dir_for(job.output_path)
    manifest = json.loads((job_dir / "manifest.json").read_text())
    manifest["vbatch_version"] = "0.0.0-old"
    del manifest["checksum"]  # NOTE: as an earlier vbatch wrote it.
    (job_dir / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    done = resume_job(job.output_path, {"display": "quiet"}, force=True, llm_factory=shared_llm)
    assert done.exit_code == 0
    assert "warning:" not in capsys.readouterr().err


def test_resume_names_an_input_that_is_gone_or_now_a_directory(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    input_path = tmp_path / "in.jsonl"
    job, _ = finished_job(input_path, tmp_path / "out.jsonl", tiny_model_dir, shared_llm, cut=True)
    input_path.unlink()
    with pytest.raises(InputError, match=r"input file .* no longer exists"):
        resume_job(job.output_path, {"display": "quiet"}, llm_factory=shared_llm)
    input_path.mkdir()
    with pytest.raises(InputError, match=r"input file .* is now a directory"):
        resume_job(job.output_path, {"display": "quiet"}, llm_factory=shared_llm)


def test_resume_force_refuses_an_input_that_now_ends_before_committed_rows(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    input_path = tmp_path / "in.jsonl"
    job, _ = finished_job(input_path, tmp_path / "out.jsonl", tiny_model_dir, shared_llm, cut=False)
    manifest = job_dir_for(job.output_path) / "manifest.json"
    before = manifest.read_bytes()
    write_jsonl(input_path, TEN_ROWS[:6])
    with pytest.raises(JobStateError, match=r"is already complete, and .*--overwrite"):
        resume_job(job.output_path, {"display": "quiet"}, force=True, llm_factory=shared_llm)
    assert manifest.read_bytes() == before, "a refused resume changes nothing"
    journal = job_dir_for(job.output_path) / JOURNAL_NAME
    journal.write_bytes(b"".join(journal.read_bytes().splitlines(keepends=True)[:-1]))
    with pytest.raises(JobStateError, match=r"now has 6 rows, but rows up to index 9.*--overwrite"):
        resume_job(job.output_path, {"display": "quiet"}, force=True, llm_factory=shared_llm)
    assert manifest.read_bytes() == before, "a refused resume changes nothing"
    assert job_status(job.output_path)["remaining"] == 0


def test_a_job_moved_or_copied_with_its_directory_goes_on_where_it_is_now(
    tmp_path: Path,
    tiny_model_dir: Path,
    shared_llm: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    first = tmp_path / "first"
    first.mkdir()
    job, _ = finished_job(
        tmp_path / "in.jsonl", first / "out.jsonl", tiny_model_dir, shared_llm, cut=True
    )
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    quiet_copy = tmp_path / "quiet"
    shutil.copytree(first, quiet_copy)
    original = job.output_path.read_bytes()
    capsys.readouterr()
    done = resume_job(copy / "out.jsonl", {"display": "plain"}, llm_factory=shared_llm)
    assert done.exit_code == 0
    assert "goes on at" in capsys.readouterr().err
    # NOTE: --quiet prints errors and warnings only; the note is neither.
    done = resume_job(quiet_copy / "out.jsonl", {"display": "quiet"}, llm_factory=shared_llm)
    assert done.exit_code == 0 and "goes on at" not in capsys.readouterr().err
    assert sorted(r["id"] for r in read_jsonl(copy / "out.jsonl")) == sorted(
        r["id"] for r in TEN_ROWS
    )
    assert job.output_path.read_bytes() == original, "the job's first place is left alone"
    status = job_status(copy / "out.jsonl")
    assert status["output"] == str((copy / "out.jsonl").absolute()) and status["complete"]
    assert not job_status(job.output_path)["complete"]


# --- 8. input pre-flight: a directory, a JSON array -------------------------------------------


def test_input_directory_and_json_array_get_clear_errors(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    model = ["--model", str(tiny_model_dir)]
    (tmp_path / "data.jsonl").mkdir()
    result = runner.invoke(app, ["run", "data.jsonl", "-o", "out.jsonl", *model])
    assert result.exit_code == 1
    assert "is a directory" in result.output and "Traceback" not in result.output
    rows = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}]
    (tmp_path / "array.json").write_bytes(orjson.dumps(rows))
    (tmp_path / "pretty.json").write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    (tmp_path / "pretty.jsonl").write_bytes(
        b"\n\n" + orjson.dumps(rows, option=orjson.OPT_INDENT_2)
    )
    for name in ("array.json", "pretty.json", "pretty.jsonl"):
        result = runner.invoke(app, ["run", name, "-o", "out.jsonl", *model])
        assert result.exit_code == 1, name
        assert "JSON array" in result.output and "jq -c '.[]'" in result.output, result.output
        assert not job_dir_for(tmp_path / "out.jsonl").exists()


def test_jsonl_rows_that_are_arrays_stay_error_rows(tmp_path: Path) -> None:
    """A JSONL row holding a (non-object) array is an error row, not a refused input."""
    from vbatch.job.reader import InputReader
    from vbatch.job.rows import ColumnOptions

    path = tmp_path / "in.jsonl"
    path.write_bytes(b'[1, 2]\n{"prompt": "x"}\n')
    reader = InputReader(path, None, ColumnOptions())
    assert [raw.record for raw in reader.records()] == [[1, 2], {"prompt": "x"}]
    with pytest.raises(InputError, match="is a directory"):
        InputReader(tmp_path, "jsonl", ColumnOptions())


def test_overwrite_keeps_the_old_job_when_the_new_engine_fails_to_start(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old output and job were removed before the new engine's start failed, and the failed
    new job was dropped in turn: nothing was left of either."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_bytes(b'{"id": "a", "prompt": "x"}\n')
    runner = CliRunner()
    flags = ["--model", str(tiny_model_dir), "--max-tokens", "2", "--num-threads", "1", "-q"]
    assert runner.invoke(app, ["run", "in.jsonl", "-o", "out.jsonl", *flags]).exit_code == 0
    written = (tmp_path / "out.jsonl").read_bytes()
    manifest = (job_dir_for(tmp_path / "out.jsonl") / "manifest.json").read_bytes()
    result = runner.invoke(
        app,
        ["run", "in.jsonl", "-o", "out.jsonl", *flags, "--overwrite", "--max-model-len", "100000"],
    )
    assert result.exit_code == 1 and "max_model_len" in result.output, result.output
    assert "out.jsonl and its job are kept as they were" in result.output
    assert (tmp_path / "out.jsonl").read_bytes() == written
    assert (job_dir_for(tmp_path / "out.jsonl") / "manifest.json").read_bytes() == manifest
