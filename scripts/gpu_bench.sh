#!/usr/bin/env bash
# The benchmarks on a GPU machine that has CUDA torch and triton but maybe no network, with pytest-megacache from
# this checkout (docs/benchmarks.md, "On a GPU machine").
#
#   bash scripts/gpu_bench.sh [run|precompile|core_cpu] [options of that benchmark]
#
# run (the default) is benchmarks/run.py with --device cuda first (your options come after it and win);
# precompile is benchmarks/precompile.py with --device cuda --workload example; core_cpu is benchmarks/core_cpu.py.
# Examples:
#   bash scripts/gpu_bench.sh --workload example mixed --repeats 3 --xdist 2 --plot
#   bash scripts/gpu_bench.sh --workload children ranks --repeats 1 --skip hot naive --no-idle
#   bash scripts/gpu_bench.sh precompile --repeats 1
#
# Before it runs: wheels in .whl/ (what benchmarks/requirements.txt and the plugin need that the machine lacks,
# e.g. boto3, botocore, s3transfer, jmespath, zstandard, moto and its server's dependencies, pytest-xdist) are
# installed into /tmp/megacache-site without resolving dependencies (the machine's torch and its dependencies stay
# as they are); the checkout goes on PYTHONPATH; and the package's child-process .pth file goes into site-packages,
# where pip would put it, so that child processes report their own counters. NO_WHEELS=1 skips the wheels.
# OUT=DIR (optional) keeps the whole log in DIR/bench.log and the results in DIR/bench/.
set -uo pipefail
cd "$(dirname "$0")/.."

bench=run
case "${1:-}" in run|precompile|core_cpu) bench=$1; shift ;; esac

site=/tmp/megacache-site
mkdir -p "$site"
if [ -d .whl ] && [ "${NO_WHEELS:-0}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
purelib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
[ -f "$purelib/pytest_megacache_children.pth" ] || cp pytest_megacache_children.pth "$purelib/" \
  || echo "could not copy pytest_megacache_children.pth into $purelib: child processes will report nothing"

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
python3 - <<'PY'
import torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "not installed"
print("torch", torch.__version__, "| triton", triton_version, "| GPUs", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY

case $bench in
  run) set -- --device cuda ${OUT:+--out "$OUT/bench"} "$@" ;;
  precompile) set -- --device cuda --workload example ${OUT:+--json "$OUT/precompile.json"} "$@" ;;
esac
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  python3 "benchmarks/$bench.py" "$@" 2>&1 | tee "$OUT/bench.log"
else
  python3 "benchmarks/$bench.py" "$@"
fi
