"""Plot one or more ``results.json`` files written by ``benchmarks/run.py`` into one PNG.

    python benchmarks/plot.py OUT.png RESULTS.json [RESULTS.json ...]

For runs taken in separate calls on the same machine (each file's environment is checked to match).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # the sibling script, found through the path set just above


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, sources = Path(argv[0]), [json.loads(Path(p).read_text()) for p in argv[1:]]
    machines = {bench.env_label(doc["environment"]) for doc in sources}
    if len(machines) != 1:
        print(f"results come from different machines: {sorted(machines)}", file=sys.stderr)
        return 1
    fields = {f.name for f in dataclasses.fields(bench.Run)}
    runs = [bench.Run(**{k: v for k, v in r.items() if k in fields}) for doc in sources
            for w in doc["workloads"] for r in w["runs"]]
    merged: dict[str, Any] = {"workloads": [w for doc in sources for w in doc["workloads"]]}
    out.parent.mkdir(parents=True, exist_ok=True)
    problem = bench.plot(out.parent, merged, runs, sources[0]["environment"])
    if problem:
        print(problem, file=sys.stderr)
        return 1
    (out.parent / "compile_seconds.png").replace(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
