#!/usr/bin/env bash
# Issue 15 on the GPU: (A) which artifacts a warm max-autotune run misses (Triton compiles and Inductor
# autotune-cache lookups logged by scripts/autotune_events.py), cold -> warm x3 -> hot, on fresh directories
# against one directory store; (B) Dynamo's caching precompile (--megacache-precompile) against the default,
# cold then warm. Needs the wheels in .whl/ (boto3, zstandard). Writes under $OUT.
# Part A's AUTOTUNE_EVENTS probe itself makes the max-autotune graph miss (scripts/autotune_events.py): read
# its Triton and autotune events, not its FX hits and misses; scripts/gpu_fxprobe.sh measures those cleanly.
set -u
OUT=${OUT:-/tmp/gpu-issue15}
mkdir -p "$OUT"
. scripts/gpu_env.sh  # wheels, PYTHONPATH (with scripts/), the child-process .pth
T=$(mktemp -d)

report() {  # one line from the plugin's JSON report
  python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
c, t = r["torch"]["counters"], r["torch"]
print(f"  FX {c.get('fxgraph_cache_hit')}/{c.get('fxgraph_cache_miss')} AOT {c.get('autograd_cache_hit')}/"
      f"{c.get('autograd_cache_miss')} compile {t['compile_seconds']:.2f}s one-thread={t['single_compile_thread']} "
      f"restored={r['restore']['entries']} new={r['upload'].get('new_entries')} layers={t.get('layers')}")
for p in r.get("processes", []):
    print("  " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in p.items() if v))
PY
}

if [ "${SKIP_A:-0}" != 1 ]; then
echo "=== A: max-autotune, cold -> warm x3 -> hot"
A=$T/at
at_run() {  # name, dirs, extra args
  local d=$2
  mkdir -p "$d/inductor" "$d/triton" "$d/tmp" "$A/$1"
  local start=$(date +%s.%N)
  (cd example_project && TORCHINDUCTOR_CACHE_DIR=$d/inductor TRITON_CACHE_DIR=$d/triton TMPDIR=$d/tmp \
     AUTOTUNE_EVENTS=$A/$1/events.jsonl MEGACACHE_REPORT=$A/$1/report.json \
     python3 -m pytest -q -p pytest_megacache.plugin -p autotune_events -p no:cacheprovider $3 \
       -m gpu -k max_autotune tests/test_model_gpu.py 2>&1 | tail -2)
  echo "--- $1: wall $(python3 -c "import time; print(round(time.time() - $start, 1))") s"
  python3 scripts/autotune_events.py "$A/$1/events.jsonl"
  report "$A/$1/report.json"
  echo "  best_config files: $(find "$d/inductor" -name '*.best_config' | wc -l)"
  cp "$A/$1/events.jsonl" "$OUT/at-$1-events.jsonl" 2>/dev/null; cp "$A/$1/report.json" "$OUT/at-$1-report.json"
}
at_run cold "$A/cold" "--megacache-dir=$A/store"
for i in 1 2 3; do at_run warm$i "$A/warm$i" "--megacache-dir=$A/store"; done
at_run hot "$A/cold" "--megacache-dir=$A/empty --megacache-mode=read"
fi

if [ "${SKIP_B:-0}" != 1 ]; then
echo "=== B: --megacache-precompile vs default (example -m gpu, not autotune)"
pre_run() {  # name, store, extra
  local d=$T/pre-$1
  mkdir -p "$d/inductor" "$d/triton" "$d/tmp"
  local start=$(date +%s.%N)
  (cd example_project && TORCHINDUCTOR_CACHE_DIR=$d/inductor TRITON_CACHE_DIR=$d/triton TMPDIR=$d/tmp \
     MEGACACHE_REPORT=$OUT/pre-$1.json \
     python3 -m pytest -q -p pytest_megacache.plugin -p no:cacheprovider --megacache-dir="$T/store-$2" $3 \
       -m gpu -k "not autotune" 2>&1 | tail -3)
  echo "--- $1: wall $(python3 -c "import time; print(round(time.time() - $start, 1))") s"
  report "$OUT/pre-$1.json"
}
pre_run cold-off off ""; pre_run warm-off off ""
pre_run cold-on on --megacache-precompile; pre_run warm-on on --megacache-precompile
fi
