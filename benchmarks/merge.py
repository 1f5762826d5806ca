"""Medians over several runs of ``benchmarks/run.py``: pools their records per workload and mode, numbers the
repeats again, and prints the same tables (ratios of medians, per-process phases, plots) that one run with
``--repeats N`` would. For a device whose per-command limit fits one repeat: run ``run.py --repeats 1`` once
per call, then merge the calls' ``results.json`` here.

    python benchmarks/merge.py OUT results1.json results2.json ... [--plot]

Writes ``OUT/results.json`` (the pooled records, each run's environment and command) and ``OUT/results.md``.
Records are merged only from runs on one kind of machine (same GPUs, CPU model and torch): a run from another
machine is refused, because a median across machines measures nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # benchmarks/run.py, beside this script

MACHINE_KEYS = ("cpu", "gpus", "torch", "triton")  # what must agree for records to be pooled
RUN_FIELDS = {f.name for f in dataclasses.fields(bench.Run)}


def machine(env: dict[str, Any]) -> tuple[str, ...]:
    return tuple(json.dumps(env.get(k), sort_keys=True) for k in MACHINE_KEYS)


def pool(docs: list[dict[str, Any]]) -> tuple[dict[str, tuple[dict[str, Any], list[Any]]], int]:
    """{workload name: (its first entry, pooled Runs)}, and the number of repeats pooled."""
    workloads: dict[str, tuple[dict[str, Any], list[Any]]] = {}
    offset = 0
    for doc in docs:
        repeats = int(doc.get("options", {}).get("repeats", 1))
        for w in doc["workloads"]:
            _, runs = workloads.setdefault(w["name"], (w, []))
            for record in w["runs"]:
                fields = {k: v for k, v in record.items() if k in RUN_FIELDS}
                fields["repeat"] = int(fields.get("repeat", 0)) + offset
                runs.append(bench.Run(**fields))
        offset += repeats
    return workloads, offset


def merge(out: Path, paths: list[Path], plot: bool = False) -> dict[str, Any]:
    docs = [json.loads(p.read_text()) for p in paths]
    first = docs[0]["environment"]
    for p, doc in zip(paths[1:], docs[1:], strict=True):
        if machine(doc["environment"]) != machine(first):
            raise SystemExit(f"{p}: measured on another machine or torch than {paths[0]} "
                             f"({', '.join(MACHINE_KEYS)} differ): not merged")
    workloads, repeats = pool(docs)
    results: dict[str, Any] = {"environment": first, "merged_from": [str(p) for p in paths],
                               "commands": [doc.get("argv") for doc in docs],
                               "environments": [doc["environment"] for doc in docs], "workloads": [],
                               "apart": next((doc["apart"] for doc in docs if doc.get("apart")), None),
                               "notes": [n for doc in docs for n in doc.get("notes", [])]}
    md = ["# pytest-megacache benchmark (merged)", "", f"{bench.env_label(first)}; {len(paths)} runs of "
          f"`python benchmarks/run.py`, {repeats} repeats pooled: " + "; ".join(
              f"{doc['environment'].get('date', '?')}: `{' '.join(doc.get('argv') or [])}`" for doc in docs), ""]
    all_runs: list[Any] = []
    for name, (entry, runs) in workloads.items():
        wl = bench.Workload(name, bench.ROOT, list(entry.get("tests", [])), bench.ROOT / "pyproject.toml",
                            entry.get("device", "cpu"), bool(entry.get("children", False)))
        lines, summary = bench.workload_tables(wl, runs, repeats)
        results["workloads"].append({"name": name, "device": wl.device, "tests": wl.args, "children": wl.children,
                                     **summary,
                                     "runs": [r.__dict__ for r in runs]})
        all_runs += runs
        md += lines
    if results["apart"]:
        md += bench.apart_lines(results["apart"])
    md += [f"- note: {n}" for n in dict.fromkeys(results["notes"])] + [""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text("\n".join(md))
    print("\n".join(md))
    if plot:
        note = bench.plot(out, results, all_runs, first)
        if note:
            print(f"note: {note}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the merged results.json and results.md")
    parser.add_argument("results", nargs="+", type=Path, help="results.json files of benchmarks/run.py")
    parser.add_argument("--plot", action="store_true", help="draw the plots (needs matplotlib)")
    opts = parser.parse_args(argv)
    merge(opts.out, opts.results, opts.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
