"""What the cache did, for people: terminal lines, the JSON report and the GitHub step summary."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .torch_adapter import MISS_COUNTERS, counter_sum  # a light module: it imports no torch

REPORT_SCHEMA = "pytest-megacache/report"
REPORT_VERSION = 2


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def build(*, enabled: bool, reason: str | None, settings: dict[str, Any], fingerprint: dict[str, Any] | None,
          stats: dict[str, Any] | None, problems: list[str], session_seconds: float,
          scope: dict[str, Any] | None = None, notes: list[str] | None = None) -> dict[str, Any]:
    return {
        "schema": REPORT_SCHEMA,
        "version": REPORT_VERSION,
        "enabled": enabled,
        "reason": reason,
        "settings": settings,
        "fingerprint": fingerprint,
        "scope": scope,
        "idle": enabled and stats is None,  # the session never imported torch: nothing restored or uploaded
        "session_seconds": round(session_seconds, 3),
        **(stats or {}),
        "notes": list(notes or []),
        "problems": problems,
    }


def slowest_uncached(report: dict[str, Any], n: int) -> list[tuple[str, dict[str, Any]]]:
    """The ``n`` tests with the most compile seconds that the cache did not cover (tests with misses)."""
    per_test: dict[str, dict[str, Any]] = (report.get("torch") or {}).get("per_test", {})
    missed = [(nodeid, t) for nodeid, t in per_test.items()
              if counter_sum(t["counters"], MISS_COUNTERS) > 0]
    return sorted(missed, key=lambda item: -float(item[1]["seconds"]))[:n]


def _layer_line(t: dict[str, Any]) -> str:
    c = t["counters"]
    parts = [
        f"FX graph {c.get('fxgraph_cache_hit', 0)} hit / {c.get('fxgraph_cache_miss', 0)} miss"
        f" / {c.get('fxgraph_cache_bypass', 0)} bypass",
        f"AOTAutograd {c.get('autograd_cache_hit', 0)} hit / {c.get('autograd_cache_miss', 0)} miss"
        f" / {c.get('autograd_cache_bypass', 0)} bypass",
    ]
    if c.get("dynamo_cache_hit", 0) or c.get("dynamo_cache_miss", 0):
        parts.append(f"Dynamo precompile {c.get('dynamo_cache_hit', 0)} hit / {c.get('dynamo_cache_miss', 0)} miss")
    for layer, used in sorted(t.get("layers", {}).items()):
        if layer not in ("inductor", "aot_autograd"):
            parts.append(f"{layer} {used['used']} of {used['restored']} restored used")
    return "torch: " + ", ".join(parts)


def _pairs(counts: dict[str, int]) -> str:
    return ", ".join(f"{k.split('/', 1)[-1] if k.startswith('torch/') else k} {v}" for k, v in counts.items()) or "none"


def terminal_lines(report: dict[str, Any], verbose: int = 0, durations: int = 0) -> list[str]:
    if not report["enabled"]:
        return [f"disabled: {report['reason']}"]
    fp = report["fingerprint"] or {}
    scope = report.get("scope") or {}
    lines = [f"fingerprint {fp.get('key')}",
             f"store {report['settings']['store']} (mode {report['settings']['mode']}, scope {scope.get('write')})"]
    if "restore" not in report:
        lines.append("idle: the session never imported torch, so nothing was restored or uploaded")
        lines.extend(report.get("notes", []))
        return lines
    r, ld, t, up = report["restore"], report["load"], report["torch"], report["upload"]
    if r["attempted"]:
        status = "" if r["ok"] else " (failed)"
        lines.append(
            f"restored {r['objects_used']}/{r['objects_listed']} objects{status}, {human_bytes(r['bytes_fetched'])} "
            f"in {r['seconds']:.2f} s: {_pairs(r['entries'])}; {r['files_written']} files written"
            + (f", {r['objects_rejected']} objects refused" if r["objects_rejected"] else "")
        )
        if verbose > 0 and r.get("folders"):
            lines.append("  from " + ", ".join(f"{folder} ({n})" for folder, n in r["folders"].items()))
        if r.get("why_miss"):
            lines.append(f"nothing stored for this fingerprint: {r['why_miss']}")
    if ld["called"]:
        lines.append(f"loaded into torch: {_pairs(ld['artifacts'])} in {ld['seconds']:.3f} s"
                     + (f" (the first compile waited {ld['waited']:.2f} s for the restore)"
                        if ld.get("waited", 0) >= 0.05 else "") if ld["ok"]
                     else f"torch did not load the bundle: {ld['error']}")
    xd = report.get("xdist") or {}
    if t["compiled"]:
        lines.append(_layer_line(t))
        lines.append(
            f"{t['compiles']} compiles, {t['compile_seconds']:.2f} s compiling"
            + (f" across {xd['workers']} xdist workers" if xd.get("workers") else "")
            + (f"; about {t['seconds_saved']:.1f} s of cold compiling saved" if t.get("seconds_saved") else "")
            + ("; one compile thread (the cache covers this selection)" if t.get("single_compile_thread") else "")
        )
    else:
        lines.append("torch: nothing was compiled")
    if durations:
        slow = slowest_uncached(report, durations)
        lines.append(f"slowest {len(slow)} uncached compiles:" if slow else "no test compiled anything uncached")
        lines.extend(f"  {rec['seconds']:7.2f} s  {rec['compiles']:3d} compiles  {nodeid}" for nodeid, rec in slow)
    if up["objects"]:
        lines.append(f"uploaded {_pairs(up['new_entries'])} new entries as {human_bytes(up['bytes'])} "
                     f"({human_bytes(up['raw_bytes'])} raw) in {up['seconds']:.2f} s"
                     + (f", compacting {up['compacted']} objects" if up["compacted"] else ""))
    else:
        lines.append(f"uploaded nothing: {up['reason']}")
    if verbose > 0 and up["files_skipped"]:
        lines.extend(f"  not carried: {s}" for s in up["files_skipped"][:20])
    if xd.get("lost"):
        lines.append(f"xdist workers that handed nothing over (their new artifacts are lost): {', '.join(xd['lost'])}")
    lines.extend(report.get("notes", []))
    if report["problems"]:
        lines.append(f"{len(report['problems'])} problem(s); the session ran without that part of the cache")
    return lines


def markdown(report: dict[str, Any], durations: int = 0) -> str:
    out = ["### pytest-megacache", ""]
    out.extend(f"- {line}" if not line.startswith("  ") else f"  - {line.strip()}"
               for line in terminal_lines(report, durations=durations))
    out.extend(f"- :warning: {p}" for p in report["problems"])
    return "\n".join(out) + "\n"


def write_json(path: str, report: dict[str, Any]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)


def append_step_summary(report: dict[str, Any], env: dict[str, str] | None = None, durations: int = 0) -> None:
    path = (env if env is not None else os.environ).get("GITHUB_STEP_SUMMARY")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(markdown(report, durations=max(durations, 5)))
