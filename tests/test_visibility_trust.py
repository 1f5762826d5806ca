"""Real torch.compile sessions: per-test attribution and --megacache-durations, dynamic-shape profiles
(TORCH_COMPILE_JOB_ID) reused by a warm run, signed objects end to end, and fork pull requests."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import pytest

from pytest_megacache import bundle as bundlemod
from pytest_megacache.bundle import Entries, Entry

from .helpers_torch import TorchProject

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

KEY = "k" * 32


def test_durations_and_per_test_attribution(pytester: pytest.Pytester, tmp_path: Path) -> None:
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(tmp_path / "store")})
    cold = project.run("--megacache-durations=2")
    cold.result.assert_outcomes(passed=3)
    cold.result.stdout.fnmatch_lines(["slowest 2 uncached compiles:", "*s  *compiles  test_compiled.py::test_*",
                                      "*s  *compiles  test_compiled.py::test_*"])
    assert cold.report is not None
    per_test = cold.report["torch"]["per_test"]
    assert set(per_test) == {"test_compiled.py::test_f", "test_compiled.py::test_g"}  # test_plain compiles nothing
    for record in per_test.values():
        assert record["seconds"] > 0 and record["counters"]["fxgraph_cache_miss"] == 1
        assert any(a.startswith("inductor:") for a in record["artifacts"])

    warm = project.run("--megacache-durations=2")
    assert warm.fx_misses == 0 and warm.fx_hits == 2
    warm.result.stdout.fnmatch_lines(["*of cold compiling saved*", "no test compiled anything uncached"])
    assert warm.report is not None
    saved = warm.report["torch"]["seconds_saved"]
    # What the warm run saved is what the cold run spent on those artifacts.
    assert 0 < saved <= sum(r["seconds"] for r in per_test.values()) + 0.01


TWO_SHAPES = textwrap.dedent(
    """
    import torch

    @torch.compile
    def f(x):
        return torch.sin(x) + x.sum()

    def test_two_shapes():
        assert f(torch.zeros(4)).shape == (4,)
        assert f(torch.zeros(9)).shape == (9,)
    """
)


def test_dynamic_shape_profile_makes_the_warm_run_compile_once(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Dynamic-shape profiles are the user's opt-in (TORCH_COMPILE_JOB_ID; the plugin sets none): then they are
    carried, keys with '/' included (torch makes them file names itself), and a warm run compiles once."""
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(tmp_path / "store"),
                                          "TORCH_COMPILE_JOB_ID": "myorg/myrepo"}, tests=TWO_SHAPES)
    cold = project.run()
    cold.result.assert_outcomes(passed=1)
    assert cold.report is not None
    assert cold.report["torch"]["compiles"] == 2  # static shape first, then a dynamic recompile
    assert cold.report["upload"]["new_entries"].get("torch/pgo") == 1
    warm = project.run()
    assert warm.report is not None
    assert warm.report["torch"]["compiles"] == 1, warm.report["torch"]  # the profile says: dynamic at once
    assert warm.fx_misses == 0


def test_signed_objects_round_trip_and_unsigned_ones_are_refused(pytester: pytest.Pytester, tmp_path: Path) -> None:
    store = tmp_path / "store"
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(store), "MEGACACHE_SIGNING_KEY": KEY})
    cold = project.run("-k", "test_f")
    assert cold.report is not None and cold.report["upload"]["objects"] == 1
    [signed] = list(store.rglob("*.mcb"))
    header = bundlemod.decode_header(signed.read_bytes(), verify_keys=[KEY.encode()])[0]
    assert header.signature is not None
    # Someone without the key plants an object (a kernel file) next to it.
    planted = signed.with_name("20990101T000000-1-abcdef.mcb")
    planted.write_bytes(bundlemod.encode(Entries([Entry("file/inductor", "zz/evil.so", b"\x7fELF")]),
                                         header.fingerprint))
    warm = project.run("-k", "test_f")
    assert warm.fx_misses == 0 and warm.fx_hits == 1  # the signed object was used
    assert warm.report is not None and warm.report["restore"]["objects_rejected"] == 1
    warm.result.stdout.fnmatch_lines([f"*refused*{planted.name}*unsigned object*"])
    assert not (warm.root / "inductor" / "zz" / "evil.so").exists()
    assert not any("trusted as-is" in line for line in warm.result.outlines)


def test_a_fork_pull_request_restores_but_never_uploads(pytester: pytest.Pytester, tmp_path: Path) -> None:
    event = tmp_path / "event.json"
    event.write_text(json.dumps({
        "pull_request": {"number": 7, "head": {"repo": {"id": 2, "full_name": "someone/fork", "fork": True}},
                         "base": {"repo": {"id": 1, "full_name": "org/repo"}}},
        "repository": {"id": 1, "full_name": "org/repo", "default_branch": "main"},
    }))
    store = tmp_path / "store"
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(store)})
    main = project.run("-k", "test_f", env={"GITHUB_EVENT_NAME": "push", "GITHUB_REF": "refs/heads/main",
                                            "GITHUB_REF_NAME": "main"})
    assert main.report is not None and main.report["upload"]["objects"] == 1
    fork_env: dict[str, str | None] = {"GITHUB_EVENT_NAME": "pull_request", "GITHUB_EVENT_PATH": str(event),
                                       "GITHUB_REF": "refs/pull/7/merge", "GITHUB_HEAD_REF": "patch-1",
                                       "GITHUB_BASE_REF": "main"}
    pr = project.run(env=fork_env)  # compiles test_g, which main's cache lacks
    assert pr.report is not None
    assert pr.report["settings"]["mode"] == "read"
    assert pr.report["scope"] == {"write": "pr-7", "read": ["pr-7", "main"]}
    assert pr.fx_hits == 1 and pr.fx_misses == 1  # main's cache was read
    assert pr.report["upload"]["reason"] == "read-only mode"
    assert len(list(store.rglob("*.mcb"))) == 1
    pr.result.stdout.fnmatch_lines(["*read-only: *fork*"])
    # An explicit mode wins over the fork default.
    explicit = project.run("--megacache-mode", "readwrite", env=fork_env)
    assert explicit.report is not None and explicit.report["upload"]["objects"] == 1
    assert sorted(p.relative_to(store).parts[1] for p in store.rglob("*.mcb")) == ["main", "pr-7"]


def test_restored_but_unloadable_blames_the_load_not_the_settings(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Objects were restored, torch refused to load them, and hit none: the one warning says the load failed
    (it used to blame settings). The "same tests, no hit" warning naming likely causes is for objects torch
    did load (tests/test_deadlines.py)."""
    from pytest_megacache.fingerprint import compute

    store = tmp_path / "store"
    key = compute().key
    folder = store.joinpath("pytest-megacache", "main", *key.split("/"))
    folder.mkdir(parents=True)
    unrelated = Entries([Entry("torch/inductor", "f" + "q" * 51, b"an FX graph this project never builds")])
    # Stored by a run of the very same tests (the selection digest the plugin records): were the load not the
    # cause, "hit none" would be a note naming a changed setting or code.
    selection = hashlib.sha256(b"test_compiled.py::test_f").hexdigest()[:32]
    (folder / "20260101T000000000-1-abcdef.mcb").write_bytes(
        bundlemod.encode(unrelated, key, extra={"producer": {"selection": selection}}))
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(store), "MEGACACHE_MODE": "read"})
    run = project.run("-k", "test_f")
    assert run.fx_misses == 1 and run.fx_hits == 0
    assert run.report is not None and run.report["restore"]["objects_used"] == 1
    warnings = run.megacache_warnings()
    assert len(warnings) == 1 and "torch did not load the restored artifacts" in warnings[0], warnings
    assert run.report is not None and not any("compiled only graphs" in note for note in run.report["notes"])
