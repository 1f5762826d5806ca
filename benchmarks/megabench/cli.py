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
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .apart import bench_apart
from .console import say
from .environment import env_label, environment
from .idle import bench_idle
from .modes import ISA_FLAG, SKIPPABLE, bench_workload
from .objects import bench_objects
from .plots import plot
from .records import Run
from .runner import S3, THREADS_FLAG, Runner, has_threads_option
from .tables import apart_lines, idle_lines, objects_lines, workload_tables
from .workloads import (
    CHILD_PTH,
    Workload,
    child_records_installed,
    make_children,
    make_example,
    make_mixed,
    make_ranks,
    make_synthetic,
    make_varied,
)


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
