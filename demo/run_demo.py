"""pytest-megacache, end to end: a cold CI run fills an S3 bucket, a fresh "runner" restores from it.

Run from the repository root with the project's virtualenv (``scripts/demo.sh`` sets it up)::

    python demo/run_demo.py [--keep] [-- extra pytest args]

What it does:

1. starts an S3 server (moto) on 127.0.0.1 and creates a bucket;
2. runs ``example_project``'s tests with ``--megacache-bucket``: COLD, with empty Inductor, Triton and
   temp directories;
3. runs them again, WARM, as a new CI runner would: new empty Inductor, Triton and temp directories, so
   everything reused comes out of the bucket;
4. prints the two runs side by side. Wall time is measured here, around each pytest process; compile time
   and bytes moved come from the plugin's JSON report; the cache hits and misses come from torch's own
   counters, written by a demo-only pytest plugin (``demo/megacache_demo_counters.py``), not from the
   plugin under demonstration.

Exits non-zero if either pytest run fails, or if the warm run missed torch's FX graph cache (or neither hit it nor
took a frame from the store: Dynamo reuse, on by default where checked, takes traced frames without looking their
graphs up).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from local_s3 import LocalS3, clean_env  # beside this script (shared with benchmarks/megabench/ and tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = ROOT / "demo"
TESTS = "example_project/tests"
BUCKET = "megacache-demo"
COUNTERS_PLUGIN = "megacache_demo_counters"
COUNTERS_ENV = "MEGACACHE_DEMO_COUNTERS"



def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


@dataclass
class RunResult:
    name: str
    returncode: int
    wall_seconds: float
    report: dict[str, Any] | None
    counters: dict[str, Any] | None
    bucket_objects: int
    bucket_bytes: int
    keys: list[str] = field(default_factory=list)
    # torch's counters of each child process (the DDP ranks of test_distributed.py), summed
    children: dict[str, dict[str, int]] = field(default_factory=dict)
    ranks: int = 0  # child processes that wrote their counters file


def child_env(s3: LocalS3, run_dir: Path, counters_path: Path) -> dict[str, str]:
    # Settings from the calling shell that would change what the demo measures (a configured store or
    # mode, cache directories or switches, AWS credentials and endpoints, pytest options) are dropped.
    env = clean_env()
    dirs = {name: run_dir / name for name in ("inductor-cache", "triton-cache", "tmp")}
    for path in dirs.values():
        path.mkdir(parents=True)
    env.update(s3.env(no_aws_files=str(run_dir / "no-aws-config")))
    env.update({
        "TORCHINDUCTOR_CACHE_DIR": str(dirs["inductor-cache"]),
        "TRITON_CACHE_DIR": str(dirs["triton-cache"]),
        "TMPDIR": str(dirs["tmp"]),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(DEMO_DIR), os.environ.get("PYTHONPATH", "")) if p),
        COUNTERS_ENV: str(counters_path),
        # example_project's distributed test: each rank (a child process) writes its own torch counters here.
        "EXAMPLE_CHILD_COUNTERS": str(run_dir / "child-counters"),
    })
    return env


def child_counters(run_dir: Path) -> dict[str, dict[str, int]]:
    """torch's counters of the child processes (one JSON file each), summed per group."""
    out: dict[str, dict[str, int]] = {}
    for path in sorted((run_dir / "child-counters").glob("*.json")):
        doc = load_json(path) or {}
        for group, values in doc.items():
            for name, value in dict(values).items():
                out.setdefault(group, {})[name] = out.get(group, {}).get(name, 0) + int(value)
    return out


def stream(proc: subprocess.Popen[bytes], prefix: str) -> None:
    """Copy the child's output as it comes (pytest's progress dots included), prefixing each line."""
    assert proc.stdout is not None
    out = sys.stdout.buffer
    at_line_start = True
    while True:
        chunk = proc.stdout.read1(4096)  # type: ignore[attr-defined]
        if not chunk:
            break
        for piece in chunk.splitlines(keepends=True):
            if at_line_start:
                out.write(prefix.encode())
            out.write(piece)
            at_line_start = piece.endswith(b"\n")
        out.flush()
    if not at_line_start:
        out.write(b"\n")
        out.flush()


def load_json(path: Path) -> dict[str, Any] | None:  # the benchmarks read the plugin's reports with it too
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def run_pytest(name: str, s3: LocalS3, bucket: str, work: Path, extra: list[str]) -> RunResult:
    run_dir = work / name
    report_path, counters_path = run_dir / "megacache-report.json", run_dir / "torch-counters.json"
    env = child_env(s3, run_dir, counters_path)
    cmd = [sys.executable, "-m", "pytest", TESTS, "-q", "-p", "no:cacheprovider", "-p", COUNTERS_PLUGIN,
           "--megacache-bucket", bucket, "--megacache-report", str(report_path), *extra]
    say(f"{name.upper()} run: empty TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and TMPDIR under {run_dir}")
    say("  $ " + " ".join(cmd[2:]))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        stream(proc, f"  [{name}] ")
    finally:
        returncode = proc.wait()
    wall = time.perf_counter() - start
    objects = s3.objects(bucket)
    result = RunResult(name, returncode, wall, load_json(report_path), load_json(counters_path),
                       len(objects), sum(size for _, size in objects), [key for key, _ in objects],
                       child_counters(run_dir), len(list((run_dir / "child-counters").glob("*.json"))))
    say(f"{name} run finished in {wall:.1f} s (pytest exit {returncode}); the bucket holds "
        f"{result.bucket_objects} object(s), {human_bytes(result.bucket_bytes)}")
    for key, size in objects:
        say(f"  s3://{bucket}/{key}  ({human_bytes(size)})")
    return result


# --- the table -------------------------------------------------------------------------------------
def _report_children(r: RunResult, prefix: str) -> str | None:
    """Hits / misses summed over the children listed in the session report (``torch.children``: each child's
    own record, written through the .pth hook the package installs)."""
    children = _get(r.report, "torch", "children") if r.report is not None else None
    if not isinstance(children, list):
        return None
    hits = sum(int(c["counters"].get(f"{prefix}_hit", 0)) for c in children)
    misses = sum(int(c["counters"].get(f"{prefix}_miss", 0)) for c in children)
    return f"{hits} / {misses} ({len(children)} children)"


def _get(data: dict[str, Any] | None, *path: str) -> Any:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "n/a"
    if kind == "s":
        return f"{value:.2f} s"
    if kind == "bytes":
        return f"{human_bytes(value)} ({value:,} B)" if value else "0 B"
    return str(value)


def _ratio(cold: Any, warm: Any) -> str:
    if not isinstance(cold, (int, float)) or not isinstance(warm, (int, float)) or cold <= 0:
        return ""
    return f"{warm / cold:.2f}x"


def _dynamo(r: RunResult, name: str) -> int:
    """A Dynamo reuse counter of the run's report (torch's counter table, where the plugin counts them)."""
    return int((_get(r.report, "torch", "counters") or {}).get(name, 0)) if r.report is not None else 0


def table(cold: RunResult, warm: RunResult) -> list[str]:
    rows: list[tuple[str, str, Any, Any, bool]] = []  # label, kind, cold, warm, show ratio

    def row(label: str, kind: str, fn: Any, ratio: bool = False) -> None:
        rows.append((label, kind, fn(cold), fn(warm), ratio))

    row("pytest exit code", "", lambda r: r.returncode)
    row("session wall time (measured by the demo)", "s", lambda r: r.wall_seconds, ratio=True)
    row("time compiling (report torch.compile_seconds)", "s", lambda r: _get(r.report, "torch", "compile_seconds"),
        ratio=True)
    row("compile events (report torch.compiles)", "", lambda r: _get(r.report, "torch", "compiles"))
    row("FX graph cache hits (torch counters)", "", lambda r: _get(r.counters, "inductor", "fxgraph_cache_hit") or 0
        if r.counters else None)
    row("FX graph cache misses (torch counters)", "", lambda r: _get(r.counters, "inductor", "fxgraph_cache_miss") or 0
        if r.counters else None)
    row("AOTAutograd cache hits (torch counters)", "", lambda r: _get(r.counters, "aot_autograd", "autograd_cache_hit")
        or 0 if r.counters else None)
    row("AOTAutograd cache misses (torch counters)", "",
        lambda r: _get(r.counters, "aot_autograd", "autograd_cache_miss") or 0 if r.counters else None)
    # Graphs with nothing for Inductor to compile (and a dynamic-shape graph's restarted first attempt) miss
    # AOTAutograd's cache on every run: torch never saves them. This row shows how many it did save.
    row("AOTAutograd entries saved by torch (torch counters)", "",
        lambda r: _get(r.counters, "aot_autograd", "autograd_cache_saved") or 0 if r.counters else None)
    # Dynamo reuse (on by default where checked): frames taken from the store are not traced, and their graphs are
    # never looked up in the FX graph cache; the frames still traced look theirs up as without it.
    row("Dynamo frames taken from the store / traced (report)", "", lambda r: None if r.report is None else
        f"{_dynamo(r, 'dynamo_frames_reused')} / {_dynamo(r, 'dynamo_traced')}")
    row("child processes (DDP ranks): FX graph hits / misses", "", lambda r: None if not r.children else
        f"{_get(r.children, 'inductor', 'fxgraph_cache_hit') or 0} / {_get(r.children, 'inductor', 'fxgraph_cache_miss') or 0}")
    row("child processes (DDP ranks): AOTAutograd hits / misses", "", lambda r: None if not r.children else
        f"{_get(r.children, 'aot_autograd', 'autograd_cache_hit') or 0} / "
        f"{_get(r.children, 'aot_autograd', 'autograd_cache_miss') or 0}")
    row("child processes in the plugin's report: FX hits / misses", "", lambda r: _report_children(r, "fxgraph_cache"))
    row("child processes in the plugin's report: AOTAutograd hits / misses", "",
        lambda r: _report_children(r, "autograd_cache"))
    row("restore: objects used / listed", "", lambda r: None if r.report is None else
        f"{_get(r.report, 'restore', 'objects_used')} / {_get(r.report, 'restore', 'objects_listed')}")
    row("restore: bytes fetched (report restore.bytes_fetched)", "bytes",
        lambda r: _get(r.report, "restore", "bytes_fetched"))
    row("restore: seconds (report restore.seconds)", "s", lambda r: _get(r.report, "restore", "seconds"))
    row("restore: compiled files written", "", lambda r: _get(r.report, "restore", "files_written"))
    row("artifacts loaded into torch", "", lambda r: None if r.report is None else
        (sum(_get(r.report, "load", "artifacts").values()) if _get(r.report, "load", "ok") else "none"))
    row("upload: bytes (report upload.bytes)", "bytes", lambda r: _get(r.report, "upload", "bytes"))
    row("upload: new entries", "", lambda r: None if r.report is None else
        (sum((_get(r.report, "upload", "new_entries") or {}).values()) or
         f"0 ({_get(r.report, 'upload', 'reason')})"))
    row("objects in the bucket after the run", "", lambda r: r.bucket_objects)
    row("cache problems reported by the plugin", "", lambda r: None if r.report is None else
        len(r.report.get("problems") or []))

    header = ("", "COLD", "WARM", "warm/cold")
    cells = [header] + [(label, _fmt(c, kind), _fmt(w, kind), _ratio(c, w) if ratio else "")
                        for label, kind, c, w, ratio in rows]
    widths = [max(len(cell[i]) for cell in cells) for i in range(4)]
    lines = []
    for i, cell in enumerate(cells):
        values = [c.rjust(w) for c, w in zip(cell[1:], widths[1:], strict=True)]
        lines.append("  ".join([cell[0].ljust(widths[0]), *values]))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


# --- checks ----------------------------------------------------------------------------------------
def check(cold: RunResult, warm: RunResult) -> tuple[list[str], list[str]]:
    """(failures, notes): failures make the demo exit non-zero."""
    failures: list[str] = []
    notes: list[str] = []
    for r in (cold, warm):
        if r.returncode != 0:
            failures.append(f"the {r.name} pytest run failed (exit {r.returncode}); its output is above")
        if r.report is None:
            failures.append(f"the {r.name} run wrote no megacache report (is pytest-megacache installed?)")
        elif not r.report.get("enabled"):
            failures.append(f"pytest-megacache was not active in the {r.name} run: {r.report.get('reason')}")
        if r.counters is None:
            failures.append(f"the {r.name} run wrote no torch counters ({COUNTERS_PLUGIN} did not run)")
        elif not r.counters.get("torch_dynamo_imported"):
            failures.append(f"the {r.name} run never reached torch.compile (all compiled tests skipped?)")
        for problem in (r.report or {}).get("problems") or []:
            notes.append(f"{r.name} run, plugin problem: {problem}")
        # The plugin's claims against torch's own counters.
        if r.report is not None and r.counters is not None:
            claimed = _get(r.report, "torch", "counters") or {}
            for group, name in (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                                ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss")):
                torch_says = _get(r.counters, group, name) or 0
                if claimed.get(name, 0) != torch_says:
                    notes.append(f"{r.name} run: the report says {name}={claimed.get(name, 0)}, "
                                 f"torch says {torch_says}")
    child_misses = _get(warm.children, "inductor", "fxgraph_cache_miss") or 0
    if child_misses:
        failures.append(f"the warm run's child processes (DDP ranks) missed torch's FX graph cache {child_misses} "
                        "time(s)")
    for r in (cold, warm):
        told = _get(r.report, "torch", "children") if r.report is not None else None
        if r.ranks and (not isinstance(told, list) or len(told) != r.ranks):
            failures.append(f"the {r.name} run's report lists {len(told or [])} child processes, {r.ranks} ranks wrote "
                            "counters (is pytest_megacache_children.pth installed in site-packages?)")
    warm_hits = _get(warm.counters, "inductor", "fxgraph_cache_hit") or 0
    warm_misses = _get(warm.counters, "inductor", "fxgraph_cache_miss") or 0
    if warm.counters is not None and warm_misses:
        why = [f"the warm run missed torch's FX graph cache {warm_misses} time(s): it recompiled graphs the cold "
               "run had uploaded"]
        fp_cold, fp_warm = _get(cold.report, "fingerprint", "key"), _get(warm.report, "fingerprint", "key")
        if fp_cold != fp_warm:
            why.append(f"the fingerprints differ (cold {fp_cold}, warm {fp_warm}), so the warm run looked in "
                       "another folder")
        if warm.report is not None:
            restore, load = warm.report.get("restore") or {}, warm.report.get("load") or {}
            if not restore.get("objects_used"):
                why.append(f"the warm run restored no object ({restore.get('objects_listed', 0)} listed)")
            if load.get("called") and not load.get("ok"):
                why.append(f"torch refused the restored artifacts: {load.get('error')}")
            if warm.report.get("problems"):
                why.append("the plugin reported problems (see the notes above)")
        failures.append("; ".join(why))
    elif (warm.counters is not None and warm.counters.get("torch_dynamo_imported") and not warm_hits
          and not _dynamo(warm, "dynamo_frames_reused")):
        failures.append("the warm run never hit the FX graph cache and took no frame from the store")
    return failures, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (caches, reports, logs)")
    parser.add_argument("--bucket", default=BUCKET, help=f"bucket name on the embedded server (default {BUCKET})")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    args = parser.parse_args(argv)

    total_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="megacache-demo-"))
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    say(f"python {sys.version.split()[0]}, torch {version}, {os.cpu_count()} CPU(s); scratch directory {work}")
    try:
        with LocalS3() as s3:
            s3.create_bucket(args.bucket)
            say(f"S3 server (moto) on {s3.url}, bucket {args.bucket!r} created, empty")
            cold = run_pytest("cold", s3, args.bucket, work, args.pytest_args)
            warm = run_pytest("warm", s3, args.bucket, work, args.pytest_args)
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    print()
    say("results (every number measured in these two runs)")
    for line in table(cold, warm):
        print("  " + line)
    print()
    failures, notes = check(cold, warm)
    for note in notes:
        say(f"note: {note}")
    say(f"whole demo: {time.perf_counter() - total_start:.1f} s")
    if failures:
        for failure in failures:
            say(f"FAILED: {failure}")
        return 1
    say("OK: the warm run reused every FX graph the cold run compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
