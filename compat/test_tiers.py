"""Every tier of the cache on the installed torch: the small project run with the plugin off, cold, warm and warm
``-n 2`` (each on fresh cache directories, as on a new CI runner), hits read from torch's own counters.

A tier is ``hit`` when the warm session found in the restored cache what the cold one compiled; the outcomes of
every session must be the plugin-off session's, and a session may warn once at most."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import Matrix, Results, version
from .sessions import Session, cli
from .test_isa import torch_records_its_checks

MAIN_TESTS = {"test_pointwise", "test_train", "test_dynamic_recompile", "test_max_autotune", "test_child_process",
              "test_plain"}


def passed(session: Session) -> None:
    assert session.returncode == 0, session.describe()
    assert set(session.outcomes) >= MAIN_TESTS and set(session.outcomes.values()) == {"passed"}, session.describe()


def warned_once_at_most(session: Session) -> None:
    assert len(session.megacache_warnings()) <= 1, session.describe()
    assert len(session.problems) <= 1 or len(session.megacache_warnings()) == 1, session.problems


@pytest.mark.tier("outcomes")
def test_outcomes_are_the_plugin_offs_and_one_warning_at_most(matrix: Matrix, results: Results) -> None:
    plain = matrix.plain()
    passed(plain)
    assert not plain.megacache_warnings()
    sessions = [matrix.cold(), matrix.warm(), matrix.warm_xdist()]
    for session in sessions:
        assert session.outcomes == plain.outcomes, session.describe()
        warned_once_at_most(session)
    problems = sorted({p for s in sessions for p in s.problems})
    results.record("outcomes", "same" if not problems else "same, with a warning",
                   f"{len(plain.outcomes)} tests, plugin off / cold / warm / warm -n 2 identical; problems: {problems}")


@pytest.mark.tier("fx_aot")
def test_fx_graphs_and_aotautograd_entries_hit_warm(matrix: Matrix, results: Results) -> None:
    cold, warm = matrix.cold(), matrix.warm()
    passed(cold)
    passed(warm)
    assert cold.counters.fx_misses > 0 and cold.counters.fx_hits == 0, cold.counters.totals
    assert warm.counters.fx_misses == 0 and warm.counters.fx_hits == cold.counters.fx_misses, warm.counters.totals
    assert warm.counters.aot_misses == 0 and warm.counters.aot_hits >= 1, warm.counters.totals
    assert warm.report is not None and warm.report["load"]["ok"] is True, warm.report and warm.report["load"]
    results.record("fx_aot", "hit", f"FX {warm.counters.fx_hits}/{warm.counters.fx_misses}, AOTAutograd "
                   f"{warm.counters.aot_hits}/{warm.counters.aot_misses} (hit/miss) warm; cold FX misses "
                   f"{cold.counters.fx_misses}; loaded {warm.report['load']['artifacts']}")


@pytest.mark.tier("cpp_kernels")
def test_compiled_cpu_kernels_travel(matrix: Matrix, results: Results) -> None:
    cold, warm = matrix.cold(), matrix.warm()
    assert cold.report is not None and warm.report is not None
    carried = cold.report["upload"]["new_entries"].get("file/inductor", 0)
    assert carried > 0, cold.report["upload"]
    assert warm.report["restore"]["files_written"] > 0, warm.report["restore"]
    # Nothing the warm session added to its cache directory was new: no kernel was built again.
    assert warm.report["upload"]["reason"] == "nothing new", warm.report["upload"]
    libraries = [p for p in warm.cache_dir.rglob("*.so") if p.is_file()]
    assert libraries, "the warm session's cache directory holds no compiled kernel"
    results.record("cpp_kernels", "hit", f"{carried} files carried, {warm.report['restore']['files_written']} "
                   f"written warm, nothing new to upload after the warm run")


@pytest.mark.tier("xdist")
def test_warm_xdist_workers_hit(matrix: Matrix, results: Results) -> None:
    warm, xdist = matrix.warm(), matrix.warm_xdist()
    passed(xdist)
    assert xdist.report is not None and xdist.report["xdist"], xdist.report
    assert xdist.counters.fx_misses == 0 and xdist.counters.fx_hits == warm.counters.fx_hits, xdist.counters.totals
    assert xdist.counters.aot_misses == 0 and xdist.counters.aot_hits == warm.counters.aot_hits, xdist.counters.totals
    results.record("xdist", "hit", f"-n 2: FX {xdist.counters.fx_hits}/{xdist.counters.fx_misses}, AOTAutograd "
                   f"{xdist.counters.aot_hits}/{xdist.counters.aot_misses} over both workers")


@pytest.mark.tier("child_process")
def test_a_child_process_hits_warm(matrix: Matrix, results: Results) -> None:
    cold, warm, xdist = matrix.cold(), matrix.warm(), matrix.warm_xdist()
    assert cold.children.fx_misses >= 1, cold.children.totals
    for session in (warm, xdist):
        assert session.children.fx_misses == 0 and session.children.fx_hits >= 1, (session.name, session.children.totals)
    results.record("child_process", "hit", f"the child's own counters: cold FX {cold.children.fx_hits}/"
                   f"{cold.children.fx_misses}, warm {warm.children.fx_hits}/{warm.children.fx_misses}, warm -n 2 "
                   f"{xdist.children.fx_hits}/{xdist.children.fx_misses}")


@pytest.mark.tier("dynamic_shapes")
def test_a_dynamic_shape_recompile_compiles_the_same_graphs_and_hits(matrix: Matrix, results: Results) -> None:
    name = "test_dynamic_recompile"
    plain, cold, warm, xdist = matrix.plain(), matrix.cold(), matrix.warm(), matrix.warm_xdist()
    graphs = [s.counters.graphs(name) for s in (plain, cold, warm, xdist)]
    assert graphs[0] == 2 and len(set(graphs)) == 1, graphs  # a static graph, then a dynamic one, in every session
    test = warm.counters.test(name)
    assert test.get("inductor", {}).get("fxgraph_cache_miss", 0) == 0, test
    assert test.get("inductor", {}).get("fxgraph_cache_hit", 0) == 2, test
    results.record("dynamic_shapes", "hit", f"graphs plugin off / cold / warm / -n 2: {graphs}; warm FX 2/0")


@pytest.mark.tier("max_autotune")
def test_a_max_autotune_compile_hits_warm(matrix: Matrix, results: Results) -> None:
    name = "test_max_autotune"
    cold, warm = matrix.cold().counters.test(name), matrix.warm().counters.test(name)
    assert cold.get("inductor", {}).get("fxgraph_cache_miss", 0) >= 1, cold
    assert warm.get("inductor", {}).get("fxgraph_cache_miss", 0) == 0, warm
    assert warm.get("inductor", {}).get("fxgraph_cache_hit", 0) >= 1, warm
    results.record("max_autotune", "hit", f"max-autotune-no-cudagraphs matmul: cold {cold.get('inductor')}, "
                   f"warm {warm.get('inductor')}")


@pytest.mark.tier("pgo")
def test_a_dynamic_shape_profile_travels_when_the_user_sets_a_job_id(matrix: Matrix, results: Results) -> None:
    name = "test_dynamic_recompile"
    cold, warm = matrix.pgo_cold(), matrix.pgo_warm()
    for session in (cold, warm):
        assert session.returncode == 0 and session.outcomes == {name: "passed"}, session.describe()
        warned_once_at_most(session)
    assert cold.counters.graphs(name) == 2, cold.counters.per_test
    assert cold.report is not None and cold.report["upload"]["new_entries"].get("torch/pgo", 0) >= 1, cold.report
    # The profile restored says "dynamic" from the first call: one graph for the three shapes.
    assert warm.counters.graphs(name) == 1, warm.counters.per_test
    results.record("pgo", "hit", "TORCH_COMPILE_JOB_ID set: cold compiled 2 graphs (static, dynamic), warm 1 (dynamic)")


@pytest.mark.tier("isa_check")
def test_the_vector_isa_check_is_not_run_again_warm(matrix: Matrix, results: Results) -> None:
    from pytest_megacache import isaprobe

    cold, warm = matrix.cold(), matrix.warm()
    assert cold.report is not None and warm.report is not None
    if torch_records_its_checks():  # decided from torch's source, not from what the plugin says about it
        # torch keeps its own records (compat/test_isa.py shows what they do): the session says so, once. (An xdist
        # controller never imports torch, and its workers' notes stay with them.)
        for session, times in ((cold, 1), (warm, 1), (matrix.warm_xdist(), 0)):
            assert session.notes.count(isaprobe.TORCH_RECORDS_NOTE) == times, (session.name, session.notes)
            assert not any("runs in every process" in n for n in session.notes), session.notes
        carried = [p for p in warm.cache_dir.rglob("*" + isaprobe.TORCH_RECORD_SUFFIX)]
        assert carried, "no .load_ok record was restored"
        results.record("isa_check", "hit", f"torch's own .load_ok records carried ({len(carried)} restored); the "
                       "session's note says so")
        return
    assert isaprobe.TORCH_RECORDS_NOTE not in cold.notes, cold.notes
    assert not any("vector-ISA" in n for n in warm.notes), warm.notes
    checks = cold.report["torch"]["isa_checks"], warm.report["torch"]["isa_checks"]
    assert checks[0].get("run", 0) >= 1 and checks[0].get("recorded") == checks[0]["run"], checks
    assert checks[1] == {"reused": checks[0]["run"]}, checks
    results.record("isa_check", "hit", f"the plugin's records: cold {checks[0]}, warm {checks[1]}")


@pytest.mark.tier("reuse")
def test_dynamo_reuse_is_on_by_default_where_checked_and_off_without_a_warning_elsewhere(matrix: Matrix,
                                                                                      results: Results) -> None:
    """Dynamo reuse: on a release its checks were written for, on by default (the cold session) and where asked for
    (the warm one, --megacache-precompile), and the warm session takes frames the cold one stored instead of tracing
    them; elsewhere off, silently by default and with one warning where asked for. Turned off
    (--megacache-no-precompile, the layers' sessions), off and said so. The outcomes are the plugin-off session's
    either way."""
    from pytest_megacache import dynamo as dynamo_reuse

    plain, cold, warm = matrix.plain(), matrix.reuse_cold(), matrix.reuse_warm()
    for session in (cold, warm):
        assert session.outcomes == plain.outcomes, session.describe()
        warned_once_at_most(session)
        assert session.report is not None, session.describe()
    torch = version("torch") or "?"
    checked = dynamo_reuse.release_checked(torch)
    c = {k: int(v) for k, v in warm.report["torch"]["counters"].items()}  # type: ignore[index]
    turned_off = matrix.warm()
    assert turned_off.report is not None, turned_off.describe()
    grounds = turned_off.report["settings"]["dynamo_reuse"]  # type: ignore[index]
    assert grounds["on"] is False and grounds["why"].startswith("turned off"), grounds
    assert not any("precompile" in p for p in turned_off.problems), turned_off.problems
    by_default = cold.report["settings"]["dynamo_reuse"]  # type: ignore[index]
    asked = warm.report["settings"]["dynamo_reuse"]  # type: ignore[index]
    assert by_default["on"] is checked and asked["on"] is checked, (by_default, asked)
    assert not any("precompile" in p for p in cold.problems), cold.problems  # by default: said in the report only
    if not checked:
        assert "checked on torch" in by_default["why"], by_default
        assert any("--megacache-precompile ignored" in p for p in warm.problems), warm.problems
        assert c.get("dynamo_reused", 0) == 0, c
        results.record("reuse", "off", f"torch {torch}: off by default without a warning, asked for ignored with one; "
                                       "outcomes same")
        return
    assert by_default["why"].startswith("on by default") and by_default["backends"] == "torch's own", by_default
    assert asked["why"].startswith("asked for") and asked["backends"] == "any", asked
    cold_c = {k: int(v) for k, v in cold.report["torch"]["counters"].items()}  # type: ignore[index]
    assert cold_c.get("dynamo_stored", 0) >= 1, cold_c
    assert c.get("dynamo_frames_reused", 0) >= 1 and c.get("dynamo_traced", 0) < cold_c.get("dynamo_traced", 0), (
        cold_c, c)
    refused = {k: v for k, v in c.items() if k.startswith("dynamo_refused_") and v}
    results.record("reuse", "hit", f"cold traced {cold_c.get('dynamo_traced')} / stored {cold_c.get('dynamo_stored')}; "
                   f"warm frames reused {c.get('dynamo_frames_reused')} / traced {c.get('dynamo_traced')}; "
                   f"refused {refused}")


@pytest.mark.tier("cli")
def test_the_command_line_works(matrix: Matrix, results: Results) -> None:
    warm = matrix.warm()
    assert warm.report is not None
    env = {"TORCHINDUCTOR_CACHE_DIR": str(warm.cache_dir), "TRITON_CACHE_DIR": str(warm.root / "triton"),
           "TMPDIR": str(warm.root / "tmp")}
    key = cli("key", env=env)
    assert key.returncode == 0 and key.stdout.strip() == warm.report["fingerprint"]["key"], key
    parts = cli("key", "--json", env=env)
    assert parts.returncode == 0 and json.loads(parts.stdout), parts
    doctor = cli("doctor", "--dir", str(matrix.store), env=env)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    objects = sorted(str(p) for p in Path(matrix.store).rglob("*.mcb"))
    assert objects, "the cold session stored nothing"
    inspect = cli("inspect", "-v", *objects, env=env)
    assert inspect.returncode == 0 and "inductor" in inspect.stdout, inspect.stdout + inspect.stderr
    results.record("cli", "works", f"key, key --json, doctor --dir, inspect -v ({len(objects)} object(s))")
