"""The command's exit (vbatch/__main__.py): sys.exit's status and effects, without the
interpreter's teardown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("code", "status", "stderr"),
    [("None", 0, ""), ("0", 0, ""), ("3", 3, ""), ("'no input'", 1, "no input\n")],
)
def test_exit_now_ends_with_sys_exit_status(code: str, status: int, stderr: str) -> None:
    done = run_python(f"from vbatch.__main__ import exit_now; exit_now({code})")
    assert (done.returncode, done.stderr) == (status, stderr)


def test_exit_now_runs_exit_hooks_and_flushes_unterminated_output(tmp_path: Path) -> None:
    marker = tmp_path / "hook-ran"
    done = run_python(
        "import atexit, pathlib, sys\n"
        "from vbatch.__main__ import exit_now\n"
        f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes')\n"
        "sys.stdout.write('partial line, no newline')\n"
        "sys.stderr.write('err without newline')\n"
        "exit_now(0)\n"
    )
    assert done.returncode == 0
    assert marker.read_text() == "yes"
    assert done.stdout == "partial line, no newline"
    assert done.stderr == "err without newline"


def test_exit_now_waits_for_a_running_non_daemon_thread(tmp_path: Path) -> None:
    marker = tmp_path / "thread-finished"
    done = run_python(
        "import pathlib, threading, time\n"
        "from vbatch.__main__ import exit_now\n"
        "def work():\n"
        "    time.sleep(0.5)\n"
        f"    pathlib.Path({str(marker)!r}).write_text('done')\n"
        "threading.Thread(target=work).start()\n"
        "exit_now(5)\n"
    )
    assert done.returncode == 5
    assert marker.read_text() == "done"


def test_the_command_line_exits_with_its_status() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "vbatch", "no-such-command"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "No such command" in done.stderr


@pytest.mark.parametrize(("preset", "seen"), [(None, "1"), ("4", "4")], ids=["ours", "users"])
def test_the_command_runs_numpys_blas_on_one_thread_unless_told_otherwise(
    preset: str | None, seen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if preset is None:
        monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", preset)
    done = run_python(
        "import atexit, os, sys\n"
        "atexit.register(lambda: print(os.environ.get('OPENBLAS_NUM_THREADS')))\n"
        "sys.argv = ['vbatch', '--version']\n"
        "from vbatch.__main__ import main\n"
        "print('numpy loaded before main:', 'numpy' in sys.modules)\n"
        "main()\n"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "numpy loaded before main: False"
    assert lines[-1] == seen


def test_a_ctrl_c_anywhere_in_the_start_up_is_one_line_never_a_traceback(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """SIGINT at moments spread over the command's start-up: once, it could land in vbatch's
    package imports or the preloaded core's (a traceback), or in Typer's dispatch, which turned
    it into exit 130 silently. Each landing now says `error: interrupted` (130), or, once the
    job runs, stops it (75) or lets it finish; only the interpreter's own start-up, before any
    vbatch code, is left to Python."""
    import signal
    import time

    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    args = ["run", "in.jsonl", "-o", "out.jsonl", "--model", str(tiny_model_dir)]
    command = [sys.executable, "-m", "vbatch", *args, "--max-tokens", "2", "--overwrite"]
    outcomes = []
    for delay in (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.9):
        proc = subprocess.Popen(
            command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
        outcomes.append((delay, proc.returncode, stderr))
        if proc.returncode == -signal.SIGINT:
            assert "vbatch" not in stderr, stderr
            continue
        if stderr.startswith("Fatal Python error: init_import_site"):
            # NOTE: on a busy machine the signal can land in the site module's .pth imports,
            # the interpreter's start-up before `-m vbatch` runs anything of ours.
            assert "vbatch/__main__" not in stderr and "vbatch/cli" not in stderr, stderr
            continue
        assert "Traceback" not in stderr, stderr
        assert proc.returncode in (0, 75, 130), (delay, proc.returncode, stderr)
        if proc.returncode == 130:
            assert stderr.splitlines()[-1] == "error: interrupted", stderr
    assert any(code == 130 for _, code, _ in outcomes), outcomes


def run_signalled_at(
    tmp_path: Path, tiny_model_dir: Path, signum: str, module: str, name: str
) -> subprocess.CompletedProcess[str]:
    """`vbatch run` of one row on the tiny model, the process sending itself `signum` as it calls
    `module.name`, so that no timing decides where the signal lands. A SIGINT case starts with
    SIGINT ignored (`cmd &` in a script); a SIGHUP one with SIGHUP as a terminal's command has
    it, also where the suite runs under nohup."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    argv = ["vbatch", "run", "in.jsonl", "-o", "out.jsonl", "--model", str(tiny_model_dir)]
    code = "\n".join(
        [
            "import os, signal, sys",
            "signal.signal(signal.SIGINT, signal.SIG_IGN)" if signum == "SIGINT" else "",
            "signal.signal(signal.SIGHUP, signal.SIG_DFL)" if signum == "SIGHUP" else "",
            f"sys.argv = {[*argv, '--max-tokens', '2']!r}",
            f"import {module} as target",
            f"start = target.{name}",
            "def signalled(*args, **kwargs):",
            f"    os.kill(os.getpid(), signal.{signum})",
            "    return start(*args, **kwargs)",
            f"target.{name} = signalled",
            "from vbatch.__main__ import main",
            "main()",
        ]
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("signum", "moment"),
    [
        ("SIGINT", "preload"),
        ("SIGTERM", "preload"),
        ("SIGHUP", "preload"),
        ("SIGTERM", "dispatch"),
        ("SIGHUP", "dispatch"),
    ],
)
def test_a_stop_signal_before_the_job_exists_interrupts_the_command(
    signum: str, moment: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A stop signal sent as the command starts its engine core (SIGINT with the command started
    ignoring it, as `cmd &` in a script does) or as Typer dispatches: the ignored SIGINT was
    lost and the job ran to its end (0), SIGTERM and SIGHUP killed the command without a word.
    Each now ends it as a Ctrl-C does, before any job exists."""
    module, name = ("vbatch.engine.preload", "preload_core")
    if moment == "dispatch":
        module, name = ("vbatch.cli", "app")
    proc = run_signalled_at(tmp_path, tiny_model_dir, signum, module, name)
    assert (proc.returncode, proc.stderr.splitlines()[-1:]) == (130, ["error: interrupted"])
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out.jsonl").exists()
    assert not (tmp_path / "out.jsonl.vbatch").exists()


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_as_a_finished_job_reports_leaves_its_status_0(
    signum: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A stop signal landing as a finished job prints its summary: the command said `error:
    interrupted` (130) over a complete output, and running it again, as that implies, was
    refused for the job directory. The job's result stands."""
    proc = run_signalled_at(tmp_path, tiny_model_dir, signum, "vbatch.cli", "_finish")
    assert proc.returncode == 0, proc.stderr
    assert "error: interrupted" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("wrote "), proc.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("stderr", ["full", "closed-pipe", "closed"])
def test_a_job_whose_stderr_cannot_be_written_finishes_with_status_0(
    stderr: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The terminal gone, `2>/dev/full`, `2>&1 | head -1` or `2>&-`: before, the summary's failed
    write was reported as a full disk holding a job file (or the exit's flush failed), and a
    finished job exited 1."""
    (tmp_path / "in.jsonl").write_text("".join(f'{{"prompt": "row {i}"}}\n' for i in range(6)))
    args = [sys.executable, "-m", "vbatch", "run", "in.jsonl", "-o", "out.jsonl"]
    args += ["--model", str(tiny_model_dir), "--max-tokens", "3", "--num-threads", "1"]
    if stderr == "full":
        with open("/dev/full", "w") as full:
            done = subprocess.run(args, cwd=tmp_path, stderr=full, timeout=180, check=False)
    elif stderr == "closed-pipe":
        read_end, write_end = os.pipe()
        os.close(read_end)
        done = subprocess.run(args, cwd=tmp_path, stderr=write_end, timeout=180, check=False)
        os.close(write_end)
    else:
        done = subprocess.run(
            args,
            cwd=tmp_path,
            stderr=subprocess.DEVNULL,
            timeout=180,
            check=False,
            preexec_fn=lambda: os.close(2),
        )
    assert done.returncode == 0
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 6


def test_a_closed_standard_fd_gets_the_null_device_before_any_file_takes_its_number() -> None:
    done = run_python(
        "import os, sys\n"
        "os.close(2)\n"
        "from vbatch.__main__ import guard_standard_streams\n"
        "guard_standard_streams()\n"
        "fd = os.open(os.devnull, os.O_RDONLY)\n"
        "print(fd > 2, os.path.samestat(os.fstat(2), os.stat(os.devnull)))\n"
    )
    assert done.stdout.split() == ["True", "True"]


def test_a_command_whose_stdout_cannot_be_written_says_so_in_one_line() -> None:
    """`vbatch status > /dev/full`: before, a traceback ending in the OSError."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "vbatch", "--version"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 1
    assert done.stderr == "error: cannot write the command's output: No space left on device\n"
