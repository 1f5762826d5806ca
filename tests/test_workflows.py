"""The GitHub Actions workflows, the action (action.yml), actionlint's config and docs/ci.md: schema, pinning,
wiring, and the plugin names they use; and the user docs (README.md, CHANGELOG.md, docs/*.md): every flag and
variable they name exists, and docs/settings.md describes every option.

actionlint cannot be installed offline (its PyPI package downloads a binary from GitHub), so the schema
checks use check-jsonschema's vendored copies of GitHub's workflow and action schemas, and the rest is checked
here with PyYAML. .github/actionlint.yaml still declares the self-hosted runner labels and repository variables
for whoever runs actionlint, and a test keeps it in step with the workflows. Each structural check is a
function returning a list of problems, with a test feeding it a broken input so that the check is known to be
able to fail. What the action's script does at run time is tested in tests/test_action.py.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from pytest_megacache.settings import OPTIONS

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
ACTION = ROOT / "action.yml"
ACTION_SCRIPT = ROOT / "action" / "megacache_action.py"
ACTIONLINT = ROOT / ".github" / "actionlint.yaml"
DOCS = ROOT / "docs" / "ci.md"
CI = WORKFLOWS / "ci.yml"
GPU_S3 = WORKFLOWS / "gpu-example.yml"
GPU_ACTIONS_CACHE = WORKFLOWS / "gpu-example-actions-cache.yml"
RELEASE = WORKFLOWS / "release.yml"
CHECK_RELEASE = ROOT / ".github" / "scripts" / "check_release.py"
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
INPUT_RE = re.compile(r"\binputs\.([A-Za-z_][A-Za-z0-9_-]*)")
VARS_RE = re.compile(r"\bvars\.([A-Za-z_][A-Za-z0-9_]*)")
USES_RE = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+(?:/[^@\s]+)?@(?:v\d+(?:\.\d+){0,2}|[0-9a-f]{40})")
SHA_RE = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+(?:/[^@\s]+)?@[0-9a-f]{40}")
CACHE_KEY_MAX = 512  # actions/cache: keys of at most 512 characters, without commas
# Runner labels actionlint knows without configuration: GitHub-hosted images and the self-hosted defaults.
HOSTED_LABEL_RE = re.compile(r"(ubuntu|windows|macos)-[a-z0-9.-]+")
BUILTIN_SELF_HOSTED = frozenset({"self-hosted", "linux", "macos", "windows", "x64", "arm", "arm64"})


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path.name}: not a mapping"
    if True in data:  # YAML 1.1 reads the `on` key as a boolean
        data["on"] = data.pop(True)
    return data


def _load_action_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("megacache_action_for_workflows", ACTION_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


action_script = _load_action_script()


def jobs(wf: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = wf.get("jobs") or {}
    assert isinstance(found, dict)
    return found


def steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    found = job.get("steps") or []
    assert isinstance(found, list)
    return found


def action_steps(action: dict[str, Any]) -> list[dict[str, Any]]:
    found = (action.get("runs") or {}).get("steps") or []
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


def find_step(wf: dict[str, Any], predicate: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    matches = [s for job in jobs(wf).values() for s in steps(job) if predicate(s)]
    assert len(matches) == 1, f"expected exactly one {what} step, found {len(matches)}"
    return matches[0]


def uses(step: dict[str, Any], action: str) -> bool:
    return str(step.get("uses", "")).startswith(action + "@")


def local_action(step: dict[str, Any]) -> bool:
    return str(step.get("uses", "")).rstrip("/") in {".", "./"}


def step_index(wf: dict[str, Any], step: dict[str, Any]) -> int:
    for job in jobs(wf).values():
        for i, s in enumerate(steps(job)):
            if s is step:
                return i
    raise AssertionError("step not found")


# --- the generic checks --------------------------------------------------------------------------

def _pin_problem(where: str, ref: Any) -> list[str]:
    if not str(ref).startswith("./") and not USES_RE.fullmatch(str(ref)):
        return [f"{where}: {ref!r} is not pinned to a major version or a commit SHA"]
    return []


def pin_problems(wf: dict[str, Any]) -> list[str]:
    """Every `uses:` names owner/repo[/path]@vN[.N[.N]] or @<40-hex SHA>; local ./ actions are fine."""
    problems = []
    for name, job in jobs(wf).items():
        refs = [job["uses"]] if "uses" in job else []
        refs += [s["uses"] for s in steps(job) if "uses" in s]
        for ref in refs:
            problems += _pin_problem(f"job {name}", ref)
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


def _steps_output_problems(label: str, step_list: list[dict[str, Any]],
                           run_outputs: Callable[[dict[str, Any], str], bool]) -> tuple[list[str], set[str]]:
    problems = []
    earlier: dict[str, dict[str, Any]] = {}
    for i, step in enumerate(step_list):
        where = f"{label}, step {step.get('id') or step.get('name') or i}"
        for expr in expressions(step):
            for sid, out in STEP_OUTPUT_RE.findall(expr):
                if sid not in earlier:
                    problems.append(f"{where}: steps.{sid} is not a step defined earlier in this job")
                elif "run" in earlier[sid] and not run_outputs(earlier[sid], out):
                    problems.append(f"{where}: step {sid} never writes the output {out!r}")
        sid = step.get("id")
        if sid is not None:
            if sid in earlier:
                problems.append(f"{where}: duplicate step id {sid!r}")
            earlier[str(sid)] = step
    return problems, set(earlier)


def step_output_problems(wf: dict[str, Any]) -> list[str]:
    """Every steps.X.outputs.Y names a step X defined earlier in the same job (and, for a `run:` step,
    an output Y its script writes to $GITHUB_OUTPUT); step ids are unique within a job."""
    problems = []
    for name, job in jobs(wf).items():
        found, ids = _steps_output_problems(f"job {name}", steps(job), writes_output)
        problems += found
        for out_name, value in (job.get("outputs") or {}).items():
            for sid, _ in STEP_OUTPUT_RE.findall(str(value)):
                if sid not in ids:
                    problems.append(f"job {name}, output {out_name}: steps.{sid} is not a step of this job")
    return problems


def mode_override_problems(wf: dict[str, Any]) -> list[str]:
    """A job using the action must not set the mode itself: `--megacache-mode` on the command line, or a
    MEGACACHE_MODE in a job's or step's env, beats the MEGACACHE_MODE=read the action exports for forks (the
    action's own `mode` input is the way)."""
    problems = []
    for name, job in jobs(wf).items():
        if not any(local_action(s) or "/pytest-megacache@" in str(s.get("uses", "")) for s in steps(job)):
            continue
        places = [("job env", dict(job.get("env") or {}))]
        places += [(f"step {s.get('name') or i}", {"run": s.get("run", ""), **(s.get("env") or {})})
                   for i, s in enumerate(steps(job))]
        for where, node in places:
            text = " ".join([*map(str, node), *strings(node)])
            if "--megacache-mode" in text or "MEGACACHE_MODE" in text:
                problems.append(f"job {name}, {where}: sets the mode, overriding the action's read-only fork runs")
    return problems


def unknown_plugin_names(text: str) -> set[str]:
    """--megacache-* flags and MEGACACHE_* environment variables in text that the plugin does not have."""
    flags = {o.flag for o in OPTIONS} | {o.negation for o in OPTIONS if o.negation} | PENDING_FLAGS
    env = {o.env for o in OPTIONS} | PENDING_ENV
    return (set(FLAG_RE.findall(text)) - flags) | (set(ENV_RE.findall(text)) - env)


def conjuncts(condition: str) -> set[str]:
    """The terms of an `a && b && c` condition; a condition with || or ! at the top is refused."""
    text = normalized(condition)
    assert "||" not in text, f"condition {text!r} has ||: it may hold more often than meant"
    return {term.strip() for term in text.split("&&")}


def cache_key_problems(component: str) -> list[str]:
    problems = []
    if not component:
        problems.append("empty")
    if re.search(r"[\s,/]", component):
        problems.append(f"{component!r} holds a space, a comma or a slash")
    # The longest key the action builds from it: prefix, component, a 100-character job and suffix, run, attempt.
    full = f"megacache-{component}-{'j' * 100}-{'s' * 100}~{'9' * 20}-{'9' * 4}"
    if len(full) > CACHE_KEY_MAX:
        problems.append(f"a key built from {component!r} has {len(full)} characters (at most {CACHE_KEY_MAX})")
    return problems


# --- the action's checks -------------------------------------------------------------------------

def action_input_problems(action: dict[str, Any]) -> list[str]:
    """Every inputs.X used is declared, and every declared input is used."""
    declared = set(action.get("inputs") or {})
    used = {name for text in strings(action.get("runs") or {}) for expr in EXPR_RE.findall(text)
            for name in INPUT_RE.findall(expr)}
    used |= {name for step in action_steps(action) for expr in expressions(step) for name in INPUT_RE.findall(expr)}
    return ([f"input {n!r} is used but not declared" for n in sorted(used - declared)]
            + [f"input {n!r} is declared but never used" for n in sorted(declared - used)])


def action_step_problems(action: dict[str, Any], root: Path) -> list[str]:
    """A composite action; run steps are one-line calls of a script that exists (logic lives in scripts),
    with a shell and no ${{ }} in the command (inputs reach scripts through env, never pasted into code);
    `uses:` steps are pinned to a commit (an action others run) and never local (./ is the caller's repo)."""
    problems = []
    if (action.get("runs") or {}).get("using") != "composite":
        problems.append("runs.using is not composite")
    for i, step in enumerate(action_steps(action)):
        where = f"step {step.get('id') or i}"
        if "run" in step:
            command = str(step["run"]).strip()
            if "\n" in command:
                problems.append(f"{where}: run is more than one line; put the logic in a script")
            if "${{" in command:
                problems.append(f"{where}: an expression in run; pass values through env")
            if not step.get("shell"):
                problems.append(f"{where}: composite run steps need a shell")
            scripts = re.findall(r"\$(?:\{GITHUB_ACTION_PATH\}|GITHUB_ACTION_PATH)/([^\s\"']+)", command)
            if not scripts:
                problems.append(f"{where}: calls no script under $GITHUB_ACTION_PATH")
            problems += [f"{where}: {s} does not exist" for s in scripts if not (root / s).is_file()]
        elif "uses" in step:
            ref = str(step["uses"])
            if ref.startswith("."):
                problems.append(f"{where}: a local action refers to the caller's repository, not this one")
            elif not SHA_RE.fullmatch(ref):
                problems.append(f"{where}: {ref!r} is not pinned to a commit SHA")
        else:
            problems.append(f"{where}: neither run nor uses")
    return problems


def action_output_problems(action: dict[str, Any]) -> list[str]:
    """steps.X.outputs.Y names an earlier step, and for the plan script an output it writes; every action
    output comes from a step of the action."""
    def script_writes(step: dict[str, Any], output: str) -> bool:
        return "megacache_action.py" in str(step.get("run", "")) and output in action_script.OUTPUTS
    problems, ids = _steps_output_problems("action", action_steps(action), script_writes)
    for name, spec in (action.get("outputs") or {}).items():
        refs = STEP_OUTPUT_RE.findall(str((spec or {}).get("value", "")))
        if not refs:
            problems.append(f"output {name!r} has no steps.X.outputs.Y value")
        problems += [f"output {name!r}: steps.{sid} is not a step of the action" for sid, _ in refs if sid not in ids]
    return problems


def local_action_problems(wf: dict[str, Any], action: dict[str, Any]) -> list[str]:
    """A workflow's `uses: ./` steps pass only inputs the action declares, and read only outputs it has."""
    problems = []
    inputs, outputs = set(action.get("inputs") or {}), set(action.get("outputs") or {})
    for name, job in jobs(wf).items():
        ids = {str(s["id"]) for s in steps(job) if local_action(s) and "id" in s}
        for step in steps(job):
            if local_action(step):
                problems += [f"job {name}: the action has no input {k!r}" for k in (step.get("with") or {})
                             if k not in inputs]
            for expr in expressions(step):
                problems += [f"job {name}: the action has no output {out!r}" for sid, out in
                             STEP_OUTPUT_RE.findall(expr) if sid in ids and out not in outputs]
    return problems


# --- actionlint's configuration ------------------------------------------------------------------

def runner_labels(wf: dict[str, Any]) -> set[str]:
    labels: set[str] = set()
    for job in jobs(wf).values():
        runs_on = job.get("runs-on")
        if isinstance(runs_on, dict):
            runs_on = runs_on.get("labels", [])
        labels |= {str(label) for label in ([runs_on] if isinstance(runs_on, str) else runs_on or [])}
    return labels


def actionlint_problems(config: dict[str, Any], workflows: dict[str, str]) -> list[str]:
    """Every custom self-hosted runner label a workflow uses is declared (and every declared one used), and
    `config-variables` lists exactly the repository variables (vars.X) the workflows read."""
    problems = []
    declared = set((config.get("self-hosted-runner") or {}).get("labels") or [])
    used: set[str] = set()
    for name, text in workflows.items():
        wf = yaml.safe_load(text)
        for label in runner_labels(wf if isinstance(wf, dict) else {}):
            if "${{" not in label and label not in BUILTIN_SELF_HOSTED and not HOSTED_LABEL_RE.fullmatch(label):
                used.add(label)
                if label not in declared:
                    problems.append(f"{name}: runner label {label!r} is not in actionlint.yaml")
    problems += [f"actionlint.yaml declares the unused label {label!r}" for label in sorted(declared - used)]
    variables = {v for text in workflows.values() for v in VARS_RE.findall(text)}
    listed = set(config.get("config-variables") or [])
    if listed != variables:
        problems.append(f"config-variables {sorted(listed)} is not the variables the workflows read {sorted(variables)}")
    return problems


# --- release.yml ---------------------------------------------------------------------------------

def release_problems(wf: dict[str, Any]) -> list[str]:
    """Publish on v* tags only, by trusted publishing: the one job with id-token: write runs in an environment,
    after the build job, and uses pypa/gh-action-pypi-publish, with no token or password; every action is pinned
    to a commit. The build job checks the distributions and the tag before anything is uploaded."""
    problems = []
    if wf.get("on") != {"push": {"tags": ["v*"]}}:
        problems.append("release must trigger on pushed v* tags only")
    if (wf.get("permissions") or {}) != {"contents": "read"}:
        problems.append("the workflow's own permissions must be contents: read (id-token only in the publish job)")
    publishers = {n: j for n, j in jobs(wf).items() if any(uses(s, "pypa/gh-action-pypi-publish")
                                                           or "gh-action-pypi-publish@" in str(s.get("uses", ""))
                                                           for s in steps(j))}
    if len(publishers) != 1:
        return [*problems, f"want one publishing job, found {len(publishers)}"]
    pub_name, pub = next(iter(publishers.items()))
    token_jobs = sorted(n for n, j in jobs(wf).items() if (j.get("permissions") or {}).get("id-token") == "write")
    if token_jobs != [pub_name] or set(pub.get("permissions") or {}) != {"id-token"}:
        problems.append(f"only the publish job may have (only) id-token: write; found {token_jobs}")
    environment = pub.get("environment")
    if not (environment.get("name") if isinstance(environment, dict) else environment):
        problems.append("the publish job needs an environment (PyPI's trusted publisher names it)")
    unpinned = [str(s["uses"]) for j in jobs(wf).values() for s in steps(j) if "uses" in s
                and not SHA_RE.fullmatch(str(s["uses"]))]
    if unpinned:
        problems.append(f"actions in release.yml must be pinned to a commit SHA: {unpinned}")
    text = yaml.safe_dump(wf)
    if re.search(r"\b(password|api-token|user)\s*:|secrets\.", text):
        problems.append("a token, password or secret in release.yml: trusted publishing needs none")
    needs = pub.get("needs", [])
    needs = [needs] if isinstance(needs, str) else needs
    build_scripts = " ".join(str(s.get("run", "")) for n in needs for s in steps(jobs(wf).get(n, {})))
    for needle, what in [("-m build", "build the distributions"), ("twine check --strict", "run twine check --strict"),
                         ('check_release.py "$GITHUB_REF_NAME"', "check the tag against the version")]:
        if needle not in build_scripts:
            problems.append(f"a job the publish job needs must {what}")
    return problems


# --- schema --------------------------------------------------------------------------------------

def check_jsonschema(schema: str, *paths: Path) -> subprocess.CompletedProcess[str]:
    # check-jsonschema is in the test extra: a missing one fails here (ModuleNotFoundError), it is never skipped.
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema, *map(str, paths)],
                          capture_output=True, text=True, timeout=120)


def test_the_workflows_exist() -> None:
    assert {p.name for p in WORKFLOW_FILES} >= {"ci.yml", "gpu-example.yml", "gpu-example-actions-cache.yml",
                                                "release.yml"}


def test_workflows_validate_against_githubs_schema() -> None:
    proc = check_jsonschema("vendor.github-workflows", *WORKFLOW_FILES)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_action_validates_against_githubs_schema() -> None:
    proc = check_jsonschema("vendor.github-actions", ACTION)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_schema_checks_reject_a_broken_workflow_and_a_broken_action(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  tests:\n    runs-on: ubuntu-latest\n    stepz: []\n")
    bad_action = tmp_path / "action.yml"
    bad_action.write_text("name: x\ndescription: y\nruns:\n  using: composite\n  stepz: []\n")
    for schema, path in [("vendor.github-workflows", bad), ("vendor.github-actions", bad_action)]:
        proc = check_jsonschema(schema, path)
        assert proc.returncode != 0, proc.stdout + proc.stderr


# --- generic structure ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", WORKFLOW_FILES, ids=lambda p: p.name)
def test_workflow_structure(path: Path) -> None:
    wf = load(path)
    assert jobs(wf), f"{path.name} has no jobs"
    problems = (pin_problems(wf) + runs_on_problems(wf) + needs_problems(wf) + step_output_problems(wf)
                + local_action_problems(wf, load(ACTION)) + mode_override_problems(wf))
    assert not problems, "\n".join(problems)


def test_action_structure() -> None:
    action = load(ACTION)
    problems = action_input_problems(action) + action_step_problems(action, ROOT) + action_output_problems(action)
    assert not problems, "\n".join(problems)


def test_actionlint_config_matches_the_workflows() -> None:
    config = yaml.safe_load(ACTIONLINT.read_text())
    problems = actionlint_problems(config, {p.name: p.read_text() for p in WORKFLOW_FILES})
    assert not problems, "\n".join(problems)


def test_release_workflow() -> None:
    assert not release_problems(load(RELEASE)), release_problems(load(RELEASE))
    assert CHECK_RELEASE.is_file()


GOOD_ACTION: dict[str, Any] = {
    "name": "a", "description": "b",
    "inputs": {"dir": {"description": "d"}},
    "outputs": {"fork": {"description": "f", "value": "${{ steps.plan.outputs.fork }}"}},
    "runs": {"using": "composite", "steps": [
        {"id": "plan", "shell": "bash", "env": {"INPUT_DIR": "${{ inputs.dir }}"},
         "run": 'python3 "$GITHUB_ACTION_PATH/action/megacache_action.py"'},
        {"if": "steps.plan.outputs.cache == 'restore'", "uses": f"actions/cache/restore@{'a' * 40}",
         "with": {"path": "${{ steps.plan.outputs.path }}"}}]},
}


def _action(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    data = yaml.safe_load(yaml.safe_dump(GOOD_ACTION))
    assert isinstance(data, dict)
    change(data)
    return data


def _step(n: int, **values: Any) -> Callable[[dict[str, Any]], object]:
    return lambda a: a["runs"]["steps"][n].update(values)


WF_WITH_ACTION: dict[str, Any] = {"jobs": {"a": {"runs-on": "x", "steps": [
    {"id": "m", "uses": "./", "with": {"dir": "d"}}, {"run": "python -m pytest"}]}}}

BROKEN: dict[str, tuple[Callable[[dict[str, Any]], list[str]], dict[str, Any]]] = {
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
    "mode flag next to the action": (mode_override_problems, {"jobs": {"a": {"runs-on": "x", "steps": [
        {"uses": "./"}, {"run": "python -m pytest --megacache-mode readwrite"}]}}}),
    "mode in a step's env next to the action": (mode_override_problems, {"jobs": {"a": {"runs-on": "x", "steps": [
        {"uses": "owner/pytest-megacache@v1"}, {"env": {"MEGACACHE_MODE": "readwrite"}, "run": "pytest"}]}}}),
    "mode in the job's env next to the action": (mode_override_problems, {"jobs": {"a": {
        "runs-on": "x", "env": {"MEGACACHE_MODE": "write"}, "steps": [{"uses": "./"}]}}}),
    "input used, not declared": (action_input_problems, _action(
        lambda a: a["runs"]["steps"][0]["env"].update({"INPUT_X": "${{ inputs.x }}"}))),
    "input declared, never used": (action_input_problems, _action(lambda a: a["inputs"].update({"y": {}}))),
    "multi-line run": (lambda a: action_step_problems(a, ROOT), _action(_step(0, run="set -e\npython3 x.py"))),
    "expression in run": (lambda a: action_step_problems(a, ROOT), _action(
        _step(0, run='python3 "$GITHUB_ACTION_PATH/action/megacache_action.py" "${{ inputs.dir }}"'))),
    "missing script": (lambda a: action_step_problems(a, ROOT), _action(
        _step(0, run='python3 "$GITHUB_ACTION_PATH/action/gone.py"'))),
    "no script at all": (lambda a: action_step_problems(a, ROOT), _action(_step(0, run="echo hi"))),
    "no shell": (lambda a: action_step_problems(a, ROOT), _action(lambda a: a["runs"]["steps"][0].pop("shell"))),
    "action pinned to a tag": (lambda a: action_step_problems(a, ROOT), _action(_step(1, uses="actions/cache@v5"))),
    "action using ./": (lambda a: action_step_problems(a, ROOT), _action(_step(1, uses="./other"))),
    "not composite": (lambda a: action_step_problems(a, ROOT), _action(lambda a: a["runs"].update(using="node24"))),
    "output the script never writes": (action_output_problems, _action(
        _step(1, **{"if": "steps.plan.outputs.nope == 'x'"}))),
    "action output from no step": (action_output_problems, _action(
        lambda a: a["outputs"].update({"x": {"description": "x", "value": "${{ steps.gone.outputs.fork }}"}}))),
    "unknown input to the action": (lambda wf: local_action_problems(wf, GOOD_ACTION), {"jobs": {"a": {
        "runs-on": "x", "steps": [{"uses": "./", "with": {"bucket": "b"}}]}}}),
    "unknown output of the action": (lambda wf: local_action_problems(wf, GOOD_ACTION), {"jobs": {"a": {
        "runs-on": "x", "steps": [*WF_WITH_ACTION["jobs"]["a"]["steps"],
                                  {"if": "steps.m.outputs.nope == 'true'", "run": "true"}]}}}),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_structure_checks_catch_broken_input(case: str) -> None:
    check, wf = BROKEN[case]
    assert check(wf), f"{getattr(check, '__name__', check)} let {case} through"


def test_the_good_examples_pass() -> None:
    """The broken cases above differ from these in one thing each, so the check, not the example, fails."""
    assert not (action_input_problems(GOOD_ACTION) + action_step_problems(GOOD_ACTION, ROOT)
                + action_output_problems(GOOD_ACTION))
    assert not local_action_problems(WF_WITH_ACTION, GOOD_ACTION) + mode_override_problems(WF_WITH_ACTION)


def _wf(runs_on: Any, text: str = "") -> dict[str, str]:
    return {"w.yml": yaml.safe_dump({"jobs": {"a": {"runs-on": runs_on, "steps": [{"run": "true"}]}}}) + text}


@pytest.mark.parametrize(("case", "config", "workflows"), [
    ("undeclared label", {"self-hosted-runner": {"labels": []}}, _wf(["self-hosted", "gpu"])),
    ("label in a group", {"self-hosted-runner": {"labels": []}}, _wf({"group": "g", "labels": ["a100"]})),
    ("stale label", {"self-hosted-runner": {"labels": ["gpu", "tpu"]}}, _wf(["self-hosted", "gpu"])),
    ("undeclared variable", {"self-hosted-runner": {"labels": ["gpu"]}},
     _wf(["self-hosted", "gpu"], "# ${{ vars.X }}")),
    ("stale variable", {"self-hosted-runner": {"labels": ["gpu"]}, "config-variables": ["Y"]},
     _wf(["self-hosted", "gpu"])),
])
def test_actionlint_check_catches(case: str, config: dict[str, Any], workflows: dict[str, str]) -> None:
    assert actionlint_problems(config, workflows), case
    good = {"self-hosted-runner": {"labels": ["gpu"]}}
    assert not actionlint_problems(good, _wf(["self-hosted", "linux", "x64", "gpu"]))
    assert not actionlint_problems({}, _wf("ubuntu-latest"))


def _release(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    wf = load(RELEASE)
    change(wf)
    return wf


def _publish_job(wf: dict[str, Any]) -> dict[str, Any]:
    return jobs(wf)["publish"]


@pytest.mark.parametrize(("case", "change"), [
    ("token for the whole workflow", lambda wf: wf["permissions"].update({"id-token": "write"})),
    ("triggered by pushes to main", lambda wf: wf["on"].update({"push": {"branches": ["main"]}})),
    ("no environment", lambda wf: _publish_job(wf).pop("environment")),
    ("a password", lambda wf: steps(_publish_job(wf))[-1].update({"with": {"password": "${{ secrets.PYPI }}"}})),
    ("publisher pinned to a branch", lambda wf: steps(_publish_job(wf))[-1].update(
        {"uses": "pypa/gh-action-pypi-publish@release/v1"})),
    ("checkout pinned to a tag", lambda wf: steps(jobs(wf)["build"])[0].update({"uses": "actions/checkout@v6"})),
    ("publish without the build job", lambda wf: _publish_job(wf).pop("needs")),
    ("no tag check", lambda wf: jobs(wf)["build"]["steps"].pop(
        next(i for i, s in enumerate(steps(jobs(wf)["build"])) if "check_release.py" in str(s.get("run", ""))))),
    ("build job with the token", lambda wf: jobs(wf)["build"].update({"permissions": {"id-token": "write"}})),
])
def test_release_check_catches(case: str, change: Callable[[dict[str, Any]], object]) -> None:
    assert release_problems(_release(change)), case


# --- plugin names --------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [*WORKFLOW_FILES, DOCS, ACTION, ACTION_SCRIPT], ids=lambda p: p.name)
def test_plugin_flags_and_environment_variables_exist(path: Path) -> None:
    unknown = unknown_plugin_names(path.read_text())
    assert not unknown, f"{path.name} names what pytest_megacache.settings.OPTIONS does not have: {sorted(unknown)}"


# The user docs: README.md, CHANGELOG.md and docs/*.md. Besides OPTIONS and PENDING_ENV they may name the variables
# the plugin sets for its own child processes (documented so that nobody sets them by hand; settings.md lists them).
USER_DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
DOCS_ONLY_ENV = frozenset({"MEGACACHE_CHILD_SPOOL", "MEGACACHE_RESTORE_READY", "MEGACACHE_ISA_REUSE"})


def test_the_variables_the_plugin_sets_for_children_are_listed_as_not_settings() -> None:
    settings = (ROOT / "docs" / "settings.md").read_text()
    for name in DOCS_ONLY_ENV:
        assert f"| `{name}` | set by the plugin" in settings, name


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_the_user_docs_name_only_real_settings(path: Path) -> None:
    unknown = unknown_plugin_names(path.read_text()) - DOCS_ONLY_ENV
    assert not unknown, f"{path.name} names what pytest_megacache.settings.OPTIONS does not have: {sorted(unknown)}"


def test_the_settings_reference_describes_every_option() -> None:
    text = (ROOT / "docs" / "settings.md").read_text()
    rows = {line for line in text.splitlines() if line.startswith("| `--megacache-")}
    missing = [opt.flag for opt in OPTIONS
               if not any(f"`{opt.flag}`{f', `{opt.negation}`' if opt.negation else ''} | `{opt.env}` | `{opt.ini}` |"
                          in row for row in rows)]
    assert not missing, f"docs/settings.md has no row (flag | variable | ini key) for {missing}"
    assert "`MEGACACHE_SIGNING_KEY`" in text


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


def test_the_actions_inputs_and_outputs_are_documented() -> None:
    docs = DOCS.read_text()
    action = load(ACTION)
    missing = [name for name in [*action["inputs"], *action["outputs"]] if f"`{name}`" not in docs]
    assert not missing, f"docs/ci.md does not describe {missing}"


# --- the GPU examples: both use the action ---------------------------------------------------------

def megacache_step(wf: dict[str, Any]) -> dict[str, Any]:
    return find_step(wf, local_action, "pytest-megacache action (uses: ./)")


def gpu_test_step(wf: dict[str, Any]) -> dict[str, Any]:
    return find_step(wf, lambda s: "pytest -m gpu" in str(s.get("run", "")), "GPU test")


@pytest.fixture(scope="module")
def s3_wf() -> dict[str, Any]:
    return load(GPU_S3)


@pytest.fixture(scope="module")
def cache_wf() -> dict[str, Any]:
    return load(GPU_ACTIONS_CACHE)


@pytest.mark.parametrize("path", [GPU_S3, GPU_ACTIONS_CACHE], ids=lambda p: p.name)
def test_gpu_triggers_runner_and_concurrency(path: Path) -> None:
    wf = load(path)
    on = wf["on"]
    assert on["push"]["branches"] == ["main"]
    assert "pull_request" in on and "workflow_dispatch" in on
    assert "github.ref" in wf["concurrency"]["group"]
    (job,) = jobs(wf).values()
    assert job["runs-on"] == ["self-hosted", "linux", "x64", "gpu"]


@pytest.mark.parametrize("path", [GPU_S3, GPU_ACTIONS_CACHE], ids=lambda p: p.name)
def test_gpu_test_step(path: Path) -> None:
    wf = load(path)
    action, tests = megacache_step(wf), gpu_test_step(wf)
    script = tests["run"]
    assert step_index(wf, action) < step_index(wf, tests)
    assert tests["working-directory"] == "example_project"
    assert re.search(r"--megacache-report[ =]megacache-report\.json", script), script
    assert normalized(tests["env"]["MEGACACHE_SIGNING_KEY"]) == "secrets.MEGACACHE_SIGNING_KEY"
    for flag in ("--megacache-bucket", "--megacache-dir", "--megacache-mode", "--megacache-strict"):
        # The store and the mode come from the action ($GITHUB_ENV); a flag would override them, and fork pull
        # requests rely on the plugin failing open.
        assert flag not in script, flag


@pytest.mark.parametrize("path", [GPU_S3, GPU_ACTIONS_CACHE], ids=lambda p: p.name)
def test_gpu_report_is_uploaded_always(path: Path) -> None:
    wf = load(path)
    tests = gpu_test_step(wf)
    upload = find_step(wf, lambda s: uses(s, "actions/upload-artifact"), "upload-artifact")
    assert "always()" in str(upload.get("if", ""))
    assert upload["with"]["path"] == f"{tests['working-directory']}/megacache-report.json"
    assert step_index(wf, tests) < step_index(wf, upload)


def test_gpu_s3_grants_the_oidc_token(s3_wf: dict[str, Any]) -> None:
    (job,) = jobs(s3_wf).values()
    permissions = {**(s3_wf.get("permissions") or {}), **(job.get("permissions") or {})}
    assert permissions.get("id-token") == "write"
    assert permissions.get("contents") == "read"


def test_gpu_s3_store_and_credentials_skipped_for_forks(s3_wf: dict[str, Any]) -> None:
    action = megacache_step(s3_wf)
    assert {k: normalized(v) for k, v in action["with"].items()} == {"bucket": "vars.MEGACACHE_BUCKET"}
    creds = find_step(s3_wf, lambda s: uses(s, "aws-actions/configure-aws-credentials"), "credentials")
    assert normalized(creds["with"]["role-to-assume"]) == "vars.MEGACACHE_ROLE_ARN"
    assert normalized(creds["with"]["aws-region"]) == "vars.AWS_REGION"
    # The action's fork output (true for a fork's pull request): forks get no OIDC token, so no credentials step.
    assert normalized(str(creds.get("if", ""))) == f"steps.{action['id']}.outputs.fork != 'true'"
    assert step_index(s3_wf, action) < step_index(s3_wf, creds) < step_index(s3_wf, gpu_test_step(s3_wf))
    assert "aws-access-key-id" not in creds["with"], "OIDC only: no stored AWS keys"


def test_gpu_actions_cache_has_no_aws(cache_wf: dict[str, Any]) -> None:
    text = GPU_ACTIONS_CACHE.read_text()
    for needle in ("aws-actions/", "id-token", "role-to-assume", "MEGACACHE_BUCKET", "--megacache-bucket", "AWS_"):
        assert needle not in text, needle
    # The action restores and saves: a workflow's own actions/cache step would save on every event.
    (job,) = jobs(cache_wf).values()
    assert not [s for s in steps(job) if "actions/cache" in str(s.get("uses", ""))]


def test_gpu_actions_cache_store_and_placement(cache_wf: dict[str, Any]) -> None:
    """The action computes the fingerprint: it runs after every step that changes what the tests see (the venv,
    torch, the TORCHINDUCTOR_* / TRITON_* settings written to $GITHUB_ENV), so its key matches the session's."""
    action = megacache_step(cache_wf)
    assert action["with"] == {"dir": "${{ runner.temp }}/megacache"}
    (job,) = jobs(cache_wf).values()
    changes_env = [s for s in steps(job) if re.search(r"GITHUB_(ENV|PATH)", str(s.get("run", "")))]
    assert changes_env and all(step_index(cache_wf, s) < step_index(cache_wf, action) for s in changes_env)


def test_ci_runs_the_action_end_to_end() -> None:
    wf = load(CI)
    action = megacache_step(wf)
    job = next(j for j in jobs(wf).values() if action in steps(j))
    after = steps(job)[steps(job).index(action) + 1:]
    assert action["with"] == {"dir": "${{ runner.temp }}/megacache"}
    assert any("python -m pytest" in str(s.get("run", "")) for s in after)
    assert any("megacache-report.json" in str(s.get("run", "")) and "enabled" in str(s.get("run", "")) for s in after)


# --- pytest-megacache key --flat ------------------------------------------------------------------

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="pytest-megacache key needs torch")


def test_cache_key_check_catches_bad_components() -> None:
    assert cache_key_problems("torch-2.13.0+cpu/cpu")
    assert cache_key_problems("a,b")
    assert cache_key_problems("a b")
    assert cache_key_problems("x" * 300)
    assert not cache_key_problems("torch-2.13.0+cpu-cpu-avx2-t2-py3.11-linux-x86_64-895359ba7608")


@needs_torch
def test_key_flat_is_an_actions_cache_key_component() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest_megacache", "key", "--flat"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    flat = proc.stdout.strip()
    assert "\n" not in flat
    assert not cache_key_problems(flat), cache_key_problems(flat)
    assert action_script.FLAT_KEY.fullmatch(flat), "the action accepts what the command prints"
    plain = subprocess.run([sys.executable, "-m", "pytest_megacache", "key"], capture_output=True, text=True,
                           timeout=120).stdout.strip()
    assert flat == plain.replace("/", "-")
