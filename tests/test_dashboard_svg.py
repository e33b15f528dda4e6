"""scripts/dashboard_svg.py: the README's dashboard picture is the real dashboard of the recorded
snapshot, and the committed SVG is what the script makes of it now."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_readme_dashboard_is_regenerated_from_the_recorded_snapshot(tmp_path: Path) -> None:
    out = tmp_path / "dashboard.svg"
    proc = subprocess.run(
        [sys.executable, "scripts/dashboard_svg.py", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    svg = out.read_text()
    snapshot = json.loads((ROOT / "docs" / "dashboard_snapshot.json").read_text())
    assert svg.startswith("<svg") and "vbatch&#160;run" in svg
    assert f"{snapshot['num_rows_done']}/{snapshot['total_rows']}" in svg
    assert "docs/dashboard.svg" in (ROOT / "README.md").read_text()
    assert svg == (ROOT / "docs" / "dashboard.svg").read_text(), (
        "docs/dashboard.svg is stale; run python scripts/dashboard_svg.py"
    )
