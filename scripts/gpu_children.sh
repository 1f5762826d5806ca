#!/usr/bin/env bash
# GPU proof for child processes: a test whose compile runs only in a child Python process on CUDA, cold then
# warm on fresh cache directories, against a directory store. The child writes torch's own counters and its
# compile seconds; the session's wall is measured around pytest. Needs zstandard (a wheel in .whl/, see the
# device README). Writes under $OUT.
set -u
OUT=${OUT:-/tmp/gpu-children}
mkdir -p "$OUT"
. scripts/gpu_env.sh  # wheels, PYTHONPATH, the child-process .pth
T=$(mktemp -d)
P=$T/project
mkdir -p "$P"
cat > "$P/kid.py" <<'EOF'
import json, os, sys, time
import torch

def step(model, x):
    loss = model(x).square().mean()
    loss.backward()
    return loss

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
                            torch.nn.Linear(512, 64)).cuda()
compiled = torch.compile(step)
x = torch.randn(32, 256, device="cuda")
start = time.perf_counter()
compiled(model, x)
torch.cuda.synchronize()
seconds = time.perf_counter() - start
from torch._dynamo.utils import counters
with open(sys.argv[1], "w") as fh:
    json.dump({"first_call_seconds": round(seconds, 3), "inductor": dict(counters["inductor"]),
               "aot_autograd": dict(counters["aot_autograd"])}, fh)
EOF
cat > "$P/test_kid.py" <<'EOF'
import os, subprocess, sys
from pathlib import Path

import torch  # the pytest process imports torch (so the restore starts at collection) but compiles nothing

def test_compile_in_a_child_on_cuda():
    assert torch.cuda.is_available()
    subprocess.run([sys.executable, str(Path(__file__).with_name("kid.py")), os.environ["KID_OUT"]], check=True)
EOF
for r in cold warm; do
  d=$T/$r
  mkdir -p "$d/inductor" "$d/triton" "$d/tmp"
  start=$(date +%s.%N)
  (cd "$P" && TORCHINDUCTOR_CACHE_DIR=$d/inductor TRITON_CACHE_DIR=$d/triton TMPDIR=$d/tmp KID_OUT=$OUT/kid-$r.json \
     MEGACACHE_REPORT=$OUT/report-$r.json python3 -m pytest -q -p pytest_megacache.plugin -p no:cacheprovider \
     --megacache-dir="$T/store" 2>&1 | tail -9)
  end=$(date +%s.%N)
  echo "$r session wall: $(python3 -c "print(round($end - $start, 2))") s"
  echo "$r child: $(cat "$OUT/kid-$r.json")"
  echo "$r children in the plugin's report: $(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['torch'].get('children'))" "$OUT/report-$r.json")"
done
