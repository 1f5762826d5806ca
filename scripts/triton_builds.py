"""Count the Triton kernels one run built and found cached, from the example's compile listener log
(EXAMPLE_TRITON_EVENTS, one JSON object per compile): ``python scripts/triton_builds.py EVENTS.jsonl [INDENT]``."""

from __future__ import annotations

import collections
import json
import sys


def main(argv: list[str]) -> None:
    try:
        with open(argv[1], encoding="utf-8") as fh:
            events = [json.loads(line) for line in fh if line.strip()]
    except OSError:
        events = []
    built = collections.Counter(e["name"] for e in events if not e["cache_hit"])
    indent = argv[2] if len(argv) > 2 else "  "
    print(f"{indent}Triton: {len(events) - sum(built.values())} cached, {sum(built.values())} built: {dict(built)}")


if __name__ == "__main__":
    main(sys.argv)
