"""The tables: each workload's modes side by side with the ratios of their medians against the targets, where
each process's seconds go, and the measurements beside the workloads (apart, idle, objects), as Markdown lines."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from pytest_megacache.report.stats import PHASES  # the plugin's phases, from this checkout

from .console import human_bytes
from .records import Run
from .workloads import Workload

# Targets: (ratio name, bound, comparison); the warm/cold bound depends on the device.
WARM_COLD_TARGET = {"cuda": 0.05, "cpu": 0.2}
WARM_HOT_TARGET = 1.10
# A cold run with the plugin against plain pytest on the same machine (the plugin must not slow a cold run).
COLD_PLAIN_TARGET = 1.05
WARM_COLD_WALL_TARGET = 0.20  # GPU only; on CPU the session wall has no target
MOVED_RAW_TARGET = 0.15
XDIST_WARM_TARGET = 1.0  # a warm -n N run against a warm serial one (session wall)
IDLE_TARGET_MS = 100.0


def _values(runs: list[Run], attr: str) -> list[float]:
    return [float(getattr(r, attr)) for r in runs if r.ok and getattr(r, attr) is not None]


def _median(runs: list[Run], attr: str) -> float | None:
    vals = _values(runs, attr)
    return statistics.median(vals) if vals else None


def _cell(runs: list[Run], attr: str, kind: str) -> str:
    vals = _values(runs, attr)
    if not vals:
        return "n/a"
    fmt: Callable[[float], str] = (lambda v: f"{v:.2f}") if kind == "s" else human_bytes if kind == "b" else (
        lambda v: f"{v:g}")
    med = fmt(statistics.median(vals))
    return med if len(vals) == 1 or min(vals) == max(vals) else f"{med} [{fmt(min(vals))}-{fmt(max(vals))}]"


def _hits(runs: list[Run], hit: str, miss: str) -> str:
    ok = [r for r in runs if r.ok]
    if not ok:
        return "n/a"
    pairs = sorted({f"{getattr(r, hit)}/{getattr(r, miss)}" for r in ok if getattr(r, hit) is not None})
    return ", ".join(pairs) or "-"


def _check(value: float | None, bound: float, strict_less: bool = False) -> str:
    if value is None:
        return "n/a"
    good = value < bound if strict_less else value <= bound
    return "PASS" if good else "MISS"


def workload_tables(wl: Workload, runs: list[Run], repeats: int) -> tuple[list[str], dict[str, Any]]:
    by_mode: dict[str, list[Run]] = {}
    for r in runs:
        by_mode.setdefault(r.mode, []).append(r)
    lines = [f"### {wl.name} ({wl.device}; median [min-max] of {repeats})", "",
             "| mode | runs ok | session wall s | compile s | FX hit/miss | AOT hit/miss | Triton built/cached "
             "| bytes stored (zst / raw) | bytes moved | restore s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, rs in by_mode.items():
        ok = sum(r.ok for r in rs)
        stored = (f"{_cell(rs, 'upload_bytes', 'b')} / {_cell(rs, 'upload_raw_bytes', 'b')}"
                  if mode.startswith("cold") else "")
        moved = _cell(rs, "bytes_moved", "b") if mode in ("naive",) or mode.startswith("warm") else ""
        restore = _cell(rs, "restore_seconds", "s") if mode == "naive" or mode.startswith("warm") else ""
        lines.append(f"| {mode} | {ok}/{len(rs)} | {_cell(rs, 'wall', 's')} | {_cell(rs, 'compile_seconds', 's')} "
                     f"| {_hits(rs, 'fx_hit', 'fx_miss')} | {_hits(rs, 'aot_hit', 'aot_miss')} "
                     f"| {_hits(rs, 'triton_built', 'triton_hits')} | {stored} | {moved} "
                     f"| {restore} |")
    naive = [r for r in by_mode.get("naive", []) if r.ok]
    if naive:
        ex = naive[0].extra
        lines += ["", f"naive: tar {human_bytes(ex.get('tar_bytes'))} raw, tar.zst {human_bytes(ex.get('tar_zst_bytes'))}; "
                      f"pack {statistics.median(r.extra['pack_seconds'] for r in naive):.2f} s, unpack "
                      f"{statistics.median(r.extra['unpack_seconds'] for r in naive):.2f} s (median); restore s = pack + unpack"]
    med = {mode: {attr: _median(rs, attr) for attr in ("compile_seconds", "wall", "bytes_moved", "upload_raw_bytes")}
           for mode, rs in by_mode.items()}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    g = lambda mode, attr: med.get(mode, {}).get(attr)  # noqa: E731
    warm_cold = ratio(g("warm", "compile_seconds"), g("cold", "compile_seconds"))
    cold_plain = ratio(g("cold", "wall"), g("plain", "wall"))
    warm_plain = ratio(g("warm", "wall"), g("plain", "wall"))
    warm_cold_wall = ratio(g("warm", "wall"), g("cold", "wall"))
    wall_bound = WARM_COLD_WALL_TARGET if wl.device == "cuda" else None
    warm_hot = ratio(g("warm", "compile_seconds"), g("hot", "compile_seconds"))
    moved_raw = ratio(g("warm", "bytes_moved"), g("cold", "upload_raw_bytes"))
    moved_naive = ratio(g("warm", "bytes_moved"), g("naive", "bytes_moved"))
    wc_bound = WARM_COLD_TARGET["cuda" if wl.device == "cuda" else "cpu"]
    f = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    ratios = {"cold/plain wall": cold_plain, "warm/plain wall": warm_plain, "warm/cold wall": warm_cold_wall,
              "warm/cold compile": warm_cold, "warm/hot compile": warm_hot, "warm bytes moved / raw": moved_raw,
              "warm bytes moved / naive tar.zst": moved_naive}
    lines += ["", "| ratio (medians) | value | target | result |", "| --- | --- | --- | --- |",
              f"| cold/plain session wall | {f(cold_plain)} | <= {COLD_PLAIN_TARGET} "
              f"| {_check(cold_plain, COLD_PLAIN_TARGET)} |",
              f"| warm/plain session wall | {f(warm_plain)} | - | - |",
              f"| warm/cold session wall | {f(warm_cold_wall)} | "
              + (f"<= {wall_bound} ({wl.device}) | {_check(warm_cold_wall, wall_bound)} |" if wall_bound else "- | - |"),
              f"| warm/cold compile | {f(warm_cold)} | <= {wc_bound} ({wl.device}) | {_check(warm_cold, wc_bound)} |",
              f"| warm/hot compile | {f(warm_hot)} | <= {WARM_HOT_TARGET} | {_check(warm_hot, WARM_HOT_TARGET)} |",
              f"| warm bytes moved / cold raw bytes | {f(moved_raw)} | <= {MOVED_RAW_TARGET} "
              f"| {_check(moved_raw, MOVED_RAW_TARGET)} |",
              f"| warm bytes moved / naive tar.zst | {f(moved_naive)} | < 1 | {_check(moved_naive, 1.0, strict_less=True)} |"]
    xwarm = [r for r in by_mode.get("warm-xdist", []) if r.ok and r.extra.get("downloads") is not None]
    if xwarm:
        downloads = statistics.median(r.extra["downloads"] for r in xwarm)
        ratios["warm-xdist bytes fetched / bytes stored"] = downloads
        ratios["warm-xdist/warm compile"] = ratio(g("warm-xdist", "compile_seconds"), g("warm", "compile_seconds"))
        ratios["warm-xdist/cold-xdist compile"] = ratio(g("warm-xdist", "compile_seconds"),
                                                        g("cold-xdist", "compile_seconds"))
        ratios["warm-xdist/warm wall"] = ratio(g("warm-xdist", "wall"), g("warm", "wall"))
        stored = statistics.median(r.extra["bucket_bytes"] for r in xwarm)
        lines += [f"| warm-xdist bytes fetched / bytes stored ({human_bytes(stored)} in "
                  f"{statistics.median(r.extra['bucket_objects'] for r in xwarm):g} objects) | {f(downloads)} "
                  f"| 1 (one download for all workers) | {_check(abs(downloads - 1.0), 1e-9)} |",
                  f"| warm-xdist/cold-xdist compile | {f(ratios['warm-xdist/cold-xdist compile'])} "
                  f"| <= {wc_bound} ({wl.device}) | {_check(ratios['warm-xdist/cold-xdist compile'], wc_bound)} |",
                  f"| warm-xdist/warm session wall | {f(ratios['warm-xdist/warm wall'])} | <= {XDIST_WARM_TARGET} "
                  f"(never slower than serial) | {_check(ratios['warm-xdist/warm wall'], XDIST_WARM_TARGET)} |"]
    if "warm-auto" in by_mode:
        wa, wk = med["warm-auto"], med["warm-keep"]
        ratios["warm-auto/warm-keep wall"] = ratio(wa["wall"], wk["wall"])
        ratios["warm-auto/warm-keep compile"] = ratio(wa["compile_seconds"], wk["compile_seconds"])
        threads = sorted({str(r.compile_threads) for r in by_mode["warm"] if r.ok}) or ["n/a (no warm run ok)"]
        lines += [f"| warm-auto/warm-keep session wall | {f(ratios['warm-auto/warm-keep wall'])} | (no target) | |",
                  f"| warm-auto/warm-keep compile | {f(ratios['warm-auto/warm-keep compile'])} | (no target) | |",
                  "", f"worker-pool policy: the plain warm run resolved compile_threads to {', '.join(threads)}."]
    if "warm-isa-off" in by_mode:
        off = med["warm-isa-off"]
        ratios["warm/warm-isa-off wall"] = ratio(g("warm", "wall"), off["wall"])
        ratios["warm/warm-isa-off compile"] = ratio(g("warm", "compile_seconds"), off["compile_seconds"])
        lines += [f"| warm/warm-isa-off session wall | {f(ratios['warm/warm-isa-off wall'])} | (no target) | |",
                  f"| warm/warm-isa-off compile | {f(ratios['warm/warm-isa-off compile'])} | (no target) | |"]
    if wl.children:
        counts = sorted({str(r.children) for r in runs if r.ok and r.children is not None}) or ["n/a"]
        lines += ["", f"{wl.name}: the pytest process compiles nothing; compile seconds and hits/misses are the child "
                      f"processes' own records, summed ({', '.join(counts)} children per run)."]
    failures = [r for r in runs if not r.ok]
    if failures:
        lines += ["", "FAILED runs:"]
        lines += [f"- {r.mode}, repeat {r.repeat + 1}: {r.error}" + (f" (log {r.log})" if r.log else "") for r in failures]
    lines.append("")
    phases = phase_rows(runs)
    lines += phase_lines(wl, runs, phases)
    return lines, {"medians": med, "ratios": ratios, "warm_cold_target": wc_bound,
                   "phases": [{"mode": m, "process": p, **v} for m, p, v in phases]}


def _phase_medians(rs: list[Run], process: str) -> dict[str, float] | None:
    """Median seconds per phase of one process (by name: "main", "controller", "gw0", ...) over the runs."""
    rows = [next((p for p in r.processes if p.get("process") == process), None) for r in rs if r.ok]
    rows = [p for p in rows if p is not None]
    if not rows:
        return None
    out = {name: statistics.median(float(p.get(name) or 0.0) for p in rows) for name in (*PHASES, "total")}
    exits = [r.exit_seconds for r in rs if r.ok and r.exit_seconds is not None]
    if process in ("main", "controller") and exits:
        out["exit"] = statistics.median(exits)
    return out


def phase_rows(runs: list[Run]) -> list[tuple[str, str, dict[str, float]]]:
    """(mode, process, median seconds per phase) for every mode with reports, session process first."""
    by_mode: dict[str, list[Run]] = {}
    for r in runs:
        if r.processes:
            by_mode.setdefault(r.mode, []).append(r)
    out = []
    for mode, rs in by_mode.items():
        names = list(dict.fromkeys(str(p.get("process")) for r in rs for p in r.processes))
        for process in names:
            med = _phase_medians(rs, process)
            if med is not None:
                out.append((mode, process, med))
    return out


def phase_lines(wl: Workload, runs: list[Run], rows: list[tuple[str, str, dict[str, float]]]) -> list[str]:
    """The table of :func:`phase_rows` (``rows``), with each mode's session wall from ``runs``."""
    if not rows:
        return []
    cols = [*PHASES, "exit"]
    lines = [f"#### {wl.name}: where each process's seconds go (medians; the plugin's per-process times, exit "
             "measured from outside)", "",
             "| mode | process | " + " | ".join(c.replace("_", " ") for c in cols) + " | sum | session wall |",
             "| --- | --- | " + " | ".join("---" for _ in cols) + " | --- | --- |"]
    walls = {mode: _median([r for r in runs if r.mode == mode], "wall") for mode, _p, _m in rows}
    for mode, process, med in rows:
        cells = [f"{med[c]:.2f}" if c in med else "" for c in cols]
        wall = walls.get(mode)
        lines.append(f"| {mode} | {process} | " + " | ".join(cells) + f" | {sum(med.get(c, 0.0) for c in cols):.2f} "
                     f"| {'' if wall is None or process not in ('main', 'controller') else f'{wall:.2f}'} |")
    lines += ["", "startup: interpreter, pytest, plugins, first conftests (torch's import, when a conftest imports "
              "it); imports: torch and torch._dynamo when the plugin saw them; dynamo / backend / backward: torch's own "
              "split of the compile; exit: interpreter shutdown, Inductor's compile pool included.", ""]
    return lines


def apart_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["### per-process costs measured apart (each a fresh process)", "",
             "| what | median s | runs |", "| --- | --- | --- |"]
    for r in rows:
        med = "n/a" if r["median"] is None else f"{r['median']:.2f}"
        lines.append(f"| {r['what']} | {med} | {', '.join(f'{x:.2f}' for x in r['seconds'])} |")
    return [*lines, ""]


def idle_lines(idle: dict[str, Any]) -> list[str]:
    lines = [f"### idle: a one-test session that compiles nothing (median of {idle['repeats']})", "",
             "| variant | session wall s (median) | plugin cost ms | objects restored | target | result |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, v in idle["variants"].items():
        cost = v.get("cost_ms")
        restored = ", ".join(sorted({str(x) for x in v["objects_restored"]})) or ""
        med = f"{v['median']:.3f}" if "median" in v else "n/a"
        lines.append(f"| {name} | {med} | {'' if cost is None else f'{cost:.1f}'} | {restored} | "
                     f"{'' if cost is None else f'<= {IDLE_TARGET_MS:.0f} ms'} | "
                     f"{'' if cost is None else ('PASS' if cost <= IDLE_TARGET_MS else 'MISS')} |")
    for failure in idle["failures"]:
        lines.append(f"\nFAILED: {failure}")
    lines.append("")
    return lines


def objects_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["### restore time vs objects (same entries; S3 on 127.0.0.1, list + parallel fetch + validate + write)", "",
             "| dataset | entries | raw | 1 object: stored, restore s | 8 objects: stored, restore s | 8/1 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        one, eight = row["split1"], row["split8"]
        lines.append(f"| {row['dataset']} | {row['entries']} | {human_bytes(row['raw_bytes'])} "
                     f"| {human_bytes(one['stored_bytes'])}, {one['median']:.3f} "
                     f"| {human_bytes(eight['stored_bytes'])} ({eight['objects']} objects), {eight['median']:.3f} "
                     f"| {eight['median'] / one['median']:.2f} |")
    lines.append("")
    return lines
