"""End to end: real torch.compile (CPU Inductor) in pytest subprocesses, real S3 over HTTP (moto server).

Hits and misses are read from torch's own counters (written by the project's conftest), never from the
plugin's report alone. The sessions that many tests read run once, in two chains (one over S3, one over a
directory store), each a class-scoped fixture of the class whose tests assert on its runs and store snapshots.
The chains carry per-test attribution (--megacache-durations), fork pull requests and an explicit ``-n 0`` too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pytest_megacache import bundle as bundlemod
from pytest_megacache.bundle import Entries, Entry
from pytest_megacache.report.stats import PHASES

from .conftest import S3Server, SmallFilesystems, free_port, removed_unless_failed
from .helpers_torch import Run, TorchProject, skip_without_torch

skip_without_torch()
pytestmark = pytest.mark.torch

PREFIX = "pytest-megacache"


def objects(s3: S3Server, bucket: str) -> list[str]:
    return [k for k in s3.keys(bucket) if k.endswith(".mcb")]


def fingerprint_folder(run: Run) -> str:
    assert run.report is not None
    return f"{PREFIX}/main/{run.report['fingerprint']['key']}"


def assert_all_reused(run: Run, frames: int) -> None:
    """Every frame the session compiled was taken from the store: Dynamo traced none (torch's own record of its
    traces, and no graph looked up), none was refused, and none was stored again."""
    assert run.fx_misses == run.fx_hits == run.aot_misses == 0, run.counters
    assert sum(run.counters["traces_per_test"].values()) == 0, run.counters
    assert run.report is not None
    counters = run.report["torch"]["counters"]
    refused = {k: v for k, v in counters.items() if k.startswith("dynamo_refused_") and v}
    assert (counters["dynamo_frames_reused"], counters["dynamo_traced"], refused) == (frames, 0, {}), counters
    assert "torch/precompile" not in run.report["upload"]["new_entries"], run.report["upload"]


@pytest.fixture
def s3_project(pytester: pytest.Pytester, s3_server: S3Server) -> tuple[TorchProject, str]:
    bucket = s3_server.new_bucket()
    return TorchProject(pytester, env={**s3_server.env(), "MEGACACHE_BUCKET": bucket}), bucket


# --- one bucket, one sequence of sessions: read-only, cold, a subset, warm, planted objects, write-only -------


def _malformed_objects(fingerprint: str) -> dict[str, bytes]:
    good = bundlemod.encode(Entries([Entry("torch/inductor", "fabcdefgh12345678", b"x")]), fingerprint)
    foreign = bundlemod.encode(Entries([Entry("torch/inductor", "fabcdefgh12345678", b"x")]), "torch-0.0/elsewhere")
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    return {
        "a-garbage.mcb": b"not a bundle at all",
        "b-truncated.mcb": good[:-3],
        "c-flipped.mcb": bytes(flipped),
        "d-foreign.mcb": foreign,
        "e-escape.mcb": raw_bundle(fingerprint, "file/inductor", "../../escaped.so", b"\x7fELF"),
        "f-torch-escape.mcb": raw_bundle(fingerprint, "torch/inductor", "../../../pwned", b"payload"),
    }


def raw_bundle(fingerprint: str, kind: str, name: str, data: bytes) -> bytes:
    """A bundle whose header and digest are right but whose entry name is hostile (bypasses encode's checks)."""
    import hashlib
    import json

    import zstandard

    k, n = kind.encode(), name.encode()
    raw = (bundlemod.PAYLOAD_MAGIC + (1).to_bytes(4, "big") + len(k).to_bytes(1, "big") + k
           + len(n).to_bytes(2, "big") + n + (0o644).to_bytes(4, "big") + len(data).to_bytes(8, "big") + data)
    payload = zstandard.ZstdCompressor().compress(raw)
    header = json.dumps({"format": 1, "fingerprint": fingerprint, "payload_size": len(payload),
                         "raw_size": len(raw), "payload_sha256": hashlib.sha256(payload).hexdigest(),
                         "entries": 1, "created": 0}).encode()
    return bundlemod.MAGIC + b"\x01" + len(header).to_bytes(4, "big") + header + payload


@dataclass
class S3Chain:
    project: TorchProject
    s3: S3Server
    bucket: str
    # The same project checked out in another, deeper folder (another runner's work folder, ``job@2``): its sessions
    # run there, with the same code
    elsewhere: TorchProject | None = None
    runs: dict[str, Run] = field(default_factory=dict)
    objects: dict[str, list[str]] = field(default_factory=dict)  # the bucket's objects after each run
    planted: dict[str, bytes] = field(default_factory=dict)

    def run(self, name: str, *args: str, project: TorchProject | None = None) -> Run:
        self.runs[name] = run = (project or self.project).run(*args)
        self.objects[name] = objects(self.s3, self.bucket)
        return run


@pytest.fixture(scope="class")
def s3_chain(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> S3Chain:
    """The sessions of a CI job on the plugin's defaults (Dynamo reuse on): a frame taken from the store never looks
    its graphs up, so what the layers below Dynamo restore is read where a session traces (the cold, read-only and
    write-only ones) and in the chains that turn reuse off."""
    bucket = s3_server.new_bucket()
    base = removed_unless_failed(request, tmp_path_factory.mktemp("s3-chain"))
    env = {**s3_server.env(), "MEGACACHE_BUCKET": bucket}
    project = TorchProject(path=base / "work", env=env, dynamo_reuse=True)
    chain = S3Chain(project, s3_server, bucket,
                    TorchProject(path=base / "runner-2" / "_work" / "repo" / "repo", env=env, dynamo_reuse=True))
    chain.run("read", "-k", "test_f", "--megacache-mode", "read")  # on the empty bucket
    cold = chain.run("cold", "--megacache-durations=2")
    chain.run("subset", "-k", "test_f", project=chain.elsewhere)  # a fresh runner, in another folder, runs a subset
    chain.run("warm", "--megacache-durations=2", "-v", project=chain.elsewhere)  # -v: every line of the summary
    if cold.report is not None:  # else the tests reading the cold run say why
        client = s3_server.client()
        chain.planted = _malformed_objects(cold.report["fingerprint"]["key"])
        for name, blob in chain.planted.items():
            client.put_object(Bucket=bucket, Key=f"{fingerprint_folder(cold)}/{name}", Body=blob)
        chain.run("refusing", "-k", "test_f")
    chain.run("write", "-k", "test_f", "--megacache-mode", "write")
    return chain


def _summary(lines: list[str]) -> list[str]:
    """The plugin's section of a session's terminal output (after its ``megacache`` separator)."""
    start = next(i for i, line in enumerate(lines) if re.fullmatch(r"-+ megacache -+", line))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(("=", "-"))), len(lines))
    return lines[start + 1:end]


class TestS3Chain:
    """Assertions on the S3 chain's sessions (a class: under pytest-xdist its tests share one worker)."""

    def test_cold_then_warm_over_s3_subset_never_shrinks(self, s3_chain: S3Chain) -> None:
        cold = s3_chain.runs["cold"]
        cold.result.assert_outcomes(passed=3)
        assert cold.fx_misses == 2 and cold.fx_hits == 0
        assert cold.report and cold.report["upload"]["objects"] == 1
        assert cold.report["upload"]["new_entries"]["file/inductor"] > 0  # compiled C++ kernels travel too
        # by default the summary says what was restored and from where, the hits, the compiling and what was uploaded
        # (the slowest compiles as asked); the fingerprint, the load and the notes only under -v (the warm run)
        summary = _summary(cold.result.outlines)
        assert len([line for line in summary if not line.startswith(("slowest", "  "))]) == 4, summary
        assert summary[0].startswith("restored 0/0 objects") and " from s3://" in summary[0], summary
        assert summary[-1].startswith("uploaded ") and "new entries" in summary[-1], summary
        assert not any(line.startswith(("fingerprint", "loaded into torch", "restored bundles")) for line in summary)
        assert len(s3_chain.objects["cold"]) == 1

        # A fresh runner that runs a subset, checked out in another folder: everything it touches is taken from the
        # store, and it must not shrink the cache (nor store a copy for its folder).
        subset = s3_chain.runs["subset"]
        subset.result.assert_outcomes(passed=1, deselected=2)
        assert_all_reused(subset, frames=1)
        assert subset.report and subset.report["upload"]["reason"] == "nothing new"
        assert len(s3_chain.objects["subset"]) == 1

        # The whole selection there, the second run in that folder: every frame taken, nothing uploaded.
        warm = s3_chain.runs["warm"]
        warm.result.assert_outcomes(passed=3)
        assert_all_reused(warm, frames=2)
        assert warm.report is not None
        assert warm.report["restore"]["files_written"] > 0
        assert warm.report["load"]["ok"] is True
        assert warm.report["upload"]["objects"] == 0
        warm.result.stdout.fnmatch_lines(["fingerprint torch-*", "restored 1/1 objects*", "loaded into torch:*",
                                          "torch: FX graph 0 hit / 0 miss / 0 bypass, AOTAutograd 0 hit / 0 miss / 0 "
                                          "bypass, Dynamo reuse 2 frames reused / 0 traced (100 % reused) / 0 refused*"])


    def test_durations_and_per_test_attribution(self, s3_chain: S3Chain) -> None:
        cold = s3_chain.runs["cold"]  # with --megacache-durations=2, as the warm run
        cold.result.assert_outcomes(passed=3)
        cold.result.stdout.fnmatch_lines(["slowest 2 uncached compiles:", "*s  *compiles  test_compiled.py::test_*",
                                          "*s  *compiles  test_compiled.py::test_*"])
        assert cold.report is not None
        per_test = cold.report["torch"]["per_test"]
        assert set(per_test) == {"test_compiled.py::test_f", "test_compiled.py::test_g"}  # test_plain compiles nothing
        for record in per_test.values():
            assert record["seconds"] > 0 and record["counters"]["fxgraph_cache_miss"] == 1
            assert any(a.startswith("inductor:") for a in record["artifacts"])

        warm = s3_chain.runs["warm"]  # every frame taken from the store
        assert warm.fx_misses == warm.fx_hits == 0
        warm.result.stdout.fnmatch_lines(["*of cold compiling saved*", "no test compiled anything uncached"])
        assert warm.report is not None
        saved = warm.report["torch"]["seconds_saved"]
        # What the warm run saved agrees with torch's own compile-time records (the project's conftest): it was spared
        # at least what it compiled less than the cold run (torch times a stored entry's load as a frame compile), and
        # at most what the cold run compiled for the same tests (each variant's seconds are timed inside torch's timing
        # of its frame). Both sides are one run's timings: a loaded machine slows both alike. A subset that takes one
        # test's frame is spared that test's compiling, not the stored whole.
        subset = s3_chain.runs["subset"]
        assert subset.report is not None
        figures = {"warm": (saved, cold.counters["compile_seconds"], warm.counters["compile_seconds"]),
                   "subset": (subset.report["torch"]["seconds_saved"],
                              cold.counters["compile_seconds_per_test"]["test_compiled.py::test_f"],
                              subset.counters["compile_seconds"])}
        off = {run: (claimed, cold_seconds, warm_seconds) for run, (claimed, cold_seconds, warm_seconds) in figures.items()
               if not (0 < cold_seconds - warm_seconds and 0.75 * (cold_seconds - warm_seconds) <= claimed
                       <= 1.05 * cold_seconds + 0.05)}
        assert not off, f"seconds saved (claimed, torch's cold, torch's warm) off torch's records: {off}"
        # What the warm run saved is what the cold run spent on those artifacts.
        assert 0 < saved <= sum(r["seconds"] for r in per_test.values()) + 0.01


    def test_corrupt_foreign_and_hostile_objects_are_refused_before_torch(self, s3_chain: S3Chain) -> None:
        folder = fingerprint_folder(s3_chain.runs["cold"])
        bad = s3_chain.planted
        assert len(bad) == 6 and "refusing" in s3_chain.runs
        warm = s3_chain.runs["refusing"]
        # The good object still serves the session; every bad one is refused and named, in the session's one warning.
        # (Back in the first folder, after the runs in another: the frame is taken from the store there too.)
        assert warm.result.ret == 0
        assert_all_reused(warm, frames=1)
        refused = [line for line in warm.result.outlines if "MegacacheWarning: refused" in line]
        assert len(refused) == 1, warm.result.outlines
        joined = refused[0]
        assert all(f"refused {folder}/{name}" in joined for name in bad), joined
        for reason in ("bad magic", "truncated", "SHA-256 mismatch", "not this environment", "unsafe file path",
                       "unsafe inductor key"):
            assert reason in joined
        assert warm.report and warm.report["restore"]["objects_rejected"] == len(bad)
        assert not list(Path(warm.root).parent.rglob("escaped.so")) and not list(Path(warm.root).parent.rglob("pwned"))


    def test_read_mode_never_uploads_and_write_mode_never_restores(self, s3_chain: S3Chain) -> None:
        read = s3_chain.runs["read"]  # the first session on the bucket
        assert read.fx_misses == 1
        assert s3_chain.objects["read"] == []
        assert read.report and read.report["upload"]["reason"] == "read-only mode"
        write = s3_chain.runs["write"]  # after the cold run populated the bucket
        assert s3_chain.objects["cold"]
        assert write.fx_misses == 1  # nothing was restored
        assert write.report and not write.report["restore"]["attempted"]


# --- one directory store: a push to main (cold, then warm), then a fork's pull request ------------------------


XDIST = importlib.util.find_spec("xdist") is not None
PUSH_TO_MAIN: dict[str, str | None] = {"GITHUB_EVENT_NAME": "push", "GITHUB_REF": "refs/heads/main",
                                       "GITHUB_REF_NAME": "main"}


@dataclass
class DirChain:
    store: Path
    runs: dict[str, Run] = field(default_factory=dict)
    stored: dict[str, list[Path]] = field(default_factory=dict)  # the store's objects after each run
    temp_files: list[Path] = field(default_factory=list)  # the store's .tmp-* after the first run
    first_object: bytes = b""


@pytest.fixture(scope="class")
def dir_chain(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> DirChain:
    base = removed_unless_failed(request, tmp_path_factory.mktemp("dir-chain"))
    chain = DirChain(base / "store")
    project = TorchProject(path=base / "project", env={"MEGACACHE_DIR": str(chain.store)})
    event = base / "event.json"
    event.write_text(json.dumps({
        "pull_request": {"number": 7, "head": {"repo": {"id": 2, "full_name": "someone/fork", "fork": True}},
                         "base": {"repo": {"id": 1, "full_name": "org/repo"}}},
        "repository": {"id": 1, "full_name": "org/repo", "default_branch": "main"},
    }))
    fork_env: dict[str, str | None] = {"GITHUB_EVENT_NAME": "pull_request", "GITHUB_EVENT_PATH": str(event),
                                       "GITHUB_REF": "refs/pull/7/merge", "GITHUB_HEAD_REF": "patch-1",
                                       "GITHUB_BASE_REF": "main"}
    # The first run says -n 0 too where pytest-xdist is installed: xdist loaded, no workers, no controller.
    n0 = ("-n", "0") if XDIST else ()
    for name, args, env in (("main", (*n0, "-k", "test_f"), PUSH_TO_MAIN),
                            ("warm", ("-k", "test_f"), None),
                            ("pr", ("-v",), fork_env),  # compiles test_g, which main's cache lacks; -v: the notes
                            ("explicit", ("--megacache-mode", "readwrite"), fork_env)):  # an explicit mode wins
        chain.runs[name] = project.run(*args, env=env)
        chain.stored[name] = sorted(chain.store.rglob("*.mcb"))
        if name == "main":
            chain.temp_files = list(chain.store.rglob(".tmp-*"))
            chain.first_object = chain.stored[name][0].read_bytes() if chain.stored[name] else b""
    return chain


class TestDirChain:
    """Assertions on the directory chain's sessions (a class: under pytest-xdist its tests share one worker)."""

    def test_cold_then_warm_over_local_directory(self, dir_chain: DirChain) -> None:
        cold = dir_chain.runs["main"]
        assert cold.fx_misses == 1
        written = dir_chain.stored["main"]
        assert len(written) == 1 and not dir_chain.temp_files
        header, entries = bundlemod.decode(dir_chain.first_object)
        assert header.fingerprint in str(written[0])
        assert {"torch/inductor", "torch/aot_autograd", "file/inductor"} <= set(entries.counts())

        warm = dir_chain.runs["warm"]
        assert warm.fx_hits == 1 and warm.fx_misses == 0 and warm.aot_hits == 1
        # Where each session's seconds went: its own process only, the compile split by torch's own timings.
        for run in (cold, warm):
            assert run.report is not None
            [main] = run.report["processes"]
            assert main["process"] == "main"
            assert main["startup"] is not None and 0 < main["startup"] < main["total"]
            assert main["imports"] > 0  # torch._dynamo's import, inside the test's first torch.compile
            assert main["dynamo"] > 0 and main["backend"] > 0
            phases = sum(main[name] or 0 for name in PHASES)
            assert phases <= main["total"] + 0.05, main
            assert main["total"] <= main["startup"] + run.report["session_seconds"] + 0.05, main
        assert cold.report and warm.report
        assert cold.report["processes"][0]["backend"] > warm.report["processes"][0]["backend"]
        assert warm.report["processes"][0]["load"] > 0 and cold.report["processes"][0]["load"] == 0


    def test_a_fork_pull_request_restores_but_never_uploads(self, dir_chain: DirChain) -> None:
        main = dir_chain.runs["main"]  # a push to main
        assert main.report is not None and main.report["upload"]["objects"] == 1
        pr = dir_chain.runs["pr"]
        assert pr.report is not None
        assert pr.report["settings"]["mode"] == "read"
        assert pr.report["scope"] == {"write": "pr-7", "read": ["pr-7", "main"]}
        assert pr.fx_hits == 1 and pr.fx_misses == 1  # main's cache was read
        assert pr.report["upload"]["reason"] == "read-only mode"
        assert len(dir_chain.stored["pr"]) == 1
        pr.result.stdout.fnmatch_lines(["*read-only: *fork*"])
        # An explicit mode wins over the fork default.
        explicit = dir_chain.runs["explicit"]
        assert explicit.report is not None and explicit.report["upload"]["objects"] == 1
        assert sorted(p.relative_to(dir_chain.store).parts[1] for p in dir_chain.stored["explicit"]) == ["main", "pr-7"]


    @pytest.mark.skipif(not XDIST, reason="pytest-xdist is not installed")
    def test_n0_runs_without_a_controller(self, dir_chain: DirChain) -> None:
        run = dir_chain.runs["main"]  # -n 0
        run.result.assert_outcomes(passed=1)
        assert run.report is not None
        assert run.report["xdist"]["role"] == "solo" and run.report["upload"]["objects"] == 1


# --- sessions of their own ---------------------------------------------------------------------------------


def test_writers_in_sequence_keep_both_and_compaction_loses_nothing(pytester: pytest.Pytester,
                                                                    s3_server: S3Server) -> None:
    """On the plugin's defaults (Dynamo reuse on): the merged object holds every Dynamo entry, the one restored
    and not used by the second writer included, and a warm run from it takes every frame."""
    bucket = s3_server.new_bucket()
    project = TorchProject(pytester, env={**s3_server.env(), "MEGACACHE_BUCKET": bucket}, dynamo_reuse=True)
    client = s3_server.client()

    def dynamo_entries() -> set[str]:
        """The names of the Dynamo entries of the bucket's one object."""
        [key] = objects(s3_server, bucket)
        _, entries = bundlemod.decode(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        return {e.name for e in entries if e.kind == "torch/precompile"}

    first = project.run("-k", "test_f", "--megacache-compact-after", "1")
    assert first.fx_misses == 1
    assert len(objects(s3_server, bucket)) == 1
    f_entry = dynamo_entries()
    assert len(f_entry) == 1
    second = project.run("-k", "test_g", "--megacache-compact-after", "1")
    # g was new; f's object had been restored, so the upload holds both and replaces it.
    assert second.fx_misses == 1
    assert second.report and second.report["upload"]["compacted"] == 1
    remaining = objects(s3_server, bucket)
    assert len(remaining) == 1
    merged = dynamo_entries()
    assert len(merged) == 2 and f_entry < merged, (f_entry, merged)
    warm = project.run()
    warm.result.assert_outcomes(passed=3)
    assert_all_reused(warm, frames=2)  # both frames taken from the merged object


def test_unreachable_endpoint_warns_once_and_runs_cold(pytester: pytest.Pytester, s3_server: S3Server) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    project = TorchProject(pytester, env={**s3_server.env(), "AWS_ENDPOINT_URL_S3": dead, "MEGACACHE_BUCKET": "any-bucket"})
    start = time.monotonic()
    run = project.run("-k", "test_f")
    elapsed = time.monotonic() - start
    run.result.assert_outcomes(passed=1, deselected=2)
    assert run.result.ret == 0
    assert run.fx_misses == 1
    warnings = [w for w in run.result.outlines if "MegacacheWarning: restore: S3 list" in w]
    assert len(warnings) == 1, run.result.outlines
    assert run.report and run.report["upload"]["reason"] == "store unavailable"
    assert elapsed < 120, f"a dead endpoint must cost seconds, not minutes ({elapsed:.0f} s)"


def test_missing_bucket_warns_and_runs_cold(pytester: pytest.Pytester, s3_server: S3Server) -> None:
    project = TorchProject(pytester, env={**s3_server.env(), "MEGACACHE_BUCKET": "no-such-bucket-here"})
    run = project.run("-k", "test_f")
    assert run.result.ret == 0
    run.result.stdout.fnmatch_lines(["*MegacacheWarning: restore: S3 list on bucket 'no-such-bucket-here' failed*"])
    assert run.report and run.report["upload"]["reason"] == "store unavailable"


def test_strict_mode_turns_a_cache_problem_into_an_error(pytester: pytest.Pytester, s3_server: S3Server) -> None:
    project = TorchProject(pytester, env={**s3_server.env(), "MEGACACHE_BUCKET": "no-such-bucket-here"})
    run = project.run("-k", "test_plain", "--megacache-strict")
    assert run.result.ret != 0
    run.result.stderr.fnmatch_lines(["*pytest-megacache (strict): restore: S3 list*NoSuchBucket*"])


def test_idle_session_imports_no_compiler_stack(s3_project: tuple[TorchProject, str]) -> None:
    project, _bucket = s3_project
    run = project.run("-k", "test_plain")
    run.result.assert_outcomes(passed=1, deselected=2)
    assert run.counters["modules"] == {"torch": True, "torch._dynamo": False, "torch._inductor": False}
    assert run.report and run.report["restore"]["attempted"] and run.report["upload"]["reason"] == "nothing was compiled"


def test_full_disk_store_warns_and_keeps_the_session_green(pytester: pytest.Pytester,
                                                           small_filesystem: SmallFilesystems) -> None:
    tiny_disk = small_filesystem("64k")
    disk = os.statvfs(tiny_disk)
    assert disk.f_blocks * disk.f_frsize <= 64 * 1024, tiny_disk  # the tiny filesystem itself, not the one below it
    (tiny_disk / "filler").write_bytes(b"\0" * 60 * 1024)
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(tiny_disk / "store")})
    run = project.run("-k", "test_f")
    run.result.assert_outcomes(passed=1, deselected=2)
    assert run.result.ret == 0
    run.result.stdout.fnmatch_lines(["*MegacacheWarning: upload: cannot write*No space left on device*"])
    assert run.report and run.report["upload"]["reason"] == "upload failed"
    assert not list(tiny_disk.rglob("*.mcb")) and not list(tiny_disk.rglob(".tmp-*"))


BUCKET_VANISHES = textwrap.dedent("""
    import os

    import boto3
    import torch

    def test_compiles_then_the_bucket_goes_away():
        assert torch.compile(lambda x: torch.sin(x) * 3)(torch.zeros(2)).sum() == 0
        s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
        s3.delete_bucket(Bucket=os.environ["MEGACACHE_BUCKET"])  # empty: a cold run stored nothing yet
    """)


@pytest.mark.parametrize("strict", [False, True])
def test_an_upload_failure_warns_and_only_strict_mode_fails_the_session(pytester: pytest.Pytester,
                                                                       s3_server: S3Server, strict: bool) -> None:
    """The restore works, the tests pass, then the upload fails (the bucket is gone): one warning and a
    green session; with --megacache-strict the same session fails, and says why."""
    bucket = s3_server.new_bucket()
    project = TorchProject(pytester, env={**s3_server.env(), "MEGACACHE_BUCKET": bucket}, tests=BUCKET_VANISHES)
    run = project.run(*(["--megacache-strict"] if strict else []))
    run.result.assert_outcomes(passed=1)
    assert run.report is not None
    assert run.report["upload"]["attempted"] and run.report["upload"]["reason"] == "upload failed"
    [problem] = run.report["problems"]
    assert "upload" in problem and "NoSuchBucket" in problem, problem
    if strict:
        assert run.result.ret == pytest.ExitCode.TESTS_FAILED
        run.result.stdout.fnmatch_lines(["*megacache strict: 1 cache problem(s) fail this session*"])
    else:
        assert run.result.ret == pytest.ExitCode.OK


FORWARD_ONLY = textwrap.dedent("""
    import torch

    def f(x, w):
        return torch.sin(x @ w).sum()

    def test_forward_only_with_a_weight_that_requires_grad():
        torch.manual_seed(0)
        x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
        # a sum: its order of additions differs from eager's, so a tolerance for that, not allclose's near-zero one
        torch.testing.assert_close(torch.compile(f)(x, w), f(x, w), atol=1e-5, rtol=1e-5)
    """)


@pytest.mark.parametrize("eager", [False, True], ids=["default", "eager-backward"])
def test_eager_backward_makes_a_forward_only_graph_storable(pytester: pytest.Pytester, eager: bool) -> None:
    """torch stores an AOTAutograd entry only once its backward is compiled, which is lazy: a forward whose weight
    requires grad, in a test that never calls backward(), misses in every run by default, and the note says so.
    --megacache-eager-backward compiles the backward with the forward, so the entry is stored and hits warm."""
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(pytester.path / "store")}, tests=FORWARD_ONLY)
    args = ("--megacache-eager-backward",) if eager else ()
    cold = project.run(*args)
    cold.result.assert_outcomes(passed=1)
    warm = project.run(*args)
    warm.result.assert_outcomes(passed=1)
    assert warm.report is not None
    c = warm.report["torch"]["counters"]
    assert (c["autograd_cache_hit"], c["autograd_cache_miss"]) == ((1, 0) if eager else (0, 1)), c
    unstored = [n for n in warm.report["notes"] if "not stored" in n]
    if eager:
        assert warm.report["settings"]["eager_backward"] is True and unstored == []
    else:
        assert len(unstored) == 1 and "--megacache-eager-backward" in unstored[0], warm.report["notes"]
