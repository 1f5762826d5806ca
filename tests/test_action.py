"""The GitHub Action's planning script (action/megacache_action.py) and how action.yml wires it to actions/cache.

The script runs as the runner runs it: a subprocess with fake GITHUB_ENV / GITHUB_OUTPUT files, a fake event
payload (GITHUB_EVENT_NAME / GITHUB_EVENT_PATH) and, for a directory store, a fake ``pytest-megacache`` on PATH
that prints a fingerprint (one test uses the real command). Validation cases call ``plan()`` in-process.
action.yml's schema and generic structure are checked in tests/test_workflows.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from pytest_megacache import ci_env

from .conftest import tool_path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "action" / "megacache_action.py"
ACTION = ROOT / "action.yml"
FAKE_KEY = "torch-2.13.0+cpu-cpu-avx2-t2-py3.11-linux-x86_64-895359ba7608"
SECRET = "s3cr3t-Value-that-must-never-show"
REPO = {"id": 1, "full_name": "owner/repo", "default_branch": "main"}
FORK_REPO = {"id": 2, "full_name": "someone/repo", "fork": True}


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("megacache_action", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


action = _load()


def pr_event(head: dict[str, Any] | None, base: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"repository": base or REPO, "pull_request": {"number": 7, "head": {"repo": head}}}


PUSH = {"repository": REPO}


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    env: dict[str, str]
    outputs: dict[str, str]


def _pairs(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines() if path.exists() else []
    pairs = [line.split("=", 1) for line in lines]
    assert all(len(p) == 2 for p in pairs), lines
    names = [p[0] for p in pairs]
    assert len(names) == len(set(names)), f"a name written twice: {names}"
    return dict((p[0], p[1]) for p in pairs)


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """A directory holding a fake ``pytest-megacache`` that prints FAKE_KEY for ``key --flat``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "pytest-megacache"
    exe.write_text(f'#!/bin/sh\n[ "$1 $2" = "key --flat" ] || exit 9\necho "{FAKE_KEY}"\n')
    exe.chmod(0o755)
    return bindir


def run_action(tmp_path: Path, inputs: dict[str, str], *, event: str = "push",
               payload: dict[str, Any] | None = None, ref: str = "refs/heads/main", bindir: Path | None = None,
               extra: dict[str, str] | None = None) -> Result:
    env_file, out_file, event_file = tmp_path / "github_env", tmp_path / "github_output", tmp_path / "event.json"
    env_file.write_text("")
    out_file.write_text("")
    event_file.write_text(json.dumps(PUSH if payload is None else payload))
    path = os.pathsep.join([str(bindir)] if bindir else []) or str(tmp_path / "empty-path")
    env = {
        "PATH": path, "HOME": str(tmp_path), "GITHUB_ENV": str(env_file), "GITHUB_OUTPUT": str(out_file),
        "GITHUB_EVENT_NAME": event, "GITHUB_EVENT_PATH": str(event_file), "GITHUB_REF": ref,
        "GITHUB_RUN_ID": "4242", "GITHUB_RUN_ATTEMPT": "3", "GITHUB_JOB": "gpu-tests",
        **{action.INPUTS[name]: value for name, value in inputs.items()}, **(extra or {}),
    }
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env,
                          cwd=tmp_path)
    return Result(proc.returncode, proc.stdout, proc.stderr, _pairs(env_file), _pairs(out_file))


def ok(result: Result) -> Result:
    assert result.rc == 0, result.stdout + result.stderr
    assert "::error" not in result.stdout
    assert set(result.outputs) == set(action.OUTPUTS), "every output is written on every run"
    return result


# --- a directory store -----------------------------------------------------------------------------

def test_dir_store_push_to_default_branch_restores_and_saves(tmp_path: Path, fake_bin: Path) -> None:
    r = ok(run_action(tmp_path, {"dir": "store"}, bindir=fake_bin))
    store = str(tmp_path / "store")
    assert r.env == {"MEGACACHE_DIR": store}, "relative to the workspace, absolute for the test step"
    assert r.outputs["store"] == "dir" and r.outputs["path"] == store
    assert r.outputs["fork"] == "false" and r.outputs["mode"] == "readwrite"
    assert r.outputs["key"] == FAKE_KEY
    assert r.outputs["cache"] == "restore-and-save"
    assert "saved at the end of the job" in r.stdout


def test_dir_store_keys(tmp_path: Path, fake_bin: Path) -> None:
    """actions/cache entries are immutable: each run saves under a key of its own (run id and attempt), and the
    one restore key is that key up to the run: the newest entry of this fingerprint and job."""
    r = ok(run_action(tmp_path, {"dir": "store"}, bindir=fake_bin))
    key, restore = r.outputs["cache-key"], r.outputs["restore-key"]
    assert key.startswith(restore) and restore.endswith("~")
    assert FAKE_KEY in restore and "gpu-tests" in restore
    assert key[len(restore):] == "4242-3"
    assert "," not in key and len(key) <= action.KEY_MAX


@pytest.mark.parametrize(("event", "payload", "ref", "why"), [
    ("push", {"repository": {**REPO, "default_branch": "trunk"}}, "refs/heads/main", "another branch"),
    ("push", {"repository": {"id": 1}}, "refs/heads/main", "does not name the default branch"),
    ("pull_request", pr_event(REPO), "refs/pull/7/merge", "not a push"),
    ("workflow_dispatch", PUSH, "refs/heads/main", "not a push"),
])
def test_dir_store_restores_only_except_on_pushes_to_the_default_branch(
        tmp_path: Path, fake_bin: Path, event: str, payload: dict[str, Any], ref: str, why: str) -> None:
    r = ok(run_action(tmp_path, {"dir": "store"}, event=event, payload=payload, ref=ref, bindir=fake_bin))
    assert r.outputs["cache"] == "restore", r.stdout
    assert why in r.stdout
    assert "MEGACACHE_MODE" not in r.env, "a pull request from this repository keeps the plugin's default"


@pytest.mark.parametrize(("mode", "cache"), [("read", "restore"), ("off", "none"), ("write", "restore-and-save"),
                                             ("readwrite", "restore-and-save")])
def test_dir_store_mode(tmp_path: Path, fake_bin: Path, mode: str, cache: str) -> None:
    r = ok(run_action(tmp_path, {"dir": "store", "mode": mode}, bindir=fake_bin))
    assert r.env["MEGACACHE_MODE"] == mode and r.outputs["mode"] == mode
    assert r.outputs["cache"] == cache
    if mode == "off":
        assert r.outputs["cache-key"] == "" and r.outputs["key"] == "", "off needs no fingerprint"


def test_dir_store_path_forms() -> None:
    def path(directory: str) -> str:
        plan = action.plan({"INPUT_DIR": directory, "GITHUB_RUN_ID": "1"}, Path("/work/repo"), lambda: FAKE_KEY)
        assert plan.outputs["path"] == plan.env["MEGACACHE_DIR"], "actions/cache saves what the plugin writes"
        return str(plan.env["MEGACACHE_DIR"])
    assert path("store") == "/work/repo/store"
    assert path("./a/../store/") == "/work/repo/store"
    assert path("/tmp/megacache") == "/tmp/megacache"
    assert path("~/megacache") == os.path.join(os.path.expanduser("~"), "megacache")


def _keys(suffix: str, job: str = "tests") -> tuple[str, str]:
    env = {"INPUT_DIR": "/s", "INPUT_KEY_SUFFIX": suffix, "GITHUB_RUN_ID": "99", "GITHUB_JOB": job}
    outputs = action.plan(env, Path("/"), lambda: FAKE_KEY).outputs
    return str(outputs["restore-key"]), str(outputs["cache-key"])


@pytest.mark.parametrize(("mine", "other"), [("", "a"), ("a", "a-b"), ("a", ""), ("py3.11", "py3.11-cuda"),
                                             ("x", "x.y")])
def test_key_suffixes_never_restore_each_others_entries(mine: str, other: str) -> None:
    restore, _ = _keys(mine)
    _, other_key = _keys(other)
    assert not other_key.startswith(restore), (restore, other_key)
    assert _keys(mine)[1].startswith(restore)


def test_jobs_never_restore_each_others_entries() -> None:
    restore, _ = _keys("", job="tests")
    assert not _keys("", job="tests-gpu")[1].startswith(restore)
    assert _keys("", job="bad job/name")[0].endswith("-bad_job_name~"), "a job id is made a key component"


def test_the_real_key_command(tmp_path: Path) -> None:
    """With the plugin installed, the key is `pytest-megacache key --flat` (what tests/test_workflows.py checks)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("pytest-megacache key needs torch")
    bindir = Path(sys.executable).parent
    if not (bindir / "pytest-megacache").exists():
        pytest.skip("the pytest-megacache script is not installed next to this interpreter")
    # The key names the C++ compiler found on PATH: the action's step sees the PATH the test step will (as on a runner).
    r = ok(run_action(tmp_path, {"dir": "store"}, bindir=bindir,
                      extra={"PATH": os.pathsep.join([str(bindir), os.environ.get("PATH", "")])}))
    flat = subprocess.run([str(bindir / "pytest-megacache"), "key", "--flat"], capture_output=True, text=True,
                          timeout=120).stdout.strip()
    assert r.outputs["key"] == flat and flat in r.outputs["cache-key"]


# --- an S3 store -----------------------------------------------------------------------------------

def test_s3_store_exports_the_settings_only(tmp_path: Path) -> None:
    r = ok(run_action(tmp_path, {"bucket": "my-ci-cache", "prefix": "proj", "endpoint-url": "https://minio.example:9000"}))
    assert r.env == {"MEGACACHE_BUCKET": "my-ci-cache", "MEGACACHE_PREFIX": "proj",
                     "MEGACACHE_ENDPOINT_URL": "https://minio.example:9000"}
    assert r.outputs["store"] == "s3" and r.outputs["cache"] == "none" and r.outputs["key"] == ""
    assert "my-ci-cache" not in r.stdout + r.stderr and "minio" not in r.stdout + r.stderr


def test_s3_store_needs_no_plugin_yet() -> None:
    """The S3 path runs before the environment is set up (its fork output decides the credentials step)."""
    def no_key() -> str:
        raise AssertionError("the S3 path must not compute a fingerprint")
    plan = action.plan({"INPUT_BUCKET": "b-1"}, Path("/"), no_key)
    assert plan.env == {"MEGACACHE_BUCKET": "b-1"} and plan.outputs["cache"] == "none"


# --- pull requests from forks -----------------------------------------------------------------------

FORK_CASES: dict[str, tuple[str, dict[str, Any] | None, bool]] = {
    "fork by id": ("pull_request", pr_event(FORK_REPO), True),
    "same repository": ("pull_request", pr_event(REPO), False),
    "renamed base, same id": ("pull_request", pr_event(REPO, {**REPO, "full_name": "owner/renamed"}), False),
    "names only, case differs": ("pull_request", pr_event({"full_name": "Owner/Repo"}, {"full_name": "owner/repo"}),
                                 False),
    "names only, fork": ("pull_request", pr_event({"full_name": "x/repo"}, {"full_name": "owner/repo"}), True),
    "deleted fork": ("pull_request", pr_event(None), True),
    "fork flag only": ("pull_request", pr_event({"fork": True}, {"x": 1}), True),
    "nothing known": ("pull_request", pr_event({"x": 1}, {"x": 1}), True),
    "target event from a fork": ("pull_request_target", pr_event(FORK_REPO), True),
    "unreadable payload": ("pull_request", None, True),
    "push": ("push", PUSH, False),
}


def _fork_env(tmp_path: Path, event: str, payload: dict[str, Any] | None) -> dict[str, str]:
    path = tmp_path / "event.json"
    path.write_text("{not json" if payload is None else json.dumps(payload))
    return {"GITHUB_EVENT_NAME": event, "GITHUB_EVENT_PATH": str(path)}


@pytest.mark.parametrize("case", sorted(FORK_CASES))
def test_fork_detection_agrees_with_the_plugin(tmp_path: Path, case: str) -> None:
    event, payload, expected = FORK_CASES[case]
    env = _fork_env(tmp_path, event, payload)
    fork, _why = action.fork_pull_request(env)
    assert fork is expected
    assert bool(ci_env.is_fork_pull_request(env)) is fork, "the action and the plugin must agree"


@pytest.mark.parametrize("requested", ["", "readwrite", "read", "write", "off"])
def test_fork_pull_requests_are_read_only(tmp_path: Path, fake_bin: Path, requested: str) -> None:
    inputs = {"dir": "store", **({"mode": requested} if requested else {})}
    r = ok(run_action(tmp_path, inputs, event="pull_request", payload=pr_event(FORK_REPO), ref="refs/pull/7/merge",
                      bindir=fake_bin))
    assert r.outputs["fork"] == "true"
    assert r.env["MEGACACHE_MODE"] in {"read", "off"}, "exported explicitly, so no ini setting can make it write"
    assert r.outputs["mode"] == r.env["MEGACACHE_MODE"]
    assert r.outputs["cache"] in {"restore", "none"}
    assert "::notice title=pytest-megacache::pull request from a fork" in r.stdout


def test_fork_pull_request_with_s3_is_read_only(tmp_path: Path) -> None:
    r = ok(run_action(tmp_path, {"bucket": "my-ci-cache"}, event="pull_request", payload=pr_event(FORK_REPO)))
    assert r.env["MEGACACHE_MODE"] == "read" and r.outputs["fork"] == "true"


# --- errors -----------------------------------------------------------------------------------------

ERRORS: dict[str, tuple[dict[str, str], str]] = {
    "no store": ({}, "set one store"),
    "blank store": ({"dir": "  ", "bucket": ""}, "set one store"),
    "two stores": ({"dir": "d", "bucket": "b-1"}, "not both"),
    "endpoint without bucket": ({"dir": "d", "endpoint-url": "https://h"}, "set 'bucket' too"),
    "bad mode": ({"dir": "d", "mode": "rw"}, "input 'mode' must be one of"),
    "suffix with bucket": ({"bucket": "b-1", "key-suffix": "a"}, "for 'dir' only"),
    "bad suffix": ({"dir": "d", "key-suffix": "a,b"}, "input 'key-suffix' may hold only"),
    "long suffix": ({"dir": "d", "key-suffix": "a" * 101}, "input 'key-suffix' may hold only"),
    "line break": ({"dir": "d\nMEGACACHE_MODE=write"}, "input 'dir' holds a line break"),
    "glob dir": ({"dir": "cache/*"}, "input 'dir' must be a plain path"),
    "negated dir": ({"dir": "!cache"}, "input 'dir' must be a plain path"),
    "endpoint not a URL": ({"bucket": "b-1", "endpoint-url": "minio:9000"}, "must be an http:// or https:// URL"),
    "endpoint bad port": ({"bucket": "b-1", "endpoint-url": "http://h:port"}, "is not a URL"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_inputs_are_clear_errors(case: str) -> None:
    inputs, message = ERRORS[case]
    env = {action.INPUTS[k]: v for k, v in inputs.items()} | {"GITHUB_RUN_ID": "1"}
    with pytest.raises(action.ActionError, match=re.escape(message)):
        action.plan(env, Path("/"), lambda: FAKE_KEY)


def error(result: Result, message: str) -> None:
    assert result.rc == 1, result.stdout + result.stderr
    assert f"::error title=pytest-megacache::{message}" in result.stdout, result.stdout
    assert result.env == {} and result.outputs == {}, "nothing is exported on an error"


def test_error_from_the_runner_side(tmp_path: Path, fake_bin: Path) -> None:
    error(run_action(tmp_path, {}), "set one store")
    error(run_action(tmp_path, {"dir": "store"}), "the pytest-megacache command is not on PATH")
    error(run_action(tmp_path, {"dir": "store"}, bindir=fake_bin, extra={"GITHUB_RUN_ID": ""}),
          "GITHUB_RUN_ID / GITHUB_RUN_ATTEMPT are not set")


def test_a_failing_key_command_is_an_error(tmp_path: Path, fake_bin: Path) -> None:
    (fake_bin / "pytest-megacache").write_text("#!/bin/sh\necho 'noise' >&2\necho 'torch is not installed' >&2\nexit 2\n")
    error(run_action(tmp_path, {"dir": "store"}, bindir=fake_bin),
          "pytest-megacache key failed (exit status 2): torch is not installed")


@pytest.mark.parametrize("printed", ["", "has space", "a/b", "x" * 301])
def test_an_unusable_key_is_an_error(printed: str) -> None:
    with pytest.raises(action.ActionError, match="no usable actions/cache key"):
        action.plan({"INPUT_DIR": "/d", "GITHUB_RUN_ID": "1"}, Path("/"), lambda: printed)


def test_too_long_a_key_is_an_error() -> None:
    env = {"INPUT_DIR": "/d", "INPUT_KEY_SUFFIX": "s" * 100, "GITHUB_JOB": "j" * 100, "GITHUB_RUN_ID": "1"}
    with pytest.raises(action.ActionError, match="use a shorter key-suffix"):
        action.plan(env, Path("/"), lambda: "k" * 300)


@pytest.mark.parametrize("missing", ["GITHUB_ENV", "GITHUB_OUTPUT"])
def test_missing_github_files_are_errors(tmp_path: Path, missing: str, capsys: pytest.CaptureFixture[str]) -> None:
    files = {"GITHUB_ENV": tmp_path / "env", "GITHUB_OUTPUT": tmp_path / "out"}
    env = {"INPUT_BUCKET": "b-1", **{k: str(v) for k, v in files.items() if k != missing}}
    assert action.main(env, tmp_path) == 1
    assert f"{missing} is not set" in capsys.readouterr().out
    assert not any(p.exists() for p in files.values()), "nothing written when either file is missing"


# --- nothing secret in the log -----------------------------------------------------------------------

SECRET_ENV = {"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": SECRET, "MEGACACHE_SIGNING_KEY": SECRET,
              "RUNNER_DEBUG": "1", "ACTIONS_STEP_DEBUG": "true"}


def test_credentials_in_the_endpoint_are_refused_unseen(tmp_path: Path) -> None:
    url = f"https://ci-user:{SECRET}@minio.example"
    r = run_action(tmp_path, {"bucket": "my-ci-cache", "endpoint-url": url}, extra=SECRET_ENV)
    error(r, "input 'endpoint-url' holds credentials")
    assert SECRET not in r.stdout + r.stderr and "ci-user" not in r.stdout + r.stderr


@pytest.mark.parametrize("inputs", [{"bucket": "my-ci-cache"}, {"dir": "store"}, {"dir": "store", "mode": "nope"}],
                         ids=["s3", "dir", "error"])
def test_no_secret_in_stdout_or_stderr(tmp_path: Path, fake_bin: Path, inputs: dict[str, str]) -> None:
    r = run_action(tmp_path, inputs, bindir=fake_bin, extra=SECRET_ENV)
    assert r.stdout.strip(), "the script says what it did (the check below must see its output)"
    assert SECRET not in r.stdout + r.stderr
    assert SECRET not in "".join(r.env.values()) + "".join(r.outputs.values()), "nothing of the environment exported"


# --- action.yml wiring -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def action_yml() -> dict[str, Any]:
    data = yaml.safe_load(ACTION.read_text())
    assert isinstance(data, dict)
    return data


def _steps(action_yml: dict[str, Any]) -> list[dict[str, Any]]:
    found = action_yml["runs"]["steps"]
    assert isinstance(found, list)
    return found


def cache_wiring_problems(action_yml: dict[str, Any]) -> list[str]:
    """One actions/cache step per cache value of the plan: restore-only uses actions/cache/restore (it never
    saves), restore-and-save uses actions/cache (its post step saves); both restore the same path and keys."""
    problems = []
    steps = _steps(action_yml)
    plan_ids = [s.get("id") for s in steps if "megacache_action.py" in str(s.get("run", ""))]
    if plan_ids != ["plan"] or steps[0].get("id") != "plan":
        problems.append(f"the plan step must come first, once, with id 'plan' (found {plan_ids})")
    expected = {"restore": "actions/cache/restore@", "restore-and-save": "actions/cache@"}
    for value in action.CACHE_STEPS:
        cond = f"steps.plan.outputs.cache == '{value}'"
        matching = [s for s in steps if " ".join(str(s.get("if", "")).split()) == cond]
        if value == "none":
            if matching:
                problems.append("no step may run for cache == 'none'")
            continue
        if len(matching) != 1 or not str(matching[0].get("uses", "")).startswith(expected[value]):
            problems.append(f"cache == '{value}' must run exactly one {expected[value]}... step")
            continue
        with_ = matching[0].get("with") or {}
        want = {"path": "${{ steps.plan.outputs.path }}", "key": "${{ steps.plan.outputs.cache-key }}",
                "restore-keys": "${{ steps.plan.outputs.restore-key }}"}
        if {k: str(with_.get(k, "")).strip() for k in want} != want:
            problems.append(f"cache == '{value}': path, key and restore-keys must be the plan's")
    others = [s for s in steps if "actions/cache" in str(s.get("uses", "")) and "steps.plan.outputs.cache ==" not in
              str(s.get("if", ""))]
    if others:
        problems.append("an actions/cache step runs without the plan's condition")
    return problems


def test_action_cache_wiring(action_yml: dict[str, Any]) -> None:
    assert not cache_wiring_problems(action_yml), cache_wiring_problems(action_yml)


def _broken(action_yml: dict[str, Any], change: Callable[[list[dict[str, Any]]], object]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(action_yml))
    change(_steps(data))
    return data


BROKEN_WIRING: dict[str, Callable[[list[dict[str, Any]]], object]] = {
    "save on every event": lambda steps: steps[1].update({"uses": "actions/cache@v5"}),
    "restore step removed": lambda steps: steps.pop(1),
    "another path": lambda steps: steps[2]["with"].update({"path": "/tmp/x"}),
    "plan not first": lambda steps: steps.append(steps.pop(0)),
    "unconditional cache": lambda steps: steps[2].pop("if"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_WIRING))
def test_cache_wiring_check_catches(action_yml: dict[str, Any], case: str) -> None:
    assert cache_wiring_problems(_broken(action_yml, BROKEN_WIRING[case])), case


def test_plan_step_passes_every_input_through_env(action_yml: dict[str, Any]) -> None:
    plan = _steps(action_yml)[0]
    env = {k: " ".join(str(v).split()) for k, v in plan["env"].items()}
    assert env == {var: f"${{{{ inputs.{name} }}}}" for name, var in action.INPUTS.items()}
    assert set(action.INPUTS) == set(action_yml["inputs"])


def test_action_outputs_are_the_plans(action_yml: dict[str, Any]) -> None:
    for name, spec in action_yml["outputs"].items():
        assert " ".join(str(spec["value"]).split()) == f"${{{{ steps.plan.outputs.{name} }}}}", name
        assert name in action.OUTPUTS


def test_scripts_never_trace(tmp_path: Path) -> None:
    """`set -x` would print every expanded command (and any secret in it) to the log."""
    texts = [ACTION.read_text(), *(p.read_text() for p in (ROOT / "action").iterdir() if p.is_file())]
    for text in texts:
        for needle in ("set -x", "set -o xtrace", "bash -x", "::add-mask::"):
            assert needle not in text, needle


def test_the_scripts_are_lint_and_type_clean() -> None:
    """tests/test_quality.py covers the package and the tests; the action's and the release's scripts run on
    runners, outside both: ruff and mypy --strict here."""
    scripts = [str(SCRIPT), str(ROOT / ".github" / "scripts" / "check_release.py")]
    ruff = subprocess.run([tool_path("ruff"), "check", *scripts], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr
    mypy = subprocess.run([tool_path("mypy"), "--strict", *scripts], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert mypy.returncode == 0, mypy.stdout + mypy.stderr
