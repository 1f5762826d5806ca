#!/usr/bin/env bash
# Create (or reuse) .venv with the plugin, its test extras and the CPU build of torch.
# Usage: source scripts/bootstrap.sh   (sets $PY to the venv's python)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGACACHE_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
PY="$venv/bin/python"
stamp="$venv/.megacache-deps"
want="$(cat "$root/pyproject.toml" "$root/constraints-ci.txt" "$root/setup.py" "$root/pytest_megacache_children.pth" | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$PY" -m pip install -q --disable-pip-version-check -c "$root/constraints-ci.txt" \
    "torch==2.13.0" -e "$root[test]" ruff mypy
  echo "$want" > "$stamp"
fi
export PY
