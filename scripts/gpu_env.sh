# Sourced (". scripts/gpu_env.sh") from the repository root by the GPU scripts, on a machine with CUDA torch and
# triton and no internet. It installs the wheels carried in .whl/ (boto3, moto[server], zstandard: the device
# README says how to carry them) into /tmp/site; puts /tmp/site, the checkout and scripts/ on PYTHONPATH; and,
# since the plugin runs from the checkout rather than installed, copies the package's child-process .pth into
# site-packages, where pip would put it, so child interpreters report their own counters
# (pytest_megacache/childhook.py). NO_WHEELS=1 skips the wheels (a machine that already has them). Prints torch's
# and triton's versions and the GPUs.
mkdir -p /tmp/site
if [ -d .whl ] && [ "${NO_WHEELS:-0}" != 1 ]; then
  # --no-deps: .whl/ holds only what the image lacks (its sympy, jinja2, ... stay torch's), as the device README says
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts
megacache_site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp pytest_megacache_children.pth "$megacache_site/" 2>/dev/null || echo "could not copy the .pth into $megacache_site"
# PLUGIN_ON / PLUGIN_OFF: pytest arguments that load the plugin from this checkout (-p), or, where it is installed,
# leave its entry point on / turn it off ("no:nothing" is a placeholder that changes nothing).
read -r PLUGIN_ON PLUGIN_OFF < <(python3 -c "import importlib.metadata as m
i = any(e.name == 'megacache' for e in m.entry_points(group='pytest11'))
print('-pno:nothing -pno:megacache' if i else '-ppytest_megacache.plugin -pno:nothing')")
python3 - <<'PY'
import torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "absent"
print("torch", torch.__version__, "triton", triton_version, "GPUs", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
