#!/usr/bin/env bash
# The test suite, from a fresh checkout: builds .venv (CPU torch, moto, boto3, zstandard) and runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
"$PY" -m pytest "$@"
