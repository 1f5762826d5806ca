"""A run's record: what one pytest process measured, read from the plugin's JSON report and the example project's
Triton listener log, and whether the run counts as failed."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .workloads import CHILD_PTH, Workload


@dataclass
class Run:
    """One pytest process and what it measured."""

    workload: str
    mode: str
    repeat: int
    ok: bool = False
    error: str | None = None
    returncode: int | None = None
    wall: float | None = None
    compile_seconds: float | None = None
    compiles: int | None = None
    fx_hit: int | None = None
    fx_miss: int | None = None
    aot_hit: int | None = None
    aot_miss: int | None = None
    upload_bytes: int | None = None
    upload_raw_bytes: int | None = None
    bytes_moved: int | None = None
    restore_seconds: float | None = None
    objects_used: int | None = None
    compile_threads: str | None = None
    single_thread: bool | None = None  # whether the plugin chose one compile thread (auto policy engaged)
    problems: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    log: str | None = None
    # where each process's seconds went (the report's "processes": the session's own, then xdist workers'),
    # and the session process's exit (interpreter shutdown, Inductor's pool): wall minus what its report covers
    processes: list[dict[str, Any]] = field(default_factory=list)
    exit_seconds: float | None = None
    # Triton compiles in the pytest process, from the example project's listener (EXAMPLE_TRITON_EVENTS):
    # kernels built (cache miss) and kernels Triton found in its cache; None where the workload has no listener
    triton_built: int | None = None
    triton_hits: int | None = None
    # child processes that reported their own counters (the report's torch.children); for a workload whose compiles
    # happen in children, the counters and compile seconds above are theirs, summed
    children: int | None = None


def lookup(doc: Any, *path: str) -> Any:
    for part in path:
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc


def fill_from_report(r: Run, doc: dict[str, Any], from_children: bool = False) -> None:
    counters = lookup(doc, "torch", "counters") or {}
    r.compile_seconds = lookup(doc, "torch", "compile_seconds")
    r.compiles = lookup(doc, "torch", "compiles")
    children = [c for c in lookup(doc, "torch", "children") or [] if isinstance(c, dict)]
    r.children = len(children)
    if from_children:  # the pytest process compiled nothing: the children's own records
        counters = {}
        for child in children:
            for name, n in (child.get("counters") or {}).items():
                counters[name] = counters.get(name, 0) + int(n)
        r.compile_seconds = sum(float(c.get("compile_seconds") or 0.0) for c in children)
        r.compiles = sum(int(c.get("compiles") or 0) for c in children)
    r.fx_hit, r.fx_miss = counters.get("fxgraph_cache_hit", 0), counters.get("fxgraph_cache_miss", 0)
    r.aot_hit, r.aot_miss = counters.get("autograd_cache_hit", 0), counters.get("autograd_cache_miss", 0)
    r.upload_bytes, r.upload_raw_bytes = lookup(doc, "upload", "bytes"), lookup(doc, "upload", "raw_bytes")
    r.bytes_moved = lookup(doc, "restore", "bytes_fetched")
    r.restore_seconds = lookup(doc, "restore", "seconds")
    r.objects_used = lookup(doc, "restore", "objects_used")
    r.compile_threads = lookup(doc, "settings", "compile_threads")
    r.single_thread = lookup(doc, "torch", "single_compile_thread")
    r.problems = list(doc.get("problems") or [])
    r.processes = [p for p in doc.get("processes") or [] if isinstance(p, dict)]
    main = r.processes[0] if r.processes else {}
    if r.wall is not None and main.get("startup") is not None and isinstance(main.get("total"), (int, float)):
        r.exit_seconds = max(0.0, r.wall - float(main["total"]))


def failure_reason(rc: int, doc: dict[str, Any] | None, wl: Workload, mode: str) -> str | None:
    if rc != 0:
        return "timed out" if rc == -1 else f"pytest exited {rc}"
    if doc is None:
        return "no megacache report was written (is the plugin loaded?)"
    if not doc.get("enabled"):
        return f"the plugin was not active: {doc.get('reason')}"
    if doc.get("problems"):
        return "the plugin reported problems: " + "; ".join(str(p) for p in doc["problems"])[:600]
    if wl.children:
        if not lookup(doc, "torch", "children"):
            return ("no child process reported a compile (is the package installed, with its "
                    f"{CHILD_PTH} in site-packages?)")
    elif not lookup(doc, "torch", "compiled"):
        return f"nothing was compiled (are the {wl.device} tests all skipped?)"
    if mode == "cold" and not lookup(doc, "upload", "objects"):
        return f"the cold run uploaded nothing: {lookup(doc, 'upload', 'reason')}"
    return None


def triton_events(path: Path) -> tuple[int | None, int | None]:
    """(kernels Triton built, kernels it found cached) from the example project's listener log (one JSON object
    a line, appended by each process that compiled); (None, None) where no process wrote one."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None, None
    hits = [bool(json.loads(line).get("cache_hit")) for line in lines if line.strip()]
    return hits.count(False), hits.count(True)
