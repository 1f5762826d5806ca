#!/usr/bin/env bash
# What torch's CPU vector-ISA probe costs a process on this host, and what the plugin's reuse of its load check
# (pytest_megacache/isaprobe.py, on by default; MEGACACHE_REUSE_ISA_CHECK=no turns it off) changes, side by side.
# 1. Apart, each in a fresh process: `import torch`; the probe (`valid_vec_isa_list()`) in an empty cache directory,
#    again with its libraries present (as a restore leaves them), then with the reuse installed: a first process
#    that runs the checks and records them, a second that takes them from the records. Each prints the ISAs torch
#    found valid, the one it picked and its compile flags (they must agree every way).
#    APART=0 leaves this part out.
# 2. The example's CPU tests through the plugin (a directory store): one cold run, then warm on fresh directories with
#    the reuse on and off, then warm with -n 2 both ways. Writes under $OUT.
set -u
OUT=${OUT:-/tmp/isa-probe}
mkdir -p "$OUT"; T=$(mktemp -d)
. scripts/gpu_env.sh  # wheels, PYTHONPATH, the child-process .pth
PROBE='import sys, time, torch._inductor.cpu_vec_isa as m
if sys.argv[1] == "reuse":
    from pytest_megacache import isaprobe
    assert isaprobe.install(m) is None
t = time.perf_counter(); l = m.valid_vec_isa_list(); s = time.perf_counter() - t
p = m.pick_vec_isa()
from pytest_megacache import isaprobe
print(f"{s:.2f} s; valid {[str(i) for i in l]}; picked {p} flags {p.build_arch_flags()!r}; checks {isaprobe.counts()}")'
if [ "${APART:-1}" = 1 ]; then
echo "== apart (fresh processes)"
for i in 1 2; do printf 'import torch: '; python -c 'import time; t = time.perf_counter(); import torch; print(f"{time.perf_counter() - t:.2f} s")'; done
for i in ${APART_REPEATS:-1}; do
  d=$T/apart$i; mkdir -p "$d/i" "$d/j" "$d/tmp"
  printf 'probe, empty cache dir: ';                 TORCHINDUCTOR_CACHE_DIR=$d/i TMPDIR=$d/tmp python -c "$PROBE" torch
  printf 'probe, libraries present: ';              TORCHINDUCTOR_CACHE_DIR=$d/i TMPDIR=$d/tmp python -c "$PROBE" torch
  printf 'reuse, empty cache dir (records): ';       TORCHINDUCTOR_CACHE_DIR=$d/j TMPDIR=$d/tmp python -c "$PROBE" reuse
  printf 'reuse, libraries and records present: ';  TORCHINDUCTOR_CACHE_DIR=$d/j TMPDIR=$d/tmp python -c "$PROBE" reuse
done
fi
one() {  # name, store, pytest args, extra env...
  local name=$1 store=$2 args=$3 d=$T/$1; shift 3
  mkdir -p "$d/i" "$d/t" "$d/tmp"
  local start=$(date +%s.%N)
  (cd example_project && env "$@" TORCHINDUCTOR_CACHE_DIR=$d/i TRITON_CACHE_DIR=$d/t TMPDIR=$d/tmp \
     python -m pytest -q -p no:cacheprovider $PLUGIN_ON $args tests/test_model_cpu.py --megacache-dir="$T/$store" \
       --megacache-report="$OUT/$name.json" > "$OUT/$name.log" 2>&1)
  local rc=$? end=$(date +%s.%N)
  python - "$OUT/$name.json" "$name" "$rc" "$start" "$end" <<'PY'
import json, sys
path, name, rc, start, end = sys.argv[1:]
try:
    r = json.load(open(path)); t = r["torch"]; c = t["counters"]
    backend = sum(p.get("backend", 0) for p in r.get("processes") or [])
    detail = (f"FX {c.get('fxgraph_cache_hit')}/{c.get('fxgraph_cache_miss')} AOT {c.get('autograd_cache_hit')}/"
              f"{c.get('autograd_cache_miss')}; compile {t.get('compile_seconds', 0):.2f} s; backend {backend:.2f} s "
              f"(all processes); ISA checks {t.get('isa_checks')}; problems {r.get('problems')}")
except (OSError, ValueError, KeyError, IndexError) as e:
    detail = f"no report ({e!r})"
print(f"{name}: rc={rc} wall {float(end) - float(start):.1f} s; {detail}")
PY
}
echo "== example CPU tests through the plugin"
# One cold run fills the store; the warm runs restore the same objects with the reuse on, then off (with it off
# the plugin installs nothing in torch, and the records that travelled are never read).
one cold-on store "" MEGACACHE_REUSE_ISA_CHECK=yes
one warm-on store "" MEGACACHE_REUSE_ISA_CHECK=yes
one warm-off store "" MEGACACHE_REUSE_ISA_CHECK=no
one warm-n2-on store "-n 2" MEGACACHE_REUSE_ISA_CHECK=yes
one warm-n2-off store "-n 2" MEGACACHE_REUSE_ISA_CHECK=no
