"""The plots (``--plot``, with matplotlib): compile seconds per mode of each workload, and where each process's
seconds go."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from pytest_megacache.report.stats import PHASES  # the plugin's phases, from this checkout

from .environment import env_label
from .records import Run

# One color per phase of the plugin's per-process times (pytest_megacache.report.stats.PHASES), and the exit, measured
# from outside.
PHASE_COLORS = {"startup": "#95a5a6", "collect": "#bdc3c7", "imports": "#7f8c8d", "restore_wait": "#e67e22",
                "load": "#f39c12", "dynamo": "#8e44ad", "backend": "#c0392b", "isa_check": "#f1948a", "backward": "#e74c3c",
                "compile_other": "#d35400", "reused": "#48c9b0", "tests": "#27ae60", "finish": "#2980b9", "exit": "#34495e"}
MODE_COLORS = {"plain": "#7f8c8d",
               "cold": "#c0392b", "warm": "#27ae60", "warm-auto": "#16a085", "warm-keep": "#1abc9c", "hot": "#2980b9",
               "naive": "#8e44ad", "cold-xdist": "#e67e22", "warm-xdist": "#f1c40f",
               "warm-isa-off": "#d98880"}  # one color per mode


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
