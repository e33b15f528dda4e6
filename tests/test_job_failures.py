"""Failures outside vbatch's control (a full disk, a read-only directory, a failed write, a changed
input, a bug) give one clear error line, keep every committed row, and leave a resumable job.

The jobs run the real `vbatch` command over a stand-in engine (tests/standin_vbatch.py); the
disk failures are real ones from the kernel, not mocks:

- ENOSPC: a small tmpfs mounted in a private user and mount namespace (`unshare`, no root
  needed, nothing left mounted afterwards), filled by a ballast file that is deleted to "free
  space"; and /dev/full, which fails every write with ENOSPC, as the output file;
- EFBIG: RLIMIT_FSIZE in a subprocess, to fail one journal append at a chosen byte;
- EACCES: a directory without write permission (for root, CAP_DAC_OVERRIDE is dropped from the
  subprocess's bounding set first, since root ignores permission bits).
"""

from __future__ import annotations

import ctypes
import gzip
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import STANDIN_GGUF

import vbatch
from vbatch.errors import JobStateError
from vbatch.job.finalize import finalize
from vbatch.job.journal import Journal, read_journal
from vbatch.job.paths import JobLock, job_dir_for, tmp_output_path
from vbatch.job.results import error_row, parquet_schema
from vbatch.job.rows import InputRow
from vbatch.job.writer import ParquetWriter

STANDIN = Path(__file__).with_name("standin_vbatch.py")
SRC = Path(vbatch.__file__).resolve().parents[1]
TIMEOUT_S = 120


def _load_standin() -> Any:
    spec = importlib.util.spec_from_file_location("standin_vbatch", STANDIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


expected_text = _load_standin().expected_text


def standin_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VBATCH_STANDIN_")}
    env.pop("VBATCH_DEBUG", None)
    # NOTE: the subprocess must import this checkout's vbatch, whatever its working directory.
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def vbatch_cmd(*args: str) -> list[str]:
    return [sys.executable, str(STANDIN), *args]


def run_vbatch(
    cwd: Path, *args: str, preexec_fn: Any = None, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        vbatch_cmd(*args),
        cwd=cwd,
        env=standin_env(**env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        preexec_fn=preexec_fn,
    )


def write_input(path: Path, num_rows: int, row_id: Any = lambda i: f"r{i}") -> Path:
    path.write_bytes(
        b"".join(
            orjson.dumps({"id": row_id(i), "prompt": f"prompt {i}"}) + b"\n"
            for i in range(num_rows)
        )
    )
    return path


def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "standin.gguf"
    path.write_bytes(STANDIN_GGUF)
    return path


def run_args(input_path: Path, output: Path, model: Path, *flags: str) -> list[str]:
    return ["run", str(input_path), "-o", str(output), "--model", str(model), "-q", *flags]


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one `error:` line of a failed command, after checking there is no traceback."""
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def assert_exactly_once(output: Path, num_rows: int, num_chars: int = 64) -> list[dict[str, Any]]:
    rows = read_rows(output)
    assert sorted(r["index"] for r in rows) == list(range(num_rows)), "a row is missing or twice"
    for row in rows:
        assert row["error"] is None
        assert row["id"] == f"r{row['index']}"
        assert row["text"] == expected_text(f"prompt {row['index']}", num_chars)
    return rows


# ---------------------------------------------------------------------------------------------
# A corrupt input


def test_corrupt_gzip_input_is_one_line(tmp_path: Path) -> None:
    data = b"".join(orjson.dumps({"prompt": f"p {i}"}) + b"\n" for i in range(2000))
    good = gzip.compress(data)
    # NOTE: the first flipped byte that zlib itself rejects (zlib.error, not an OSError).
    for position in range(10, len(good)):
        compressed = bytearray(good)
        compressed[position] ^= 0xFF
        try:
            gzip.decompress(bytes(compressed))
        except zlib.error:
            break
        except (OSError, EOFError):
            continue
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(bytes(compressed))
    proc = subprocess.run(
        [sys.executable, "-m", "vbatch", "run", str(path), "-o", str(tmp_path / "o.jsonl")],
        env=standin_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    line = error_line(proc)
    assert f"cannot read {path}: its gzip data is corrupt or truncated" in line, line
    assert "Check it with `gzip -t`, and compress it again from the original" in line


# ---------------------------------------------------------------------------------------------
# A full disk (ENOSPC)


def test_full_disk_on_the_output_is_one_line_and_resumes(tmp_path: Path) -> None:
    """/dev/full as the output file: every write to it fails with a real ENOSPC."""
    input_path = write_input(tmp_path / "in.jsonl", 50)
    output = tmp_path / "out.jsonl"
    model = model_file(tmp_path)
    # NOTE: a job that crashed before its first commit: job directory made, empty output.
    crashed = run_vbatch(
        tmp_path, *run_args(input_path, output, model), VBATCH_STANDIN_EXIT_AFTER="0"
    )
    assert crashed.returncode == 9, crashed.stderr
    output.unlink()
    output.symlink_to("/dev/full")
    proc = run_vbatch(tmp_path, "resume", str(output), "-q")
    line = error_line(proc)
    assert "no space left on the device holding" in line and "out.jsonl (ENOSPC)" in line
    assert "free some space there, then resume the job" in line
    assert f"0 rows are committed. Resume with: vbatch resume {output}" in proc.stderr
    output.unlink()
    output.touch()
    proc = run_vbatch(tmp_path, "resume", str(output), "-q")
    assert proc.returncode == 0, proc.stderr
    assert_exactly_once(output, 50)


def _namespace_prefix(probe_dir: Path) -> list[str] | None:
    """A command prefix that runs its command in a private mount namespace where it may mount a
    tmpfs, or None where this system allows neither a user namespace nor (as root) unshare."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return None
    candidates = [["unshare", "--user", "--map-root-user", "--mount"]]
    if os.geteuid() == 0:
        candidates.append(["unshare", "--mount"])
    for prefix in candidates:
        probe = [*prefix, "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe_dir}"]
        if subprocess.run(probe, capture_output=True, timeout=30).returncode == 0:
            return prefix
    return None


# NOTE: the job runs inside the namespace, so the whole scenario does too: fill the disk, run
# (it fails), delete the ballast, continue, and copy the output out before the tmpfs vanishes.
DRIVER = textwrap.dedent(
    """
    set -u
    mount -t tmpfs -o size="$DISK_KIB"k tmpfs "$MNT"
    head -c "$BALLAST" /dev/zero > "$MNT/ballast"
    "$PY" "$STANDIN" run "$INPUT" -o "$MNT/$OUT" --model "$MODEL" -q $FLAGS 2> "$LOG/run.err"
    echo $? > "$LOG/run.rc"
    ls -A "$MNT" > "$LOG/after-run.ls"
    rm "$MNT/ballast"
    if [ -d "$MNT/$OUT.vbatch" ]; then
        "$PY" "$STANDIN" resume "$MNT/$OUT" -q 2> "$LOG/resume.err"
    else
        "$PY" "$STANDIN" run "$INPUT" -o "$MNT/$OUT" --model "$MODEL" -q $FLAGS 2> "$LOG/resume.err"
    fi
    echo $? > "$LOG/resume.rc"
    ls -A "$MNT" "$MNT/$OUT.vbatch" > "$LOG/after-resume.ls"
    cp "$MNT/$OUT" "$LOG/$OUT"
    """
)
DISK_KIB = 4096
NUM_ROWS = 400
TEXT_CHARS = 1000


@pytest.mark.parametrize(
    ("case", "output_name", "free_kib", "flags", "failed_file"),
    [
        # No room for the manifest: nothing is left behind, and `run` starts cleanly later.
        ("start", "out.jsonl", 0, "", "manifest.json"),
        # 200 KiB free for ~460 KiB of output: the JSONL output fills up mid-run.
        ("output", "out.jsonl", 200, "--commit-every-rows 20", "out.jsonl (ENOSPC)"),
        # 850 KiB free: the parts (~650 KiB) fit, the final copy of them (~410 KiB) does not.
        ("finalize", "out.parquet", 850, "--commit-every-rows 20 --ordered", "vbatch-tmp"),
        # 700 KiB free: the output (~460 KiB) fits, its sort runs plus the sorted copy do not.
        ("sort", "out.jsonl", 700, "--commit-every-rows 20 --ordered", "ENOSPC"),
    ],
)
def test_full_disk_leaves_a_resumable_job(
    tmp_path: Path, case: str, output_name: str, free_kib: int, flags: str, failed_file: str
) -> None:
    mount_dir = tmp_path / "disk"
    mount_dir.mkdir()
    prefix = _namespace_prefix(mount_dir)
    if prefix is None:
        pytest.skip("cannot mount a small tmpfs here (no user or mount namespace via unshare)")
    log = tmp_path / "log"
    log.mkdir()
    env = standin_env(
        MNT=str(mount_dir),
        BALLAST=str((DISK_KIB - free_kib) * 1024),
        PY=sys.executable,
        STANDIN=str(STANDIN),
        INPUT=str(write_input(tmp_path / "in.jsonl", NUM_ROWS)),
        MODEL=str(model_file(tmp_path)),
        OUT=output_name,
        FLAGS=flags,
        LOG=str(log),
        DISK_KIB=str(DISK_KIB),
        VBATCH_STANDIN_TEXT_CHARS=str(TEXT_CHARS),
    )
    subprocess.run([*prefix, "bash", "-c", DRIVER], env=env, timeout=4 * TIMEOUT_S, check=True)
    run_err = (log / "run.err").read_text()
    failed = subprocess.CompletedProcess([], int((log / "run.rc").read_text()), "", run_err)
    line = error_line(failed)
    assert "no space left on the device holding" in line and failed_file in line, run_err
    assert "free some space there" in line
    left = (log / "after-run.ls").read_text().split()
    assert not any("vbatch-tmp" in name for name in left), "a failed finalize left its temp file"
    if case == "start":
        assert "then run the same command again" in line
        assert f"{output_name}.vbatch" not in left, "a half-made job directory was left"
    else:
        assert f"Resume with: vbatch resume {mount_dir / output_name}" in run_err
    assert (log / "resume.rc").read_text().strip() == "0", (log / "resume.err").read_text()
    rows = assert_exactly_once(log / output_name, NUM_ROWS, TEXT_CHARS)
    if "--ordered" in flags:
        assert [r["index"] for r in rows] == list(range(NUM_ROWS))
    assert "parts" not in (log / "after-resume.ls").read_text().split()


def test_a_metrics_file_on_a_full_disk_is_refused_before_the_job_exists(tmp_path: Path) -> None:
    """An empty probe file fits on a full disk: the first update failed after the job was made,
    with a raw errno message, and the same command was then refused (a job existed)."""
    mount_dir = tmp_path / "disk"
    mount_dir.mkdir()
    prefix = _namespace_prefix(mount_dir)
    if prefix is None:
        pytest.skip("cannot mount a small tmpfs here (no user or mount namespace via unshare)")
    input_path = write_input(tmp_path / "in.jsonl", 3)
    output = tmp_path / "out.jsonl"
    metrics = mount_dir / "m.json"
    command = " ".join(
        shlex.quote(part)
        for part in vbatch_cmd(
            *run_args(input_path, output, model_file(tmp_path), "--metrics-file", str(metrics))
        )
    )
    script = (
        f"mount -t tmpfs -o size=64k tmpfs {mount_dir} && "
        f"(head -c 1048576 /dev/zero > {mount_dir}/ballast; true) && {command}"
    )
    proc = subprocess.run(
        [*prefix, "sh", "-c", script],
        env=standin_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    line = error_line(proc)
    assert f"cannot write metrics file {metrics}: no space left on the device holding" in line
    assert not output.exists() and not (tmp_path / "out.jsonl.vbatch").exists()


# ---------------------------------------------------------------------------------------------
# A failed journal append


JOURNAL_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    from vbatch.job.journal import Journal, read_journal

    job_dir = Path(sys.argv[1])
    path = job_dir / "journal.jsonl"
    journal = Journal(job_dir)
    journal.append("commit", rows=1, indices=[[0, 1]], errors=[], offset=10)
    size = path.stat().st_size
    # NOTE: the next record would cross this limit: the kernel writes part of it, then EFBIG.
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 20, resource.RLIM_INFINITY))
    try:
        journal.append("commit", rows=1, indices=[[1, 2]], errors=[], offset=20)
        print("appended")
    except Exception as e:
        print(f"{type(e).__name__}:", e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("size kept:", path.stat().st_size == size, journal.state.num_records)
    journal.append("commit", rows=1, indices=[[2, 3]], errors=[], offset=30)
    journal.close()
    state, _ = read_journal(path)
    print("replayed:", state.num_records, state.committed.ranges(), state.offset)
    """
)


def test_a_failed_journal_append_is_cut_and_the_journal_stays_consistent(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", JOURNAL_SCRIPT, str(tmp_path)],
        env=standin_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("StorageError: ") and "journal.jsonl" in lines[0]
    assert "largest file size allowed" in lines[0] and "EFBIG" in lines[0]
    assert lines[1] == "size kept: True 1"
    assert lines[2] == "replayed: 2 [[0, 1], [2, 3]] 30"


# ---------------------------------------------------------------------------------------------
# A read-only output directory (EACCES)


def _without_dac_override() -> None:
    """preexec_fn: make root obey permission bits (drop CAP_DAC_OVERRIDE before exec)."""
    pr_capbset_drop, cap_dac_override = 24, 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_capbset_drop, cap_dac_override, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def _permission_preexec(tmp_path: Path) -> Any:
    if os.geteuid() != 0:
        return None
    probe = tmp_path / "probe"
    probe.mkdir(mode=0o555)
    try:
        result = subprocess.run(
            [sys.executable, "-c", f"open({str(probe / 'x')!r}, 'w')"],
            preexec_fn=_without_dac_override,
            capture_output=True,
        )
    except (OSError, subprocess.SubprocessError):
        pytest.skip("cannot drop CAP_DAC_OVERRIDE, and root ignores permission bits")
    if result.returncode == 0:
        pytest.skip("root still writes into a read-only directory here")
    return _without_dac_override


def test_read_only_output_directory_is_one_line(tmp_path: Path) -> None:
    preexec = _permission_preexec(tmp_path)
    input_path = write_input(tmp_path / "in.jsonl", 30)
    model = model_file(tmp_path)
    out_dir = tmp_path / "ro"
    out_dir.mkdir()
    out_dir.chmod(0o555)
    output = out_dir / "out.jsonl"
    proc = run_vbatch(tmp_path, *run_args(input_path, output, model), preexec_fn=preexec)
    line = error_line(proc)
    assert f"permission denied for {out_dir}" in line and "(EACCES)" in line, line
    assert "make its directory writable for this user, or write the output elsewhere" in line

    # NOTE: a Parquet job that committed 10 rows, then lost write permission on its parts/.
    out_dir.chmod(0o755)
    output = out_dir / "out.parquet"
    args = run_args(input_path, output, model, "--commit-every-rows", "10")
    crashed = run_vbatch(tmp_path, *args, VBATCH_STANDIN_EXIT_AFTER="15")
    assert crashed.returncode == 9, crashed.stderr
    parts = out_dir / "out.parquet.vbatch" / "parts"
    parts.chmod(0o555)
    proc = run_vbatch(tmp_path, "resume", str(output), "-q", preexec_fn=preexec)
    line = error_line(proc)
    assert f"permission denied for {parts}" in line, line
    assert f"10 rows are committed. Resume with: vbatch resume {output}" in proc.stderr
    parts.chmod(0o755)
    proc = run_vbatch(tmp_path, "resume", str(output), "-q")
    assert proc.returncode == 0, proc.stderr
    assert_exactly_once(output, 30)


# ---------------------------------------------------------------------------------------------
# `resume --force` after the ids changed type


def test_forced_resume_after_ids_became_strings(tmp_path: Path) -> None:
    model = model_file(tmp_path)
    input_path = write_input(tmp_path / "in.jsonl", 30, row_id=lambda i: i)
    for name in ("out.parquet", "out.jsonl"):
        output = tmp_path / name
        args = run_args(input_path, output, model, "--commit-every-rows", "10")
        write_input(input_path, 30, row_id=lambda i: i)
        crashed = run_vbatch(tmp_path, *args, VBATCH_STANDIN_EXIT_AFTER="15")
        assert crashed.returncode == 9, crashed.stderr
        write_input(input_path, 30)
        proc = run_vbatch(tmp_path, "resume", str(output), "-q", "--force")
        if name == "out.parquet":
            line = error_line(proc)
            assert "were all integers and now some are strings" in line, line
            assert "10 committed rows hold integer ids" in line
            assert "start again with `vbatch run ... --overwrite`" in line
        else:
            # NOTE: JSONL lines carry each id as it is: the job goes on with string ids.
            assert proc.returncode == 0, proc.stderr
            ids = {r["index"]: r["id"] for r in read_rows(output)}
            assert sorted(ids) == list(range(30))
            assert {type(v) for i, v in ids.items() if i >= 10} == {str}


# ---------------------------------------------------------------------------------------------
# The input changed while the job reads it


def test_rows_appended_while_the_job_runs_are_not_the_jobs(tmp_path: Path) -> None:
    """A producer appends rows (reusing ids) after the job counted its input: the job covers the
    rows it counted, each exactly once, and no id twice."""
    model = model_file(tmp_path)
    for name in ("out.jsonl", "out.parquet"):
        input_path = write_input(tmp_path / "in.jsonl", 400)
        output = tmp_path / name
        appended = "".join(f'{{"id": "r{i}", "prompt": "appended"}}\n' for i in range(50))
        proc = run_vbatch(
            tmp_path,
            *run_args(input_path, output, model),
            VBATCH_STANDIN_EDIT_AFTER="5",
            VBATCH_STANDIN_EDIT_PATH=str(input_path),
            VBATCH_STANDIN_EDIT_APPEND=appended,
        )
        assert proc.returncode == 0, proc.stderr
        assert input_path.read_text().count("appended") == 50
        assert_exactly_once(output, 400)


def test_an_input_cut_short_while_the_job_runs_is_an_error_not_an_interruption(
    tmp_path: Path,
) -> None:
    """Exit 75 means a signal stopped the job (a scheduler requeues on it); an input that ends
    early is an error naming the cause, and the rows committed stay. The cut falls inside a
    line, which is part of the cut, not an error row: once the input is restored, a resume
    runs it."""
    model = model_file(tmp_path)
    input_path = write_input(tmp_path / "in.jsonl", 400)
    original = input_path.read_bytes()
    cut = original.index(b"\n", len(original) // 2) - 5
    output = tmp_path / "out.jsonl"
    proc = run_vbatch(
        tmp_path,
        *run_args(input_path, output, model),
        VBATCH_STANDIN_EDIT_AFTER="5",
        VBATCH_STANDIN_EDIT_PATH=str(input_path),
        VBATCH_STANDIN_EDIT_SIZE=str(cut),
    )
    line = error_line(proc)
    assert "ended before the 400 rows it had when the job started" in line, line
    assert "changed during the job" in line
    committed = run_vbatch(tmp_path, "status", str(output))
    assert "400" in committed.stdout, committed.stdout
    input_path.write_bytes(original)
    resumed = run_vbatch(tmp_path, "resume", str(output), "-q")
    assert resumed.returncode == 0, resumed.stderr
    assert_exactly_once(output, 400)


def test_a_forced_resume_of_a_complete_job_takes_no_new_rows(tmp_path: Path) -> None:
    """A complete job's output is final: resume --force on a grown input is refused, and the
    manifest still describes the job that ran."""
    model = model_file(tmp_path)
    input_path = write_input(tmp_path / "in.jsonl", 20)
    output = tmp_path / "out.jsonl"
    assert run_vbatch(tmp_path, *run_args(input_path, output, model)).returncode == 0
    with input_path.open("a") as f:
        f.write('{"id": "new", "prompt": "appended"}\n')
    line = error_line(run_vbatch(tmp_path, "resume", str(output), "--force"))
    assert "is already complete" in line and "takes no new rows" in line, line
    assert "--overwrite" in line
    status = run_vbatch(tmp_path, "status", str(output), "--json")
    assert json.loads(status.stdout)["remaining"] == 0, status.stdout
    assert_exactly_once(output, 20)


def test_directories_where_vbatch_keeps_files_are_named(tmp_path: Path) -> None:
    model = model_file(tmp_path)
    input_path = write_input(tmp_path / "in.jsonl", 10)
    output = tmp_path / "out.parquet"
    tmp_output_path(output).mkdir()
    line = error_line(run_vbatch(tmp_path, *run_args(input_path, output, model)))
    assert f"{tmp_output_path(output)} is a directory, where vbatch keeps a file" in line, line
    tmp_output_path(output).rmdir()
    proc = run_vbatch(
        tmp_path, *run_args(input_path, output, model, "--commit-every-rows", "2"),
        VBATCH_STANDIN_EXIT_AFTER="5",
    )  # fmt: skip
    assert proc.returncode != 0
    (job_dir_for(output) / "parts" / "stray").mkdir()
    resumed = run_vbatch(tmp_path, "resume", str(output), "-q")
    assert resumed.returncode == 0, resumed.stderr
    assert_exactly_once(output, 10)


def test_a_job_resumed_by_another_spelling_of_its_path_has_not_moved(tmp_path: Path) -> None:
    model = model_file(tmp_path)
    (tmp_path / "a").mkdir()
    input_path = write_input(tmp_path / "a" / "in.jsonl", 10)
    output = tmp_path / "a" / "out.jsonl"
    proc = run_vbatch(tmp_path, *run_args(input_path, output, model), VBATCH_STANDIN_EXIT_AFTER="3")
    assert proc.returncode != 0
    manifest = json.loads((job_dir_for(output) / "manifest.json").read_text())
    assert manifest["input_path"] == str(input_path)
    resumed = run_vbatch(tmp_path / "a", "resume", "../a/out.jsonl", "-q")
    assert resumed.returncode == 0, resumed.stderr
    assert "note:" not in resumed.stderr, resumed.stderr
    manifest = json.loads((job_dir_for(output) / "manifest.json").read_text())
    assert manifest["output_path"] == str(output)
    assert_exactly_once(output, 10)


def test_sigterm_before_the_job_exists_interrupts_and_leaves_no_directory(
    tmp_path: Path,
) -> None:
    """SIGTERM (timeout, Slurm) while `run` still scans its input acts as SIGINT does: exit
    130, `error: interrupted`, and no lock-only directory that resume would call no job."""
    model = model_file(tmp_path)
    input_path = tmp_path / "in.jsonl"
    # NOTE: a scan of seconds, so the signal lands in it once the job directory appears.
    input_path.write_bytes(b"".join(b'{"id": "r%d", "prompt": "p"}\n' % i for i in range(10**6)))
    output = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        vbatch_cmd(*run_args(input_path, output, model)),
        cwd=tmp_path,
        env=standin_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    while not job_dir_for(output).exists() and proc.poll() is None:
        time.sleep(0.005)
    # NOTE: past taking the job's lock, into the scan.
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=TIMEOUT_S)[1]
    assert proc.returncode == 130, stderr
    assert "error: interrupted" in stderr and "Traceback" not in stderr
    assert not job_dir_for(output).exists() and not output.exists()


def test_a_lock_only_job_directory_says_how_to_go_on(tmp_path: Path) -> None:
    """What a run killed (SIGKILL) before its job existed leaves: resume and status say so."""
    output = tmp_path / "out.jsonl"
    job_dir_for(output).mkdir()
    (job_dir_for(output) / "lock").touch()
    for command in ("resume", "status"):
        line = error_line(run_vbatch(tmp_path, command, str(output)))
        assert "holds no job: a `vbatch run` stopped before its job was created" in line
    # NOTE: a run still scanning its input holds the lock: not a stopped one.
    lock = JobLock(job_dir_for(output))
    try:
        line = error_line(run_vbatch(tmp_path, "status", str(output)))
        assert "a `vbatch run` is still creating the job" in line and "ask again" in line
    finally:
        lock.release()


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_an_output_that_is_a_symlink_is_written_through_it(tmp_path: Path, suffix: str) -> None:
    """The job writes the file the link points to, keeps the link, and resumes through it."""
    model = model_file(tmp_path)
    input_path = write_input(tmp_path / "in.jsonl", 30)
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / f"out{suffix}"
    link = tmp_path / f"out{suffix}"
    link.symlink_to(Path("elsewhere") / target.name)
    args = run_args(input_path, link, model, "--commit-every-rows", "5")
    crashed = run_vbatch(tmp_path, *args, VBATCH_STANDIN_EXIT_AFTER="17")
    assert crashed.returncode == 9, crashed.stderr
    assert job_dir_for(target).is_dir() and not job_dir_for(link).exists()
    resumed = run_vbatch(tmp_path, "resume", link.name, "-q")
    assert resumed.returncode == 0, resumed.stderr
    assert link.is_symlink() and link.resolve() == target
    assert_exactly_once(target, 30)
    status = run_vbatch(tmp_path, "status", link.name)
    assert status.returncode == 0 and "(complete)" in status.stdout, status.stderr


DAMAGED_PARTS = {
    "delete": "is missing",
    "truncate": "cannot be read",
    "garbage": "cannot be read",
    "fewer-rows": "holds 1 rows where its commit recorded 10",
    "other-columns": "holds other columns than this job writes",
    "data": "cannot be read",
}


@pytest.mark.parametrize("damage", DAMAGED_PARTS)
def test_a_committed_parquet_part_damaged_outside_vbatch_is_refused_at_resume(
    tmp_path: Path, damage: str
) -> None:
    """Before running anything: its rows would be lost at finalize, and every later resume would
    fail the same way there. Damage past a readable footer (its data pages) shows only when
    finalize reads the part: the same one line then, not "a bug" and a resume that repeats it."""
    model = model_file(tmp_path)
    input_path = write_input(tmp_path / "in.jsonl", 60)
    output = tmp_path / "out.parquet"
    args = run_args(input_path, output, model, "--commit-every-rows", "10")
    crashed = run_vbatch(tmp_path, *args, VBATCH_STANDIN_EXIT_AFTER="35")
    assert crashed.returncode == 9, crashed.stderr
    part = sorted((tmp_path / "out.parquet.vbatch" / "parts").glob("part-*.parquet"))[1]
    schema = pq.read_schema(part)
    if damage == "delete":
        part.unlink()
    elif damage == "truncate":
        part.write_bytes(part.read_bytes()[:300])
    elif damage == "garbage":
        part.write_bytes(os.urandom(part.stat().st_size))
    elif damage == "fewer-rows":
        pq.write_table(pq.read_table(part).slice(0, 1), part)
    elif damage == "other-columns":
        pq.write_table(pa.table({"x": list(range(10))}), part)
    else:
        data = bytearray(part.read_bytes())
        data[4:64] = b"\xff" * 60
        part.write_bytes(bytes(data))
    resumed = run_vbatch(tmp_path, "resume", str(output), "-q")
    line = error_line(resumed)
    assert f"{part}, a committed part of this job's output, {DAMAGED_PARTS[damage]}" in line, line
    assert "vbatch run ... --overwrite" in line
    assert "bug" not in resumed.stderr and "Resume with" not in resumed.stderr, resumed.stderr
    if damage == "data":
        return
    state, _ = read_journal(tmp_path / "out.parquet.vbatch" / "journal.jsonl")
    assert len(state.committed) == 30, "the refused resume ran rows"
    with pytest.raises(JobStateError, match="a committed part of this job's output"):
        finalize(
            tmp_path / "out.parquet.vbatch",
            output,
            Journal(tmp_path / "out.parquet.vbatch"),
            schema,
            ordered=False,
        )


def test_an_output_below_a_file_and_a_pipe_as_input_are_one_line_each(tmp_path: Path) -> None:
    model = model_file(tmp_path)
    input_path = write_input(tmp_path / "in.jsonl", 3)
    below = run_vbatch(tmp_path, *run_args(input_path, input_path / "x.jsonl", model))
    assert f"cannot write {input_path / 'x.jsonl'}: {input_path} is a file" in error_line(below)
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    piped = run_vbatch(tmp_path, *run_args(fifo, tmp_path / "out.jsonl", model))
    assert f"the input {fifo} is not a regular file (a pipe" in error_line(piped)
    assert not (tmp_path / "out.jsonl.vbatch").exists()


def test_a_row_without_an_id_among_rows_with_ids_is_an_error_row_on_resume_too(
    tmp_path: Path,
) -> None:
    """Its index could equal another row's id (2 here): it is an error row with no id, and the
    job is neither refused for a duplicate nor given an id that was never in the input."""
    model = model_file(tmp_path)
    input_path = tmp_path / "in.jsonl"
    records = [{"id": 9, "prompt": "a"}, {"id": 8, "prompt": "b"}, {"prompt": "c"}]
    records += [{"id": 2, "prompt": "d"}, {"prompt": "e"}]
    input_path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    output = tmp_path / "out.jsonl"
    args = run_args(input_path, output, model, "--commit-every-rows", "1")
    crashed = run_vbatch(tmp_path, *args, VBATCH_STANDIN_EXIT_AFTER="2")
    assert crashed.returncode == 9, crashed.stderr
    resumed = run_vbatch(tmp_path, "resume", str(output), "-q")
    assert resumed.returncode == 0, resumed.stderr
    rows = {r["index"]: r for r in read_rows(output)}
    assert [rows[i]["id"] for i in range(5)] == [9, 8, None, 2, None]
    for i in (2, 4):
        assert (
            f"line {i + 1}: the row has no 'id', which the input's other rows" in rows[i]["error"]
        )
    assert all(rows[i]["error"] is None for i in (0, 1, 3))


def test_status_of_a_shards_own_file_in_text_and_json(tmp_path: Path) -> None:
    """cli.md: resume and status take a shard's file. Its manifest's shard record once reached
    the printer as a struct (a traceback in both forms)."""
    model = model_file(tmp_path)
    input_path = write_input(tmp_path / "in.jsonl", 6)
    done = run_vbatch(
        tmp_path, *run_args(input_path, tmp_path / "out.jsonl", model), "--shard", "0/2"
    )
    assert done.returncode == 0, done.stderr
    shard_file = tmp_path / "out.shard-0-of-2.jsonl"
    text = run_vbatch(tmp_path, "status", str(shard_file))
    assert text.returncode == 0 and "shard:       0/2" in text.stdout, text.stderr
    as_json = run_vbatch(tmp_path, "status", str(shard_file), "--json")
    assert as_json.returncode == 0, as_json.stderr
    info = orjson.loads(as_json.stdout)
    assert info["shard"]["index"] == 0 and info["shard"]["count"] == 2


def test_an_engine_that_never_starts_leaves_no_job_to_resume_unless_rows_were_committed(
    tmp_path: Path,
) -> None:
    """A resume of a job that never ran a row could only fail the same way (its settings are the
    job's): the new job is dropped, and the same command, fixed, runs. A job with committed rows
    is kept, with its resume command."""
    model = model_file(tmp_path)
    input_path = write_input(tmp_path / "in.jsonl", 20)
    output = tmp_path / "out.jsonl"
    args = run_args(input_path, output, model, "--commit-every-rows", "5")
    failed = run_vbatch(tmp_path, *args, VBATCH_STANDIN_FAIL_START="the model is broken")
    line = error_line(failed)
    assert line == "error: the model is broken", line
    assert "no row ran, so no job was kept: fix the cause and run the same command again" in (
        failed.stderr
    )
    assert "Resume with" not in failed.stderr
    assert not output.exists() and not (tmp_path / "out.jsonl.vbatch").exists()
    # NOTE: a job that exists keeps its resume command, committed rows or not.
    never = run_vbatch(tmp_path, *args, VBATCH_STANDIN_EXIT_AFTER="0")
    assert never.returncode == 9, never.stderr
    again = run_vbatch(tmp_path, "resume", str(output), "-q", VBATCH_STANDIN_FAIL_START="still")
    assert error_line(again) == "error: still"
    assert "0 rows are committed. Resume with:" in again.stderr
    crashed = run_vbatch(tmp_path, *args, "--overwrite", VBATCH_STANDIN_EXIT_AFTER="12")
    assert crashed.returncode == 9, crashed.stderr
    kept = run_vbatch(tmp_path, "resume", str(output), "-q", VBATCH_STANDIN_FAIL_START="gone")
    assert error_line(kept) == "error: gone"
    assert "10 rows are committed. Resume with:" in kept.stderr
    resumed = run_vbatch(tmp_path, "resume", str(output), "-q")
    assert resumed.returncode == 0, resumed.stderr
    assert_exactly_once(output, 20)


def test_columns_first_seen_past_the_checked_rows_keep_and_identify(tmp_path: Path) -> None:
    """--keep-all-columns takes a key that only row 150 has, and ids that start at row 130 fix
    the id column: neither is a user's typo for the first-rows column check to refuse."""
    model = model_file(tmp_path)
    records: list[dict[str, Any]] = [{"prompt": f"prompt {i}"} for i in range(130)]
    records += [{"id": f"r{i}", "prompt": f"prompt {i}"} for i in range(130, 160)]
    records[150]["note"] = "late"
    input_path = tmp_path / "in.jsonl"
    input_path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    output = tmp_path / "out.jsonl"
    proc = run_vbatch(tmp_path, *run_args(input_path, output, model, "--keep-all-columns"))
    assert proc.returncode == 0, proc.stderr
    rows = {r["index"]: r for r in read_rows(output)}
    assert len(rows) == 160 and rows[150]["note"] == "late" and rows[151]["note"] is None
    assert rows[140]["id"] == "r140" and rows[140]["error"] is None
    assert rows[0]["id"] is None and "the row has no 'id'" in rows[0]["error"]


@pytest.mark.parametrize(
    "where", ["new-dir", "a-directory", "below-a-file", "proc", "a-pipe", "a-symlink"]
)
def test_a_metrics_file_is_checked_and_its_directory_made_before_the_job_exists(
    tmp_path: Path, where: str
) -> None:
    """As for the output; a metrics file that could not be written failed the job after it was
    created, stranding it. A pipe (or a device: /dev/null) was replaced by a regular file, and
    a symlink by the file it should have been written through to."""
    model = model_file(tmp_path)
    input_path = write_input(tmp_path / "in.jsonl", 3)
    output = tmp_path / "out.jsonl"
    metrics = {
        "new-dir": tmp_path / "new" / "m.json",
        "a-directory": tmp_path,
        "below-a-file": input_path / "m.json",
        "proc": Path("/proc/m.json"),
        "a-pipe": tmp_path / "pipe",
        "a-symlink": tmp_path / "link.json",
    }[where]
    if where == "a-pipe":
        os.mkfifo(metrics)
    if where == "a-symlink":
        (tmp_path / "real").mkdir()
        metrics.symlink_to(tmp_path / "real" / "m.json")
    proc = run_vbatch(
        tmp_path, *run_args(input_path, output, model, "--metrics-file", str(metrics))
    )
    if where in ("new-dir", "a-symlink"):
        assert proc.returncode == 0, proc.stderr
        assert orjson.loads(metrics.read_bytes())
        assert metrics.is_symlink() == (where == "a-symlink")
        return
    problem = {
        "a-directory": "it is a directory",
        "below-a-file": f"{input_path} is a file",
        "proc": "/proc is not writable",
        "a-pipe": "it is not a regular file (a pipe, a device or a socket)",
    }[where]
    assert f"cannot write metrics file {metrics}: {problem}" in error_line(proc), proc.stderr
    assert not output.exists() and not (tmp_path / "out.jsonl.vbatch").exists()
    fixed = run_vbatch(tmp_path, *run_args(input_path, output, model))
    assert fixed.returncode == 0, fixed.stderr


# ---------------------------------------------------------------------------------------------
# Anything unexpected


def test_unexpected_error_commits_finished_rows_and_prints_one_line(tmp_path: Path) -> None:
    input_path = write_input(tmp_path / "in.jsonl", 40)
    output = tmp_path / "out.jsonl"
    args = run_args(input_path, output, model_file(tmp_path), "--commit-every-rows", "1000")
    proc = run_vbatch(tmp_path, *args, VBATCH_STANDIN_RAISE_AFTER="25")
    line = error_line(proc)
    assert "unexpected RuntimeError: stand-in engine bug at request 25" in line
    assert "rerun with VBATCH_DEBUG=1" in line
    # NOTE: the 25 finished rows were never due for a commit; the failure committed them.
    assert f"25 rows are committed. Resume with: vbatch resume {output}" in proc.stderr
    status = subprocess.run(
        vbatch_cmd("status", str(output), "--json"),
        env=standin_env(),
        capture_output=True,
        timeout=TIMEOUT_S,
    )
    assert orjson.loads(status.stdout)["done"] == 25
    debug = run_vbatch(
        tmp_path, "resume", str(output), "-q", VBATCH_STANDIN_RAISE_AFTER="5", VBATCH_DEBUG="1"
    )
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    assert "RuntimeError: stand-in engine bug at request 5" in debug.stderr
    proc = run_vbatch(tmp_path, "resume", str(output), "-q")
    assert proc.returncode == 0, proc.stderr
    assert_exactly_once(output, 40)


# ---------------------------------------------------------------------------------------------
# Durability order


def test_directories_are_fsynced_before_the_records_that_need_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fsync and mkdir is observed (by path) next to every journal record: a part's
    directory entries, and the final temp file's, are durable before a record names them."""
    events: list[tuple[str, str]] = []
    real_fsync, real_mkdir, real_append = os.fsync, os.mkdir, Journal.append

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        real_mkdir(path, *args, **kwargs)
        events.append(("mkdir", os.path.realpath(path)))

    def append(self: Journal, kind: str, **fields: Any) -> dict[str, Any]:
        events.append((kind, str(fields.get("part") or fields.get("tmp"))))
        return real_append(self, kind, **fields)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(Journal, "append", append)
    base = Path(os.path.realpath(tmp_path))
    job_dir, output = base / "out.parquet.vbatch", base / "out.parquet"
    job_dir.mkdir()
    journal = Journal(job_dir)
    schema = parquet_schema("int", [])
    writer = ParquetWriter(journal, job_dir, schema, id_kind="int", json_kept=False, ordered=True)
    for index in (3, 1, 0, 2):
        values = error_row(InputRow(index, f"line {index + 1}", index), "bad")
        writer.add(values, None, None)
        if index in (1, 2):
            writer.commit()
    finalize(job_dir, output, journal, schema, ordered=True)

    def position(event: tuple[str, str], after: int = -1) -> int:
        if event not in events[after + 1 :]:
            pytest.fail(f"no {event} after event {after}: {events}")
        return events.index(event, after + 1)

    made_job, made_parts = (
        position(("mkdir", str(job_dir))),
        position(("mkdir", str(job_dir / "parts"))),
    )
    for name in ["parts/part-000000.parquet", "parts/part-000001.parquet"]:
        record = position(("commit", name))
        wrote_part = position(("fsync", str(job_dir / name)))
        assert wrote_part < record
        assert position(("fsync", str(job_dir / "parts")), wrote_part) < record
        assert position(("fsync", str(job_dir)), made_parts) < record, "parts/ entry not durable"
        assert position(("fsync", str(base)), made_job) < record, "job dir entry not durable"
    tmp = tmp_output_path(output)
    complete = position(("complete", tmp.name))
    synced_tmp = position(("fsync", str(tmp)))
    assert position(("fsync", str(base)), synced_tmp) < complete, "temp file entry not durable"
    assert output.exists()


def test_a_job_names_sampling_settings_given_beside_the_prompt_once(tmp_path: Path) -> None:
    model = model_file(tmp_path)
    input_path = tmp_path / "in.jsonl"
    input_path.write_bytes(
        b"".join(
            orjson.dumps({"id": f"r{i}", "prompt": f"p {i}", "max_tokens": 5, "seed": i}) + b"\n"
            for i in range(4)
        )
    )
    args = [a for a in run_args(input_path, tmp_path / "out.jsonl", model) if a != "-q"]
    done = run_vbatch(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "beside its prompt" in line]
    assert warnings == [
        "vbatch: warning: line 1 holds max_tokens, seed beside its prompt, where a row's sampling "
        'settings are not read: give them under "sampling_params" ({"sampling_params": '
        '{"max_tokens": ...}}) or as the run\'s flags'
    ], done.stderr
    assert len(read_rows(tmp_path / "out.jsonl")) == 4
