"""ProgressDisplay: the display thread behind the live dashboard, the log line and metrics file."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson
from rich.console import Console
from rich.live import Live
from rich.text import Text

from vbatch.errors import ConfigError
from vbatch.job.dashboard import plain_line, render_dashboard, render_summary
from vbatch.job.metrics import JobMetrics, JobSnapshot
from vbatch.job.paths import write_atomic

MODES = ("auto", "live", "plain", "quiet")
METRICS_FILE_PERIOD_S = 1.0

# NOTE: a render took 2.3-5.4 ms of CPU on a 2-vCPU AVX2 EPYC, so two a second keep the
# display thread's hold on the GIL near 1%.
REFRESH_PER_SECOND = 2.0
# NOTE: a notice that starts so is shown in quiet mode too.
WARNING_PREFIX = "warning:"


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` with `data` as JSON so that a reader sees the old or the new file, whole;
    a symlink there is written through (its target replaced, the link kept)."""
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    write_atomic(path, orjson.dumps(data, option=orjson.OPT_INDENT_2), sync_dir=False)


def snapshot_to_json(snap: JobSnapshot) -> dict[str, Any]:
    data = dataclasses.asdict(snap)
    data["num_truncated"] = snap.num_truncated
    data["updated_at"] = time.time()
    return data


class ProgressDisplay:
    """Shows a job's JobMetrics: a rich Live view, a plain line every `log_interval_s`, or nothing.

    Invariants: while started, only the display thread renders, prints progress or writes the
    metrics file; the job's thread touches nothing here but JobMetrics. `stop()` joins the thread
    and then prints the summary exactly once, in every mode but quiet (nothing but errors).
    """

    def __init__(
        self,
        metrics: JobMetrics,
        *,
        mode: str = "auto",
        console: Console | None = None,
        log_interval_s: float = 10.0,
        metrics_file: Path | None = None,
        refresh_per_second: float = REFRESH_PER_SECOND,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"progress mode must be one of {', '.join(MODES)}, got {mode!r}")
        if log_interval_s <= 0 or refresh_per_second <= 0:
            raise ConfigError("log_interval_s and refresh_per_second must be positive")
        self.metrics = metrics
        self.console = console or Console()
        if mode == "auto":
            is_tty = self.console.is_terminal and not self.console.is_dumb_terminal
            mode = "live" if is_tty else "plain"
        self.mode = mode
        self.log_interval_s = log_interval_s
        self.metrics_file = Path(metrics_file) if metrics_file is not None else None
        self._refresh_s = 1.0 / refresh_per_second
        self._live: Live | None = None
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._last_log_t = 0.0
        self._last_log_key: tuple[str, str] | None = None
        self._last_write_t = 0.0
        self._seen_error_kinds: set[str] = set()
        self._num_notices_shown = 0

    def __enter__(self) -> ProgressDisplay:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        assert self._thread is None, "ProgressDisplay started twice"
        snap = self.metrics.snapshot()
        if self.metrics_file is not None:
            try:
                write_json_atomic(self.metrics_file, snapshot_to_json(snap))
            except OSError as e:
                raise ConfigError(f"cannot write metrics file {self.metrics_file}: {e}") from e
            self._last_write_t = time.monotonic()
        if self.mode == "live":
            self._live = Live(
                render_dashboard(snap), console=self.console, auto_refresh=False, transient=True
            )
            self._live.start(refresh=True)
        self._thread = threading.Thread(target=self._run, name="vbatch-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Join the display thread, write the final metrics file and print the summary (unless
        quiet)."""
        if self._thread is None or self._stop_event.is_set():
            return
        self._stop_event.set()
        self._thread.join()
        snap = self.metrics.snapshot()
        if self._live is not None:
            # NOTE: Live.stop() draws its last frame uncropped before erasing it, and what is
            # taller than the terminal would stay in its scrollback above the summary.
            self._live.update(Text(""), refresh=True)
            self._live.stop()
        self._report_errors(snap)
        self._show_notices(snap)
        if self.metrics_file is not None:
            self._write_metrics_file(snap)
        if self.mode != "quiet":
            self.console.print(render_summary(snap))

    def _run(self) -> None:
        self._tick(time.monotonic())
        while not self._stop_event.wait(self._refresh_s):
            self._tick(time.monotonic())

    def _tick(self, now: float) -> None:
        snap = self.metrics.snapshot()
        self._show_notices(snap)
        if self._live is not None:
            self._live.update(render_dashboard(snap), refresh=True)
        elif self.mode == "plain":
            key = (snap.state, snap.startup_stage)
            if key != self._last_log_key or now - self._last_log_t >= self.log_interval_s:
                self._print_plain(plain_line(snap))
                self._last_log_key, self._last_log_t = key, now
        self._report_errors(snap)
        if self.metrics_file is not None and now - self._last_write_t >= METRICS_FILE_PERIOD_S:
            self._write_metrics_file(snap)
            self._last_write_t = now

    def _print_plain(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _show_notices(self, snap: JobSnapshot) -> None:
        """Print each new notice once (above the live view); in quiet mode, the warnings only."""
        for text in snap.notices[self._num_notices_shown :]:
            if self.mode != "quiet" or text.startswith(WARNING_PREFIX):
                self._print_plain(f"vbatch: {text}")
        self._num_notices_shown = len(snap.notices)

    def _report_errors(self, snap: JobSnapshot) -> None:
        """Plain and quiet modes name each new kind of row error once; live shows them anyway."""
        if self.mode == "live":
            return
        for kind in sorted(snap.errors_by_kind.keys() - self._seen_error_kinds):
            self._seen_error_kinds.add(kind)
            self._print_plain(f"vbatch: rows are failing with {kind} (see their error column)")

    def _write_metrics_file(self, snap: JobSnapshot) -> None:
        assert self.metrics_file is not None
        try:
            write_json_atomic(self.metrics_file, snapshot_to_json(snap))
        except OSError as e:
            # NOTE: a full disk or a removed directory must not stop the job; warn once and go on.
            self._print_plain(f"vbatch: warning: stopped writing {self.metrics_file}: {e}")
            self.metrics_file = None
