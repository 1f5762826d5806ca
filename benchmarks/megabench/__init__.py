"""The benchmark that ``benchmarks/run.py`` runs, a module per job: the workloads, the pytest runs and their
records, the modes of one workload, the measurements beside them (apart, idle, objects), the tables, the plots
and the command line that runs them in turn.

Importing the package puts on ``sys.path`` what its modules import from this checkout: ``pytest_megacache`` (the
repository's root, for the objects check), ``demo/`` (``local_s3``, the S3 server the demo and the tests use too,
and ``run_demo``'s reader of the plugin's report) and ``benchmarks/`` (``varied``).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository
sys.path.insert(0, str(ROOT))  # pytest_megacache from this checkout, for the objects check
sys.path.insert(0, str(ROOT / "demo"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # varied.py, also when run.py is imported by path (the tests)
