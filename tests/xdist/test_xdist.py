"""pytest-xdist and concurrent sessions, with real torch.compile and a real S3 server (moto, over HTTP).

- ``-n 2``: the controller fetches once, workers compile into their own directories, one merged upload (the
  workers' copies of one function's Dynamo entry merged into one); a warm ``-n 2`` run on fresh directories hits
  everything, traces nothing and downloads one object once, and a second one uploads nothing either.
- a crashed worker loses only its own new artifacts, and the summary says so;
- K = 4 sessions started at once against one bucket, each compiling something else: a warm session that
  runs all of them misses nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pytest_megacache import bundle as bundlemod

from ..conftest import S3Server
from ..helpers_torch import TorchProject, holds_function, skip_without_torch

skip_without_torch()
pytest.importorskip("xdist")
pytestmark = pytest.mark.torch


def compiled_tests(names: list[str]) -> str:
    """One test per name, each compiling a distinct tiny graph (the constant is baked into the graph)."""
    out = ["import torch", ""]
    for i, name in enumerate(names):
        out.append(textwrap.dedent(f"""
            def test_{name}():
                fn = torch.compile(lambda x: torch.sin(x) * {i + 2} + {i})
                assert torch.allclose(fn(torch.zeros(4)), torch.full((4,), {float(i)}))
            """))
    return "\n".join(out)


FOUR = ["a", "b", "c", "d"]


@pytest.fixture
def bucket_env(s3_server: S3Server) -> dict[str, str]:
    return {**s3_server.env(), "MEGACACHE_BUCKET": s3_server.new_bucket()}


def mcb(s3: S3Server, bucket: str) -> list[str]:
    return [k for k in s3.keys(bucket) if k.endswith(".mcb")]


# A file a worker's collect leaves out of the upload (its name cannot be carried): said by the controller.
LEFT_OUT = textwrap.dedent("""
    import os
    from pathlib import Path

    def test_e_leaves_a_file_that_is_not_carried():
        folder = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "zz"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "odd name.so").write_bytes(b"not carried")
    """)


# One function traced with a float32 input in one worker and with a float64 input in the other: first in the module,
# so that --dist loadgroup starts each group on a worker of its own.
TWO_DTYPES = textwrap.dedent("""
    import pytest
    import torch

    @torch.compile
    def scaled(x):
        return torch.cos(x) * 5

    @pytest.mark.xdist_group("x")
    def test_scaled_float32():
        assert torch.allclose(scaled(torch.zeros(4)), torch.full((4,), 5.0))

    @pytest.mark.xdist_group("y")
    def test_scaled_float64():
        assert torch.allclose(scaled(torch.zeros(4, dtype=torch.float64)), torch.full((4,), 5.0, dtype=torch.float64))
    """)


def dynamo_variants(blob: bytes, name: bytes) -> list[int]:
    """For each stored Dynamo entry of the function ``name`` in the object ``blob``: how many variants it holds (each
    stored variant's guards start with the plugin's header)."""
    return [entry.data.count(b"megacache-guards-") for entry in bundlemod.decode(blob)[1]
            if entry.kind == "torch/precompile" and holds_function(entry.data, name)]


def test_xdist_cold_uploads_once_and_warm_downloads_once(pytester: pytest.Pytester, s3_server: S3Server,
                                                         bucket_env: dict[str, str]) -> None:
    """With Dynamo reuse (the default): a frame taken from the store never looks its graphs up, so each graph is taken
    again either way (an FX-graph hit, or its frame reused). Each worker's copy of one function's Dynamo entry holds the
    variants it traced: the controller stores one entry holding both, which a warm run takes whole."""
    lambdas = FOUR[:2]  # with the two variants of one function: as many graphs as the four of the other tests
    project = TorchProject(pytester, env=bucket_env, tests=TWO_DTYPES + compiled_tests(lambdas) + LEFT_OUT,
                           dynamo_reuse=True)
    per_worker: dict[str, str | None] = {"TORCHINDUCTOR_CACHE_DIR": None}  # the default: under TMPDIR
    args = ("-n", "2", "--dist", "loadgroup", "-v")
    graphs = 2 + len(lambdas)
    cold = project.run(*args, env=per_worker)
    cold.result.assert_outcomes(passed=graphs + 1)
    ran_on = {line.split("]")[0] for line in cold.result.outlines if "PASSED" in line and "test_scaled_" in line}
    assert len(ran_on) == 2, cold.result.outlines  # the precondition: each dtype traced in a worker of its own
    assert cold.fx_misses == graphs, cold.counters
    assert cold.report is not None
    xd = cold.report["xdist"]
    assert (xd["role"], xd["workers"], xd["lost"], sorted(xd["per_worker"])) == ("controller", 2, [], ["gw0", "gw1"])
    assert cold.report["upload"]["objects"] == 1  # one merged upload by the controller
    assert cold.report["torch"]["counters"]["fxgraph_cache_miss"] == graphs  # the workers' counters, summed
    assert cold.report["torch"]["counters"]["dynamo_traced"] == graphs
    assert cold.report["upload"]["new_entries"]["torch/inductor"] == graphs
    assert cold.report["upload"]["new_entries"]["torch/precompile"] == len(lambdas) + 1  # one per function
    assert not [p for p in cold.report["problems"] if "not merged" in p] and not [
        n for n in cold.report["notes"] if "not merged" in n], (cold.report["problems"], cold.report["notes"])
    # Each worker compiled into its own Inductor directory, never the shared default one.
    dirs = sorted(p.name.rsplit("-", 1)[-1] for p in (cold.root / "tmp").glob("torchinductor_*-gw*"))
    assert dirs == ["gw0", "gw1"], list((cold.root / "tmp").iterdir())
    # The default directory holds only Inductor's precompiled header, which TORCHINDUCTOR_CACHE_DIR never moves.
    shared = list((cold.root / "tmp").glob("torchinductor_*[!0-9]"))
    assert all({p.name for p in d.iterdir()} <= {"precompiled_headers"} for d in shared), shared
    [stored] = mcb(s3_server, bucket_env["MEGACACHE_BUCKET"])
    blob = s3_server.client().get_object(Bucket=bucket_env["MEGACACHE_BUCKET"], Key=stored)["Body"].read()
    producer = bundlemod.decode_header(blob)[0].extra["producer"]
    assert len(producer["selection"]) == 32  # from the workers' collection: lets a warm run spare the pool
    # One entry for the function, holding the variant each worker traced.
    assert dynamo_variants(blob, b"scaled") == [2]
    # Each worker's own times travel to the controller's report; the controller compiles nothing itself.
    processes = {p["process"]: p for p in cold.report["processes"]}
    assert sorted(processes) == ["controller", "gw0", "gw1"]
    assert processes["controller"]["dynamo"] == processes["controller"]["backend"] == 0
    assert all(processes[w]["backend"] > 0 and processes[w]["startup"] > 0 for w in ("gw0", "gw1")), processes

    [left_out] = [p for p in cold.report["problems"] if "left out of the upload" in p]
    assert re.fullmatch(r"\[gw[01]\] 1 file\(s\) \(\d+ B\) left out of the upload, first zz/odd name\.so: name not portable",
                        left_out), left_out

    size = s3_server.client().head_object(Bucket=bucket_env["MEGACACHE_BUCKET"], Key=stored)["ContentLength"]
    for which in ("warm", "warm again"):
        warm = project.run(*args, env=per_worker)
        warm.result.assert_outcomes(passed=graphs + 1)
        assert warm.report is not None
        counters = warm.report["torch"]["counters"]
        # every graph taken again, its frame from the store or its FX graph; no frame traced (either dtype's included)
        assert counters["fxgraph_cache_miss"] == 0, (which, counters)
        assert counters["fxgraph_cache_hit"] + counters["dynamo_frames_reused"] == graphs, (which, counters)
        assert counters["dynamo_traced"] == 0, (which, counters)
        assert warm.report["restore"]["bytes_fetched"] == size  # the controller fetched the one object once
        assert warm.report["upload"]["reason"] == "nothing new", (which, warm.report["upload"])
        assert mcb(s3_server, bucket_env["MEGACACHE_BUCKET"]) == [stored]
    # The session's figures are its workers': each restored the compiled files into its own directory and loaded the
    # torch artifacts; neither compiled anything, so neither started a compile pool (the controller does none of it).
    rows = warm.report["xdist"]["per_worker"]
    assert sorted(rows) == ["gw0", "gw1"] and all(row["files_written"] > 0 for row in rows.values()), rows
    assert warm.report["torch"]["compiles"] == 0 and all(row["compiles"] == 0 for row in rows.values()), rows
    written = warm.report["restore"]["files_written"]
    assert written == sum(row["files_written"] for row in rows.values())
    assert warm.report["load"]["workers"] == 2 and warm.report["load"]["artifacts"]["inductor"] == 2 * graphs
    warm.result.stdout.fnmatch_lines([f"restored 1/1 objects*; {written} files written by 2 xdist workers*",
                                      f"loaded into torch by 2 xdist workers: inductor {2 * graphs}*"])


CRASHING = compiled_tests(["a", "c"]) + textwrap.dedent("""
    import os
    import pytest

    @pytest.mark.xdist_group("doomed")
    def test_b_crashes():
        fn = torch.compile(lambda x: torch.cos(x) * 7)
        assert fn(torch.zeros(2)).sum() == 14
        os._exit(3)  # the worker dies before it can hand anything over
    """).replace("def test_a", "@pytest.mark.xdist_group('safe')\ndef test_a").replace(
    "def test_c", "@pytest.mark.xdist_group('safe')\ndef test_c")


def test_a_crashed_worker_loses_only_its_own_artifacts(pytester: pytest.Pytester, s3_server: S3Server,
                                                       bucket_env: dict[str, str]) -> None:
    project = TorchProject(pytester, env=bucket_env, tests="import pytest\n" + CRASHING)
    cold = project.run("-n", "2", "--dist", "loadgroup", "--max-worker-restart", "0")
    cold.result.assert_outcomes(passed=2, failed=1)
    assert cold.report is not None
    assert len(cold.report["xdist"]["lost"]) == 1, cold.report["xdist"]
    cold.result.stdout.fnmatch_lines(["*xdist worker gw* ended without handing over*only its new artifacts are lost*"])
    # Which tests the doomed worker ran before it died is up to the scheduler. What the surviving worker
    # compiled (its own counters file; the dead one wrote none) is exactly what was uploaded.
    survived = cold.fx_misses
    assert survived >= 1
    assert cold.report["upload"]["objects"] == 1
    assert cold.report["upload"]["new_entries"]["torch/inductor"] == survived

    warm = project.run("-n", "2", "--dist", "loadgroup", "-k", "not crashes")
    warm.result.assert_outcomes(passed=2)
    # The dead worker's FX graph is lost from mega-cache; if it finished writing it into the directory both
    # workers share here, the surviving worker's scan may carry it as a file (lose nothing), so warm hits it.
    assert warm.fx_hits >= survived and warm.fx_hits + warm.fx_misses == 2, warm.counters


def test_four_sessions_at_once_then_a_warm_one_hits_everything(tmp_path: Path, s3_server: S3Server,
                                                               bucket_env: dict[str, str]) -> None:
    """K = 4 CI jobs with one fingerprint start together, each compiling something else: nothing is lost."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "test_k.py").write_text(compiled_tests(FOUR))

    def env_for(name: str) -> dict[str, str]:
        root = tmp_path / name
        for sub in ("inductor", "tmp"):
            (root / sub).mkdir(parents=True)
        return {**{k: v for k, v in os.environ.items() if not k.startswith(("MEGACACHE_", "PYTEST_"))},
                **bucket_env, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TMPDIR": str(root / "tmp"),
                "MEGACACHE_REPORT": str(root / "report.json")}

    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
    procs = [subprocess.Popen([*base, "-k", f"test_{name}"], cwd=project, env=env_for(f"job-{name}"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for name in FOUR]
    deadline = time.monotonic() + 600
    for proc in procs:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert proc.returncode == 0, out[-3000:]
    assert len(mcb(s3_server, bucket_env["MEGACACHE_BUCKET"])) == 4  # four immutable objects, none overwritten

    warm = subprocess.run(base, cwd=project, env=env_for("warm"), capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, warm.stdout[-3000:]
    report = json.loads((tmp_path / "warm" / "report.json").read_text())
    counters = report["torch"]["counters"]
    # each job's graph is taken again: its frame from the store (Dynamo reuse, on by default), or its FX graph hit
    assert counters["fxgraph_cache_miss"] == 0, counters
    assert counters["fxgraph_cache_hit"] + counters.get("dynamo_frames_reused", 0) == 4, counters
    assert report["restore"]["objects_used"] == 4


DYNAMIC_PAIR = textwrap.dedent("""
    import pytest
    import torch

    @torch.compile
    def f(x):
        return torch.sin(x) + x.sum()

    @torch.compile
    def g(x):
        return torch.cos(x) * x.mean()

    @pytest.mark.xdist_group("f")
    def test_f_two_shapes():
        assert f(torch.zeros(4)).shape == (4,)
        assert f(torch.zeros(9)).shape == (9,)

    @pytest.mark.xdist_group("g")
    def test_g_two_shapes():
        assert g(torch.zeros(5)).shape == (5,)
        assert g(torch.zeros(11)).shape == (11,)
    """)


def test_xdist_workers_dynamic_shape_profiles_are_merged_not_replaced(pytester: pytest.Pytester,
                                                                       tmp_path: Path) -> None:
    """Each worker records its own frames in the one dynamic-shape profile (one key per job): the controller
    merges them the way torch merges profiles, so a warm run compiles each function once, dynamic at once,
    whichever worker runs it. Keeping one worker's profile made the other function compile static, miss,
    and recompile in every warm run (seen on the H100 benchmark)."""
    # Profiles are the user's opt-in: torch records them only with a job id, and the plugin sets none.
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(tmp_path / "store"), "TORCH_COMPILE_JOB_ID": "ci-job"},
                           tests=DYNAMIC_PAIR)
    args = ("-n", "2", "--dist", "loadgroup", "-v")
    cold = project.run(*args)
    cold.result.assert_outcomes(passed=2)
    workers = {line.split("]")[0] for line in cold.result.outlines if "PASSED" in line and line.startswith("[gw")}
    assert len(workers) == 2, cold.result.outlines  # the precondition: the two tests ran on two workers
    assert cold.report is not None
    assert cold.report["torch"]["compiles"] == 4  # each: static first, then a dynamic recompile
    assert cold.report["upload"]["new_entries"].get("torch/pgo") == 1
    assert cold.report["upload"]["profiles_merged"] == 1, cold.report["upload"]  # two copies, one merge

    # The warm run restores the merged profile and its workers record the same frames again: nothing new, so an
    # unchanged profile is never uploaded again (a second warm run would start from the same store).
    warm = project.run(*args)
    warm.result.assert_outcomes(passed=2)
    assert warm.report is not None
    assert warm.report["torch"]["compiles"] == 2, warm.report["torch"]  # dynamic at once, both functions
    assert (warm.fx_hits, warm.fx_misses) == (2, 0), warm.counters  # both dynamic graphs restored
    assert warm.report["upload"]["reason"] == "nothing new", warm.report["upload"]
    assert warm.report["upload"]["profiles_merged"] == 0, warm.report["upload"]
