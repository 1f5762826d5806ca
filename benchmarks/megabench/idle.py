"""Idle: the plugin's cost in a one-test session that compiles nothing, against ``-p no:megacache``, with an empty
directory store, an empty S3 bucket and a bucket a workload's cold run filled."""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from run_demo import load_json  # the demo's reader of the plugin's report (demo/run_demo.py)

from .console import say
from .records import lookup
from .runner import TAIL_CHARS, Dirs, Runner
from .workloads import Workload

IDLE_TEST = "def test_idle():\n    assert True\n"


def bench_idle(runner: Runner, work: Path, repeats: int, wl: Workload | None, populated: str | None) -> dict[str, Any]:
    project = work / "idle"
    project.mkdir(parents=True)
    (project / "test_idle.py").write_text(IDLE_TEST)
    empty_bucket = runner.s3.create_bucket(f"bench-idle-empty-{os.getpid()}")
    # Run from the workload's directory with its ini file, so the prefix (and any layout the plugin derives
    # from the project) matches what the populated bucket holds.
    cwd = wl.cwd if wl else project
    ini = ["-c", str(wl.ini), "--rootdir", str(wl.cwd)] if wl else []
    variants: list[tuple[str, list[str]]] = [
        ("no plugin (-p no:megacache)", runner.unload_args),
        # The directory store never imports boto3: the difference to the S3 row is the S3 client's cost.
        ("plugin, empty directory store", [*runner.load_args, "--megacache-dir", str(project / "empty-store")]),
        ("plugin, empty S3 bucket", [*runner.load_args, "--megacache-bucket", empty_bucket]),
    ]
    if populated:
        variants.append((f"plugin, S3 bucket with {wl.name if wl else '?'}'s cache",
                         [*runner.load_args, "--megacache-bucket", populated]))
    samples: dict[str, list[float]] = {name: [] for name, _ in variants}
    restored: dict[str, list[int]] = {name: [] for name, _ in variants}
    failures: list[str] = []
    for i in range(repeats):
        for j, (name, args) in enumerate(variants):
            root = project / f"r{i}-v{j}"
            report = root / "megacache-report.json"
            plugged = "--megacache-bucket" in args or "--megacache-dir" in args
            extra = ["--megacache-report", str(report)] if plugged else []
            dirs = Dirs.fresh(root)
            rc, wall, text = runner.pytest(cwd, [*ini, str(project / "test_idle.py"), *args, *extra], dirs, root / "pytest.log")
            doc = load_json(report) if extra else None
            error = None
            if rc != 0:
                error = f"pytest exited {rc}"
            elif extra and (doc is None or not doc.get("enabled") or doc.get("problems")):
                error = f"plugin not active or reported problems: {doc and (doc.get('reason') or doc.get('problems'))}"
            if error:
                first = not any(fl.startswith(f"{name},") for fl in failures)
                failures.append(f"{name}, repeat {i + 1}: {error}")
                say(f"FAILED idle {name} (repeat {i + 1}): {error}")
                if first:  # the same failure again and again: one tail is enough
                    print(text[-TAIL_CHARS:], flush=True)
                continue
            samples[name].append(wall)
            if doc is not None:
                restored[name].append(int(lookup(doc, "restore", "objects_used") or 0))
    out: dict[str, Any] = {"repeats": repeats, "variants": {}, "failures": failures}
    base = samples[variants[0][0]]
    for name, _ in variants:
        walls = samples[name]
        entry: dict[str, Any] = {"walls": walls, "objects_restored": restored[name]}
        if walls:
            entry["median"] = statistics.median(walls)
            if base and name != variants[0][0]:
                entry["cost_ms"] = 1000 * (entry["median"] - statistics.median(base))
        out["variants"][name] = entry
    return out
