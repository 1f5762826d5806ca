"""What the cache did, for people: terminal lines, the JSON report and the GitHub step summary."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPORT_SCHEMA = "pytest-megacache/report"
REPORT_VERSION = 1


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def build(*, enabled: bool, reason: str | None, settings: dict[str, Any], fingerprint: dict[str, Any] | None,
          stats: dict[str, Any] | None, problems: list[str], session_seconds: float) -> dict[str, Any]:
    return {
        "schema": REPORT_SCHEMA,
        "version": REPORT_VERSION,
        "enabled": enabled,
        "reason": reason,
        "settings": settings,
        "fingerprint": fingerprint,
        "session_seconds": round(session_seconds, 3),
        **(stats or {}),
        "problems": problems,
    }


def _pairs(counts: dict[str, int]) -> str:
    return ", ".join(f"{k.split('/', 1)[-1] if k.startswith('torch/') else k} {v}" for k, v in counts.items()) or "none"


def terminal_lines(report: dict[str, Any], verbose: int = 0) -> list[str]:
    if not report["enabled"]:
        return [f"disabled: {report['reason']}"]
    fp = report["fingerprint"] or {}
    lines = [f"fingerprint {fp.get('key')}", f"store {report['settings']['store']} (mode {report['settings']['mode']})"]
    r, ld, t, up = report["restore"], report["load"], report["torch"], report["upload"]
    if r["attempted"]:
        status = "" if r["ok"] else " (failed)"
        lines.append(
            f"restored {r['objects_used']}/{r['objects_listed']} objects{status}, {human_bytes(r['bytes_fetched'])} "
            f"in {r['seconds']:.2f} s: {_pairs(r['entries'])}; {r['files_written']} files written"
            + (f", {r['objects_rejected']} objects refused" if r["objects_rejected"] else "")
        )
    if ld["called"]:
        lines.append(f"loaded into torch: {_pairs(ld['artifacts'])} in {ld['seconds']:.3f} s" if ld["ok"]
                     else f"torch did not load the bundle: {ld['error']}")
    c = t["counters"]
    if t["compiled"]:
        lines.append(
            f"torch: FX graph {c.get('fxgraph_cache_hit', 0)} hits / {c.get('fxgraph_cache_miss', 0)} misses"
            f" / {c.get('fxgraph_cache_bypass', 0)} bypasses, AOTAutograd {c.get('autograd_cache_hit', 0)} hits"
            f" / {c.get('autograd_cache_miss', 0)} misses; {t['compiles']} compiles, {t['compile_seconds']:.2f} s compiling"
        )
    else:
        lines.append("torch: nothing was compiled")
    if up["objects"]:
        lines.append(f"uploaded {_pairs(up['new_entries'])} new entries as {human_bytes(up['bytes'])} "
                     f"({human_bytes(up['raw_bytes'])} raw) in {up['seconds']:.2f} s"
                     + (f", compacting {up['compacted']} objects" if up["compacted"] else ""))
    else:
        lines.append(f"uploaded nothing: {up['reason']}")
    if verbose > 0 and up["files_skipped"]:
        lines.extend(f"  not carried: {s}" for s in up["files_skipped"][:20])
    if report["problems"]:
        lines.append(f"{len(report['problems'])} problem(s); the session ran without that part of the cache")
    return lines


def markdown(report: dict[str, Any]) -> str:
    out = ["### pytest-megacache", ""]
    out.extend(f"- {line}" for line in terminal_lines(report))
    out.extend(f"- :warning: {p}" for p in report["problems"])
    return "\n".join(out) + "\n"


def write_json(path: str, report: dict[str, Any]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)


def append_step_summary(report: dict[str, Any], env: dict[str, str] | None = None) -> None:
    path = (env if env is not None else os.environ).get("GITHUB_STEP_SUMMARY")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(markdown(report))
