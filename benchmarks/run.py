"""pytest-megacache benchmark: cold, warm, hot and naive runs side by side, in one command.

    python benchmarks/run.py [--workload example mixed synthetic varied children ranks] [--n 10 50 200]
                             [--repeats 3] [--device cpu|cuda] [--xdist N] [--out DIR] [--plot]

``--help`` gives every option, the modes and the workloads. The code is the package beside this script
(``benchmarks/megabench/``); this file runs its command line and gives the other scripts of this folder, and the
tests, the names they import from here.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the package, also when this file is imported by path
from megabench import ROOT  # the package puts this checkout's folders on sys.path
from megabench.cli import main
from megabench.environment import env_label
from megabench.modes import bench_workload
from megabench.plots import PHASE_COLORS, plot
from megabench.records import Run, failure_reason, fill_from_report, triton_events
from megabench.runner import Runner, clean_env, plugin_args
from megabench.tables import apart_lines, phase_lines, phase_rows, workload_tables
from megabench.workloads import Workload, make_children, make_mixed, make_ranks, synthetic_source

from pytest_megacache.report.stats import PHASES  # the plugin's phases, from this checkout

__all__ = ["PHASES", "PHASE_COLORS", "ROOT", "Run", "Runner", "Workload", "apart_lines", "bench_workload", "clean_env",
           "env_label", "failure_reason", "fill_from_report", "main", "make_children", "make_mixed", "make_ranks",
           "phase_lines", "phase_rows", "plot", "plugin_args", "synthetic_source", "triton_events", "workload_tables"]

if __name__ == "__main__":
    sys.exit(main())
