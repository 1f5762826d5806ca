"""What the cache did, for people and tools: one typed session report, built in one place
(:meth:`SessionReport.build`), rendered as terminal lines, the JSON report and the GitHub step summary.

A light module: it imports no torch, zstandard or boto3 (the plugin imports it in every session)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .fsutil import write_atomic
from .torch_adapter import MISS_COUNTERS, counter_sum  # a light module: it imports no torch

if TYPE_CHECKING:
    from .torch_adapter import TorchAdapter

REPORT_SCHEMA = "pytest-megacache/report"
REPORT_VERSION = 2


@dataclass
class RestoreStats:
    attempted: bool = False
    objects_listed: int = 0
    objects_used: int = 0
    objects_rejected: int = 0
    bytes_fetched: int = 0
    raw_fetched: int = 0  # what the objects used hold, decompressed
    raw_unique: int = 0  # of that, each entry counted once (what overlapping objects hold twice, once)
    raw_decompressed: int = 0  # what was decompressed: an entry another object gave already is not, unless its
    # frame (small entries share one) held an entry that was not there yet
    folders: dict[str, int] = field(default_factory=dict)  # objects used per folder (scope)
    entries: dict[str, int] = field(default_factory=dict)
    files_written: int = 0
    files_present: int = 0
    files_refused: list[str] = field(default_factory=list)  # kernel files cut short: not written, rebuilt
    seconds: float = 0.0
    ok: bool = False
    why_miss: str | None = None  # when nothing is stored for this fingerprint: the nearest one that is
    source: str = "store"  # "store", or "controller" for an xdist worker reading what its controller staged

    def add_files(self, other: Mapping[str, Any], worker: str) -> None:
        """Fold in an xdist worker's restore of files into its own cache directories (the controller writes none)."""
        self.files_written += as_count(other.get("files_written"))
        self.files_present += as_count(other.get("files_present"))
        refused = other.get("files_refused")
        for item in (refused if isinstance(refused, list) else [])[:MAX_REFUSED]:
            if len(self.files_refused) < MAX_REFUSED:
                self.files_refused.append(f"[{worker}] {str(item)[:300]}")


MAX_REFUSED = 50  # refused files a controller keeps from its workers' restores


def as_count(value: object) -> int:
    """A count from another process's figures: a non-negative int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 53 else 0


def _seconds(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e7 else 0.0


@dataclass
class LoadStats:
    called: bool = False
    ok: bool = False
    artifacts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    waited: float = 0.0  # how long the first compile waited for the restore (the restore's critical path)
    workers: int = 0  # xdist workers that loaded (their figures summed; ``waited`` is the longest wait)

    def add(self, other: Mapping[str, Any]) -> None:
        """Fold in an xdist worker's load (the controller loads nothing itself)."""
        if not other.get("called"):
            return
        self.ok = (self.ok or not self.called) and bool(other.get("ok"))
        self.called = True
        self.workers += 1
        artifacts = other.get("artifacts")
        for kind, n in (artifacts.items() if isinstance(artifacts, dict) else ()):
            self.artifacts[str(kind)] = self.artifacts.get(str(kind), 0) + as_count(n)
        self.seconds += _seconds(other.get("seconds"))
        self.waited = max(self.waited, _seconds(other.get("waited")))
        if self.error is None and other.get("error"):
            self.error = str(other["error"])[:300]


@dataclass
class UploadStats:
    attempted: bool = False
    reason: str | None = None  # why nothing was uploaded
    session_entries: int = 0
    new_entries: dict[str, int] = field(default_factory=dict)
    objects: int = 0
    bytes: int = 0
    raw_bytes: int = 0
    compacted: int = 0  # objects merged into the uploaded one and then deleted
    # objects that concurrent sessions stored meanwhile, found covered by the merged one or merged anew, and deleted
    superseded: int = 0
    remerged: int = 0  # further merged objects uploaded to take those in
    remerged_bytes: int = 0
    converged: int = 0  # objects a session that had nothing new to upload merged into one (or a few parts)
    merged_objects: int = 0  # the objects that merge wrote
    merged_bytes: int = 0
    files_skipped: list[str] = field(default_factory=list)
    profiles_merged: int = 0  # dynamic-shape profiles that xdist workers grew apart, merged as torch does
    seconds: float = 0.0


@dataclass
class TritonStats:
    """Triton's kernels in the session (:mod:`pytest_megacache.tritonstats`): per process, or summed over xdist
    workers. A kernel is one compiled variant (one folder of Triton's cache directory)."""

    counted: str = "listener"  # how hits were told: Triton's compilation "listener", else "cache directory"
    hits: int | None = 0  # kernels Triton loaded from its cache directory that no process compiled this session
    hits_restored: int = 0  # of those, kernels this session's restore wrote
    compiled: int = 0  # kernels compiled this session (the listener's, and folders new in the cache directory)
    compile_seconds: float = 0.0  # Triton's own timings of the compiles the listener saw
    restored: int = 0  # kernels the restore wrote (into each worker's directory: the largest count of any worker)
    hits_unknown: str | None = None  # why hits is None
    processes: int = 1  # processes counted (xdist workers)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> TritonStats:
        """Another process's figures (an xdist worker's), each checked."""
        hits = doc.get("hits")
        unknown = doc.get("hits_unknown")
        return cls(counted=str(doc.get("counted", "listener"))[:40],
                   hits=as_count(hits) if hits is not None else None, hits_restored=as_count(doc.get("hits_restored")),
                   compiled=as_count(doc.get("compiled")), compile_seconds=_seconds(doc.get("compile_seconds")),
                   restored=as_count(doc.get("restored")),
                   hits_unknown=str(unknown)[:300] if unknown else None if hits is not None else "not told",
                   processes=max(1, as_count(doc.get("processes"))))

    def add(self, other: TritonStats) -> None:
        self.hits = None if self.hits is None or other.hits is None else self.hits + other.hits
        self.hits_unknown = self.hits_unknown or other.hits_unknown
        if other.counted != "listener":
            self.counted = other.counted
        self.hits_restored += other.hits_restored
        self.compiled += other.compiled
        self.compile_seconds = round(self.compile_seconds + other.compile_seconds, 3)
        self.restored = max(self.restored, other.restored)
        self.processes += other.processes


@dataclass
class TorchStats:
    compiled: bool = False
    compiles: int = 0
    compile_seconds: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)
    # nodeid -> {"seconds", "compiles", "counters", "artifacts": ["type:key", ...]}
    per_test: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds_saved: float = 0.0  # cold compile seconds recorded for the restored artifacts this session used
    layers: dict[str, dict[str, int]] = field(default_factory=dict)  # type -> restored/used/new
    workers: int = 0
    single_compile_thread: bool = False  # the plugin ran Inductor with one compile thread (the cache covered it)
    # torch cache entries found in the cache directories that no process of the session recorded (compiled by
    # child processes: torchrun, mp.spawn, subprocess), per layer ("inductor": FX graphs, "aot_autograd")
    other_processes: dict[str, int] = field(default_factory=dict)
    # child processes that reported their own counters (childhook), one dict each: label, pid, ppid, rank,
    # local_rank, world_size, compiles, graphs, compile_seconds, counters
    children: list[dict[str, Any]] = field(default_factory=list)
    # torch's CPU vector-ISA load checks in the session's own processes (isaprobe): taken from a marker ("reused"),
    # run by torch ("run"), markers written ("recorded")
    isa_checks: dict[str, int] = field(default_factory=dict)
    triton: TritonStats | None = None  # Triton's kernels loaded from its cache vs compiled; None: none of either
    # --megacache-precompile: the first detail seen per refusal reason (dynamo_reuse), e.g. which guard was unprovable
    dynamo_refusals: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_adapter(cls, adapter: TorchAdapter) -> TorchStats:
        per_test = {
            nodeid: {"seconds": round(t.seconds, 4), "compiles": t.compiles, "counters": dict(t.counters),
                     "artifacts": [f"{typ}:{key}" for typ, key in t.artifacts]}
            for nodeid, t in adapter.per_test.items()
        }
        from . import dynamo_reuse, isaprobe

        return cls(adapter.compiled_anything(), adapter.compiles, adapter.compile_seconds, adapter.counters(), per_test,
                   isa_checks={k: v for k, v in isaprobe.counts().items() if v},
                   dynamo_refusals=dynamo_reuse.refusal_reasons())

    def add(self, other: Mapping[str, Any]) -> None:
        """Fold in another process's stats (an xdist worker's, as a dict)."""
        self.workers += 1
        self.compiled = self.compiled or bool(other.get("compiled"))
        self.compiles += int(other.get("compiles", 0))
        self.compile_seconds += float(other.get("compile_seconds", 0.0))
        for k, v in dict(other.get("counters", {})).items():
            self.counters[str(k)] = self.counters.get(str(k), 0) + int(v)
        self.per_test.update(dict(other.get("per_test", {})))
        for layer, n in dict(other.get("other_processes", {})).items():
            self.other_processes[str(layer)] = self.other_processes.get(str(layer), 0) + int(n)
        for name, n in dict(other.get("isa_checks", {})).items():
            self.isa_checks[str(name)] = self.isa_checks.get(str(name), 0) + int(n)
        for reason, detail in dict(other.get("dynamo_refusals", {})).items():
            self.dynamo_refusals.setdefault(str(reason), str(detail))
        if isinstance(other.get("triton"), dict):
            theirs = TritonStats.from_dict(other["triton"])
            if self.triton is None:
                self.triton = theirs
            else:
                self.triton.add(theirs)



def process_age() -> float | None:
    """Seconds since this process started, from the kernel's record of its start (Linux); else None."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return age if 0 <= age < 1e7 else None


@dataclass
class ProcessTimes:
    """Where one process's seconds went: the session's own process ("main") or an xdist worker ("gw0", ...).

    The phases do not overlap and, with ``startup``, add up to the process's life until its report: startup
    (process start to the plugin's configure: the interpreter, pytest, plugins and the first conftests, which
    often import torch), collect (to the end of collection: test modules), imports (torch's, when the plugin saw
    it, and torch._dynamo's, which the first ``torch.compile`` pulls in, wherever they happened), restore_wait
    (blocked on the restore), load (``load_cache_artifacts``), the compile split by torch's own timings (dynamo:
    tracing, guards, bytecode; backend: AOTAutograd and Inductor for forward graphs, cache lookups and kernel
    builds included; isa_check: torch's CPU vector-ISA load checks, which run inside the first CPU compile, taken
    out of backend (isaprobe; 0 with the reuse off); backward: lazily compiled backward graphs; compile_other:
    the rest of the compile callbacks' time), tests (the rest of running the tests) and finish (collecting and
    uploading, or handing over). Only the interpreter's exit (atexit, Inductor's compile pool) is left: whoever
    started the process measures it.
    """

    process: str = "main"
    startup: float | None = None  # None where the process's start time is not known (not Linux)
    collect: float = 0.0
    imports: float = 0.0
    restore_wait: float = 0.0
    load: float = 0.0
    dynamo: float = 0.0
    backend: float = 0.0
    isa_check: float = 0.0
    backward: float = 0.0
    compile_other: float = 0.0
    tests: float = 0.0
    finish: float = 0.0
    total: float = 0.0  # process start (or configure, without startup) to the report

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], process: str) -> ProcessTimes:
        """Another process's figures (an xdist worker's ``workeroutput``), each checked to be a finite number."""
        def num(name: str) -> float | None:
            value = doc.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < 1e7):
                return None
            return float(value)

        out = cls(process=process, startup=num("startup"))
        for name in (*PHASES[1:], "total"):
            setattr(out, name, num(name) or 0.0)
        return out

    def line(self) -> str:
        parts = [f"{name.replace('_', ' ')} {getattr(self, name):.2f}" for name in PHASES
                 if getattr(self, name) is not None and getattr(self, name) >= 0.005]
        return f"{self.process}: {self.total:.2f} s = " + ", ".join(parts)


# The phases of one process, in the order they happen: ProcessTimes's fields between its name and its total
# ("exit" comes after, measured from outside).
PHASES = tuple(f.name for f in fields(ProcessTimes) if f.name not in ("process", "total"))


@dataclass
class XdistStats:
    role: str = "solo"  # "solo" or "controller" (workers report to their controller, not here)
    workers: int = 0
    lost: list[str] = field(default_factory=list)  # workers that ended without handing anything over
    # per worker that handed over: files_written, files_present, files_refused (a count), single_compile_thread,
    # compiles, triton_hits (None: unknown), triton_compiled
    per_worker: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class SessionReport:
    """Everything a session says about the cache. ``restore`` and the other stats are None when the session
    never imported torch (idle) or the plugin was off."""

    enabled: bool
    reason: str | None
    settings: dict[str, Any]
    fingerprint: dict[str, Any] | None
    scope: dict[str, Any] | None
    session_seconds: float
    notes: list[str]
    problems: list[str]
    restore: RestoreStats | None = None
    load: LoadStats | None = None
    torch: TorchStats | None = None
    upload: UploadStats | None = None
    xdist: XdistStats | None = None
    processes: list[ProcessTimes] = field(default_factory=list)  # this process first, then xdist workers

    @property
    def idle(self) -> bool:
        """The session never imported torch: nothing restored or uploaded."""
        return self.enabled and self.restore is None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema": REPORT_SCHEMA, "version": REPORT_VERSION, "enabled": self.enabled, "reason": self.reason,
            "settings": self.settings, "fingerprint": self.fingerprint, "scope": self.scope, "idle": self.idle,
            "session_seconds": round(self.session_seconds, 3), "notes": list(self.notes),
            "problems": list(self.problems),
        }
        for name in ("restore", "load", "torch", "upload", "xdist"):
            part = getattr(self, name)
            if part is not None:
                doc[name] = asdict(part)
        if self.processes:
            doc["processes"] = [asdict(p) for p in self.processes]
        return doc


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def human_age(seconds: float) -> str:
    """An age in its largest whole unit: ``42s``, ``5m``, ``3h``, ``12d``."""
    s = max(0.0, seconds)
    for limit, unit, div in ((60, "s", 1), (3600, "m", 60), (86400, "h", 3600)):
        if s < limit:
            return f"{int(s // div)}{unit}"
    return f"{int(s // 86400)}d"


def plural(count: int, noun: str) -> str:
    """``1 object``, ``2 objects``."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def slowest_uncached(torch: TorchStats | None, n: int) -> list[tuple[str, dict[str, Any]]]:
    """The ``n`` tests with the most compile seconds that the cache did not cover (tests with misses)."""
    per_test = torch.per_test if torch is not None else {}
    missed = [(nodeid, t) for nodeid, t in per_test.items() if counter_sum(t["counters"], MISS_COUNTERS) > 0]
    return sorted(missed, key=lambda item: -float(item[1]["seconds"]))[:n]


def _layer_line(t: TorchStats) -> str:
    c = t.counters
    parts = [
        f"FX graph {c.get('fxgraph_cache_hit', 0)} hit / {c.get('fxgraph_cache_miss', 0)} miss"
        f" / {c.get('fxgraph_cache_bypass', 0)} bypass",
        f"AOTAutograd {c.get('autograd_cache_hit', 0)} hit / {c.get('autograd_cache_miss', 0)} miss"
        f" / {c.get('autograd_cache_bypass', 0)} bypass",
    ]
    if line := dynamo_reuse_text(c):
        parts.append(line)
    for layer, used in sorted(t.layers.items()):
        if layer not in ("inductor", "aot_autograd"):
            parts.append(f"{layer} {used['used']} of {used['restored']} restored used")
    return "torch: " + ", ".join(parts)


def dynamo_reuse_text(c: Mapping[str, int]) -> str:
    """``Dynamo reuse 5 installed / 2 traced / 1 refused (code changed 1), 2 stored``: compiled functions whose
    stored entry was installed, frames Dynamo traced, entries refused (per reason), frames stored; empty without
    --megacache-precompile."""
    refused = {name.removeprefix("dynamo_refused_").replace("_", " "): n for name, n in c.items()
               if name.startswith("dynamo_refused_") and n}
    reused, traced = c.get("dynamo_reused", 0), c.get("dynamo_traced", 0)
    if not (reused or traced or refused):
        return ""
    why = f" ({', '.join(f'{k} {v}' for k, v in sorted(refused.items()))})" if refused else ""
    return (f"Dynamo reuse {reused} installed / {traced} traced / {sum(refused.values())} refused{why}, "
            f"{c.get('dynamo_stored', 0)} stored")


def _pairs(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k.split('/', 1)[-1] if k.startswith('torch/') else k} {v}" for k, v in counts.items()) or "none"


def _by_workers(xd: XdistStats | None) -> str:
    return f" by {plural(xd.workers, 'xdist worker')}" if xd is not None and xd.workers else ""


def _restore_lines(r: RestoreStats, verbose: int, xd: XdistStats | None = None) -> list[str]:
    if not r.attempted:
        return []
    status = "" if r.ok else " (failed)"
    lines = [f"restored {r.objects_used}/{r.objects_listed} objects{status}, {human_bytes(r.bytes_fetched)} "
             f"in {r.seconds:.2f} s: {_pairs(r.entries)}; {r.files_written} files written{_by_workers(xd)}"
             + (f" ({r.files_present} already there)" if r.files_present else "")
             + (f", {len(r.files_refused)} refused" if r.files_refused else "")
             + (f", {r.objects_rejected} objects refused" if r.objects_rejected else "")]
    if r.raw_fetched > r.raw_unique:
        lines.append(f"the objects overlap: {human_bytes(r.raw_fetched)} raw fetched for {human_bytes(r.raw_unique)} "
                     f"of distinct entries ({human_bytes(r.raw_fetched - r.raw_unique)} held more than once; "
                     f"{human_bytes(r.raw_decompressed)} decompressed)")
    if verbose > 0 and r.folders:
        lines.append("  from " + ", ".join(f"{folder} ({n})" for folder, n in r.folders.items()))
    if r.why_miss:
        lines.append(f"nothing stored for this fingerprint: {r.why_miss}")
    return lines


def _load_line(ld: LoadStats) -> list[str]:
    if not ld.called:
        return []
    if not ld.ok:
        return [f"torch did not load the bundle: {ld.error}"]
    waited = f" (the first compile waited {ld.waited:.2f} s for the restore)" if ld.waited >= 0.05 else ""
    if ld.workers:
        waited = waited.replace("the first compile", "a worker's first compile")
        return [f"loaded into torch by {plural(ld.workers, 'xdist worker')}: {_pairs(ld.artifacts)} in "
                f"{ld.seconds:.3f} s in all{waited}"]
    return [f"loaded into torch: {_pairs(ld.artifacts)} in {ld.seconds:.3f} s{waited}"]


def _children_line(t: TorchStats) -> list[str]:
    if not t.other_processes:
        return []
    return ["child processes compiled " + ", ".join(
        f"{n} {'FX graphs' if layer == 'inductor' else 'AOTAutograd entries' if layer == 'aot_autograd' else layer}"
        for layer, n in sorted(t.other_processes.items())) + " that this session did not (found in the cache directory)"]


MAX_CHILD_LINES = 8


def _hit_miss(c: Mapping[str, int]) -> str:
    return (f"FX {c.get('fxgraph_cache_hit', 0)} hit / {c.get('fxgraph_cache_miss', 0)} miss, AOTAutograd "
            f"{c.get('autograd_cache_hit', 0)} hit / {c.get('autograd_cache_miss', 0)} miss")


def _child_records_lines(t: TorchStats) -> list[str]:
    """The child processes' own counters: a total, then one line per child."""
    if not t.children:
        return []
    total: dict[str, int] = {}
    for child in t.children:
        for name, n in child["counters"].items():
            total[name] = total.get(name, 0) + int(n)
    seconds = sum(float(child["compile_seconds"]) for child in t.children)
    lines = [f"{len(t.children)} child process(es) compiled: {_hit_miss(total)}, {seconds:.2f} s compiling"]
    lines += [f"  {child['label']}: {_hit_miss(child['counters'])}, {child['compiles']} compiles, "
              f"{float(child['compile_seconds']):.2f} s" for child in t.children[:MAX_CHILD_LINES]]
    if len(t.children) > MAX_CHILD_LINES:
        lines.append(f"  and {len(t.children) - MAX_CHILD_LINES} more (the JSON report lists every one)")
    return lines


def _torch_lines(t: TorchStats, xd: XdistStats | None) -> list[str]:
    workers = xd is not None and xd.workers > 0
    if not t.compiled:
        return [f"torch: nothing was compiled {'by the xdist workers' if workers else 'in this process'}",
                *_triton_lines(t.triton, xd), *_child_records_lines(t), *_children_line(t)]
    return [_layer_line(t),
            f"{t.compiles} compiles, {t.compile_seconds:.2f} s compiling"
            + (f" across {xd.workers} xdist workers" if xd is not None and xd.workers else "")
            + (f"; about {t.seconds_saved:.1f} s of cold compiling saved" if t.seconds_saved else "")
            + _threads(t, xd),
            *_isa_line(t), *_triton_lines(t.triton, xd), *_child_records_lines(t), *_children_line(t)]


def _threads(t: TorchStats, xd: XdistStats | None) -> str:
    if xd is not None and xd.per_worker:
        single = sum(bool(w.get("single_compile_thread")) for w in xd.per_worker.values())
        if not single:
            return ""
        which = "every" if single == len(xd.per_worker) else f"{single} of {len(xd.per_worker)}"
        return f"; one compile thread in {which} xdist worker{'' if which == 'every' else 's'} (the cache covers its tests)"
    return "; one compile thread (the cache covers this selection)" if t.single_compile_thread else ""


def _triton_lines(tr: TritonStats | None, xd: XdistStats | None) -> list[str]:
    """Triton's kernels: loaded from its cache directory vs compiled, and per xdist worker."""
    if tr is None:
        return []
    compiled = f"{tr.compiled} compiled" + (f" in {tr.compile_seconds:.2f} s" if tr.compile_seconds >= 0.005 else "")
    restored = f"; {plural(tr.restored, 'kernel')} restored" if tr.restored else ""
    if tr.hits is None:
        line = f"Triton kernels{_by_workers(xd)}: {compiled}{restored}; hits unknown: {tr.hits_unknown}"
    else:
        loaded = f"{tr.hits} loaded from the cache" + (f" ({tr.hits_restored} restored)" if tr.hits_restored else "")
        line = f"Triton kernels{_by_workers(xd)}: {loaded}, {compiled}{restored}"
    if xd is not None and xd.per_worker:
        rows = [f"{name} {'?' if w.get('triton_hits') is None else w.get('triton_hits')}/{w.get('triton_compiled', 0)}"
                for name, w in sorted(xd.per_worker.items())]
        line += " (loaded/compiled: " + ", ".join(rows[:MAX_CHILD_LINES]) + (", ..." if len(rows) > MAX_CHILD_LINES else "") + ")"
    return [line]


def _worker_lines(xd: XdistStats | None) -> list[str]:
    """Each xdist worker's own figures (verbose)."""
    if xd is None or not xd.per_worker:
        return []
    lines = ["per xdist worker:"]
    for name, w in sorted(xd.per_worker.items()):
        parts = [f"{w.get('files_written', 0)} files written", f"{w.get('compiles', 0)} compiles"]
        if w.get("files_present"):
            parts.insert(1, f"{w['files_present']} already there")
        if w.get("files_refused"):
            parts.insert(1, f"{w['files_refused']} refused")
        if w.get("compiles"):
            parts.append("one compile thread" if w.get("single_compile_thread") else "torch's compile threads")
        if w.get("triton_hits") is not None or w.get("triton_compiled"):
            hits = w.get("triton_hits")
            parts.append(f"Triton {'?' if hits is None else hits} loaded / {w.get('triton_compiled', 0)} compiled")
        lines.append(f"  {name}: " + ", ".join(parts))
    return lines


def _isa_line(t: TorchStats) -> list[str]:
    reused, run = t.isa_checks.get("reused", 0), t.isa_checks.get("run", 0)
    if not reused and not run:
        return []
    return [f"torch's CPU vector-ISA load checks: {reused} taken from an earlier run's record, {run} run"]


def _upload_lines(up: UploadStats, verbose: int, triton: TritonStats | None = None) -> list[str]:
    if up.objects:
        lines = [f"uploaded {_pairs(up.new_entries)} new entries as {human_bytes(up.bytes)} "
                 f"({human_bytes(up.raw_bytes)} raw) in {up.seconds:.2f} s"
                 + (f", compacting {up.compacted} objects" if up.compacted else "")
                 + (f"; {plural(up.superseded, 'object')} of concurrent sessions merged" if up.superseded else "")
                 + (f" ({plural(up.remerged, 'more merged upload')}, {human_bytes(up.remerged_bytes)})"
                    if up.remerged else "")]
    elif up.converged:
        lines = [f"uploaded nothing new; merged the store's {plural(up.converged, 'object')} into "
                 f"{plural(up.merged_objects, 'object')} ({human_bytes(up.merged_bytes)}) in {up.seconds:.2f} s"
                 + (f"; {plural(up.superseded, 'object')} of concurrent sessions merged" if up.superseded else "")]
    else:
        reason = up.reason
        if reason == "nothing was compiled" and triton is not None and (triton.hits or triton.compiled):
            reason = "nothing new"  # torch compiled nothing, Triton's kernels were there already
        lines = [f"uploaded nothing: {reason}"]
    if verbose > 0 and up.files_skipped:
        lines.extend(f"  not carried: {s}" for s in up.files_skipped[:20])
    return lines


def terminal_lines(report: SessionReport, verbose: int = 0, durations: int = 0) -> list[str]:
    if not report.enabled:
        return [f"disabled: {report.reason}"]
    fp, scope = report.fingerprint or {}, report.scope or {}
    lines = [f"fingerprint {fp.get('key')}",
             f"store {report.settings['store']} (mode {report.settings['mode']}, scope {scope.get('write')})"]
    r, ld, t, up = report.restore, report.load, report.torch, report.upload
    if r is None or ld is None or t is None or up is None:
        lines.append("idle: the session never imported torch, so nothing was restored or uploaded")
        return lines + report.notes
    lines += _restore_lines(r, verbose, report.xdist) + _load_line(ld) + _torch_lines(t, report.xdist)
    if durations:
        slow = slowest_uncached(t, durations)
        lines.append(f"slowest {len(slow)} uncached compiles:" if slow else "no test compiled anything uncached")
        lines.extend(f"  {rec['seconds']:7.2f} s  {rec['compiles']:3d} compiles  {nodeid}" for nodeid, rec in slow)
    lines += _upload_lines(up, verbose, t.triton)
    if verbose > 0:
        lines += _worker_lines(report.xdist)
    if verbose > 0 and report.processes:
        lines.append("seconds per process (startup to report; the exit comes after):")
        lines.extend("  " + p.line() for p in report.processes)
    if report.xdist is not None and report.xdist.lost:
        lines.append("xdist workers that handed nothing over (their new artifacts are lost): "
                     + ", ".join(report.xdist.lost))
    lines.extend(report.notes)
    if report.problems:
        lines.append(f"{len(report.problems)} problem(s); the session ran without that part of the cache")
    return lines


def markdown(report: SessionReport, durations: int = 0) -> str:
    out = ["### pytest-megacache", ""]
    out.extend(f"- {line}" if not line.startswith("  ") else f"  - {line.strip()}"
               for line in terminal_lines(report, durations=durations))
    out.extend(f"- :warning: {p}" for p in report.problems)
    return "\n".join(out) + "\n"


def write_json(path: str, report: SessionReport) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, (json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n").encode())


def append_step_summary(report: SessionReport, env: Mapping[str, str] | None = None, durations: int = 0) -> None:
    path = (env if env is not None else os.environ).get("GITHUB_STEP_SUMMARY")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(markdown(report, durations=max(durations, 5)))
