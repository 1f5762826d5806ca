"""Per-process costs no cache entry covers, each measured apart in a fresh process: ``import torch``,
``import torch._dynamo`` and torch's CPU vector-ISA check, without and with the plugin's reuse of its records."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from .console import say
from .runner import Dirs, Runner

ISA_CHECK = "CPU vector-ISA check (valid_vec_isa_list)"
APART = {
    "import torch": "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)",
    "import torch._dynamo (torch already imported)":
        "import time, torch; t = time.perf_counter(); import torch._dynamo; print(time.perf_counter() - t)",
    ISA_CHECK: "import time, torch._inductor.cpu_vec_isa as m; t = time.perf_counter(); "
               "m.valid_vec_isa_list(); print(time.perf_counter() - t)",
    # With the plugin's reuse of torch's load check (pytest_megacache/isaprobe.py): the first process records each
    # check, the second takes them from the records.
    ISA_CHECK + ", the plugin's reuse": "import time, torch._inductor.cpu_vec_isa as m; "
                                        "from pytest_megacache import isaprobe; isaprobe.install(m); "
                                        "t = time.perf_counter(); m.valid_vec_isa_list(); "
                                        "print(time.perf_counter() - t)",
}


def bench_apart(runner: Runner, work: Path, repeats: int) -> list[dict[str, Any]]:
    """Each snippet in a fresh process (the benchmark's clean environment), ``repeats`` times: the vector-ISA check
    once in an empty cache directory (what a cold run pays) and once in the directory the first one filled (what a
    run pays whose restore brought the check's libraries)."""
    rows = []
    for name, code in APART.items():
        variants = ([("fresh cache dir", True), ("its libraries present", False)] if name == ISA_CHECK
                    else [("fresh cache dir: records written", True), ("libraries and records present", False)]
                    if name.startswith(ISA_CHECK) else [("", True)])
        for label, fresh in variants:
            seconds = []
            for i in range(repeats):
                root = work / "apart" / f"{len(rows)}-{i}"
                dirs = Dirs.fresh(root)
                if not fresh:
                    prev = work / "apart" / f"{len(rows) - 1}-{i}"
                    dirs = Dirs(prev / "inductor-cache", prev / "triton-cache", dirs.tmp)
                env = {**runner.env, "TORCHINDUCTOR_CACHE_DIR": str(dirs.inductor), "TRITON_CACHE_DIR": str(dirs.triton),
                       "TMPDIR": str(dirs.tmp)}
                proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      timeout=runner.timeout)
                try:
                    seconds.append(float(proc.stdout.strip().splitlines()[-1]))
                except (ValueError, IndexError):
                    say(f"apart: {name} failed: {proc.stderr.strip()[-300:]}")
            rows.append({"what": name + (f" ({label})" if label else ""), "seconds": seconds,
                         "median": statistics.median(seconds) if seconds else None})
            say(f"  {rows[-1]['what']}: " + ", ".join(f"{x:.2f} s" for x in seconds))  # as it goes: a slow host
    return rows
