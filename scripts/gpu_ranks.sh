#!/usr/bin/env bash
# Two ranks on two GPUs (issue 18): does the device ordinal enter torch's cache keys, and does the example
# project's 2-rank DDP + torch.compile test (tests/test_distributed.py: torch.multiprocessing.spawn and torchrun)
# hit on every rank in a warm run on fresh directories? Needs zstandard (a wheel in .whl/, see the device README).
# Writes under $OUT. NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 stay as the machine sets them
# (nothing here clears the environment). On a machine with fewer than two GPUs the test runs on gloo (CPU) and
# the key probe is skipped.
set -u
OUT=${OUT:-/tmp/gpu-ranks}
mkdir -p "$OUT"
. scripts/gpu_env.sh  # wheels, PYTHONPATH, the child-process .pth (the ranks report their counters)
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-unset} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST-unset}"
T=$(mktemp -d)

# 1. The key probe: one process per compile; a training step compiled on cuda:0, then on cuda:1 against the
#    cache the first wrote, then on cuda:1 in an empty cache. Prints torch's counters, Triton's compiles and
#    the FX / AOTAutograd entry names each left on disk.
if [ "$GPUS" -ge 2 ]; then
cat > "$T/probe.py" <<'PY'
import json, os, sys, time
import torch
events = []
try:
    import triton.knobs
    def listener(*, src, metadata, metadata_group, times, cache_hit):
        events.append(bool(cache_hit))
    triton.knobs.compilation.listener = listener
except ImportError:
    pass
dev = torch.device(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                            torch.nn.Linear(128, 8)).to(dev)
def step(x):
    loss = model(x).square().mean()
    loss.backward()
    return loss
x = torch.randn(16, 64, device=dev)
start = time.perf_counter()
torch.compile(step)(x)
torch.cuda.synchronize(dev)
seconds = time.perf_counter() - start
from torch._dynamo.utils import counters
root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
entries = {sub: sorted(os.listdir(os.path.join(root, sub))) if os.path.isdir(os.path.join(root, sub)) else []
           for sub in ("fxgraph", "aotautograd")}
print(json.dumps({"device": str(dev), "first_call_s": round(seconds, 2),
                  "fx": [counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]],
                  "aot": [counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_miss"]],
                  "triton_compiles": len(events), "triton_cache_hits": sum(events), "entries_on_disk": entries}))
PY
probe() {  # probe NAME DEVICE CACHE
  mkdir -p "$T/$3/tmp"
  echo "probe $1 ($2, cache $3): $(TORCHINDUCTOR_CACHE_DIR=$T/$3/inductor TRITON_CACHE_DIR=$T/$3/triton TMPDIR=$T/$3/tmp \
     python3 "$T/probe.py" "$2" 2>"$OUT/probe-$1.err" | tail -1)"
}
probe a-cuda0-empty cuda:0 k1
probe b-cuda1-after-cuda0 cuda:1 k1
probe c-cuda1-empty cuda:1 k2
probe d-cuda0-after-cuda1 cuda:0 k2
fi

# 2. The example's distributed test (both launchers), plain pytest, then cold and warm with the plugin on fresh
#    cache directories and a directory store. The session wall is taken around pytest, until it has exited.
# The plugin from this checkout (-p) unless it is installed (then plain pytest turns it off).
if python3 -c "import importlib.metadata as m, sys; sys.exit(not any(e.name == 'megacache' for e in m.entry_points(group='pytest11')))"; then
  LOAD="" UNLOAD="-p no:megacache"
else
  LOAD="-p pytest_megacache.plugin" UNLOAD=""
fi
for r in plain cold warm; do
  d=$T/run-$r
  mkdir -p "$d/inductor" "$d/triton" "$d/tmp"
  plugin="$LOAD --megacache-dir=$T/store"
  [ "$r" = plain ] && plugin="$UNLOAD"
  start=$(date +%s.%N)
  (cd example_project && TORCHINDUCTOR_CACHE_DIR=$d/inductor TRITON_CACHE_DIR=$d/triton TMPDIR=$d/tmp \
     EXAMPLE_CHILD_COUNTERS=$d/ranks MEGACACHE_REPORT=$OUT/report-$r.json \
     python3 -m pytest -q -p no:cacheprovider $plugin tests/test_distributed.py -rA 2>&1 | tail -12)
  end=$(date +%s.%N)
  echo "$r session wall: $(python3 -c "print(round($end - $start, 2))") s"
  python3 - "$d/ranks" "$OUT/report-$r.json" "$r" <<'PY'
import json, pathlib, sys
ranks, report, run = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
for f in sorted(ranks.glob("*.json")):
    c = json.loads(f.read_text())
    ind, aot = c.get("inductor", {}), c.get("aot_autograd", {})
    print(f"{run} {f.stem}: FX {ind.get('fxgraph_cache_hit', 0)} hit / {ind.get('fxgraph_cache_miss', 0)} miss, "
          f"AOTAutograd {aot.get('autograd_cache_hit', 0)} hit / {aot.get('autograd_cache_miss', 0)} miss")
if report.exists():
    doc = json.loads(report.read_text())
    t = doc.get("torch", {})
    for child in t.get("children", []):
        print(f"{run} plugin's record: {child['label']} ppid {child['ppid']}: {child['counters']}, "
              f"{child['compiles']} compiles, {float(child['compile_seconds']):.2f} s compiling")
    print(f"{run} plugin: other_processes {t.get('other_processes')}; restore {json.dumps(doc.get('restore', {}))[:400]}")
    print(f"{run} plugin: upload {json.dumps(doc.get('upload', {}))[:400]}")
PY
done
