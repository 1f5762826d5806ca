"""Cold vs warm on CPU, side by side in one run: with and without the compiled-kernel files, and with
Inductor's precompiled header left on. Every figure is measured here; nothing is a constant.

Each phase is a fresh `pytest` process on fresh TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR / TMPDIR,
the cache restored from a local directory store (the same bundle path S3 takes, minus the network).

    python benchmarks/core_cpu.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

WORKLOAD = textwrap.dedent(
    """
    import torch

    def pointwise(x):
        return torch.sin(x) * 2 + torch.cos(x)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)
        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    def test_pointwise():
        torch.compile(pointwise)(torch.randn(64))

    def test_mlp_forward():
        with torch.no_grad():
            torch.compile(MLP())(torch.randn(8, 16))

    def test_mlp_train_step():
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = torch.compile(model)(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
    """
)

COUNTERS = textwrap.dedent(
    """
    import json, os, sys
    def pytest_sessionfinish(session):
        if "torch._dynamo.utils" in sys.modules:
            from torch._dynamo.utils import counters
            json.dump({"fx_hit": counters["inductor"]["fxgraph_cache_hit"],
                       "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
                       "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
                       "aot_miss": counters["aot_autograd"]["autograd_cache_miss"]},
                      open(os.environ["BENCH_COUNTERS"], "w"))
    """
)


def phase(project: Path, store: Path, work: Path, name: str, extra_env: dict[str, str], args: list[str]) -> dict:
    root = work / name
    for sub in ("inductor", "triton", "tmp"):
        (root / sub).mkdir(parents=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton"),
           "TMPDIR": str(root / "tmp"), "BENCH_COUNTERS": str(root / "counters.json"), **extra_env}
    report = root / "report.json"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                           "--megacache-dir", str(store), "--megacache-report", str(report), *args],
                          cwd=project, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    doc = json.loads(report.read_text())
    counters = json.loads((root / "counters.json").read_text())
    return {"wall": wall, "compile": doc["torch"]["compile_seconds"], **counters,
            "fetched": doc["restore"]["bytes_fetched"], "uploaded": doc["upload"]["bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    opts = parser.parse_args()
    scenarios = [
        ("mega-cache + kernel files (default)", {}, []),
        ("mega-cache only (--megacache-files no)", {}, ["--megacache-files", "no"]),
        ("default, precompiled header on", {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "1"}, []),
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="megacache-bench-") as tmp:
        base = Path(tmp)
        project = base / "project"
        project.mkdir()
        (project / "test_workload.py").write_text(WORKLOAD)
        (project / "conftest.py").write_text(COUNTERS)
        for label, env, args in scenarios:
            colds, warms = [], []
            for i in range(opts.repeats):
                store = base / f"store-{len(rows)}-{i}"
                work = base / f"work-{len(rows)}-{i}"
                print(f"[{label}] repeat {i + 1}: cold ...", flush=True)
                colds.append(phase(project, store, work, "cold", env, args))
                print(f"[{label}] repeat {i + 1}: warm ...", flush=True)
                warms.append(phase(project, store, work, "warm", env, args))
            rows.append((label, colds, warms))
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    print()
    print(f"torch {__import__('importlib.metadata').metadata.version('torch')}, {os.cpu_count()} CPUs, "
          f"median of {opts.repeats}")
    head = f"{'scenario':42} {'cold wall':>9} {'warm wall':>9} {'cold comp':>9} {'warm comp':>9} {'warm/cold':>9} " \
           f"{'FX hit/miss':>11} {'AOT hit/miss':>12} {'bytes':>9}"
    print(head)
    print("-" * len(head))
    for label, colds, warms in rows:
        w = warms[len(warms) // 2]
        print(f"{label:42} {med(colds, 'wall'):9.1f} {med(warms, 'wall'):9.1f} {med(colds, 'compile'):9.2f} "
              f"{med(warms, 'compile'):9.2f} {med(warms, 'compile') / med(colds, 'compile'):9.2f} "
              f"{w['fx_hit']:>5}/{w['fx_miss']:<5} {w['aot_hit']:>6}/{w['aot_miss']:<5} {w['fetched']:>9}")


if __name__ == "__main__":
    main()
