"""The support table's rows from the version suite's verdicts: ``python -m compat.table RESULTS.json...`` prints one
Markdown row per file (``--compat-results`` of ``tox -e torch27`` ... writes them, e.g. ``.tox/compat-results/``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COLUMNS = [
    ("fx_aot", "FX graphs, AOTAutograd"),
    ("cpp_kernels", "C++ kernels"),
    ("xdist", "-n 2"),
    ("child_process", "child process"),
    ("dynamic_shapes", "dynamic-shape recompile"),
    ("max_autotune", "max-autotune"),
    ("pgo", "pgo (job id)"),
    ("isa_check", "vector-ISA check"),
    ("isa_records_gated_by_cpu", "carried ISA record vs. CPU"),
    ("cli", "CLI"),
    ("outcomes", "outcomes vs. plugin off"),
]


def header() -> list[str]:
    names = ["torch (triton)", *(title for _, title in COLUMNS), "suite", "run"]
    return ["| " + " | ".join(names) + " |", "|" + " --- |" * len(names)]


def row(doc: dict[str, Any]) -> str:
    tiers = doc.get("tiers", {})
    cells = [f"{doc.get('torch')} ({doc.get('triton') or '-'})"]
    for name, _ in COLUMNS:
        tier = tiers.get(name)
        cells.append(tier["verdict"] if tier else "-")
    seconds = sum(float(s.get("seconds", 0)) for s in doc.get("sessions", {}).values())
    cells += [f"{seconds:.0f} s in sessions", str(doc.get("date", "?"))]
    return "| " + " | ".join(cells) + " |"


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(header()))
    for path in paths:
        print(row(json.loads(Path(path).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
