"""Triton's kernels in the report: loaded from the restored cache vs compiled, per session and per xdist worker.

The real sessions compile ``@triton.jit`` kernels with Triton 3.6 for a CUDA target (``triton.compile`` with a
``GPUTarget``: Triton's own front end and its bundled ptxas, no GPU), from the folder ``scripts/bootstrap.sh``
installs Triton into (never the venv's packages: where Triton is importable the plugin carries its cache directory,
which other tests do not expect); their pytest processes get it on PYTHONPATH. The rest runs without Triton: a
stand-in module where the listener's chaining is the point, the report's own types otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from pytest_megacache import report as reportmod
from pytest_megacache.bundle import Entries, Entry
from pytest_megacache.errors import BundleError
from pytest_megacache.files import FileRoot, relocate_triton_group
from pytest_megacache.report.stats import LoadStats, RestoreStats, TorchStats, TritonStats, XdistStats
from pytest_megacache.report.triton import TritonWatch, figures, kernel_folders
from pytest_megacache.xdist.staging import Takeover

TRITON_DIR = Path(sys.prefix) / "triton-3.6.0"  # scripts/bootstrap.sh


# --- the listener, chained in front of the one that was set ------------------------------------------------------


def fake_triton(monkeypatch: pytest.MonkeyPatch, listener: Any = None, knobs: bool = True) -> SimpleNamespace:
    """An imported ``triton`` whose ``knobs.compilation.listener`` is ``listener`` (none at all: ``knobs=False``,
    as in Triton 3.3)."""
    compilation = SimpleNamespace(listener=listener)
    module = ModuleType("triton")
    module.__version__ = "3.6.0" if knobs else "3.3.1"  # type: ignore[attr-defined]
    if knobs:
        module.knobs = SimpleNamespace(compilation=compilation)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "triton", module)
    return compilation


def compile_event(folder: Path, hit: bool, micros: int = 250_000) -> dict[str, Any]:
    """What ``triton.compiler.compile`` passes its listener (Triton 3.4 to 3.9), for a kernel in ``folder``."""
    name = folder.name.lower()
    return {"src": object(), "metadata": {"hash": folder.name}, "cache_hit": hit,
            "metadata_group": {f"{name}.json": str(folder / f"{name}.json"), f"{name}.cubin": str(folder / f"{name}.cubin")},
            "times": SimpleNamespace(total=micros)}


def test_the_listener_is_chained_to_the_one_set_before_and_put_back(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    theirs: list[dict[str, Any]] = []

    def user_listener(**kwargs: Any) -> None:
        theirs.append(kwargs)

    compilation = fake_triton(monkeypatch, user_listener)
    watch = TritonWatch()
    watch.install()  # Triton is imported already: chained at once
    assert compilation.listener is not user_listener
    compilation.listener(**compile_event(tmp_path / "AAAA", hit=False))
    compilation.listener(**compile_event(tmp_path / "BBBB", hit=True))
    assert [e["cache_hit"] for e in theirs] == [False, True]  # the user's listener sees every call, as it was made
    assert watch.seen() == {str(tmp_path / "AAAA"): False, str(tmp_path / "BBBB"): True}
    assert watch.compile_seconds == pytest.approx(0.25)  # Triton's own timing of the one compile
    watch.uninstall()
    assert compilation.listener is user_listener


def test_the_chained_listener_keeps_its_own_outcome_and_ours_never_fails_a_compile(monkeypatch: pytest.MonkeyPatch,
                                                                                     tmp_path: Path) -> None:
    def failing(**kwargs: Any) -> None:
        raise RuntimeError("the user's listener fails")

    compilation = fake_triton(monkeypatch, failing)
    watch = TritonWatch()
    watch.install()
    with pytest.raises(RuntimeError, match="the user's listener fails"):  # as without the plugin
        compilation.listener(**compile_event(tmp_path / "AAAA", hit=False))
    assert watch.seen() == {str(tmp_path / "AAAA"): False}
    with pytest.raises(RuntimeError, match="the user's listener fails"):  # nothing of ours escapes: it reaches theirs
        compilation.listener(metadata_group=42, metadata=None, cache_hit="odd", times=object())
    assert watch.seen() == {str(tmp_path / "AAAA"): False}
    watch.uninstall()
    assert compilation.listener is failing


def test_no_listener_set_before_is_put_back_as_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    compilation = fake_triton(monkeypatch, None)
    watch = TritonWatch()
    watch.install()
    compilation.listener(**compile_event(tmp_path / "AAAA", hit=True))
    watch.uninstall()
    watch.uninstall()  # twice (the session's end and unconfigure): harmless
    assert compilation.listener is None
    assert not watch.displaced


def test_a_listener_set_over_ours_stays_and_makes_hits_unknown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    compilation = fake_triton(monkeypatch, None)
    watch = TritonWatch()
    watch.install()

    def later(**kwargs: Any) -> None:
        pass

    compilation.listener = later  # a fixture's own, set during the session
    watch.uninstall()
    assert compilation.listener is later  # never replaced silently
    assert watch.displaced
    root = tmp_path / "triton"
    (root / "NEWK").mkdir(parents=True)
    (root / "NEWK" / "__grp__k.json").write_text("{}")
    stats = figures(watch, session_at(root, before=set()))
    assert stats is not None and stats.hits is None and stats.compiled == 1
    assert stats.hits_unknown == "another compilation listener took the place of this plugin's during the session"


def test_triton_without_a_listener_says_hits_unknown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_triton(monkeypatch, knobs=False)  # Triton 3.3: compiles tell no listener
    watch = TritonWatch()
    watch.install()
    assert watch.listener_missing == "Triton 3.3.1 has no compilation listener (Triton 3.4 and later have one)"
    root = tmp_path / "triton"
    for folder in ("OLD", "NEW1", "NEW2"):
        (root / folder).mkdir(parents=True)
        (root / folder / f"__grp__{folder.lower()}.json").write_text("{}")
    (root / "LAUNCHER").mkdir()
    (root / "LAUNCHER" / "cuda_utils.so").write_bytes(b"\x7fELF")  # a launcher module: no kernel
    stats = figures(watch, session_at(root, before={"OLD/__grp__old.json"}))
    assert stats is not None
    assert (stats.counted, stats.hits, stats.compiled) == ("cache directory", None, 2)  # the folders new this session
    lines = reportmod._triton_lines(stats, None)
    assert lines == ["Triton kernels: 2 compiled; hits unknown: Triton 3.3.1 has no compilation listener (Triton 3.4 "
                     "and later have one)"]


def test_the_import_hook_chains_when_triton_is_imported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    package = tmp_path / "site" / "triton"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from types import SimpleNamespace\n__version__ = '3.9.0'\n"
                                         "def user(**kwargs): pass\nknobs = SimpleNamespace(compilation="
                                         "SimpleNamespace(listener=user))\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    watch = TritonWatch()
    watch.install()
    try:
        # Asking whether Triton is installed imports nothing (the plugin and torch both ask): the hook waits.
        assert importlib.util.find_spec("triton") is not None and "triton" not in sys.modules
        import triton  # type: ignore[import-not-found]  # the stand-in above

        assert triton.knobs.compilation.listener is not triton.user
        watch.uninstall()
        assert triton.knobs.compilation.listener is triton.user
    finally:
        watch.uninstall()
        sys.modules.pop("triton", None)


# --- what the figures say, from the listener and the cache directory ---------------------------------------------


def session_at(root: Path, before: set[str], restored: Entries | None = None) -> Any:
    """What :func:`figures` reads of a CacheSession: its triton root, the snapshot after the restore, the restore."""
    triton = FileRoot("triton", root)
    return SimpleNamespace(roots=[triton], before={triton.kind: before}, restored=restored or Entries())


def test_figures_tell_loaded_from_compiled_and_what_the_restore_brought(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    root = tmp_path / "triton"
    restored = Entries()
    for folder in ("REST1", "REST2", "LOCAL", "POOL", "MISS"):
        (root / folder).mkdir(parents=True)
        (root / folder / f"__grp__{folder.lower()}.json").write_text("{}")
        if folder.startswith("REST"):
            restored.add(Entry("file/triton", f"{folder}/__grp__{folder.lower()}.json", b"{}"))
    before = {"REST1/__grp__rest1.json", "REST2/__grp__rest2.json", "LOCAL/__grp__local.json"}  # the rest is new
    compilation = fake_triton(monkeypatch, None)
    watch = TritonWatch()
    watch.install()
    compilation.listener(**compile_event(root / "REST1", hit=True))  # restored, loaded
    compilation.listener(**compile_event(root / "LOCAL", hit=True))  # on disk before the session, loaded
    compilation.listener(**compile_event(root / "POOL", hit=True))  # compiled this session by another process
    compilation.listener(**compile_event(root / "MISS", hit=False))  # compiled here
    watch.uninstall()
    stats = figures(watch, session_at(root, before, restored))
    assert stats == TritonStats(counted="listener", hits=2, hits_restored=1, compiled=2, compile_seconds=0.25,
                                restored=2, hits_unknown=None)
    assert reportmod._triton_lines(stats, None) == [
        "Triton kernels: 2 loaded from the cache (1 restored), 2 compiled in 0.25 s; 2 kernels restored"]


def test_nothing_to_tell_without_triton_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    watch = TritonWatch()  # Triton never imported, nothing new in its directory, nothing restored
    assert figures(watch, session_at(tmp_path, before=set())) is None
    assert kernel_folders(["A/__grp__a.json", "A/a.cubin", "__grp__top.json", "B/c/__grp__d.json"]) == {"A"}


# --- a group file restored into another directory ----------------------------------------------------------------


def test_a_restored_group_file_names_the_files_of_its_own_folder(tmp_path: Path) -> None:
    """Triton keeps a kernel's files by absolute path in its group file and counts the kernel as cached only where
    every one exists: restored as stored into another directory, every kernel missed."""
    cold = "/home/runner/.triton/cache/HASH"
    group = json.dumps({"child_paths": {"k.json": f"{cold}/k.json", "k.cubin": f"{cold}/k.cubin"}}).encode()
    root = FileRoot("triton", tmp_path / "warm")
    refused: list[str] = []
    assert root.restore([Entry("file/triton", "HASH/__grp__k.json", group),
                         Entry("file/triton", "HASH/k.json", b"{}")], refused) == (2, 0)
    written = json.loads((tmp_path / "warm" / "HASH" / "__grp__k.json").read_text())
    assert written == {"child_paths": {"k.json": str(tmp_path / "warm" / "HASH" / "k.json"),
                                       "k.cubin": str(tmp_path / "warm" / "HASH" / "k.cubin")}}
    assert refused == []


@pytest.mark.parametrize(("data", "why"), [
    (b"not json", "not JSON"),
    (b"{}", "not a Triton group file"),
    (json.dumps({"child_paths": {"../../etc/k.json": "/x"}}).encode(), "unsafe file path"),
    (json.dumps({"child_paths": {"sub/k.json": "/x"}}).encode(), "not a file of its folder"),
])
def test_a_group_file_that_is_not_one_is_refused(tmp_path: Path, data: bytes, why: str) -> None:
    with pytest.raises(BundleError, match=why):
        relocate_triton_group("HASH/__grp__k.json", data, tmp_path)
    refused: list[str] = []
    assert FileRoot("triton", tmp_path).restore([Entry("file/triton", "HASH/__grp__k.json", data)], refused) == (0, 0)
    assert len(refused) == 1 and not (tmp_path / "HASH" / "__grp__k.json").exists()


# --- the xdist controller: its workers' figures, merged ----------------------------------------------------------


def worker_output(written: int, hits: int | None, compiled: int, single: bool, loaded: int) -> dict[str, Any]:
    triton = TritonStats(counted="listener" if hits is not None else "cache directory", hits=hits, hits_restored=hits or 0,
                         compiled=compiled, restored=5, hits_unknown=None if hits is not None else "no listener")
    torch = TorchStats(compiled=True, compiles=2, single_compile_thread=single, triton=triton)
    from dataclasses import asdict

    return {"object": None, "problems": [],
            "torch": {k: v for k, v in asdict(torch).items() if k != "layers"},
            "restore": asdict(RestoreStats(attempted=True, ok=True, files_written=written, files_present=1,
                                           files_refused=["HASH/k.so: truncated"])),
            "load": asdict(LoadStats(called=True, ok=True, artifacts={"inductor": loaded}, seconds=0.5, waited=0.2))}


def test_the_controller_reports_its_workers_figures() -> None:
    takeover = Takeover("fp")
    takeover.take("gw0", worker_output(written=10, hits=3, compiled=0, single=True, loaded=4), None)
    takeover.take("gw1", worker_output(written=12, hits=2, compiled=1, single=True, loaded=4), None)
    restore, load = RestoreStats(attempted=True, ok=True), LoadStats()
    takeover.fold(restore, load)
    assert (restore.files_written, restore.files_present) == (22, 2)
    assert restore.files_refused == ["[gw0] HASH/k.so: truncated", "[gw1] HASH/k.so: truncated"]
    assert (load.called, load.ok, load.workers, load.artifacts, load.seconds, load.waited) == (
        True, True, 2, {"inductor": 8}, 1.0, 0.2)
    assert takeover.single_thread
    torch = TorchStats()
    for figures_ in takeover.torch:
        torch.add(figures_)
    assert torch.triton == TritonStats(hits=5, hits_restored=5, compiled=1, restored=5, processes=2)
    xd = takeover.stats("controller")
    assert xd.per_worker["gw1"] == {"files_written": 12, "files_present": 1, "files_refused": 1,
                                    "single_compile_thread": True, "compiles": 2, "triton_hits": 2, "triton_compiled": 1}
    torch.compiled, torch.single_compile_thread = True, True
    lines = reportmod._restore_lines(restore, 0, xd) + reportmod._load_line(load) + reportmod._torch_lines(torch, xd)
    assert lines[0].endswith("22 files written by 2 xdist workers (2 already there), 2 refused")
    assert lines[1] == "loaded into torch by 2 xdist workers: inductor 8 in 1.000 s in all " \
                       "(a worker's first compile waited 0.20 s for the restore)"
    assert "one compile thread in every xdist worker (the cache covers its tests)" in lines[3]
    assert lines[4] == ("Triton kernels by 2 xdist workers: 5 loaded from the cache (5 restored), 1 compiled; "
                        "5 kernels restored (loaded/compiled: gw0 3/0, gw1 2/1)")
    assert reportmod._worker_lines(xd)[1:] == [
        "  gw0: 10 files written, 1 refused, 1 already there, 2 compiles, one compile thread, Triton 3 loaded / 0 compiled",
        "  gw1: 12 files written, 1 refused, 1 already there, 2 compiles, one compile thread, Triton 2 loaded / 1 compiled"]


def test_one_worker_without_a_listener_makes_the_merged_hits_unknown() -> None:
    takeover = Takeover("fp")
    takeover.take("gw0", worker_output(written=1, hits=3, compiled=0, single=False, loaded=0), None)
    takeover.take("gw1", worker_output(written=1, hits=None, compiled=2, single=True, loaded=0), None)
    torch = TorchStats()
    for figures_ in takeover.torch:
        torch.add(figures_)
    assert torch.triton is not None and torch.triton.hits is None and torch.triton.compiled == 2
    assert not takeover.single_thread
    xd = takeover.stats("controller")
    assert reportmod._threads(torch, xd) == "; one compile thread in 1 of 2 xdist workers (the cache covers its tests)"
    assert "gw1 ?/2" in reportmod._triton_lines(torch.triton, xd)[0]


def test_a_worker_without_figures_counts_nothing() -> None:
    takeover = Takeover("fp")
    takeover.take("gw0", {"idle": True, "problems": []}, None)  # never imported torch
    restore, load = RestoreStats(), LoadStats()
    takeover.fold(restore, load)
    assert (restore.files_written, load.called) == (0, False)
    assert takeover.stats("controller") == XdistStats("controller", 1, [], {"gw0": {
        "files_written": 0, "files_present": 0, "files_refused": 0, "single_compile_thread": False, "compiles": 0,
        "triton_hits": 0, "triton_compiled": 0}})


# --- real sessions: Triton kernels compiled for a GPU, on a machine without one ------------------------------------

KERNEL = textwrap.dedent("""
    @triton.jit
    def scale_{i}(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * {i} + 1, mask=mask)

    def test_scale_{i}():
        kernel = compile_for_a_gpu(scale_{i})
        assert kernel.name == "scale_{i}" and kernel.asm["cubin"][:4] == b"\\x7fELF"
    """)


def triton_tests(n: int) -> str:
    head = textwrap.dedent("""
        import torch  # a Triton-kernel suite's tests import torch (its tensors); nothing here compiles through torch
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        def compile_for_a_gpu(fn):
            signature = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
            return triton.compile(ASTSource(fn=fn, signature=signature, constexprs={"BLOCK": 64}),
                                  target=GPUTarget("cuda", 80, 32))
        """)
    return head + "".join(KERNEL.format(i=i) for i in range(2, n + 2))


# The project's own listener, set before the plugin's (the conftest imports Triton): it writes what it hears and,
# at the end, whether it is Triton's listener again.
USER_LISTENER_CONFTEST = textwrap.dedent("""
    import json, os
    import triton

    heard = []

    def user_listener(*, src, metadata, metadata_group, times, cache_hit):
        heard.append(cache_hit)

    triton.knobs.compilation.listener = user_listener

    def pytest_unconfigure(config):
        with open(os.environ["USER_LISTENER_OUT"], "w") as fh:
            json.dump({"heard": heard, "restored": triton.knobs.compilation.listener is user_listener}, fh)
    """)


@pytest.fixture
def triton_env(tmp_path: Path) -> dict[str, str]:
    if not (TRITON_DIR / ".complete").is_file():
        pytest.skip(f"Triton is not installed in {TRITON_DIR}: scripts/bootstrap.sh installs it there (Linux)")
    return {"PYTHONPATH": str(TRITON_DIR), "MEGACACHE_DIR": str(tmp_path / "store")}


def triton_figures(report: dict[str, Any] | None) -> dict[str, Any]:
    assert report is not None
    return dict(report["torch"]["triton"])


@pytest.mark.torch
def test_a_warm_session_reports_every_triton_kernel_loaded_and_none_compiled(pytester: pytest.Pytester,
                                                                             triton_env: dict[str, str]) -> None:
    from ..helpers_torch import COUNTERS_CONFTEST, TorchProject

    project = TorchProject(pytester, env=triton_env, tests=triton_tests(3))
    pytester.makeconftest(COUNTERS_CONFTEST + USER_LISTENER_CONFTEST)
    heard = pytester.path / "heard.json"
    cold = project.run(env={"USER_LISTENER_OUT": str(heard)})
    cold.result.assert_outcomes(passed=3)
    assert json.loads(heard.read_text()) == {"heard": [False] * 3, "restored": True}  # chained, then put back
    figures_ = triton_figures(cold.report)
    assert figures_.pop("compile_seconds") > 0  # Triton's own timings
    assert figures_ == {"counted": "listener", "hits": 0, "hits_restored": 0, "compiled": 3, "restored": 0,
                        "hits_unknown": None, "processes": 1}
    assert cold.report is not None and cold.report["upload"]["new_entries"]["file/triton"] >= 3 * 2

    warm = project.run("-v", env={"USER_LISTENER_OUT": str(heard)})  # fresh cache directories at other paths
    warm.result.assert_outcomes(passed=3)
    assert json.loads(heard.read_text()) == {"heard": [True] * 3, "restored": True}  # Triton's own word: all cached
    assert triton_figures(warm.report) == {"counted": "listener", "hits": 3, "hits_restored": 3, "compiled": 0,
                                           "compile_seconds": 0.0, "restored": 3, "hits_unknown": None, "processes": 1}
    warm.result.stdout.fnmatch_lines(["*restored 1/1 objects*files written*",
                                      "Triton kernels: 3 loaded from the cache (3 restored), 0 compiled; 3 kernels restored",
                                      "uploaded nothing: nothing new"])


@pytest.mark.torch
def test_xdist_workers_triton_figures_are_merged_at_the_controller(pytester: pytest.Pytester,
                                                                   triton_env: dict[str, str]) -> None:
    pytest.importorskip("xdist")
    from ..helpers_torch import TorchProject

    # No Triton in the conftest: each worker's tests import it after the plugin started (the import hook chains).
    project = TorchProject(pytester, env=triton_env, tests=triton_tests(4))
    per_worker_dirs: dict[str, str | None] = {"TRITON_CACHE_DIR": None}  # each worker its own, under HOME
    cold = project.run("-n", "2", env={**per_worker_dirs, "TRITON_HOME": str(pytester.path / "home-cold")})
    cold.result.assert_outcomes(passed=4)
    merged = triton_figures(cold.report)
    assert (merged["hits"], merged["compiled"], merged["processes"]) == (0, 4, 2)

    warm = project.run("-n", "2", "-v", env={**per_worker_dirs, "TRITON_HOME": str(pytester.path / "home-warm")})
    warm.result.assert_outcomes(passed=4)
    assert warm.report is not None
    merged = triton_figures(warm.report)
    assert (merged["hits"], merged["hits_restored"], merged["compiled"], merged["processes"]) == (4, 4, 0, 2)
    rows = warm.report["xdist"]["per_worker"]
    assert sorted(rows) == ["gw0", "gw1"]
    assert sum(row["triton_hits"] for row in rows.values()) == 4
    assert all(row["triton_compiled"] == 0 for row in rows.values())
    # Each worker restored every file into its own directory; the session's count is theirs, summed.
    written = warm.report["restore"]["files_written"]
    assert written == sum(row["files_written"] for row in rows.values()) and all(row["files_written"] for row in rows.values())
    warm.result.stdout.fnmatch_lines([f"*; {written} files written by 2 xdist workers*",
                                      "Triton kernels by 2 xdist workers: 4 loaded from the cache (4 restored), 0 compiled;*"
                                      " (loaded/compiled: gw0 */0, gw1 */0)",
                                      "per xdist worker:", "  gw0: * files written*", "  gw1: * files written*"])
