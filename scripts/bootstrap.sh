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
# Triton, for the tests that compile real Triton kernels (for a CUDA target: no GPU needed) in their pytest
# processes: a folder of its own beside the venv's packages, never among them (where Triton is importable the plugin
# carries its cache directory, which other tests do not expect); those tests put it on PYTHONPATH. Linux only
# (Triton's wheels); the stamp is the folder's completion marker.
triton_version=3.6.0
triton_dir="$venv/triton-$triton_version"
if [ "$(uname -s)" = Linux ] && [ ! -f "$triton_dir/.complete" ]; then
  rm -rf "$triton_dir.partial"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$triton_dir.partial" "triton==$triton_version"
  touch "$triton_dir.partial/.complete"
  rm -rf "$triton_dir"
  mv "$triton_dir.partial" "$triton_dir"
fi
export PY
