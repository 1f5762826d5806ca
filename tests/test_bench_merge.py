"""benchmarks/merge.py: records of several benchmark runs pooled into the tables one run with --repeats N prints.
Hand-made records; no torch, no server."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import load_benchmark

ENV = {"cpu": "Some CPU", "gpus": ["NVIDIA H200"], "torch": "2.11.0", "triton": "3.6.0", "python": "3.12",
       "cpu_count": 32, "usable_cpus": 32, "platform": "linux", "date": "2026-11-23"}


@pytest.fixture(scope="module")
def merge() -> ModuleType:
    return load_benchmark("merge.py")


def results(merge: ModuleType, path: Path, cold: float, warm: float, env: dict[str, object] = ENV) -> Path:
    def r(mode: str, compile_s: float, **kw: object) -> dict[str, object]:
        return merge.bench.Run("example", mode, 0, ok=True, wall=compile_s + 10, compile_seconds=compile_s,
                               fx_hit=1, fx_miss=0, aot_hit=1, aot_miss=0, **kw).__dict__
    doc = {"environment": env, "argv": ["--repeats", "1"], "options": {"repeats": 1}, "notes": [], "apart": None,
           "workloads": [{"name": "example", "device": "cuda", "tests": ["tests"],
                          "runs": [r("plain", cold - 1), r("cold", cold, upload_raw_bytes=1000),
                                   r("warm", warm, bytes_moved=10), r("hot", warm)]}]}
    path.write_text(json.dumps(doc))
    return path


def test_runs_are_pooled_and_ratios_are_of_the_pooled_medians(merge: ModuleType, tmp_path: Path) -> None:
    paths = [results(merge, tmp_path / f"r{i}.json", cold, warm)
             for i, (cold, warm) in enumerate([(40.0, 2.0), (50.0, 9.0), (60.0, 4.0)])]
    out = merge.merge(tmp_path / "out", paths)
    (w,) = out["workloads"]
    assert sorted({r["repeat"] for r in w["runs"]}) == [0, 1, 2]  # numbered again, not three repeat 0s
    assert w["ratios"]["warm/cold compile"] == pytest.approx(4.0 / 50.0)  # median warm over median cold
    md = (tmp_path / "out" / "results.md").read_text()
    assert "median [min-max] of 3" in md
    assert "| cold | 3/3 | 60.00 [50.00-70.00] | 50.00 [40.00-60.00] |" in md
    assert json.loads((tmp_path / "out" / "results.json").read_text())["merged_from"] == [str(p) for p in paths]


def test_runs_from_another_machine_are_refused(merge: ModuleType, tmp_path: Path) -> None:
    a = results(merge, tmp_path / "a.json", 40.0, 2.0)
    b = results(merge, tmp_path / "b.json", 40.0, 2.0, env={**ENV, "gpus": ["NVIDIA H100 80GB HBM3"]})
    with pytest.raises(SystemExit, match="another machine"):
        merge.merge(tmp_path / "out", [a, b])
    assert not (tmp_path / "out").exists()
