#!/usr/bin/env bash
# What torch's CPU vector-ISA probe costs a process on this host, and what TORCHINDUCTOR_VEC_ISA_OK=1 (the user's
# opt-out of the probe, part of torch's FX-graph key) changes. 1. Apart, each in a fresh process: `import torch`
# (what torch <= 2.11's probe child pays per ISA candidate), the probe (`valid_vec_isa_list()`) in an empty cache
# directory, again with its libraries present (as a restore leaves them), and with TORCHINDUCTOR_VEC_ISA_OK=1; with
# the ISA each way picks. 2. The example's CPU tests cold then warm through the plugin (a directory store), without
# and with TORCHINDUCTOR_VEC_ISA_OK=1 set in both runs. Writes under $OUT.
set -u
OUT=${OUT:-/tmp/isa-probe}
mkdir -p "$OUT"; T=$(mktemp -d)
. scripts/gpu_env.sh  # wheels, PYTHONPATH, the child-process .pth
PROBE='import time, torch._inductor.cpu_vec_isa as m; t = time.perf_counter(); l = m.valid_vec_isa_list(); s = time.perf_counter() - t
imports = "\nimport torch" in m.VecISA._avx_py_load
print(f"{s:.2f} s; valid {[str(i) for i in l]}; picked {m.pick_vec_isa()}; the probe child imports torch: {imports}")'
echo "== apart (fresh processes)"
for i in 1 2; do printf 'import torch: '; python -c 'import time; t = time.perf_counter(); import torch; print(f"{time.perf_counter() - t:.2f} s")'; done
for i in 1 2; do
  d=$T/apart$i; mkdir -p "$d/i" "$d/tmp"
  printf 'probe, empty cache dir: ';        TORCHINDUCTOR_CACHE_DIR=$d/i TMPDIR=$d/tmp python -c "$PROBE"
  printf 'probe, libraries present: ';     TORCHINDUCTOR_CACHE_DIR=$d/i TMPDIR=$d/tmp python -c "$PROBE"
  printf 'probe, TORCHINDUCTOR_VEC_ISA_OK=1 (empty dir): '
  mkdir -p "$d/j"; TORCHINDUCTOR_VEC_ISA_OK=1 TORCHINDUCTOR_CACHE_DIR=$d/j TMPDIR=$d/tmp python -c "$PROBE"
done
one() {  # name, store, extra env...
  local name=$1 store=$2 d=$T/$1; shift 2
  mkdir -p "$d/i" "$d/t" "$d/tmp"
  local start=$(date +%s.%N)
  (cd example_project && env "$@" TORCHINDUCTOR_CACHE_DIR=$d/i TRITON_CACHE_DIR=$d/t TMPDIR=$d/tmp \
     python -m pytest -q -p no:cacheprovider $PLUGIN_ON tests/test_model_cpu.py --megacache-dir="$T/$store" \
       --megacache-report="$OUT/$name.json" > "$OUT/$name.log" 2>&1)
  local rc=$? end=$(date +%s.%N)
  python - "$OUT/$name.json" "$name" "$rc" "$start" "$end" <<'PY'
import json, sys
path, name, rc, start, end = sys.argv[1:]
try:
    r = json.load(open(path)); c = r["torch"]["counters"]
    p = (r.get("processes") or [{}])[0]
    detail = (f"FX {c.get('fxgraph_cache_hit')}/{c.get('fxgraph_cache_miss')} AOT {c.get('autograd_cache_hit')}/"
              f"{c.get('autograd_cache_miss')}; compile {r['torch'].get('compile_seconds', 0):.2f} s; backend "
              f"{p.get('backend', 0):.2f} s, dynamo {p.get('dynamo', 0):.2f} s; problems {r.get('problems')}")
except (OSError, ValueError, KeyError, IndexError) as e:
    detail = f"no report ({e!r})"
print(f"{name}: rc={rc} wall {float(end) - float(start):.1f} s; {detail}")
PY
}
echo "== example CPU tests through the plugin"
one cold-default store-default A=1
one warm-default store-default A=1
one cold-isa-ok store-isa-ok TORCHINDUCTOR_VEC_ISA_OK=1
one warm-isa-ok store-isa-ok TORCHINDUCTOR_VEC_ISA_OK=1
