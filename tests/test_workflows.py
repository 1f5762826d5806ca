"""The GitHub Actions workflows and docs/ci.md: schema, pinning, wiring, and the plugin names they use.

actionlint cannot be installed offline (its PyPI package downloads a binary from GitHub), so the schema
check uses check-jsonschema's vendored copy of GitHub's workflow schema, and the rest is checked here
with PyYAML. Each structural check is a function returning a list of problems, with a test feeding it a
broken workflow so that the check is known to be able to fail.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pytest_megacache.settings import OPTIONS

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
DOCS = ROOT / "docs" / "ci.md"
GPU_S3 = WORKFLOWS / "gpu-example.yml"
GPU_ACTIONS_CACHE = WORKFLOWS / "gpu-example-actions-cache.yml"
WORKFLOW_FILES = sorted(WORKFLOWS.glob("*.yml"))

# Names the workflows and docs/ci.md may use that are not settings.OPTIONS entries: the signing key is
# read from the environment only (never a flag or an ini key). Everything else must exist in OPTIONS.
PENDING_FLAGS: frozenset[str] = frozenset()
PENDING_ENV = frozenset({"MEGACACHE_SIGNING_KEY"})

FLAG_RE = re.compile(r"--megacache-[a-z0-9]+(?:-[a-z0-9]+)*")
# MEGACACHE_* names, except repository variables and secrets (vars.MEGACACHE_ROLE_ARN is not the plugin's).
ENV_RE = re.compile(r"(?<![A-Za-z0-9_])(?<!vars\.)(?<!secrets\.)MEGACACHE_[A-Z0-9]+(?:_[A-Z0-9]+)*")
EXPR_RE = re.compile(r"\$\{\{(.*?)\}\}", re.S)
STEP_OUTPUT_RE = re.compile(r"\bsteps\.([A-Za-z_][A-Za-z0-9_-]*)\.outputs\.([A-Za-z_][A-Za-z0-9_-]*)")
USES_RE = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+(?:/[^@\s]+)?@(?:v\d+(?:\.\d+){0,2}|[0-9a-f]{40})")
CACHE_KEY_MAX = 512  # actions/cache: keys of at most 512 characters, without commas


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path.name}: not a mapping"
    if True in data:  # YAML 1.1 reads the `on` key as a boolean
        data["on"] = data.pop(True)
    return data


def jobs(wf: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = wf.get("jobs") or {}
    assert isinstance(found, dict)
    return found


def steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    found = job.get("steps") or []
    assert isinstance(found, list)
    return found


def strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)


def expressions(node: dict[str, Any]) -> list[str]:
    """The expressions in a step or job: every ${{ }} in any value, and `if:` whole (it may be bare)."""
    found = [m for text in strings(node) for m in EXPR_RE.findall(text)]
    condition = node.get("if")
    if isinstance(condition, str):
        found.append(condition)
    return found


def normalized(text: str) -> str:
    text = text.strip()
    if text.startswith("${{") and text.endswith("}}"):
        text = text[3:-2]
    return " ".join(text.split())


def find_step(wf: dict[str, Any], predicate: Any, what: str) -> dict[str, Any]:
    matches = [s for job in jobs(wf).values() for s in steps(job) if predicate(s)]
    assert len(matches) == 1, f"expected exactly one {what} step, found {len(matches)}"
    return matches[0]


def uses(step: dict[str, Any], action: str) -> bool:
    return str(step.get("uses", "")).startswith(action + "@")


def step_index(wf: dict[str, Any], step: dict[str, Any]) -> int:
    for job in jobs(wf).values():
        for i, s in enumerate(steps(job)):
            if s is step:
                return i
    raise AssertionError("step not found")


# --- the generic checks --------------------------------------------------------------------------

def pin_problems(wf: dict[str, Any]) -> list[str]:
    """Every `uses:` names owner/repo[/path]@vN[.N[.N]] or @<40-hex SHA>; local ./ actions are fine."""
    problems = []
    for name, job in jobs(wf).items():
        refs = [job["uses"]] if "uses" in job else []
        refs += [s["uses"] for s in steps(job) if "uses" in s]
        for ref in refs:
            if not str(ref).startswith("./") and not USES_RE.fullmatch(str(ref)):
                problems.append(f"job {name}: {ref!r} is not pinned to a major version or a commit SHA")
    return problems


def runs_on_problems(wf: dict[str, Any]) -> list[str]:
    """Every job has `runs-on` (a job calling a reusable workflow has `uses` instead)."""
    return [f"job {name} has no runs-on" for name, job in jobs(wf).items()
            if not job.get("runs-on") and "uses" not in job]


def needs_problems(wf: dict[str, Any]) -> list[str]:
    problems = []
    names = set(jobs(wf))
    for name, job in jobs(wf).items():
        needs = job.get("needs", [])
        for need in [needs] if isinstance(needs, str) else needs:
            if need not in names or need == name:
                problems.append(f"job {name} needs {need!r}, which is not another job of this workflow")
    return problems


def writes_output(step: dict[str, Any], output: str) -> bool:
    script = str(step.get("run", ""))
    return "GITHUB_OUTPUT" in script and re.search(rf"(?<![A-Za-z0-9_-]){re.escape(output)}=", script) is not None


def step_output_problems(wf: dict[str, Any]) -> list[str]:
    """Every steps.X.outputs.Y names a step X defined earlier in the same job (and, for a `run:` step,
    an output Y its script writes to $GITHUB_OUTPUT); step ids are unique within a job."""
    problems = []
    for name, job in jobs(wf).items():
        earlier: dict[str, dict[str, Any]] = {}
        for i, step in enumerate(steps(job)):
            label = f"job {name}, step {step.get('id') or step.get('name') or i}"
            for expr in expressions(step):
                for sid, out in STEP_OUTPUT_RE.findall(expr):
                    if sid not in earlier:
                        problems.append(f"{label}: steps.{sid} is not a step defined earlier in this job")
                    elif "run" in earlier[sid] and not writes_output(earlier[sid], out):
                        problems.append(f"{label}: step {sid} never writes the output {out!r}")
            sid = step.get("id")
            if sid is not None:
                if sid in earlier:
                    problems.append(f"{label}: duplicate step id {sid!r}")
                earlier[str(sid)] = step
        for out_name, value in (job.get("outputs") or {}).items():
            for sid, _ in STEP_OUTPUT_RE.findall(str(value)):
                if sid not in earlier:
                    problems.append(f"job {name}, output {out_name}: steps.{sid} is not a step of this job")
    return problems


def unknown_plugin_names(text: str) -> set[str]:
    """--megacache-* flags and MEGACACHE_* environment variables in text that the plugin does not have."""
    flags = {o.flag for o in OPTIONS} | PENDING_FLAGS
    env = {o.env for o in OPTIONS} | PENDING_ENV
    return (set(FLAG_RE.findall(text)) - flags) | (set(ENV_RE.findall(text)) - env)


def conjuncts(condition: str) -> set[str]:
    """The terms of an `a && b && c` condition; a condition with || or ! at the top is refused."""
    text = normalized(condition)
    assert "||" not in text, f"condition {text!r} has ||: it may hold more often than meant"
    return {term.strip() for term in text.split("&&")}


def run_step_script(step: dict[str, Any], env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """Run a `run:` step's script as the runner would (bash -e) and return what it wrote to GITHUB_OUTPUT."""
    output = tmp_path / "github_output"
    output.write_text("")
    proc = subprocess.run(["bash", "-e", "-c", step["run"]], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env, "GITHUB_OUTPUT": str(output)}, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(line.split("=", 1) for line in output.read_text().splitlines() if "=" in line)


def cache_key_problems(component: str) -> list[str]:
    problems = []
    if not component:
        problems.append("empty")
    if re.search(r"[\s,/]", component):
        problems.append(f"{component!r} holds a space, a comma or a slash")
    # The longest key the actions/cache workflow builds from it: prefix, component, run id, attempt.
    full = f"megacache-{component}-{'9' * 20}-{'9' * 4}"
    if len(full) > CACHE_KEY_MAX:
        problems.append(f"a key built from {component!r} has {len(full)} characters (at most {CACHE_KEY_MAX})")
    return problems


# --- schema --------------------------------------------------------------------------------------

def check_jsonschema(*paths: Path) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("check_jsonschema") is None:
        pytest.skip("check-jsonschema is not installed (it is in the test extra: pip install -e '.[test]')")
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
                           *map(str, paths)], capture_output=True, text=True, timeout=120)


def test_the_three_workflows_exist() -> None:
    assert {p.name for p in WORKFLOW_FILES} >= {"ci.yml", "gpu-example.yml", "gpu-example-actions-cache.yml"}


@pytest.mark.parametrize("path", WORKFLOW_FILES, ids=lambda p: p.name)
def test_workflow_validates_against_githubs_schema(path: Path) -> None:
    proc = check_jsonschema(path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_schema_check_rejects_a_broken_workflow(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  tests:\n    runs-on: ubuntu-latest\n    stepz: []\n")
    proc = check_jsonschema(bad)
    assert proc.returncode != 0, proc.stdout + proc.stderr


# --- generic structure ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", WORKFLOW_FILES, ids=lambda p: p.name)
def test_workflow_structure(path: Path) -> None:
    wf = load(path)
    assert jobs(wf), f"{path.name} has no jobs"
    problems = pin_problems(wf) + runs_on_problems(wf) + needs_problems(wf) + step_output_problems(wf)
    assert not problems, "\n".join(problems)


BROKEN: dict[str, tuple[Any, dict[str, Any]]] = {
    "unpinned uses": (pin_problems, {"jobs": {"a": {"runs-on": "x", "steps": [{"uses": "actions/checkout@main"}]}}}),
    "unversioned uses": (pin_problems, {"jobs": {"a": {"runs-on": "x", "steps": [{"uses": "actions/checkout"}]}}}),
    "short sha": (pin_problems, {"jobs": {"a": {"runs-on": "x", "steps": [{"uses": "actions/checkout@1234abcd"}]}}}),
    "no runs-on": (runs_on_problems, {"jobs": {"a": {"steps": [{"run": "true"}]}}}),
    "unknown needs": (needs_problems, {"jobs": {"a": {"runs-on": "x", "needs": ["b"]}}}),
    "self needs": (needs_problems, {"jobs": {"a": {"runs-on": "x", "needs": "a"}}}),
    "output of a later step": (step_output_problems, {"jobs": {"a": {"runs-on": "x", "steps": [
        {"run": "echo ${{ steps.later.outputs.v }}"},
        {"id": "later", "run": 'echo "v=1" >> "$GITHUB_OUTPUT"'}]}}}),
    "output of an unknown step in if": (step_output_problems, {"jobs": {"a": {"runs-on": "x", "steps": [
        {"if": "steps.nope.outputs.v == 'true'", "run": "true"}]}}}),
    "output a run step never writes": (step_output_problems, {"jobs": {"a": {"runs-on": "x", "steps": [
        {"id": "s", "run": 'echo "v=1" >> "$GITHUB_OUTPUT"'},
        {"with": {"key": "${{ steps.s.outputs.w }}"}, "uses": "actions/cache/restore@v4"}]}}}),
    "output of another job's step": (step_output_problems, {"jobs": {
        "a": {"runs-on": "x", "steps": [{"id": "s", "run": 'echo "v=1" >> "$GITHUB_OUTPUT"'}]},
        "b": {"runs-on": "x", "steps": [{"run": "echo ${{ steps.s.outputs.v }}"}]}}}),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_structure_checks_catch_broken_workflows(case: str) -> None:
    check, wf = BROKEN[case]
    assert check(wf), f"{check.__name__} let a workflow with {case} through"


# --- plugin names --------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [*WORKFLOW_FILES, DOCS], ids=lambda p: p.name)
def test_plugin_flags_and_environment_variables_exist(path: Path) -> None:
    unknown = unknown_plugin_names(path.read_text())
    assert not unknown, f"{path.name} names what pytest_megacache.settings.OPTIONS does not have: {sorted(unknown)}"


def test_pending_names_are_few_and_well_formed() -> None:
    assert len(PENDING_FLAGS | PENDING_ENV) <= 4
    assert all(FLAG_RE.fullmatch(f) for f in PENDING_FLAGS) and all(ENV_RE.fullmatch(e) for e in PENDING_ENV)


def test_plugin_name_check_catches_typos() -> None:
    assert unknown_plugin_names("pytest --megacache-buket b --megacache-mode read") == {"--megacache-buket"}
    assert unknown_plugin_names("MEGACACHE_BUCKETS: x\nMEGACACHE_DIR: y") == {"MEGACACHE_BUCKETS"}
    # Repository variables and secrets are not plugin settings; env.X is.
    assert unknown_plugin_names("${{ vars.MEGACACHE_ROLE_ARN }} ${{ secrets.MEGACACHE_OTHER }}") == set()
    assert unknown_plugin_names("${{ env.MEGACACHE_NOPE }}") == {"MEGACACHE_NOPE"}


def test_repository_variables_and_secrets_are_documented() -> None:
    docs = DOCS.read_text()
    used = {m.group(0) for p in WORKFLOW_FILES for m in re.finditer(r"\b(?:vars|secrets)\.[A-Za-z_][A-Za-z0-9_]*",
                                                                     p.read_text())}
    missing = sorted(name for name in used if name not in docs)
    assert not missing, f"docs/ci.md does not mention {missing}"


# --- gpu-example.yml: S3 with OIDC ---------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_wf() -> dict[str, Any]:
    return load(GPU_S3)


def trust_step(wf: dict[str, Any]) -> dict[str, Any]:
    return find_step(wf, lambda s: "github.event.pull_request.head.repo.full_name" in str(s.get("env", "")),
                     "fork detection")


def test_gpu_s3_triggers_runner_and_concurrency(s3_wf: dict[str, Any]) -> None:
    on = s3_wf["on"]
    assert on["push"]["branches"] == ["main"]
    assert "pull_request" in on and "workflow_dispatch" in on
    assert "github.ref" in s3_wf["concurrency"]["group"]
    (job,) = jobs(s3_wf).values()
    assert job["runs-on"] == ["self-hosted", "linux", "x64", "gpu"]


def test_gpu_s3_grants_the_oidc_token(s3_wf: dict[str, Any]) -> None:
    (job,) = jobs(s3_wf).values()
    permissions = {**(s3_wf.get("permissions") or {}), **(job.get("permissions") or {})}
    assert permissions.get("id-token") == "write"
    assert permissions.get("contents") == "read"


def test_gpu_s3_fork_detection(s3_wf: dict[str, Any], tmp_path: Path) -> None:
    step = trust_step(s3_wf)
    (expr,) = [normalized(v) for v in step["env"].values() if "head.repo.full_name" in str(v)]
    assert "github.event.pull_request.head.repo.full_name != github.repository" in expr
    # On a push the pull_request fields are empty, so without this guard every push would count as a fork.
    assert "github.event_name == 'pull_request' &&" in expr
    (var,) = [k for k, v in step["env"].items() if "head.repo.full_name" in str(v)]
    fork = run_step_script(step, {var: "true"}, tmp_path)
    same_repo = run_step_script(step, {var: "false"}, tmp_path)
    assert fork == {"fork": "true", "mode": "read"}
    assert same_repo["fork"] == "false" and same_repo["mode"] in {"readwrite", "write"}


def test_gpu_s3_credentials_by_oidc_skipped_for_forks(s3_wf: dict[str, Any]) -> None:
    trust = trust_step(s3_wf)
    creds = find_step(s3_wf, lambda s: uses(s, "aws-actions/configure-aws-credentials"), "credentials")
    assert creds["uses"] == "aws-actions/configure-aws-credentials@v4"
    assert normalized(creds["with"]["role-to-assume"]) == "vars.MEGACACHE_ROLE_ARN"
    assert normalized(creds["with"]["aws-region"]) == "vars.AWS_REGION"
    assert normalized(str(creds.get("if", ""))) == f"steps.{trust['id']}.outputs.fork != 'true'"
    assert step_index(s3_wf, trust) < step_index(s3_wf, creds)
    assert "aws-access-key-id" not in creds["with"], "OIDC only: no stored AWS keys"


def gpu_test_step(wf: dict[str, Any]) -> dict[str, Any]:
    return find_step(wf, lambda s: "pytest -m gpu" in str(s.get("run", "")), "GPU test")


def test_gpu_s3_test_step(s3_wf: dict[str, Any]) -> None:
    step = gpu_test_step(s3_wf)
    trust = trust_step(s3_wf)
    creds = find_step(s3_wf, lambda s: uses(s, "aws-actions/configure-aws-credentials"), "credentials")
    script = step["run"]
    assert step["working-directory"] == "example_project"
    assert re.search(rf'--megacache-mode[ =]"?\$\{{\{{ steps\.{trust["id"]}\.outputs\.mode }}}}"?', script), script
    assert re.search(r"--megacache-report[ =]megacache-report\.json", script), script
    assert normalized(step["env"]["MEGACACHE_BUCKET"]) == "vars.MEGACACHE_BUCKET"
    assert normalized(step["env"]["MEGACACHE_SIGNING_KEY"]) == "secrets.MEGACACHE_SIGNING_KEY"
    assert "--megacache-bucket" not in script, "an unset vars.MEGACACHE_BUCKET would make an empty flag"
    assert "--megacache-strict" not in script, "fork pull requests rely on the plugin failing open"
    assert step_index(s3_wf, creds) < step_index(s3_wf, step)


@pytest.mark.parametrize("path", [GPU_S3, GPU_ACTIONS_CACHE], ids=lambda p: p.name)
def test_gpu_report_is_uploaded_always(path: Path) -> None:
    wf = load(path)
    tests = gpu_test_step(wf)
    upload = find_step(wf, lambda s: uses(s, "actions/upload-artifact"), "upload-artifact")
    assert upload["uses"] == "actions/upload-artifact@v4"
    assert "always()" in str(upload.get("if", ""))
    assert upload["with"]["path"] == f"{tests['working-directory']}/megacache-report.json"
    assert step_index(wf, tests) < step_index(wf, upload)


# --- gpu-example-actions-cache.yml: a directory persisted by actions/cache ------------------------

@pytest.fixture(scope="module")
def cache_wf() -> dict[str, Any]:
    return load(GPU_ACTIONS_CACHE)


def test_gpu_actions_cache_has_no_aws(cache_wf: dict[str, Any]) -> None:
    text = GPU_ACTIONS_CACHE.read_text()
    for needle in ("aws-actions/", "id-token", "role-to-assume", "MEGACACHE_BUCKET", "--megacache-bucket", "AWS_"):
        assert needle not in text, needle
    (job,) = jobs(cache_wf).values()
    assert job["runs-on"] == ["self-hosted", "linux", "x64", "gpu"]
    # actions/cache@v4 (restore and save in one) would save on every event, pull requests included.
    assert not [s for s in steps(job) if uses(s, "actions/cache")]


def cache_steps(wf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    fp = find_step(wf, lambda s: "pytest-megacache key --flat" in str(s.get("run", "")), "fingerprint")
    restore = find_step(wf, lambda s: uses(s, "actions/cache/restore"), "cache restore")
    save = find_step(wf, lambda s: uses(s, "actions/cache/save"), "cache save")
    return fp, restore, save


def test_gpu_actions_cache_keys(cache_wf: dict[str, Any]) -> None:
    fp, restore, save = cache_steps(cache_wf)
    assert restore["uses"] == "actions/cache/restore@v4" and save["uses"] == "actions/cache/save@v4"
    fingerprint = f"${{{{ steps.{fp['id']}.outputs.key }}}}"
    key = restore["with"]["key"]
    restore_keys = [line.strip() for line in str(restore["with"]["restore-keys"]).splitlines() if line.strip()]
    assert fingerprint in key, key
    end = key.index(fingerprint) + len(fingerprint)
    # One restore key: the key up to and including the fingerprint and its separator. Not `megacache-`:
    # another fingerprint's objects are useless here.
    assert restore_keys == [key[:end + 1]] and key[end] == "-", (key, restore_keys)
    assert "github.run_id" in key[end:], "each run must save under a new key (actions/cache keys are immutable)"
    assert save["with"]["key"] == key
    assert save["with"]["path"] == restore["with"]["path"], "actions/cache's version depends on the path"
    assert step_index(cache_wf, fp) < step_index(cache_wf, restore) < step_index(cache_wf, save)


def test_gpu_actions_cache_saves_only_on_pushes_to_the_default_branch(cache_wf: dict[str, Any]) -> None:
    _, _, save = cache_steps(cache_wf)
    terms = conjuncts(str(save["if"]))
    assert {"always()", "github.event_name == 'push'",
            "github.ref == format('refs/heads/{0}', github.event.repository.default_branch)"} <= terms, terms
    assert not any(t.startswith("!") for t in terms)


def test_conjuncts_refuse_a_widened_condition() -> None:
    with pytest.raises(AssertionError):
        conjuncts("always() && github.event_name == 'push' || github.event_name == 'pull_request'")
    assert "github.event_name == 'push'" not in conjuncts("always() && github.event_name != 'push'")


def test_gpu_actions_cache_directory_is_the_cached_path(cache_wf: dict[str, Any]) -> None:
    _, restore, save = cache_steps(cache_wf)
    tests = gpu_test_step(cache_wf)
    match = re.search(r'--megacache-dir[ =](?:"([^"]+)"|(\S+))', tests["run"])
    assert match, tests["run"]
    assert (match[1] or match[2]) == restore["with"]["path"]
    assert step_index(cache_wf, restore) < step_index(cache_wf, tests) < step_index(cache_wf, save)


# --- pytest-megacache key --flat ------------------------------------------------------------------

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="pytest-megacache key needs torch")


def test_cache_key_check_catches_bad_components() -> None:
    assert cache_key_problems("torch-2.13.0+cpu/cpu")
    assert cache_key_problems("a,b")
    assert cache_key_problems("a b")
    assert cache_key_problems("x" * 500)
    assert not cache_key_problems("torch-2.13.0+cpu-cpu-avx2-t2-py3.11-linux-x86_64-895359ba7608")


@needs_torch
def test_key_flat_is_an_actions_cache_key_component() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest_megacache", "key", "--flat"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    flat = proc.stdout.strip()
    assert "\n" not in flat
    assert not cache_key_problems(flat), cache_key_problems(flat)
    plain = subprocess.run([sys.executable, "-m", "pytest_megacache", "key"], capture_output=True, text=True,
                           timeout=120).stdout.strip()
    assert flat == plain.replace("/", "-")


@needs_torch
def test_fingerprint_step_writes_the_key(cache_wf: dict[str, Any], tmp_path: Path) -> None:
    """The workflow's own fingerprint script, run with this interpreter's scripts first on PATH."""
    bindir = str(Path(sys.executable).parent)
    path = os.pathsep.join([bindir, os.environ.get("PATH", "")])
    if shutil.which("pytest-megacache", path=path) is None:
        pytest.skip("the pytest-megacache script is not installed next to this interpreter")
    fp, _, _ = cache_steps(cache_wf)
    outputs = run_step_script(fp, {"PATH": path}, tmp_path)
    assert not cache_key_problems(outputs.get("key", "")), outputs
