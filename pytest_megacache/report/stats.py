"""The figures each part of a session records for its report (:mod:`.report`): the restore, torch's load and
compiles, Triton's kernels, the upload, xdist's workers and where each process's seconds went; and how a
controller folds in the figures its xdist workers hand over (each value checked, as it comes from another
process).

A light module: it imports no torch, zstandard or boto3 (the plugin imports it in every session)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..torch_adapter import TorchAdapter


@dataclass
class RestoreStats:
    attempted: bool = False
    objects_listed: int = 0
    objects_used: int = 0
    objects_rejected: int = 0
    objects_in_memory: int = 0  # fetched or decoded in memory: the scratch directory (TMPDIR) had no room for them
    objects_left_out: int = 0  # no room for them in the scratch directory, too large to hold in memory
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
    strays_removed: int = 0  # temporary files that gone writers (a killed session) left in the cache directories
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
    files_skipped: list[str] = field(default_factory=list)  # files left out of the upload: "<path>: <why>"
    files_skipped_bytes: int = 0
    profiles_merged: int = 0  # dynamic-shape profiles that xdist workers grew apart, merged as torch does
    seconds: float = 0.0


@dataclass
class TritonStats:
    """Triton's kernels in the session (:mod:`pytest_megacache.report.triton`): per process, or summed over xdist
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
    # nodeid -> {"seconds", "backend" (where torch keeps metrics), "compiles", "counters", "artifacts": ["type:key", ...]}
    per_test: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds_saved: float = 0.0  # cold compile seconds recorded for the restored artifacts this session used
    # Dynamo reuse: what the stored Dynamo variants taken in this process took to trace and compile where
    # they were traced (part of seconds_saved)
    dynamo_spared: float = 0.0
    # of those, what their traces took without their backends' compiles, where the variants recorded it: what a run
    # without reuse, whose backends hit torch's caches, spends again
    dynamo_tracing_spared: float = 0.0
    # and what reuse itself cost them (offering, loading, installing: dynamo.cost_seconds), taken off seconds_saved
    dynamo_cost: float = 0.0
    # and the backwards no test ran that it compiled, so that their graphs are stored (dynamo.backwards): their
    # seconds, taken off seconds_saved too
    dynamo_backwards: float = 0.0
    layers: dict[str, dict[str, int]] = field(default_factory=dict)  # type -> restored/used/new
    workers: int = 0
    single_compile_thread: bool = False  # the plugin ran Inductor with one compile thread (the cache covered it)
    # torch cache entries found in the cache directories that no process of the session recorded (compiled by
    # child processes: torchrun, mp.spawn, subprocess), per layer ("inductor": FX graphs, "aot_autograd")
    other_processes: dict[str, int] = field(default_factory=dict)
    # child processes that reported their own counters (children.hook), one dict each: label, pid, ppid, rank,
    # local_rank, world_size, compiles, graphs, compile_seconds, counters
    children: list[dict[str, Any]] = field(default_factory=list)
    # torch's CPU vector-ISA load checks in the session's own processes (isaprobe): taken from a marker ("reused"),
    # run by torch ("run"), markers written ("recorded")
    isa_checks: dict[str, int] = field(default_factory=dict)
    triton: TritonStats | None = None  # Triton's kernels loaded from its cache vs compiled; None: none of either
    # Dynamo reuse: the first detail seen per refusal reason (dynamo), e.g. which guard was unprovable
    dynamo_refusals: dict[str, str] = field(default_factory=dict)
    # Dynamo reuse: each frame a refusal left traced (its function and file:line), with its first reason
    dynamo_refused_frames: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_adapter(cls, adapter: TorchAdapter) -> TorchStats:
        per_test = {
            nodeid: {"seconds": round(t.seconds, 4), "compiles": t.compiles, "counters": dict(t.counters),
                     "artifacts": [f"{typ}:{key}" for typ, key in t.artifacts],
                     **({"backend": round(t.backend, 4)} if t.backend is not None else {})}
            for nodeid, t in adapter.per_test.items()
        }
        from .. import dynamo, isaprobe

        return cls(adapter.compiled_anything(), adapter.compiles, adapter.compile_seconds, adapter.counters(), per_test,
                   isa_checks={k: v for k, v in isaprobe.counts().items() if v},
                   dynamo_refusals=dynamo.refusal_reasons(), dynamo_refused_frames=dynamo.refused_frames(),
                   dynamo_spared=round(max(0.0, dynamo.spared_seconds() - adapter.spared_before), 3),
                   dynamo_tracing_spared=round(max(0.0, dynamo.spared_tracing_seconds() - adapter.tracing_before), 3),
                   dynamo_cost=round(max(0.0, dynamo.cost_seconds() - adapter.cost_before), 3),
                   dynamo_backwards=round(max(0.0, dynamo.completing_seconds() - adapter.completing_before), 3))

    def saved(self, before: Mapping[str, int], after: Mapping[str, int]) -> None:
        """Fold in what this process's Dynamo reuse counted while torch's artifacts were saved (after the counters
        were read): an entry refused because it does not pickle, with its reason's first detail."""
        from .. import dynamo

        for name, n in after.items():
            if name.startswith("dynamo_") and n != before.get(name, 0):
                self.counters[name] = self.counters.get(name, 0) + n - before.get(name, 0)
        for reason, detail in dynamo.refusal_reasons().items():
            self.dynamo_refusals.setdefault(reason, detail)
        self.dynamo_refused_frames.update(dynamo.refused_frames())  # this process's, each frame's reasons now

    def count_use(self, cold: Mapping[tuple[str, str], float], restored: set[tuple[str, str]],
                  ident: Callable[[str], tuple[str, str]], installed: Iterable[tuple[str, str]],
                  restored_counts: Mapping[str, int], prefix: str) -> None:
        """Per layer what was restored and used, and the seconds saved, each test's and the session's: what the
        restored artifacts used (``restored``, object idents; a test's as ``ident`` reads them; Dynamo entries
        ``installed``) cost cold (``cold``) less what their tests still spent in the backend, and what the Dynamo
        variants taken spared less what reuse itself cost (never more than was spared). ``prefix``: of torch's kinds."""
        used: set[tuple[str, str]] = set()
        paid = 0.0  # what the tests that took restored artifacts still spent in the backend (loading them, say)
        for record in self.per_test.values():
            hits = [a for a in map(ident, record["artifacts"]) if a in restored]
            spent = float(record.get("backend", 0.0)) if hits else 0.0
            record["seconds_saved"] = round(max(0.0, sum(cold.get(a, 0.0) for a in hits) - spent), 3)
            used.update(hits)
            paid += spent
        used.update(a for a in installed if a in restored)
        self.seconds_saved = round(max(0.0, sum(cold.get(a, 0.0) for a in used) - paid + self.dynamo_spared
                                       - self.dynamo_cost - self.dynamo_backwards), 3)
        for kind, count in restored_counts.items():
            if kind.startswith(prefix):
                self.layers[kind[len(prefix):]] = {"restored": count, "used": 0}
        for kind, _key in used:
            self.layers.setdefault(kind[len(prefix):], {"restored": 0, "used": 0})["used"] += 1

    def add(self, other: Mapping[str, Any]) -> None:
        """Fold in another process's stats (an xdist worker's, as a dict)."""
        self.workers += 1
        self.compiled = self.compiled or bool(other.get("compiled"))
        self.compiles += int(other.get("compiles", 0))
        self.compile_seconds += float(other.get("compile_seconds", 0.0))
        self.dynamo_spared = round(self.dynamo_spared + float(other.get("dynamo_spared", 0.0)), 3)
        self.dynamo_tracing_spared = round(self.dynamo_tracing_spared + float(other.get("dynamo_tracing_spared", 0.0)), 3)
        self.dynamo_cost = round(self.dynamo_cost + float(other.get("dynamo_cost", 0.0)), 3)
        self.dynamo_backwards = round(self.dynamo_backwards + float(other.get("dynamo_backwards", 0.0)), 3)
        for k, v in dict(other.get("counters", {})).items():
            self.counters[str(k)] = self.counters.get(str(k), 0) + int(v)
        self.per_test.update(dict(other.get("per_test", {})))
        for layer, n in dict(other.get("other_processes", {})).items():
            self.other_processes[str(layer)] = self.other_processes.get(str(layer), 0) + int(n)
        for name, n in dict(other.get("isa_checks", {})).items():
            self.isa_checks[str(name)] = self.isa_checks.get(str(name), 0) + int(n)
        for reason, detail in dict(other.get("dynamo_refusals", {})).items():
            self.dynamo_refusals.setdefault(str(reason), str(detail))
        for frame, reason in dict(other.get("dynamo_refused_frames", {})).items():
            self.dynamo_refused_frames.setdefault(str(frame), str(reason))
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
    the rest of the compile callbacks' time), reused (Dynamo reuse's own time: stored Dynamo variants offered where
    Dynamo was about to trace, taken or passed over, before torch's compile timings start, and stored entries loaded
    and installed where ``torch.compile()`` wrapped a function, taken out of collect or tests), tests (the rest of
    running the tests) and finish (collecting and
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
    reused: float = 0.0
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
