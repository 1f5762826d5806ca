#!/usr/bin/env bash
# The pytest-megacache demo: a cold and a warm run of example_project's tests against an S3 server on
# loopback, side by side. Builds .venv (CPU torch, the plugin, moto) on first use.
# Usage: bash scripts/demo.sh [--keep] [-- extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
"$PY" demo/run_demo.py "$@"
