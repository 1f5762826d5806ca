"""The small project every torch release is exercised on: its tests and its conftest, written into a temporary
directory and run as real pytest sessions (compat/sessions.py).

Each test stands for one tier of what the plugin carries: a pointwise graph and a training step (FX graphs and
AOTAutograd entries with their C++ kernels), a function compiled for three shapes (a dynamic-shape recompile;
with a job id, torch's dynamic-shape profile), a max-autotune compile, a child process that compiles, and a plain
test. The conftest reads torch's own counters, per test and per process, without the plugin."""

from __future__ import annotations

TESTS = '''
import json
import os
import subprocess
import sys

import torch


def pointwise(x):
    return torch.sin(x) * 2 + 1


def test_pointwise():
    assert torch.allclose(torch.compile(pointwise)(torch.zeros(8)), torch.ones(8))


def test_train():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    loss = torch.compile(model)(torch.ones(3, 4)).sum()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def scale(x):
    return x * 2 + x.sum()


def test_dynamic_recompile():
    # Three shapes: torch compiles a static graph, then (automatic dynamic) a dynamic one that serves the third.
    fn = torch.compile(scale)
    for n in (4, 8, 12):
        assert torch.allclose(fn(torch.ones(n)), torch.full((n,), 2.0 + n))


def mm(a, b):
    return a @ b + 1


def test_max_autotune():
    torch.manual_seed(0)
    a, b = torch.randn(32, 32), torch.randn(32, 32)
    out = torch.compile(mm, mode="max-autotune-no-cudagraphs")(a, b)
    torch.testing.assert_close(out, a @ b + 1)


CHILD = """
import json, os, torch
from torch._dynamo.utils import counters

def child_fn(x):
    return torch.cos(x) + 3

assert torch.allclose(torch.compile(child_fn)(torch.zeros(4)), torch.full((4,), 4.0))
out = os.environ.get("CHILD_COUNTERS_OUT")
if out:
    with open(out, "w") as fh:
        json.dump({g: dict(counters[g]) for g in ("inductor", "aot_autograd")}, fh)
"""


def test_child_process():
    env = dict(os.environ)
    base = os.environ.get("TEST_COUNTERS_OUT")
    if base:
        env["CHILD_COUNTERS_OUT"] = f"{base}.child.{os.getpid()}"
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=600)


def test_plain():
    assert torch.ones(2).sum() == 2


def test_isa_decision():
    """What torch decides about the CPU's vector ISAs (torch 2.14 and later, whose check keeps .load_ok records):
    the valid list, the pick, and every load check that ran. With COMPAT_PRETEND_AMX=1, torch is told this CPU
    has AMX tiles (as an AMX machine's torch would find), for this decision only."""
    import torch._inductor.cpu_vec_isa as m

    probes = []
    real_probe = m.VecISA._probe_load
    saved = (torch.cpu._is_amx_tile_supported, torch.cpu._init_amx)

    def spy(self, output_path):
        probes.append([str(self), output_path])
        return real_probe(self, output_path)

    m.VecISA._probe_load = spy
    if os.environ.get("COMPAT_PRETEND_AMX") == "1":
        torch.cpu._is_amx_tile_supported = lambda: True
        torch.cpu._init_amx = lambda: True
    try:
        m.valid_vec_isa_list.cache_clear()
        valid = [str(isa) for isa in m.valid_vec_isa_list()]
        picked = str(m.pick_vec_isa())
    finally:
        m.VecISA._probe_load = real_probe
        torch.cpu._is_amx_tile_supported, torch.cpu._init_amx = saved
        m.valid_vec_isa_list.cache_clear()
    with open(os.environ["COMPAT_ISA_OUT"], "w") as fh:
        json.dump({"valid": valid, "picked": picked, "probes": probes,
                   "cache_dir": os.environ["TORCHINDUCTOR_CACHE_DIR"]}, fh)
    # A compile with the CPU's own decision, so that the session has something to store.
    assert torch.allclose(torch.compile(pointwise)(torch.zeros(8)), torch.ones(8))
'''

CONFTEST = '''
import json
import os
import sys

import pytest

GROUPS = ("inductor", "aot_autograd", "stats")
PER_TEST = {}


def _counters():
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    return {g: dict(utils.counters[g]) for g in GROUPS}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = _counters()
    yield
    after = _counters()
    PER_TEST[item.name] = {g: {k: v - before.get(g, {}).get(k, 0) for k, v in after.get(g, {}).items()
                               if v != before.get(g, {}).get(k, 0)} for g in GROUPS}


def pytest_sessionfinish(session):
    out = os.environ.get("TEST_COUNTERS_OUT")
    if not out:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        out += "." + os.environ["PYTEST_XDIST_WORKER"]
    with open(out, "w") as fh:
        json.dump({"totals": _counters(), "per_test": PER_TEST, "pid": os.getpid()}, fh)
'''

PYTEST_INI = "[pytest]\naddopts = -p no:cacheprovider\n"
