"""Plain pytest vs the plugin's cold and warm runs on CPU, side by side in one run: the default (Inductor's
precompiled header on, as torch has it, and carried), without the compiled-kernel files, and with the header
turned off. Every figure is measured here; nothing is a constant.

Each phase is a fresh `pytest` process on fresh TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR / TMPDIR (the
header lives under TMPDIR: a fresh machine), the cache restored from a local directory store (the same
bundle path S3 takes, minus the network). Plain pytest runs without the plugin (``-p no:megacache``).

    python benchmarks/core_cpu.py [--repeats N]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from run import plugin_args  # benchmarks/run.py, beside this script (its folder is on sys.path)

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


# The installed entry point, else the plugin from this checkout (PYTHONPATH): benchmarks/run.py's rule.
LOAD = plugin_args()[0]


def phase(project: Path, store: Path, work: Path, name: str, extra_env: dict[str, str], args: list[str]) -> dict:
    root = work / name
    for sub in ("inductor", "triton", "tmp"):
        (root / sub).mkdir(parents=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton"),
           "TMPDIR": str(root / "tmp"), "BENCH_COUNTERS": str(root / "counters.json"), **extra_env}
    report = root / "report.json"
    plugin = ["-p", "no:megacache"] if name == "plain" else [*LOAD, "--megacache-dir", str(store),
                                                              "--megacache-report", str(report)]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                           *plugin, *args], cwd=project, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    print(f"  {name}: wall {wall:.1f} s", flush=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    counters = json.loads((root / "counters.json").read_text())
    if name == "plain":
        return {"wall": wall, **counters}
    doc = json.loads(report.read_text())
    return {"wall": wall, "compile": doc["torch"]["compile_seconds"], **counters,
            "fetched": doc["restore"]["bytes_fetched"], "uploaded": doc["upload"]["bytes"],
            "restore": doc["restore"]["seconds"], "upload": doc["upload"]["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-files-no", action="store_true", help="leave out the mega-cache-only row (saves time)")
    opts = parser.parse_args()
    off = {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}
    scenarios = [
        ("plugin default (header on and carried)", {}, []),
        ("mega-cache only (--megacache-files no)", {}, ["--megacache-files", "no"]),
        ("header off (PRECOMPILE_HEADERS=0)", off, []),
    ]
    if opts.skip_files_no:
        del scenarios[1]
    rows = []
    plains: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="megacache-bench-") as tmp:
        base = Path(tmp)
        project = base / "project"
        project.mkdir()
        (project / "test_workload.py").write_text(WORKLOAD)
        (project / "conftest.py").write_text(COUNTERS)
        for i in range(opts.repeats):
            # Interleaved, repeat by repeat, so that a slow spell of the machine hits every row alike.
            print(f"[plain pytest] repeat {i + 1} ...", flush=True)
            plains.append(phase(project, base / "unused", base / f"plain-{i}", "plain", {}, []))
            for n, (label, env, args) in enumerate(scenarios):
                if i == 0:
                    rows.append((label, [], []))
                store, work = base / f"store-{n}-{i}", base / f"work-{n}-{i}"
                print(f"[{label}] repeat {i + 1}: cold, warm ...", flush=True)
                rows[n][1].append(phase(project, store, work, "cold", env, args))
                rows[n][2].append(phase(project, store, work, "warm", env, args))
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    plain = med(plains, "wall")
    print()
    print(f"torch {importlib.metadata.version('torch')}, {os.cpu_count()} CPUs, "
          f"median of {opts.repeats}; plain pytest (no plugin, header on): wall {plain:.1f} s")
    head = f"{'scenario':42} {'cold wall':>9} {'cold/plain':>10} {'warm wall':>9} {'warm/plain':>10} {'cold comp':>9} " \
           f"{'warm comp':>9} {'restore':>7} {'upload':>6} {'FX hit/miss':>11} {'AOT hit/miss':>12} {'fetched':>10}"
    print(head)
    print("-" * len(head))
    for label, colds, warms in rows:
        w = warms[len(warms) // 2]
        print(f"{label:42} {med(colds, 'wall'):9.1f} {med(colds, 'wall') / plain:10.2f} {med(warms, 'wall'):9.1f} "
              f"{med(warms, 'wall') / plain:10.2f} {med(colds, 'compile'):9.2f} {med(warms, 'compile'):9.2f} "
              f"{med(warms, 'restore'):7.2f} {med(colds, 'upload'):6.2f} "
              f"{w['fx_hit']:>5}/{w['fx_miss']:<5} {w['aot_hit']:>6}/{w['aot_miss']:<5} {w['fetched']:>10}")


if __name__ == "__main__":
    main()
