"""benchmarks/hook_timeline.py logs where a session's end goes, per process (xdist workers included)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_process_logs_its_end_in_order(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    (tmp_path / "test_a.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    log = tmp_path / "tl.txt"
    env = {**os.environ, "TIMELINE_LOG": str(log), "TIMELINE_T0": str(time.time()), "PYTHONPATH": str(BENCHMARKS)}
    env.pop("PYTEST_XDIST_WORKER", None)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "hook_timeline", "-p", "no:cacheprovider", "-n", "2",
                    "test_a.py"], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120)
    rows = [line.split(None, 2) for line in log.read_text().splitlines()]
    seconds = [float(r[0]) for r in rows]
    assert all(s >= 0 for s in seconds)
    events = {(who, event) for _, who, event in rows}
    for who in ("gw0", "gw1", "ctl"):
        mine = [event for _, w, event in rows if w == who]
        assert mine[0] == "plugin-import" and mine[-1] == "atexit-end", (who, mine)
        assert mine.index("sessionfinish-begin") < mine.index("unconfigure-end") < mine.index("atexit-begin"), mine
    assert ("ctl", "nodedown gw0") in events and ("ctl", "nodedown gw1") in events
    assert sum(event.startswith("report ") for who, event in events if who == "ctl") == 2
