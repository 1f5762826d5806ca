#!/usr/bin/env bash
# The test suite, as CI runs it (.ci/run): builds .venv on first use (scripts/bootstrap.sh), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
# Two pytest-xdist workers: a torch session of the tests keeps about one core busy, so two of them share a 2-core
# runner. The tests of a class share a worker (tests/conftest.py). A worker that crashes ends the run at once
# (a replaced worker could be left waiting); -n 0 after this runs serially.
"$PY" -m pytest -n 2 --max-worker-restart=0 "$@"
