"""Compiles in child processes (subprocess, torch.multiprocessing.spawn) are restored and stored.

A child compiles into the cache directories it inherits; torch writes its FX-graph and AOTAutograd entries
there, and the session carries the ones no process of it recorded (nor restored) as files, so a warm run
puts them in place before the first test and the child hits. Hits and misses are read from each child's own
torch counters. One child kills itself with SIGKILL right after compiling: the session passes and the others'
work is stored."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import bundle as bundlemod

from ..helpers_torch import Run, TorchProject, skip_without_torch

skip_without_torch()
pytestmark = pytest.mark.torch

KID = textwrap.dedent(
    """
    import json, os, signal, sys

    import torch

    FUNCS = {
        "subprocess": lambda x: torch.cos(x) * 3 + 1,
        "spawn": lambda x: torch.tanh(x) - 2,
        "killed": lambda x: torch.exp(x) + 5,
    }

    def compile_and_report(name):
        assert torch.compile(FUNCS[name])(torch.zeros(4)).shape == (4,)
        from torch._dynamo.utils import counters
        doc = {"inductor": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"])}
        with open(os.path.join(os.environ["KID_COUNTERS"], name + ".json"), "w") as fh:
            json.dump(doc, fh)
        if name == "killed":
            os.kill(os.getpid(), signal.SIGKILL)

    def spawned(rank, name):
        compile_and_report(name)

    if __name__ == "__main__":
        compile_and_report(sys.argv[1])
    """
)

TESTS = textwrap.dedent(
    """
    import os, subprocess, sys
    from pathlib import Path

    KID = str(Path(__file__).with_name("kid.py"))

    def test_subprocess():
        subprocess.run([sys.executable, KID, "subprocess"], check=True)

    def test_killed_child_does_not_fail_the_session():
        proc = subprocess.run([sys.executable, KID, "killed"])
        assert proc.returncode == -9
    """
)

# In a second file, so that `-n 2 --dist loadfile` gives each worker children of its own.
SPAWN_TESTS = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    def test_spawn():
        import torch.multiprocessing as mp
        sys.path.insert(0, str(Path(__file__).parent))
        import kid
        mp.spawn(kid.spawned, args=("spawn",), nprocs=1, join=True)
    """
)

PLUGIN_TEMP = ("pytest-megacache-", "megacache-children-")


def kid_counters(run: Run, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((run.root / "kids" / f"{name}.json").read_text())
    return doc


def isa_checks(run: Run) -> list[tuple[int, int]]:
    """(run, reused) of torch's vector-ISA checks in each child of the session report."""
    assert run.report is not None
    return [(c["isa_checks"]["run"], c["isa_checks"]["reused"]) for c in run.report["torch"]["children"]]


def children_by_counters(run: Run) -> list[tuple[int, int]]:
    """(FX hits, FX misses) of each child in the session report."""
    assert run.report is not None
    return [(c["counters"]["fxgraph_cache_hit"], c["counters"]["fxgraph_cache_miss"])
            for c in run.report["torch"]["children"]]


def run_with_kids(project: TorchProject, *args: str) -> Run:
    kids = project.pytester.path / f"run{project.runs + 1}" / "kids"
    kids.mkdir(parents=True)
    return project.run(*args, env={"KID_COUNTERS": str(kids)})


def plugin_temp(run: Run) -> list[str]:
    """What the plugin left in the run's TMPDIR (its staging and spool folders are named so)."""
    return sorted(p.name for p in (run.root / "tmp").iterdir() if p.name.startswith(PLUGIN_TEMP))


def kid_project(pytester: pytest.Pytester, store: Path) -> TorchProject:
    pytester.makepyfile(kid=KID, test_spawned=SPAWN_TESTS)
    return TorchProject(pytester, env={"MEGACACHE_DIR": str(store)}, tests=TESTS)


def test_compiles_in_child_processes_are_stored_and_hit_warm(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Default settings. This project's pytest process imports torch only inside the last test (mp.spawn): the
    restore and the snapshot of the cache directories start with the session, and the first child compiles before
    pytest's own process has imported torch."""
    store = tmp_path / "store"
    project = kid_project(pytester, store)
    cold = run_with_kids(project, "-v")  # -v: the summary's lines on child processes
    cold.result.assert_outcomes(passed=3)
    for name in ("subprocess", "spawn", "killed"):
        assert kid_counters(cold, name)["inductor"].get("fxgraph_cache_miss") == 1
    assert cold.report is not None and cold.report["upload"]["objects"] == 1, cold.report and cold.report["upload"]
    # The children's FX graphs (one each, the killed child's included: it was written before the kill).
    assert cold.report["torch"]["other_processes"]["inductor"] == 3
    cold.result.stdout.fnmatch_lines(["child processes compiled *3 FX graphs* that this session did not*"])
    # Each child that exited normally reported its own counters (childhook: the .pth installed with the package);
    # the SIGKILLed one could not. They match what the children read from torch themselves.
    cold_children = children_by_counters(cold)
    assert sorted(cold_children) == [(0, 1), (0, 1)], cold.report["torch"]["children"]
    assert [kid_counters(cold, n)["inductor"]["fxgraph_cache_miss"] for n in ("subprocess", "spawn")] == [1, 1]
    cold.result.stdout.fnmatch_lines(["2 child process(es) compiled: FX 0 hit / 2 miss*", "  pid *: FX 0 hit / 1 miss*"])
    # torch's vector-ISA checks ran in the first child that compiled, which recorded them; a later child took the
    # records (the session's decision digest is theirs): every check is counted, run or reused.
    cold_isa = isa_checks(cold)
    assert sum(ran for ran, _ in cold_isa) >= 1 and all(ran + reused >= 1 for ran, reused in cold_isa), cold_isa
    [obj] = list(store.rglob("*.mcb"))
    names = {e.name for e in bundlemod.decode(obj.read_bytes())[1]}
    assert sum(name.startswith("fxgraph/") for name in names) == 3
    assert not cold.megacache_warnings(), cold.result.outlines[-20:]

    warm = run_with_kids(project, "-n", "2", "--dist", "loadfile", "-v")  # -v: the children's lines
    warm.result.assert_outcomes(passed=3)
    for name in ("subprocess", "spawn", "killed"):
        counters = kid_counters(warm, name)["inductor"]
        assert counters.get("fxgraph_cache_hit", 0) >= 1 and counters.get("fxgraph_cache_miss", 0) == 0, (name, counters)
    assert warm.report is not None and warm.report["upload"]["objects"] == 0, warm.report["upload"]
    # The children of xdist workers report to the controller's spool too.
    assert sorted(children_by_counters(warm)) == [(1, 0), (1, 0)], warm.report["torch"]["children"]
    # Their vector-ISA checks came from the records carried from the cold run: none ran.
    warm_isa = isa_checks(warm)
    assert all(ran == 0 and reused >= 1 for ran, reused in warm_isa), warm_isa
    warm.result.stdout.fnmatch_lines(["  pid *; vector-ISA checks 0 run / * reused*"])
    assert not warm.megacache_warnings(), warm.result.outlines[-20:]
    assert plugin_temp(warm) == []  # the staging folder and the spool are gone
    assert len(list(store.rglob("*.mcb"))) == 1  # nothing uploaded twice


def test_children_of_xdist_workers_are_stored_and_hit_warm(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Cold under `-n 2`, each worker with children of its own (one file each), none of the workers compiling
    itself but through mp.spawn's import: what the children compiled is handed over and stored once; a serial warm
    run hits it all."""
    store = tmp_path / "store"
    project = kid_project(pytester, store)
    cold = run_with_kids(project, "-n", "2", "--dist", "loadfile")
    cold.result.assert_outcomes(passed=3)
    assert cold.report is not None
    assert len({child["ppid"] for child in cold.report["torch"]["children"]}) == 2, cold.report["torch"]["children"]
    assert cold.report["upload"]["objects"] == 1, cold.report["upload"]
    assert cold.report["torch"]["other_processes"]["inductor"] == 3, cold.report["torch"]
    [obj] = list(store.rglob("*.mcb"))
    names = [e.name for e in bundlemod.decode(obj.read_bytes())[1]]
    assert sum(name.startswith("fxgraph/") for name in names) == 3  # each child's graph, once
    assert not cold.megacache_warnings(), cold.result.outlines[-20:]
    assert plugin_temp(cold) == []

    warm = run_with_kids(project)
    warm.result.assert_outcomes(passed=3)
    for name in ("subprocess", "spawn", "killed"):
        counters = kid_counters(warm, name)["inductor"]
        assert counters.get("fxgraph_cache_hit", 0) >= 1 and counters.get("fxgraph_cache_miss", 0) == 0, (name, counters)
    assert warm.report is not None and warm.report["upload"]["objects"] == 0, warm.report["upload"]
