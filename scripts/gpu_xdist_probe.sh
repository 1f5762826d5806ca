#!/usr/bin/env bash
# Which test misses in a warm `pytest -n 2` run? Cold once into a directory store, then warm K times on
# fresh cache directories; prints each warm run's per-test FX/AOT misses from the plugin's report, and the Triton
# kernels each run built rather than found in its cache (the example's listener, EXAMPLE_TRITON_EVENTS).
# SERIAL=1 adds one warm run without -n, from the same store; XDIST=0 runs every session without -n.
set -u
OUT=${OUT:-/tmp/xdist-probe}; K=${K:-4}; MARK=${MARK:-gpu}
mkdir -p "$OUT"; T=$(mktemp -d)
. scripts/gpu_env.sh  # wheels, PYTHONPATH, the child-process .pth
one() {
  local d=$T/$1; mkdir -p "$d/i" "$d/t" "$d/tmp"
  local workers="-n 2"; { [ "${1#serial}" != "$1" ] || [ "${XDIST:-1}" = 0 ]; } && workers=""
  (cd example_project && TORCHINDUCTOR_CACHE_DIR=$d/i TRITON_CACHE_DIR=$d/t TMPDIR=$d/tmp \
     EXAMPLE_TRITON_EVENTS="$OUT/$1-triton.jsonl" \
     python -m pytest -v -p pytest_megacache.plugin -p no:cacheprovider $workers -m "$MARK" \
       --megacache-dir="$T/store" --megacache-report="$OUT/$1.json" > "$OUT/$1.log" 2>&1)
  echo "$1 rc=$?"
  python - "$OUT/$1.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); c = r["torch"]["counters"]
print("  FX", c.get("fxgraph_cache_hit"), "/", c.get("fxgraph_cache_miss"), "AOT", c.get("autograd_cache_hit"), "/",
      c.get("autograd_cache_miss"), "upload", r["upload"]["objects"], r["upload"].get("new_entries"), "profiles merged", r["upload"].get("profiles_merged"), "problems", r.get("problems"))
for node, t in sorted(r["torch"].get("per_test", {}).items()):
    tc = t.get("counters", {})
    print(f"  {node}: compiles {t.get('compiles')} {t.get('seconds', 0):.2f}s FX {tc.get('fxgraph_cache_hit', 0)}/{tc.get('fxgraph_cache_miss', 0)}"
          f" AOT {tc.get('autograd_cache_hit', 0)}/{tc.get('autograd_cache_miss', 0)} {[a for a in t.get('artifacts', []) if not a.startswith('inductor')][:6]}")
PY
  python scripts/triton_builds.py "$OUT/$1-triton.jsonl" "  "
  grep -o '\[gw[0-9]\] .*PASSED.*\|\[gw[0-9]\] .*FAILED.*' "$OUT/$1.log" | sed 's/^/    /'
}
one cold
for k in $(seq "$K"); do one "warm$k"; done
[ "${SERIAL:-0}" = 1 ] && one serial-warm
