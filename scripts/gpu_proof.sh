#!/usr/bin/env bash
# GPU proof on a machine with CUDA torch + triton and no internet: wheels for boto3, moto and zstandard
# travel in .whl/ (pip download --python-version 3.12 --only-binary=:all: ...). Writes under $OUT.
set -u
OUT=${OUT:-/tmp/gpu-proof}
mkdir -p "$OUT"
. scripts/gpu_env.sh  # wheels, PYTHONPATH, the child-process .pth
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

[ "${SKIP_KERNEL:-0}" = 1 ] || {
# 1. The user @triton.jit kernel: cold, then warm on fresh dirs restored from a directory store.
T=$(mktemp -d)
kernel_run() {
  local d=$T/$1
  mkdir -p "$d/inductor" "$d/triton" "$d/tmp"
  (cd example_project && TORCHINDUCTOR_CACHE_DIR=$d/inductor TRITON_CACHE_DIR=$d/triton TMPDIR=$d/tmp \
     EXAMPLE_TRITON_EVENTS=$d/events.jsonl MEGACACHE_REPORT=$d/report.json \
     python -m pytest -q -p pytest_megacache.plugin -p no:cacheprovider --megacache-dir="$T/store" \
       -m gpu tests/test_kernels.py 2>&1 | tail -8)
  echo "--- triton compile events ($1):"; cat "$d/events.jsonl" 2>/dev/null
  cp "$d/report.json" "$OUT/kernel-$1-report.json" 2>/dev/null
}
kernel_run cold
kernel_run warm
}

# 2. Dynamo's caching precompile (opt-in): cold then warm with --megacache-precompile, vs a plain warm.
pre_run() {
  local d=$T/pre-$1
  mkdir -p "$d/inductor" "$d/triton" "$d/tmp"
  (cd example_project && TORCHINDUCTOR_CACHE_DIR=$d/inductor TRITON_CACHE_DIR=$d/triton TMPDIR=$d/tmp \
     MEGACACHE_REPORT=$OUT/precompile-$1.json \
     python -m pytest -q -p pytest_megacache.plugin -p no:cacheprovider --megacache-dir="$T/store-$2" $3 \
       -m gpu -k "not autotune" 2>&1 | tail -6)
}
if [ "${SKIP_PRECOMPILE:-0}" != 1 ]; then
  pre_run cold-on on --megacache-precompile; pre_run warm-on on --megacache-precompile
  pre_run cold-off off --megacache-mode=readwrite; pre_run warm-off off --megacache-mode=readwrite
fi

# 3. Benchmarks: cold / warm (S3) / hot / naive side by side.
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
# REPEATS (default 1) and BENCH_ARGS (say "--xdist 2 --plot") pass through; BENCH_OUT names the results folder.
# The whole log goes to $OUT/bench.log as it is written, so a call cut off by its time limit still returns it.
python benchmarks/run.py --device cuda --workload ${WORKLOADS:-example} --n ${NS:-10} --repeats ${REPEATS:-1} --no-idle \
  --out "${BENCH_OUT:-$OUT/bench}" --objects-repeats 1 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -${TAIL:-60}
