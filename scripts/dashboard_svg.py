"""Render the README's dashboard picture: vbatch's own render_dashboard of a recorded snapshot.

    python scripts/dashboard_svg.py [--snapshot SNAPSHOT.json] [--out OUT.svg]

The defaults are docs/dashboard_snapshot.json and docs/dashboard.svg. The snapshot is the
`--metrics-file` of a real job, copied while it ran: the file holds the JobSnapshot the live view
draws. To record a new one, start `vbatch run ... --metrics-file m.json`, copy m.json mid-run
over docs/dashboard_snapshot.json, and run this script.
"""

from __future__ import annotations

import argparse
import io
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from rich.console import Console

from vbatch.job.dashboard import render_dashboard
from vbatch.job.metrics import JobSnapshot

DOCS = Path(__file__).parents[1] / "docs"
WIDTH = 100


def load_snapshot(path: Path) -> JobSnapshot:
    """A JobSnapshot from a metrics file (keys it lacks, like `updated_at`, are left out)."""
    data: dict[str, Any] = json.loads(path.read_text())
    names = {f.name for f in fields(JobSnapshot)}
    return JobSnapshot(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
    )


def save_dashboard_svg(snapshot: JobSnapshot, out: Path, width: int = WIDTH) -> None:
    console = Console(
        record=True, width=width, file=io.StringIO(), force_terminal=True, color_system="truecolor"
    )
    console.print(render_dashboard(snapshot))
    console.save_svg(str(out), title="vbatch run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshot", type=Path, default=DOCS / "dashboard_snapshot.json")
    parser.add_argument("--out", type=Path, default=DOCS / "dashboard.svg")
    parser.add_argument("--width", type=int, default=WIDTH)
    args = parser.parse_args()
    save_dashboard_svg(load_snapshot(args.snapshot), args.out, args.width)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
