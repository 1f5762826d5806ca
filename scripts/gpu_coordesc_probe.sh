#!/usr/bin/env bash
# Why does a warm (or hot) run tune a max-autotune kernel again although its autotune entry is restored?
# The example's max-autotune test, cold into a directory store, then hot (the cold run's own directories, no
# plugin), then warm (fresh directories restored by the plugin, uploading what it adds), then a second warm run that
# restores both objects. Each run logs Inductor's run-time tuning at DEBUG
# ("Save heuristic|coordesc tuning result", "COORDESC:" benchmarks) and the Triton kernels it built; after each
# run every .best_config file is listed with a digest of its content, so a run that wrote an entry again, or a
# new one beside it, shows up in the diff against the cold run's. SAME_PATH=1 (default) adds a warm run at the cold
# run's own paths (its directories moved away first), as a CI job with a fixed cache directory has. Writes under $OUT.
set -u
OUT=${OUT:-/tmp/coordesc-probe}
mkdir -p "$OUT"; T=$(mktemp -d)
. scripts/gpu_env.sh  # wheels, PYTHONPATH, the child-process .pth
export TORCH_LOGS="+torch._inductor.runtime.triton_heuristics,+torch._inductor.runtime.autotune_cache"
one() {  # name, dirs, plugin args...
  local name=$1 d=$T/$2; shift 2
  mkdir -p "$d/i" "$d/t" "$d/tmp"
  (cd example_project && TORCHINDUCTOR_CACHE_DIR=$d/i TRITON_CACHE_DIR=$d/t TMPDIR=$d/tmp \
     EXAMPLE_TRITON_EVENTS="$OUT/$name-triton.jsonl" \
     python -m pytest -q -s -p no:logging -p no:cacheprovider -m gpu -k autotune "$@" > "$OUT/$name.log" 2>&1)
  echo "== $name rc=$? ($(grep -c 'COORDESC:' "$OUT/$name.log") COORDESC benchmarks;" \
       "$(grep -c 'tuning result to' "$OUT/$name.log") saves)"
  grep -o 'Save [a-z]* tuning result to .*' "$OUT/$name.log" | sed 's/^/   /' | sort | uniq -c
  (cd "$d/i" && find . -name '*.best_config' -exec sh -c 'printf "%s %s %s\n" "$(sha1sum < "$1" | cut -c1-10)" "$1" "$(cat "$1")"' _ {} \; | sort -k2) > "$OUT/$name-best.txt"
  echo "   $(wc -l < "$OUT/$name-best.txt") .best_config files"
  python scripts/triton_builds.py "$OUT/$name-triton.jsonl" "   "
}
one cold cold $PLUGIN_ON --megacache-dir="$T/store"
one hot cold $PLUGIN_OFF
if [ "${SAME_PATH:-1}" = 1 ]; then
  # A fresh runner with the cold run's paths (what a CI job with a fixed cache directory is): the cold run's
  # directories moved away, the same paths restored by the plugin (read-only: the store keeps the cold object only).
  mv "$T/cold" "$T/cold-kept"
  one warm-same-path cold $PLUGIN_ON --megacache-dir="$T/store" --megacache-mode=read
  rm -rf "$T/cold"; mv "$T/cold-kept" "$T/cold"
  later="hot warm-same-path"
fi
one warm warm $PLUGIN_ON --megacache-dir="$T/store"
one warm2 warm2 $PLUGIN_ON --megacache-dir="$T/store" --megacache-mode=read
echo "== .best_config entries that differ from the cold run's (< cold, > the later run):"
for r in ${later:-hot} warm warm2; do echo "-- $r"; diff "$OUT/cold-best.txt" "$OUT/$r-best.txt" | grep '^[<>]' | cut -c1-400; done
