"""pytest-megacache benchmark: cold, warm, hot and naive runs side by side, in one command.

    python benchmarks/run.py [--workload example mixed synthetic varied children ranks] [--n 10 50 200]
                             [--repeats 3] [--device cpu|cuda] [--xdist N] [--out DIR] [--plot]

Every figure is measured in this run; nothing is a constant. Each run is a fresh ``python -m pytest``
process with its own fresh TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and TMPDIR unless its mode says
otherwise:

- plain: empty caches, the plugin not loaded (``-p no:megacache``): the baseline a cold run is held to.
- cold:  empty caches; the plugin uploads to an S3 server (moto, on 127.0.0.1, in this process) into a
         fresh bucket per repeat.
- warm:  empty caches; the plugin restores from that bucket (what a fresh CI runner sees).
- hot:   the cold run's cache directories and TMPDIR still in place; the plugin in read mode on an empty
         directory store, so it restores nothing and only records compile time and counters: the floor.
- naive: the cold run's TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR packed as tar + zstd (level 3, as an
         actions/cache step would), unpacked into fresh directories; the plugin in read mode on an empty
         store, only to record compile time.
- warm-auto / warm-keep: the warm run with ``--megacache-compile-threads auto`` / ``keep`` (only when the
         installed plugin has that option).
- cold-xdist / warm-xdist (``--xdist N``): cold and warm again with ``pytest -n N`` (pytest-xdist), into and
         from a bucket of their own: the controller restores once for all workers, so the warm run's bytes
         fetched should equal what the bucket holds (one download), not N times it.
- warm-isa-off (``--isa-pair``): the warm run with ``--megacache-reuse-isa-check no``, every process running
         torch's CPU vector-ISA load checks itself, as without the plugin.

Workloads: ``example`` (example_project's CPU tests, or its GPU tests with ``--device cuda``), ``mixed`` (its CPU
and GPU tests in one session), ``synthetic`` (N generated pointwise functions), ``varied`` (N small functions of 13
kinds), ``children`` (a test whose only compile, a training step, runs in a child Python process) and ``ranks``
(example_project's 2-rank DDP test, ranks started by ``torch.multiprocessing.spawn`` and by ``torchrun``; NCCL on
two GPUs, else gloo on the CPU). In ``children`` and ``ranks`` the pytest process compiles nothing: their counters
and compile seconds are the child processes' own records (the report's ``torch.children``), which need the package
installed (its ``.pth`` file in site-packages).

Also measured: the idle cost (a one-test session that compiles nothing, with the plugin vs
``-p no:megacache``), ``import torch``, ``import torch._dynamo`` and torch's CPU vector-ISA check each in a fresh
process (apart), and the restore time of the same entries stored as 1 object vs 8 objects.

Writes ``DIR/results.json`` (every raw record) and ``DIR/results.md`` (the tables); ``--plot`` adds
``DIR/compile_seconds.png``. As it goes, each finished run is appended to ``DIR/runs.jsonl`` (what a run cut off
by a time limit leaves). Exits 1 if any pytest run failed (its output tail is printed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the package, also when this file is imported by path
from megabench import ROOT  # the package puts this checkout's folders on sys.path
from megabench.apart import bench_apart
from megabench.console import human_bytes, say
from megabench.environment import env_label, environment
from megabench.idle import bench_idle
from megabench.modes import ISA_FLAG, SKIPPABLE, bench_workload
from megabench.objects import bench_objects
from megabench.records import Run, failure_reason, fill_from_report, triton_events
from megabench.runner import S3, THREADS_FLAG, Runner, clean_env, has_threads_option, plugin_args
from megabench.workloads import (
    CHILD_PTH,
    Workload,
    child_records_installed,
    make_children,
    make_example,
    make_mixed,
    make_ranks,
    make_synthetic,
    make_varied,
    synthetic_source,
)

from pytest_megacache.report import PHASES  # the plugin's phases, from this checkout

__all__ = ["PHASES", "PHASE_COLORS", "ROOT", "Run", "Runner", "Workload", "apart_lines", "bench_workload", "clean_env",
           "env_label", "failure_reason", "fill_from_report", "main", "make_children", "make_mixed", "make_ranks",
           "phase_lines", "phase_rows", "plot", "plugin_args", "synthetic_source", "triton_events", "workload_tables"]


# Targets: (ratio name, bound, comparison); the warm/cold bound depends on the device.
WARM_COLD_TARGET = {"cuda": 0.05, "cpu": 0.2}
WARM_HOT_TARGET = 1.10
# A cold run with the plugin against plain pytest on the same machine (the plugin must not slow a cold run).
COLD_PLAIN_TARGET = 1.05
WARM_COLD_WALL_TARGET = 0.20  # GPU only; on CPU the session wall has no target
MOVED_RAW_TARGET = 0.15
XDIST_WARM_TARGET = 1.0  # a warm -n N run against a warm serial one (session wall)
# One color per phase of the plugin's per-process times (pytest_megacache.report.PHASES), and the exit, measured
# from outside.
PHASE_COLORS = {"startup": "#95a5a6", "collect": "#bdc3c7", "imports": "#7f8c8d", "restore_wait": "#e67e22",
                "load": "#f39c12", "dynamo": "#8e44ad", "backend": "#c0392b", "isa_check": "#f1948a", "backward": "#e74c3c",
                "compile_other": "#d35400", "tests": "#27ae60", "finish": "#2980b9", "exit": "#34495e"}
IDLE_TARGET_MS = 100.0
MODE_COLORS = {"plain": "#7f8c8d",
               "cold": "#c0392b", "warm": "#27ae60", "warm-auto": "#16a085", "warm-keep": "#1abc9c", "hot": "#2980b9",
               "naive": "#8e44ad", "cold-xdist": "#e67e22", "warm-xdist": "#f1c40f",
               "warm-isa-off": "#d98880"}  # one color per mode


def apart_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["### per-process costs measured apart (each a fresh process)", "",
             "| what | median s | runs |", "| --- | --- | --- |"]
    for r in rows:
        med = "n/a" if r["median"] is None else f"{r['median']:.2f}"
        lines.append(f"| {r['what']} | {med} | {', '.join(f'{x:.2f}' for x in r['seconds'])} |")
    return [*lines, ""]


# --- summaries --------------------------------------------------------------------------------------
def _values(runs: list[Run], attr: str) -> list[float]:
    return [float(getattr(r, attr)) for r in runs if r.ok and getattr(r, attr) is not None]


def _median(runs: list[Run], attr: str) -> float | None:
    vals = _values(runs, attr)
    return statistics.median(vals) if vals else None


def _cell(runs: list[Run], attr: str, kind: str) -> str:
    vals = _values(runs, attr)
    if not vals:
        return "n/a"
    fmt: Callable[[float], str] = (lambda v: f"{v:.2f}") if kind == "s" else human_bytes if kind == "b" else (
        lambda v: f"{v:g}")
    med = fmt(statistics.median(vals))
    return med if len(vals) == 1 or min(vals) == max(vals) else f"{med} [{fmt(min(vals))}-{fmt(max(vals))}]"


def _hits(runs: list[Run], hit: str, miss: str) -> str:
    ok = [r for r in runs if r.ok]
    if not ok:
        return "n/a"
    pairs = sorted({f"{getattr(r, hit)}/{getattr(r, miss)}" for r in ok if getattr(r, hit) is not None})
    return ", ".join(pairs) or "-"


def _check(value: float | None, bound: float, strict_less: bool = False) -> str:
    if value is None:
        return "n/a"
    good = value < bound if strict_less else value <= bound
    return "PASS" if good else "MISS"


def workload_tables(wl: Workload, runs: list[Run], repeats: int) -> tuple[list[str], dict[str, Any]]:
    by_mode: dict[str, list[Run]] = {}
    for r in runs:
        by_mode.setdefault(r.mode, []).append(r)
    lines = [f"### {wl.name} ({wl.device}; median [min-max] of {repeats})", "",
             "| mode | runs ok | session wall s | compile s | FX hit/miss | AOT hit/miss | Triton built/cached "
             "| bytes stored (zst / raw) | bytes moved | restore s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, rs in by_mode.items():
        ok = sum(r.ok for r in rs)
        stored = (f"{_cell(rs, 'upload_bytes', 'b')} / {_cell(rs, 'upload_raw_bytes', 'b')}"
                  if mode.startswith("cold") else "")
        moved = _cell(rs, "bytes_moved", "b") if mode in ("naive",) or mode.startswith("warm") else ""
        restore = _cell(rs, "restore_seconds", "s") if mode == "naive" or mode.startswith("warm") else ""
        lines.append(f"| {mode} | {ok}/{len(rs)} | {_cell(rs, 'wall', 's')} | {_cell(rs, 'compile_seconds', 's')} "
                     f"| {_hits(rs, 'fx_hit', 'fx_miss')} | {_hits(rs, 'aot_hit', 'aot_miss')} "
                     f"| {_hits(rs, 'triton_built', 'triton_hits')} | {stored} | {moved} "
                     f"| {restore} |")
    naive = [r for r in by_mode.get("naive", []) if r.ok]
    if naive:
        ex = naive[0].extra
        lines += ["", f"naive: tar {human_bytes(ex.get('tar_bytes'))} raw, tar.zst {human_bytes(ex.get('tar_zst_bytes'))}; "
                      f"pack {statistics.median(r.extra['pack_seconds'] for r in naive):.2f} s, unpack "
                      f"{statistics.median(r.extra['unpack_seconds'] for r in naive):.2f} s (median); restore s = pack + unpack"]
    med = {mode: {attr: _median(rs, attr) for attr in ("compile_seconds", "wall", "bytes_moved", "upload_raw_bytes")}
           for mode, rs in by_mode.items()}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    g = lambda mode, attr: med.get(mode, {}).get(attr)  # noqa: E731
    warm_cold = ratio(g("warm", "compile_seconds"), g("cold", "compile_seconds"))
    cold_plain = ratio(g("cold", "wall"), g("plain", "wall"))
    warm_plain = ratio(g("warm", "wall"), g("plain", "wall"))
    warm_cold_wall = ratio(g("warm", "wall"), g("cold", "wall"))
    wall_bound = WARM_COLD_WALL_TARGET if wl.device == "cuda" else None
    warm_hot = ratio(g("warm", "compile_seconds"), g("hot", "compile_seconds"))
    moved_raw = ratio(g("warm", "bytes_moved"), g("cold", "upload_raw_bytes"))
    moved_naive = ratio(g("warm", "bytes_moved"), g("naive", "bytes_moved"))
    wc_bound = WARM_COLD_TARGET["cuda" if wl.device == "cuda" else "cpu"]
    f = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    ratios = {"cold/plain wall": cold_plain, "warm/plain wall": warm_plain, "warm/cold wall": warm_cold_wall,
              "warm/cold compile": warm_cold, "warm/hot compile": warm_hot, "warm bytes moved / raw": moved_raw,
              "warm bytes moved / naive tar.zst": moved_naive}
    lines += ["", "| ratio (medians) | value | target | result |", "| --- | --- | --- | --- |",
              f"| cold/plain session wall | {f(cold_plain)} | <= {COLD_PLAIN_TARGET} "
              f"| {_check(cold_plain, COLD_PLAIN_TARGET)} |",
              f"| warm/plain session wall | {f(warm_plain)} | - | - |",
              f"| warm/cold session wall | {f(warm_cold_wall)} | "
              + (f"<= {wall_bound} ({wl.device}) | {_check(warm_cold_wall, wall_bound)} |" if wall_bound else "- | - |"),
              f"| warm/cold compile | {f(warm_cold)} | <= {wc_bound} ({wl.device}) | {_check(warm_cold, wc_bound)} |",
              f"| warm/hot compile | {f(warm_hot)} | <= {WARM_HOT_TARGET} | {_check(warm_hot, WARM_HOT_TARGET)} |",
              f"| warm bytes moved / cold raw bytes | {f(moved_raw)} | <= {MOVED_RAW_TARGET} "
              f"| {_check(moved_raw, MOVED_RAW_TARGET)} |",
              f"| warm bytes moved / naive tar.zst | {f(moved_naive)} | < 1 | {_check(moved_naive, 1.0, strict_less=True)} |"]
    xwarm = [r for r in by_mode.get("warm-xdist", []) if r.ok and r.extra.get("downloads") is not None]
    if xwarm:
        downloads = statistics.median(r.extra["downloads"] for r in xwarm)
        ratios["warm-xdist bytes fetched / bytes stored"] = downloads
        ratios["warm-xdist/warm compile"] = ratio(g("warm-xdist", "compile_seconds"), g("warm", "compile_seconds"))
        ratios["warm-xdist/cold-xdist compile"] = ratio(g("warm-xdist", "compile_seconds"),
                                                        g("cold-xdist", "compile_seconds"))
        ratios["warm-xdist/warm wall"] = ratio(g("warm-xdist", "wall"), g("warm", "wall"))
        stored = statistics.median(r.extra["bucket_bytes"] for r in xwarm)
        lines += [f"| warm-xdist bytes fetched / bytes stored ({human_bytes(stored)} in "
                  f"{statistics.median(r.extra['bucket_objects'] for r in xwarm):g} objects) | {f(downloads)} "
                  f"| 1 (one download for all workers) | {_check(abs(downloads - 1.0), 1e-9)} |",
                  f"| warm-xdist/cold-xdist compile | {f(ratios['warm-xdist/cold-xdist compile'])} "
                  f"| <= {wc_bound} ({wl.device}) | {_check(ratios['warm-xdist/cold-xdist compile'], wc_bound)} |",
                  f"| warm-xdist/warm session wall | {f(ratios['warm-xdist/warm wall'])} | <= {XDIST_WARM_TARGET} "
                  f"(never slower than serial) | {_check(ratios['warm-xdist/warm wall'], XDIST_WARM_TARGET)} |"]
    if "warm-auto" in by_mode:
        wa, wk = med["warm-auto"], med["warm-keep"]
        ratios["warm-auto/warm-keep wall"] = ratio(wa["wall"], wk["wall"])
        ratios["warm-auto/warm-keep compile"] = ratio(wa["compile_seconds"], wk["compile_seconds"])
        threads = sorted({str(r.compile_threads) for r in by_mode["warm"] if r.ok}) or ["n/a (no warm run ok)"]
        lines += [f"| warm-auto/warm-keep session wall | {f(ratios['warm-auto/warm-keep wall'])} | (no target) | |",
                  f"| warm-auto/warm-keep compile | {f(ratios['warm-auto/warm-keep compile'])} | (no target) | |",
                  "", f"worker-pool policy: the plain warm run resolved compile_threads to {', '.join(threads)}."]
    if "warm-isa-off" in by_mode:
        off = med["warm-isa-off"]
        ratios["warm/warm-isa-off wall"] = ratio(g("warm", "wall"), off["wall"])
        ratios["warm/warm-isa-off compile"] = ratio(g("warm", "compile_seconds"), off["compile_seconds"])
        lines += [f"| warm/warm-isa-off session wall | {f(ratios['warm/warm-isa-off wall'])} | (no target) | |",
                  f"| warm/warm-isa-off compile | {f(ratios['warm/warm-isa-off compile'])} | (no target) | |"]
    if wl.children:
        counts = sorted({str(r.children) for r in runs if r.ok and r.children is not None}) or ["n/a"]
        lines += ["", f"{wl.name}: the pytest process compiles nothing; compile seconds and hits/misses are the child "
                      f"processes' own records, summed ({', '.join(counts)} children per run)."]
    failures = [r for r in runs if not r.ok]
    if failures:
        lines += ["", "FAILED runs:"]
        lines += [f"- {r.mode}, repeat {r.repeat + 1}: {r.error}" + (f" (log {r.log})" if r.log else "") for r in failures]
    lines.append("")
    phases = phase_rows(runs)
    lines += phase_lines(wl, runs, phases)
    return lines, {"medians": med, "ratios": ratios, "warm_cold_target": wc_bound,
                   "phases": [{"mode": m, "process": p, **v} for m, p, v in phases]}


def _phase_medians(rs: list[Run], process: str) -> dict[str, float] | None:
    """Median seconds per phase of one process (by name: "main", "controller", "gw0", ...) over the runs."""
    rows = [next((p for p in r.processes if p.get("process") == process), None) for r in rs if r.ok]
    rows = [p for p in rows if p is not None]
    if not rows:
        return None
    out = {name: statistics.median(float(p.get(name) or 0.0) for p in rows) for name in (*PHASES, "total")}
    exits = [r.exit_seconds for r in rs if r.ok and r.exit_seconds is not None]
    if process in ("main", "controller") and exits:
        out["exit"] = statistics.median(exits)
    return out


def phase_rows(runs: list[Run]) -> list[tuple[str, str, dict[str, float]]]:
    """(mode, process, median seconds per phase) for every mode with reports, session process first."""
    by_mode: dict[str, list[Run]] = {}
    for r in runs:
        if r.processes:
            by_mode.setdefault(r.mode, []).append(r)
    out = []
    for mode, rs in by_mode.items():
        names = list(dict.fromkeys(str(p.get("process")) for r in rs for p in r.processes))
        for process in names:
            med = _phase_medians(rs, process)
            if med is not None:
                out.append((mode, process, med))
    return out


def phase_lines(wl: Workload, runs: list[Run], rows: list[tuple[str, str, dict[str, float]]]) -> list[str]:
    """The table of :func:`phase_rows` (``rows``), with each mode's session wall from ``runs``."""
    if not rows:
        return []
    cols = [*PHASES, "exit"]
    lines = [f"#### {wl.name}: where each process's seconds go (medians; the plugin's per-process times, exit "
             "measured from outside)", "",
             "| mode | process | " + " | ".join(c.replace("_", " ") for c in cols) + " | sum | session wall |",
             "| --- | --- | " + " | ".join("---" for _ in cols) + " | --- | --- |"]
    walls = {mode: _median([r for r in runs if r.mode == mode], "wall") for mode, _p, _m in rows}
    for mode, process, med in rows:
        cells = [f"{med[c]:.2f}" if c in med else "" for c in cols]
        wall = walls.get(mode)
        lines.append(f"| {mode} | {process} | " + " | ".join(cells) + f" | {sum(med.get(c, 0.0) for c in cols):.2f} "
                     f"| {'' if wall is None or process not in ('main', 'controller') else f'{wall:.2f}'} |")
    lines += ["", "startup: interpreter, pytest, plugins, first conftests (torch's import, when a conftest imports "
              "it); imports: torch and torch._dynamo when the plugin saw them; dynamo / backend / backward: torch's own "
              "split of the compile; exit: interpreter shutdown, Inductor's compile pool included.", ""]
    return lines


def idle_lines(idle: dict[str, Any]) -> list[str]:
    lines = [f"### idle: a one-test session that compiles nothing (median of {idle['repeats']})", "",
             "| variant | session wall s (median) | plugin cost ms | objects restored | target | result |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, v in idle["variants"].items():
        cost = v.get("cost_ms")
        restored = ", ".join(sorted({str(x) for x in v["objects_restored"]})) or ""
        med = f"{v['median']:.3f}" if "median" in v else "n/a"
        lines.append(f"| {name} | {med} | {'' if cost is None else f'{cost:.1f}'} | {restored} | "
                     f"{'' if cost is None else f'<= {IDLE_TARGET_MS:.0f} ms'} | "
                     f"{'' if cost is None else ('PASS' if cost <= IDLE_TARGET_MS else 'MISS')} |")
    for failure in idle["failures"]:
        lines.append(f"\nFAILED: {failure}")
    lines.append("")
    return lines


def objects_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["### restore time vs objects (same entries; S3 on 127.0.0.1, list + parallel fetch + validate + write)", "",
             "| dataset | entries | raw | 1 object: stored, restore s | 8 objects: stored, restore s | 8/1 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        one, eight = row["split1"], row["split8"]
        lines.append(f"| {row['dataset']} | {row['entries']} | {human_bytes(row['raw_bytes'])} "
                     f"| {human_bytes(one['stored_bytes'])}, {one['median']:.3f} "
                     f"| {human_bytes(eight['stored_bytes'])} ({eight['objects']} objects), {eight['median']:.3f} "
                     f"| {eight['median'] / one['median']:.2f} |")
    lines.append("")
    return lines


def plot(out: Path, results: dict[str, Any], runs: list[Run], env: dict[str, Any]) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install -r benchmarks/requirements.txt): no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w["name"] for w in results["workloads"]]
    if not names:
        return "no workload ran: no plot"
    fig, axes = plt.subplots(1, len(names), figsize=(max(6.0, 4.5 * len(names)), 4.8), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        modes = list(dict.fromkeys(r.mode for r in runs if r.workload == name and r.mode != "plain"))
        meds, lows, highs = [], [], []
        for mode in modes:
            vals = [r.compile_seconds for r in runs if r.workload == name and r.mode == mode and r.ok
                    and r.compile_seconds is not None]
            m = statistics.median(vals) if vals else 0.0
            meds.append(m)
            lows.append(m - min(vals) if vals else 0.0)
            highs.append(max(vals) - m if vals else 0.0)
        bars = ax.bar(modes, meds, yerr=[lows, highs], capsize=4,
                      color=[MODE_COLORS.get(m, "#7f8c8d") for m in modes])
        for bar, m in zip(bars, meds, strict=True):
            ax.annotate(f"{m:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)
        ax.set_title(name)
        ax.set_ylabel("compile seconds (median, min-max)")
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle("pytest-megacache: time inside torch.compile per session\n" + env_label(env), fontsize=9)
    fig.tight_layout()
    path = out / "compile_seconds.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    plot_phases(plt, out / "phases.png", results, env)
    return None


def plot_phases(plt: Any, path: Path, results: dict[str, Any], env: dict[str, Any]) -> None:
    """Where each process's seconds go: one stacked bar per mode and process, one panel per workload."""
    panels = [(w["name"], w.get("phases") or []) for w in results["workloads"] if w.get("phases")]
    if not panels:
        return
    cols = [*PHASES, "exit"]
    height = max(3.0, 0.45 * max(len(rows) for _n, rows in panels) + 1.5)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, height * len(panels)), squeeze=False)
    for ax, (name, rows) in zip(axes[:, 0], panels, strict=True):
        labels = [f"{row['mode']} {row['process']}" if row["process"] not in ("main",) else row["mode"] for row in rows]
        left = [0.0] * len(rows)
        for col in cols:
            widths = [float(row.get(col) or 0.0) for row in rows]
            if not any(widths):
                continue
            ax.barh(labels, widths, left=left, color=PHASE_COLORS[col], label=col.replace("_", " "))
            left = [a + b for a, b in zip(left, widths, strict=True)]
        for i, total in enumerate(left):
            ax.annotate(f"{total:.1f} s", (total, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("seconds (medians per phase)")
        ax.legend(fontsize=7, ncol=6, loc="lower right")
    fig.suptitle("pytest-megacache: where each process's seconds go\n" + env_label(env), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--workload", nargs="+", choices=("example", "mixed", "synthetic", "varied", "children", "ranks"),
                        default=["example", "synthetic"])
    parser.add_argument("--n", nargs="+", type=int, default=[10, 50], help="synthetic workload sizes (default: 10 50)")
    parser.add_argument("--varied-n", nargs="+", type=int, default=[130],
                        help="varied workload sizes (default: 130 functions of 13 kinds)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--plot", action="store_true", help="write DIR/compile_seconds.png (needs matplotlib)")
    parser.add_argument("--idle-repeats", type=int, default=None,
                        help="sessions per idle variant (default: 3 x --repeats, at least 5)")
    parser.add_argument("--idle-only", action="store_true", help="only the idle measurement")
    parser.add_argument("--no-idle", action="store_true", help="skip the idle measurement")
    parser.add_argument("--no-apart", action="store_true",
                        help="skip the costs measured apart (import torch, torch._dynamo, the CPU vector-ISA check)")
    parser.add_argument("--no-threads-pair", action="store_true", help=f"skip the {THREADS_FLAG} auto/keep pair")
    parser.add_argument("--isa-pair", action="store_true",
                        help=f"also run warm with {ISA_FLAG} no (torch's CPU vector-ISA load checks in every process)")
    parser.add_argument("--xdist", type=int, default=0, metavar="N",
                        help="also run cold and warm with pytest-xdist -n N (default: off)")
    parser.add_argument("--skip", nargs="+", choices=SKIPPABLE, default=[],
                        help="modes not to run (each needs a run of its own per repeat; the targets that need them "
                             "print n/a)")
    parser.add_argument("--objects-repeats", type=int, default=3, help="restores per objects-check case (default: 3)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one pytest run may take (default: 3600)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (caches, logs, reports)")
    opts = parser.parse_args(argv)
    if opts.idle_repeats is None:
        opts.idle_repeats = max(5, 3 * opts.repeats)
    if opts.repeats < 1 or opts.idle_repeats < 1 or any(n < 1 for n in [*opts.n, *opts.varied_n]) or opts.xdist < 0:
        parser.error("--repeats, --idle-repeats and --n take positive numbers, --xdist zero or more")
    if opts.xdist and importlib.util.find_spec("xdist") is None:
        parser.error("--xdist needs pytest-xdist: pip install -r benchmarks/requirements.txt")

    started = time.perf_counter()
    env = environment()
    say(env_label(env))
    opts.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="megacache-bench-"))
    say(f"scratch directory {work}; results to {opts.out.resolve()}")
    all_runs: list[Run] = []
    results: dict[str, Any] = {"environment": env, "argv": sys.argv[1:] if argv is None else argv,
                               "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()},
                               "workloads": [], "idle": None, "objects": None, "apart": None, "notes": []}
    md: list[str] = ["# pytest-megacache benchmark", "", f"{env_label(env)}; {env['date']}", "",
                     "Command: `python benchmarks/run.py " + " ".join(results["argv"]) + "`", ""]
    notes: list[str] = results["notes"]
    failed = False
    try:
        with S3() as s3:
            runner = Runner(s3, opts.timeout, opts.out / "failed-logs")
            runner.progress_file = opts.out / "runs.jsonl"
            runner.progress_file.unlink(missing_ok=True)
            if not runner.installed:
                notes.append("pytest-megacache is not installed as a pytest plugin here: loaded with "
                             "-p pytest_megacache.plugin from this checkout")
            workloads: list[Workload] = []
            if not opts.idle_only:
                if "example" in opts.workload:
                    workloads.append(make_example(opts.device))
                if "mixed" in opts.workload:
                    workloads.append(make_mixed(opts.device))
                if "synthetic" in opts.workload:
                    workloads += [make_synthetic(work / "projects", n, opts.device) for n in opts.n]
                if "varied" in opts.workload:
                    workloads += [make_varied(work / "projects", n, opts.device) for n in opts.varied_n]
                if "children" in opts.workload:
                    workloads.append(make_children(work / "projects", opts.device))
                if "ranks" in opts.workload:
                    workloads.append(make_ranks(opts.device))
                if any(wl.children for wl in workloads) and not child_records_installed():
                    notes.append(f"{CHILD_PTH} is not in this interpreter's site-packages: child processes report "
                                 "nothing and the children and ranks runs fail (pip install -e . installs it)")
            threads = False
            if workloads and not opts.no_threads_pair:
                threads = has_threads_option(runner, workloads[0], work)
                if not threads:
                    notes.append(f"the installed plugin has no {THREADS_FLAG}: the worker-pool pair "
                                 "(warm-auto / warm-keep) was skipped")
            last_populated: tuple[Workload, str] | None = None
            for wl in workloads:
                runs, populated = bench_workload(runner, wl, opts.repeats, work, threads, opts.xdist, opts.skip,
                                                 opts.isa_pair)
                all_runs += runs
                failed |= any(not r.ok for r in runs)
                if populated:
                    last_populated = (wl, populated)
                lines, summary = workload_tables(wl, runs, opts.repeats)
                results["workloads"].append({"name": wl.name, "device": wl.device, "tests": wl.args,
                                             "children": wl.children, **summary,
                                             "runs": [r.__dict__ for r in runs]})
                md += lines
                print("\n".join(lines), flush=True)
            if workloads and not opts.no_apart:
                say("per-process costs measured apart ...")
                results["apart"] = bench_apart(runner, work, opts.repeats)
                lines = apart_lines(results["apart"])
                md += lines
                print("\n".join(lines), flush=True)
            if not opts.no_idle:
                say(f"idle: {opts.idle_repeats} sessions per variant ...")
                wl_idle, bucket = last_populated if last_populated else (None, None)
                idle = bench_idle(runner, work, opts.idle_repeats, wl_idle, bucket)
                results["idle"] = idle
                failed |= bool(idle["failures"])
                lines = idle_lines(idle)
                md += lines
                print("\n".join(lines), flush=True)
            if not opts.idle_only:
                say("restore time vs objects ...")
                wl_obj, bucket = last_populated if last_populated else (None, None)
                rows = bench_objects(s3, work, opts.objects_repeats, bucket, wl_obj.name if wl_obj else None)
                results["objects"] = rows
                lines = objects_lines(rows)
                md += lines
                print("\n".join(lines), flush=True)
    finally:
        if opts.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if opts.plot:
        note = plot(opts.out, results, all_runs, env)
        if note:
            notes.append(note)
        else:
            say(f"plot: {opts.out / 'compile_seconds.png'}")
    if failed:
        notes.append("at least one run FAILED: see the rows with fewer runs ok, and the output tails printed above")
    for note in notes:
        say(f"note: {note}")
    md += [f"- note: {n}" for n in notes] + ["", f"Whole benchmark: {time.perf_counter() - started:.0f} s", ""]
    results["seconds"] = time.perf_counter() - started
    (opts.out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (opts.out / "results.md").write_text("\n".join(md))
    say(f"wrote {opts.out / 'results.json'} and {opts.out / 'results.md'} ({results['seconds']:.0f} s in all)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
