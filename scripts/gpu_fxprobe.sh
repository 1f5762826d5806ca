#!/usr/bin/env bash
# Which condition makes the max-autotune graph miss torch's FX-graph cache on a second run? Each line of RUNS is
# "name dirs plugin listener": fresh or reused cache directories (a name), the plugin on a directory store or off,
# Triton's compile listener and the autotune-cache probe (scripts/autotune_events.py) on or off, or "triton": the
# example conftest's Triton listener alone (EXAMPLE_TRITON_EVENTS). Every FX lookup
# is logged (FX_EVENTS). Plugin "keep": on, with torch's compile-worker pool kept. Writes under $OUT.
set -u
OUT=${OUT:-/tmp/gpu-fxprobe}
mkdir -p "$OUT"
. scripts/gpu_env.sh  # wheels, PYTHONPATH (with scripts/), the child-process .pth
T=$(mktemp -d)
python3 - > "$OUT/lookup_source.txt" 2>&1 <<'PY'
import inspect, torch._inductor.codecache as cc
print(inspect.getsource(cc.FxGraphCache._lookup_graph)); print(inspect.getsource(cc.FxGraphCache.cache_hit_post_compile))
PY
RUNS=${RUNS:-"p-cold D1 on off
p-warm D2 on off
p-hot D1 read off
l-cold D3 off on
l-hot D3 off on"}
while read -r name dirs plugin listener; do
  d=$T/$dirs; mkdir -p $d/inductor $d/triton $d/tmp
  args="-p no:megacache"
  [ "$plugin" = on ] && args="-p pytest_megacache.plugin --megacache-dir=$T/store"
  [ "$plugin" = read ] && args="-p pytest_megacache.plugin --megacache-dir=$T/empty --megacache-mode=read"
  [ "$plugin" = keep ] && args="-p pytest_megacache.plugin --megacache-dir=$T/store --megacache-compile-threads=keep"
  lis=""; [ "$listener" = on ] && lis="AUTOTUNE_EVENTS=$OUT/at-$name.jsonl"
  [ "$listener" = triton ] && lis="EXAMPLE_TRITON_EVENTS=$OUT/triton-$name.jsonl"  # the example's listener alone
  (cd example_project && env TORCHINDUCTOR_CACHE_DIR=$d/inductor TRITON_CACHE_DIR=$d/triton TMPDIR=$d/tmp \
     FX_EVENTS=$OUT/fx-$name.jsonl MEGACACHE_REPORT=$OUT/report-$name.json $lis \
     python3 -m pytest -q -p autotune_events -p no:cacheprovider $args ${SELECT:--m gpu -k max_autotune} 2>&1 | tail -1)
  echo "=== $name ($dirs, plugin $plugin, listener $listener)"
  python3 -c "
import json,sys
for l in open('$OUT/fx-$name.jsonl'):
    e=json.loads(l); i=e['info']; print('  fx', e['key'][:10], 'found' if e['found'] else 'MISS', i.get('cache_status_detailed'), {k:v for k,v in i.items() if k not in ('cache_status_detailed','triton_bundler_meta')})
"
  [ -f "$OUT/at-$name.jsonl" ] && python3 scripts/autotune_events.py "$OUT/at-$name.jsonl" | head -3
  [ -f "$OUT/triton-$name.jsonl" ] && python3 -c "
import json, collections
ev = [json.loads(l) for l in open('$OUT/triton-$name.jsonl')]
print('  triton compiles', len(ev), 'misses', dict(collections.Counter(e['name'] for e in ev if not e['cache_hit'])))"
  [ -f "$OUT/report-$name.json" ] && python3 -c "
import json
r = json.load(open('$OUT/report-$name.json')); t = r.get('torch') or {}
print('  compile', round(t.get('compile_seconds', 0), 2), 's; one thread', t.get('single_compile_thread'), '; counters',
      {k: v for k, v in (t.get('counters') or {}).items() if v})
for p in r.get('processes', []):
    print('  ', ', '.join(f'{k} {v:.2f}' if isinstance(v, float) else f'{k} {v}' for k, v in p.items() if v))"
done <<< "$RUNS"
