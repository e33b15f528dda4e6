"""Pure functions from a JobSnapshot to the live dashboard, the end summary and the log line."""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.segment import Segment
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from vbatch.job.metrics import FINISH_REASONS, EngineSnapshot, JobSnapshot

STARTUP_STATES = ("starting", "loading model")
STATE_STYLES = {
    "starting": "cyan",
    "loading model": "cyan",
    "running": "green",
    "draining": "bold yellow",
    "committing": "cyan",
    "done": "bold green",
    "failed": "bold red",
    "interrupted": "bold yellow",
}
ENGINE_STATE_STYLES = {
    "live": "green",
    "starting": "cyan",
    "restarting": "yellow",
    "dead": "red",
    "stopped": "dim",
}
FINISH_STYLES = {"length": "bold yellow", "error": "red", "abort": "yellow"}
SPARK_BLOCKS = " ▁▂▃▄▅▆▇█"
LABEL_WIDTH = 13
COLUMN_GAP = 2
MIN_TWO_COLUMN_WIDTH = 60
# NOTE: past the label column (14) and the borders, a value gets about 20 columns here.
MIN_SUMMARY_TABLE_WIDTH = 40
MIN_BAR_WIDTH = 10
STALE_STATS_S = 5.0


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "--"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def fmt_rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def fmt_pct(fraction: float | None) -> str:
    return "--" if fraction is None else f"{100 * fraction:.0f}%"


def fmt_bytes(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _rows_of_total(snap: JobSnapshot) -> str:
    total = "?" if snap.total_rows is None else f"{snap.total_rows:,}"
    return f"{snap.num_rows_done:,}/{total}"


class Sparkline:
    """A one-line bar history in unicode blocks: the newest values that fit the width."""

    def __init__(self, values: tuple[float, ...], style: str = "green") -> None:
        self.values = values
        self.style = style

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # NOTE: a rate can dip below zero when an engine restarts and its counters start over.
        values = [max(v, 0.0) for v in self.values[-options.max_width :]]
        peak = max(values, default=0.0)
        top = len(SPARK_BLOCKS) - 1
        bars = "".join(
            SPARK_BLOCKS[min(top, round(v / peak * top))] if peak > 0 else SPARK_BLOCKS[0]
            for v in values
        )
        yield Text(bars, style=self.style, no_wrap=True, overflow="crop")


def _line(label: str, value: str | Text = "", style: str = "") -> Text:
    """One `label  value` row of a section, cropped with an ellipsis rather than wrapped."""
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(label.ljust(LABEL_WIDTH), style="dim")
    text.append(value if isinstance(value, Text) else Text(value, style=style))
    return text


class TwoColumns:
    """Two stacks of lines side by side, or one above the other when the width is narrow."""

    def __init__(self, left: list[Text], right: list[RenderableType]) -> None:
        self.left = left
        self.right = right

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        if width < MIN_TWO_COLUMN_WIDTH:
            yield Group(*self.left, *self.right)
            return
        left_width = (width - COLUMN_GAP) // 2
        right_width = width - COLUMN_GAP - left_width
        left = console.render_lines(Group(*self.left), options.update_width(left_width), pad=True)
        right = console.render_lines(
            Group(*self.right), options.update_width(right_width), pad=True
        )
        gap = Segment(" " * COLUMN_GAP)
        for i in range(max(len(left), len(right))):
            yield from left[i] if i < len(left) else [Segment(" " * left_width)]
            yield gap
            yield from right[i] if i < len(right) else [Segment(" " * right_width)]
            yield Segment.line()


class ProgressLine:
    """A progress bar over `total` rows (pulsing when unknown) filling the width `text` leaves."""

    def __init__(self, total: int | None, completed: int, text: str) -> None:
        self.total = total
        self.completed = completed
        self.text = text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        text = Text(f" {self.text}", no_wrap=True, overflow="ellipsis")
        bar_width = max(options.max_width - text.cell_len, MIN_BAR_WIDTH)
        yield from console.render(
            ProgressBar(total=self.total, completed=self.completed, width=bar_width), options
        )
        yield from console.render(text, options.update_width(options.max_width - bar_width))


def _header(snap: JobSnapshot) -> list[Text]:
    lines = [_line("model", snap.model or "--")]
    if snap.task != "generate":
        lines.append(_line("task", snap.task, "bold"))
    if snap.device:
        parts = [snap.device, snap.dtype, f"{snap.attention_backend} attention"]
        if snap.num_kv_blocks is not None:
            kv = f"{snap.num_kv_blocks:,} KV blocks"
            parts.append(f"{kv} ({fmt_bytes(snap.kv_cache_bytes)})" if snap.kv_cache_bytes else kv)
        if snap.max_model_len is not None:
            parts.append(f"max len {snap.max_model_len:,}")
        lines.append(_line("engine", " · ".join(parts)))
        if snap.kernels:
            lines.append(_line("kernels", " · ".join(snap.kernels)))
    lines.append(_line("input", snap.input_path or "--"))
    lines.append(_line("output", snap.output_path or "--"))
    return lines


def _progress(snap: JobSnapshot) -> RenderableType:
    if snap.state in STARTUP_STATES:
        stage = f"{snap.state}: {snap.startup_stage}" if snap.startup_stage else snap.state
        return Spinner("dots", Text(f"{stage} …", style="cyan"), style="cyan")
    total = snap.total_rows
    fraction = snap.num_rows_done / total if total else None
    pct = f"{fmt_pct(fraction)} " if fraction is not None else ""
    text = (
        f"{pct}{_rows_of_total(snap)}  {fmt_rate(snap.rows_per_s)} rows/s  "
        f"ETA {fmt_duration(snap.eta_s)}"
    )
    return ProgressLine(total or None, snap.num_rows_done, text)


def _finish_reasons(snap: JobSnapshot) -> list[Text]:
    reasons = [*FINISH_REASONS, *sorted(set(snap.finish_reasons) - set(FINISH_REASONS))]
    lines = []
    for i in range(0, len(reasons), 2):
        value = Text()
        for j, reason in enumerate(reasons[i : i + 2]):
            count = snap.finish_reasons.get(reason, 0)
            value.append(" · " if j else "")
            value.append(
                f"{reason} {count:,}", style=FINISH_STYLES.get(reason, "") if count else ""
            )
        lines.append(_line("" if i else "finish", value))
    return lines


def _rows_section(snap: JobSnapshot) -> list[Text]:
    remaining = snap.num_rows_remaining
    lines = [
        Text("Rows", style="bold"),
        _line("done", _rows_of_total(snap)),
        _line("errored", f"{snap.num_rows_errored:,}", "red" if snap.num_rows_errored else ""),
        _line("remaining", "?" if remaining is None else f"{remaining:,}"),
    ]
    if snap.rows_done_before:
        lines.append(_line("resumed", f"{snap.rows_done_before:,} rows done earlier"))
    lines.extend(_finish_reasons(snap))
    if snap.num_truncated:
        lines.append(_line("truncated", f"{snap.num_truncated:,} hit max_tokens", "bold yellow"))
    return lines


def _throughput_section(snap: JobSnapshot) -> list[RenderableType]:
    def row(label: str, recent: float, overall: float) -> Text:
        return _line(label, f"{fmt_rate(recent):>9} {fmt_rate(overall):>9}")

    if snap.task != "generate":
        # NOTE: a pooling job reads prompts and generates nothing.
        return [
            Text("Throughput", style="bold"),
            _line("", f"{'10s':>9} {'job':>9}", "dim"),
            row("rows/s", snap.rows_per_s, snap.rows_per_s_overall),
            row("prompt tok/s", snap.prompt_tps, snap.prompt_tps_overall),
        ]
    return [
        Text("Throughput", style="bold"),
        _line("", f"{'10s':>9} {'job':>9}", "dim"),
        row("prompt tok/s", snap.prompt_tps, snap.prompt_tps_overall),
        row("gen tok/s", snap.gen_tps, snap.gen_tps_overall),
        row("rows/s", snap.rows_per_s, snap.rows_per_s_overall),
        Sparkline(snap.gen_tps_history),
    ]


def _engine_section(snap: JobSnapshot) -> list[Text]:
    lines = [Text("Engine", style="bold")]
    if not snap.has_engine_stats:
        lines.append(_line("health", "waiting for engine stats", "dim"))
        return lines
    step = _step_ms(snap.step_time_s)
    tokens = "--" if snap.tokens_per_step is None else f"{snap.tokens_per_step:,.0f}"
    age = snap.stats_age_s or 0.0
    is_stale = age > STALE_STATS_S and not snap.is_finished
    lines += [
        _line("requests", f"{snap.num_running:,} running · {snap.num_waiting:,} waiting"),
        _line("tokens/step", tokens),
        _line("step time", step),
        _line(
            "KV cache",
            f"{fmt_pct(snap.kv_usage)} used",
            "bold yellow" if snap.kv_usage >= 0.95 else "",
        ),
        _line("prefix hit", fmt_pct(snap.prefix_hit_rate)),
        _line("preempted", f"{snap.num_preemptions:,}", "yellow" if snap.num_preemptions else ""),
        _line("health", f"no stats for {fmt_duration(age)}", "bold yellow")
        if is_stale
        else _line("health", "ok", "green"),
    ]
    return lines


def _step_ms(step_time_s: float | None) -> str:
    return "--" if step_time_s is None else f"{1000 * step_time_s:,.1f} ms"


def _engines_table(engines: tuple[EngineSnapshot, ...]) -> Table:
    """One row per engine of a set (data-parallel cores, Ray replicas)."""
    table = Table(box=None, padding=(0, 1), pad_edge=False, title_justify="left")
    table.title = Text("Engines", style="bold")
    for header in ("", "state", "in flight", "running", "waiting", "step time", "KV cache"):
        table.add_column(header, justify="left" if header in ("", "state") else "right")
    for engine in engines:
        table.add_row(
            Text(engine.name, style="dim"),
            Text(engine.state, style=ENGINE_STATE_STYLES.get(engine.state, "")),
            f"{engine.num_in_flight:,}",
            f"{engine.num_running:,}",
            f"{engine.num_waiting:,}",
            _step_ms(engine.step_time_s),
            Text(fmt_pct(engine.kv_usage), style="bold yellow" if engine.kv_usage >= 0.95 else ""),
        )
    return table


def _checkpoint_section(snap: JobSnapshot) -> list[Text]:
    since = snap.since_commit_s
    lines = [
        Text("Checkpoint", style="bold"),
        _line("last commit", "none yet" if since is None else f"{fmt_duration(since)} ago"),
        _line("durable rows", f"{snap.rows_committed:,}"),
    ]
    if snap.drain_left_s is not None:
        lines.append(_line("grace left", fmt_duration(snap.drain_left_s), "bold yellow"))
    return lines


def render_dashboard(snap: JobSnapshot) -> RenderableType:
    """The live view: header, progress, then rows/throughput and engine/checkpoint side by side."""
    state_style = STATE_STYLES.get(snap.state, "")
    elapsed = f" · {fmt_duration(snap.elapsed_s)}"
    title = Text.assemble(("vbatch ", "bold"), (snap.state, state_style), elapsed)
    body = Group(
        *_header(snap),
        Text(),
        _progress(snap),
        Text(),
        TwoColumns(_rows_section(snap), _throughput_section(snap)),
        TwoColumns(_engine_section(snap), _checkpoint_section(snap)),
        *([Text(), _engines_table(snap.engines)] if snap.engines else []),
    )
    return Panel(body, title=title, title_align="left", border_style=state_style or "none")


class _Summary:
    """The end-of-job table, or, narrower than MIN_SUMMARY_TABLE_WIDTH, the same rows as
    `label: value` lines (a table's label column left its values no room there)."""

    def __init__(self, rows: list[tuple[str, str | Text]]) -> None:
        self.rows = rows

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if options.max_width < MIN_SUMMARY_TABLE_WIDTH:
            yield Text("vbatch job summary")
            for label, value in self.rows:
                yield Text.assemble((f"{label}: ", "bold"), value, overflow="fold")
            return
        table = Table(title="vbatch job summary", show_header=False, title_justify="left")
        table.add_column(style="bold", no_wrap=True)
        table.add_column(overflow="fold")
        for label, value in self.rows:
            table.add_row(label, value)
        yield table


def render_summary(snap: JobSnapshot) -> RenderableType:
    """The end-of-job summary: totals, throughput, errors by kind, output path and wall time."""
    rows: list[tuple[str, str | Text]] = [
        ("state", Text(snap.state, style=STATE_STYLES.get(snap.state, "")))
    ]
    done = _rows_of_total(snap)
    errored = f"{snap.num_rows_errored:,}"
    # NOTE: after a resume the row counts cover every run, and what follows them this run's.
    this_run = ""
    if snap.rows_done_before:
        done += f" ({snap.rows_done_before:,} from earlier runs)"
        errored += f" ({snap.finish_reasons.get('error', 0):,} in this run)"
        this_run = " (this run)"
    rows.append(("rows done", done))
    rows.append(("rows errored", errored))
    if snap.num_rows_remaining:
        rows.append(("rows remaining", f"{snap.num_rows_remaining:,}"))
    reasons = ", ".join(f"{reason} {count:,}" for reason, count in snap.finish_reasons.items())
    rows.append(("finish reasons" + this_run, reasons))
    for kind, count in sorted(snap.errors_by_kind.items()):
        rows.append(("error" + this_run, Text(f"{kind}: {count:,}", style="red")))
    rows.append(
        (
            "tokens" + this_run,
            f"prompt {snap.num_prompt_tokens:,} · generated {snap.num_completion_tokens:,} · "
            f"cached {snap.num_cached_tokens:,}",
        )
    )
    rows.append(
        (
            "throughput",
            f"{fmt_rate(snap.rows_per_s_overall)} rows/s · prompt "
            f"{fmt_rate(snap.prompt_tps_overall)} tok/s · gen {fmt_rate(snap.gen_tps_overall)} "
            "tok/s",
        )
    )
    rows.append(("output", snap.output_path or "--"))
    rows.append(("wall time", fmt_duration(snap.elapsed_s)))
    return _Summary(rows)


def _printable(text: str) -> str:
    return "".join(ch if ch.isprintable() else " " for ch in text)


def plain_line(snap: JobSnapshot) -> str:
    """One log line without any control character, for logs and pipes."""
    if snap.state in STARTUP_STATES:
        stage = f": {snap.startup_stage}" if snap.startup_stage else ""
        return _printable(f"vbatch {snap.state}{stage} ({fmt_duration(snap.elapsed_s)})")
    total = snap.total_rows
    pct = f" ({fmt_pct(snap.num_rows_done / total)})" if total else ""
    parts = [
        f"vbatch {snap.state} {_rows_of_total(snap)}{pct}",
        f"{fmt_rate(snap.rows_per_s)} rows/s",
        f"gen {fmt_rate(snap.gen_tps)} tok/s",
        f"prompt {fmt_rate(snap.prompt_tps)} tok/s",
        f"ETA {fmt_duration(snap.eta_s)}",
        f"errors {snap.num_rows_errored:,}",
    ]
    if snap.num_truncated:
        parts.append(f"truncated {snap.num_truncated:,}")
    if snap.since_commit_s is None:
        parts.append("no commit yet")
    else:
        parts.append(
            f"commit {fmt_duration(snap.since_commit_s)} ago ({snap.rows_committed:,} rows)"
        )
    if snap.drain_left_s is not None:
        parts.append(f"grace {fmt_duration(snap.drain_left_s)} left")
    for engine in snap.engines:
        parts.append(
            f"{engine.name} {engine.state} step {_step_ms(engine.step_time_s)} "
            f"KV {fmt_pct(engine.kv_usage)}"
        )
    return _printable(" | ".join(parts))
