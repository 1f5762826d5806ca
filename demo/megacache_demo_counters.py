"""A pytest plugin for the demo only (loaded with ``-p megacache_demo_counters``): at the end of the session it
writes torch's own compile-cache counters to the JSON file named by $MEGACACHE_DEMO_COUNTERS.

This reads ``torch._dynamo.utils.counters`` directly, so the demo can check what pytest-megacache reports
against torch itself. It never imports torch: if the session never reached torch's compiler, the file
records that instead.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ENV = "MEGACACHE_DEMO_COUNTERS"
GROUPS = ("inductor", "aot_autograd", "stats")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get(ENV)
    if not target:
        return
    utils = sys.modules.get("torch._dynamo.utils")
    out: dict[str, object] = {"torch_dynamo_imported": utils is not None}
    if utils is not None:
        counters = utils.counters
        out.update({group: {name: int(value) for name, value in sorted(counters[group].items())}
                    for group in GROUPS if group in counters})
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
