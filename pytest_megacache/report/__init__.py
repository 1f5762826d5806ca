"""What a session counts and tells: the figures each phase records (:mod:`.stats`, Triton's in :mod:`.triton`), and
this module, the family's front door: one typed session report (:class:`SessionReport`), rendered as terminal
lines, the JSON report and the GitHub step summary.

A light family: it imports no torch, zstandard or boto3 (the plugin imports it in every session)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..fsutil import write_atomic
from ..torch_adapter import MISS_COUNTERS, counter_sum  # a light module: it imports no torch
from .findings import unstorable_note, unused_note
from .stats import (
    LoadStats,
    ProcessTimes,
    RestoreStats,
    TorchStats,
    TritonStats,
    UploadStats,
    XdistStats,
    as_count,
    process_age,
)
from .triton import TritonWatch
from .triton import figures as triton_figures

# The report's own names, and the stats it is made of (from :mod:`.stats`, Triton's from :mod:`.triton`), importable
# from here: the rest of the package imports the family from here.
__all__ = [
    "REPORT_SCHEMA", "REPORT_VERSION", "LoadStats", "ProcessTimes", "RestoreStats", "SessionReport", "TorchStats",
    "TritonStats", "TritonWatch", "UploadStats", "XdistStats", "append_step_summary", "as_count", "asked_verbosity",
    "dynamo_reuse_text",
    "human_age", "human_bytes", "markdown", "plural", "process_age", "slowest_uncached", "terminal_lines",
    "triton_figures", "unstorable_note", "unused_note", "write_json",
]

REPORT_SCHEMA = "pytest-megacache/report"
REPORT_VERSION = 2


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
    """``Dynamo reuse 7 frames reused / 2 traced (78 % reused) / 1 refused (code changed 1), 5 entries loaded, 2
    stored``: frames that took a stored variant instead of being traced, frames Dynamo traced (and the share
    reused), stored entries or variants refused (per reason), entries loaded where a function was wrapped, frames
    stored; empty where Dynamo reuse is off."""
    refused = {name.removeprefix("dynamo_refused_").replace("_", " "): n for name, n in c.items()
               if name.startswith("dynamo_refused_") and n}
    frames, loaded, traced = c.get("dynamo_frames_reused", 0), c.get("dynamo_reused", 0), c.get("dynamo_traced", 0)
    if not (frames or loaded or traced or refused):
        return ""
    why = f" ({', '.join(f'{k} {v}' for k, v in sorted(refused.items()))})" if refused else ""
    share = f" ({round(100 * frames / (frames + traced))} % reused)" if frames + traced else ""
    return (f"Dynamo reuse {frames} frames reused / {traced} traced{share} / {sum(refused.values())} refused{why}, "
            f"{loaded} entries loaded, {c.get('dynamo_stored', 0)} stored")


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
             + (f", {r.objects_rejected} objects refused" if r.objects_rejected else "")
             + (f", {r.objects_in_memory} decoded in memory" if r.objects_in_memory else "")
             + (f", {r.objects_left_out} left out (no room in TMPDIR)" if r.objects_left_out else "")]
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


def _child_isa(child: dict[str, Any]) -> str:
    isa = child.get("isa_checks") or {}
    if not (isa.get("run") or isa.get("reused")):
        return ""
    return f"; vector-ISA checks {isa.get('run', 0)} run / {isa.get('reused', 0)} reused, {isa.get('seconds', 0):.2f} s"


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
              f"{float(child['compile_seconds']):.2f} s{_child_isa(child)}" for child in t.children[:MAX_CHILD_LINES]]
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
    if up.files_skipped:
        lines.append(f"left out of the upload: {plural(len(up.files_skipped), 'file')} "
                     f"({human_bytes(up.files_skipped_bytes)}), first {up.files_skipped[0][:200]}")
    if verbose > 0 and up.files_skipped:
        lines.extend(f"  not carried: {s}" for s in up.files_skipped[:20])
    return lines


def terminal_lines(report: SessionReport, verbose: int = 0, durations: int = 0) -> list[str]:
    """The session's summary: by default what was restored and from where, the cache's hits and the frames reused, the
    compiling and the seconds saved, what was uploaded (at most 4 lines), and a line counting the problems; with
    ``verbose`` (``pytest -v``) everything: the fingerprint, the load, each layer's and each process's figures, the
    notes. ``durations``: the slowest uncached compiles, as asked."""
    if report.enabled and verbose <= 0:
        return _short_lines(report, durations)
    return full_lines(report, verbose, durations)


def asked_verbosity(config: Any) -> int:
    """The verbosity asked for in this run (``config``: pytest's): its verbosity, less what the project's own ini
    ``addopts`` set (``-vv`` there says how the project lists its tests, not that each run wants every line of this
    summary); ``-v`` on the command line or in ``PYTEST_ADDOPTS`` unfolds it."""
    try:
        addopts = [str(option) for option in config.getini("addopts")]
    except (ValueError, TypeError):
        addopts = []
    project = 0
    for option in addopts:
        if option in ("--verbose", "--quiet"):
            project += 1 if option == "--verbose" else -1
        elif len(option) > 1 and option[0] == "-" and set(option[1:]) in ({"v"}, {"q"}):
            project += (len(option) - 1) * (1 if option[1] == "v" else -1)
    return int(config.get_verbosity()) - project


def full_lines(report: SessionReport, verbose: int = 0, durations: int = 0) -> list[str]:
    """Every line of the summary (the step summary's, and the terminal's under ``pytest -v``; ``verbose`` adds the
    folders restored from, each xdist worker's and each process's figures)."""
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
    lines += _slowest(t, durations) + _upload_lines(up, verbose, t.triton)
    if verbose > 0:
        lines += _worker_lines(report.xdist)
    if verbose > 0 and report.processes:
        lines.append("seconds per process (startup to report; the exit comes after):")
        lines.extend("  " + p.line() for p in report.processes)
    lines += _lost(report)
    lines.extend(report.notes)
    return lines + _problems(report)


def _short_lines(report: SessionReport, durations: int) -> list[str]:
    r, t, up = report.restore, report.torch, report.upload
    if r is None or report.load is None or t is None or up is None:
        return ["idle: the session never imported torch, so nothing was restored or uploaded"]
    store = f"{report.settings['store']} (scope {(report.scope or {}).get('write')})"
    restored = _restore_lines(r, 0, report.xdist)
    if not restored:
        line = f"restored nothing from {store}"
    else:
        line = f"{restored[0]}, from {store}" + (f"; nothing stored for this fingerprint: {r.why_miss}" if r.why_miss else "")
    torch_lines = _torch_lines(t, report.xdist)[:2 if t.compiled else 1]  # the hits, the compiling and saved
    return [line, *torch_lines, *_slowest(t, durations), _upload_lines(up, 0, t.triton)[0], *_lost(report),
            *_problems(report)]


def _slowest(t: TorchStats, durations: int) -> list[str]:
    if not durations:
        return []
    slow = slowest_uncached(t, durations)
    return [f"slowest {len(slow)} uncached compiles:" if slow else "no test compiled anything uncached",
            *(f"  {rec['seconds']:7.2f} s  {rec['compiles']:3d} compiles  {nodeid}" for nodeid, rec in slow)]


def _lost(report: SessionReport) -> list[str]:
    if report.xdist is None or not report.xdist.lost:
        return []
    return ["xdist workers that handed nothing over (their new artifacts are lost): " + ", ".join(report.xdist.lost)]


def _problems(report: SessionReport) -> list[str]:
    if not report.problems:
        return []
    return [f"{len(report.problems)} problem(s); the session ran without that part of the cache"]


def markdown(report: SessionReport, durations: int = 0) -> str:
    out = ["### pytest-megacache", ""]
    out.extend(f"- {line}" if not line.startswith("  ") else f"  - {line.strip()}"
               for line in full_lines(report, durations=durations))
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
