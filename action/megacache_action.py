#!/usr/bin/env python3
"""The pytest-megacache GitHub Action's planning step (``action.yml`` runs it once, before the cache steps).

It reads the action's inputs from ``INPUT_*`` variables (action.yml passes them through ``env:``, never
interpolated into a script), decides what the job does, and writes:

- ``$GITHUB_ENV``: the plugin's settings for every later step of the job (``MEGACACHE_DIR``, or
  ``MEGACACHE_BUCKET`` / ``MEGACACHE_PREFIX`` / ``MEGACACHE_ENDPOINT_URL``; ``MEGACACHE_MODE`` when the
  ``mode`` input is set or the run is a pull request from a fork, which is always read-only);
- ``$GITHUB_OUTPUT``: every name in :data:`OUTPUTS`, always (empty where it does not apply), for action.yml's
  ``actions/cache`` steps and the action's own outputs.

A directory store gets an ``actions/cache`` key: ``megacache-<fingerprint>-<job>[-<key-suffix>]~<run id>-<attempt>``,
with the restore key ``megacache-<fingerprint>-<job>[-<key-suffix>]~``. Each run saves under a key of its own
(cache entries are immutable), the restore key finds the newest entry of the same fingerprint, job and suffix,
and ``~`` (which neither a job id nor a suffix may hold) ends the prefix, so that suffix ``a`` never restores
suffix ``a-b``'s entries. Only a push to the default branch saves (``cache=restore-and-save``: action.yml then
uses ``actions/cache``, whose post step saves at the end of the job when the job succeeded).

It never prints an input's value other than the directory and the cache key, and refuses an endpoint URL that
holds credentials: whatever goes to ``$GITHUB_ENV`` is shown in the log header of every later step.
Standard library only; it runs with the runner's ``python3`` (3.10 or newer, like the plugin). Whether a run is
a fork's pull request is decided by the plugin's own rule (``pytest_megacache.ci_env``, standard library only too),
imported from the action's checkout, so the action and the plugin cannot disagree.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

# The action's checkout is the plugin's repository: its own copy of the package, whatever python3 has installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pytest_megacache import ci_env

MODES = ("readwrite", "read", "write", "off")
# What a fork's pull request runs with, for each requested mode: it never writes.
FORK_MODES = {"": "read", "readwrite": "read", "read": "read", "write": "off", "off": "off"}
INPUTS = {  # action input -> the variable action.yml passes it in
    "dir": "INPUT_DIR",
    "bucket": "INPUT_BUCKET",
    "prefix": "INPUT_PREFIX",
    "endpoint-url": "INPUT_ENDPOINT_URL",
    "mode": "INPUT_MODE",
    "key-suffix": "INPUT_KEY_SUFFIX",
}
OUTPUTS = ("store", "fork", "mode", "key", "cache", "path", "cache-key", "restore-key")
CACHE_STEPS = ("none", "restore", "restore-and-save")
KEY_MAX = 512  # actions/cache: at most 512 characters, no commas
TAG_CHARS = re.compile(r"[A-Za-z0-9_.+-]+")
SUFFIX = re.compile(r"[A-Za-z0-9_.+-]{1,100}")
FLAT_KEY = re.compile(r"[A-Za-z0-9_.+-]{1,300}")


class ActionError(Exception):
    """A problem with the inputs or the environment; the message never holds an input's value."""


@dataclass(frozen=True)
class Plan:
    env: dict[str, str]  # to $GITHUB_ENV
    outputs: dict[str, str]  # to $GITHUB_OUTPUT, every name in OUTPUTS
    notices: list[str] = field(default_factory=list)  # ::notice:: lines
    summary: str = ""  # one plain log line


KeyCommand = Callable[[], str]


# --- GitHub's event -------------------------------------------------------------------------------

def fork_pull_request(env: Mapping[str, str]) -> tuple[bool, str]:
    """Is this a pull request whose head lives in another repository? The plugin's rule (``ci_env``)."""
    check = ci_env.is_fork_pull_request(env)
    return check.fork, check.reason


def default_branch_push(env: Mapping[str, str]) -> tuple[bool, str]:
    """A push to the repository's default branch (from the event payload)?"""
    event = env.get("GITHUB_EVENT_NAME", "")
    if event != "push":
        return False, f"not a push ({event or 'no GitHub event'})"
    branch = ci_env.payload_get(ci_env.event_payload(env)[0], "repository", "default_branch")
    if not isinstance(branch, str) or not branch:
        return False, "the event payload does not name the default branch"
    if env.get("GITHUB_REF", "") != f"refs/heads/{branch}":
        return False, "a push to another branch than the default one"
    return True, "a push to the default branch"


# --- inputs ---------------------------------------------------------------------------------------

def read_inputs(env: Mapping[str, str]) -> dict[str, str]:
    values = {name: env.get(var, "").strip() for name, var in INPUTS.items()}
    for name, value in values.items():
        if "\n" in value or "\r" in value:
            raise ActionError(f"input '{name}' holds a line break")
    return values


def check_endpoint(url: str) -> None:
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is not a number raises ValueError
    except ValueError:
        raise ActionError("input 'endpoint-url' is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ActionError("input 'endpoint-url' must be an http:// or https:// URL with a host")
    if "@" in parts.netloc:
        raise ActionError("input 'endpoint-url' holds credentials (user:password@host): every later step's log "
                          "would show them. Give the store's credentials as AWS_ACCESS_KEY_ID / "
                          "AWS_SECRET_ACCESS_KEY (from secrets) instead")


def job_tag(env: Mapping[str, str], suffix: str) -> str:
    job = env.get("GITHUB_JOB", "") or "job"
    job = "".join(c if TAG_CHARS.fullmatch(c) else "_" for c in job)[:100]
    return f"{job}-{suffix}" if suffix else job


def run_key_command() -> str:
    """``pytest-megacache key --flat``: the fingerprint the test session will compute."""
    exe = shutil.which("pytest-megacache")
    if exe is None:
        raise ActionError("the pytest-megacache command is not on PATH: install torch and the plugin "
                          "(pip install pytest-megacache) in a step before this action")
    try:
        proc = subprocess.run([exe, "key", "--flat"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ActionError(f"pytest-megacache key could not run ({type(exc).__name__})") from None
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        why = lines[-1][:300] if lines else "no message"
        raise ActionError(f"pytest-megacache key failed (exit status {proc.returncode}): {why}")
    return proc.stdout.strip()


# --- the plan -------------------------------------------------------------------------------------

def plan(env: Mapping[str, str], cwd: Path, key_command: KeyCommand = run_key_command) -> Plan:
    inputs = read_inputs(env)
    directory, bucket = inputs["dir"], inputs["bucket"]
    if not directory and not bucket:
        raise ActionError("set one store: 'dir' (a directory persisted by actions/cache) or 'bucket' (S3)")
    if directory and bucket:
        raise ActionError("set either 'dir' or 'bucket', not both")
    if inputs["endpoint-url"] and not bucket:
        raise ActionError("input 'endpoint-url' is for an S3 store: set 'bucket' too")
    requested = inputs["mode"]
    if requested and requested not in MODES:
        raise ActionError(f"input 'mode' must be one of {', '.join(MODES)} (or empty for the plugin's default)")
    suffix = inputs["key-suffix"]
    if suffix and bucket:
        raise ActionError("input 'key-suffix' names an actions/cache key: it is for 'dir' only")
    if suffix and not SUFFIX.fullmatch(suffix):
        raise ActionError("input 'key-suffix' may hold only letters, digits and _.+- (at most 100 characters)")

    exported: dict[str, str] = {}
    notices: list[str] = []
    fork, why_fork = fork_pull_request(env)
    if fork:
        mode = FORK_MODES[requested]
        exported["MEGACACHE_MODE"] = mode
        changed = f" instead of '{requested}'" if requested and requested != mode else ""
        notices.append(f"pull request from a fork ({why_fork}): the compile cache is read-only, "
                       f"MEGACACHE_MODE={mode}{changed}")
    else:
        mode = requested or "readwrite"
        if requested:
            exported["MEGACACHE_MODE"] = requested
    if inputs["prefix"]:
        exported["MEGACACHE_PREFIX"] = inputs["prefix"]
    outputs = dict.fromkeys(OUTPUTS, "")
    outputs.update(fork="true" if fork else "false", mode=mode, cache="none")

    if bucket:
        exported["MEGACACHE_BUCKET"] = bucket
        if inputs["endpoint-url"]:
            check_endpoint(inputs["endpoint-url"])
            exported["MEGACACHE_ENDPOINT_URL"] = inputs["endpoint-url"]
        outputs["store"] = "s3"
        summary = f"pytest-megacache: S3 store, mode {mode} (credentials: the job's own, e.g. by OIDC)"
        return Plan(exported, outputs, notices, summary)

    if any(c in directory for c in "*?[]") or directory.startswith("!"):
        raise ActionError("input 'dir' must be a plain path (no glob characters, no leading '!')")
    path = os.path.abspath(os.path.join(cwd, os.path.expanduser(directory)))
    exported["MEGACACHE_DIR"] = path
    outputs.update(store="dir", path=path)
    if mode == "off":
        return Plan(exported, outputs, notices, f"pytest-megacache: mode off, no cache restored or saved ({path})")

    key = key_command()
    if not FLAT_KEY.fullmatch(key):
        raise ActionError("pytest-megacache key --flat printed no usable actions/cache key component")
    run_id, attempt = env.get("GITHUB_RUN_ID", ""), env.get("GITHUB_RUN_ATTEMPT", "") or "1"
    if not run_id.isdigit() or not attempt.isdigit():
        raise ActionError("GITHUB_RUN_ID / GITHUB_RUN_ATTEMPT are not set: run this action inside GitHub Actions")
    restore_key = f"megacache-{key}-{job_tag(env, suffix)}~"
    cache_key = f"{restore_key}{run_id}-{attempt}"
    if len(cache_key) > KEY_MAX:
        raise ActionError(f"the actions/cache key would have {len(cache_key)} characters (at most {KEY_MAX}): "
                          "use a shorter key-suffix")
    saves, why_save = default_branch_push(env)
    cache = "restore-and-save" if saves and mode in ("readwrite", "write") else "restore"
    outputs.update(key=key, cache=cache, **{"cache-key": cache_key, "restore-key": restore_key})
    when = ("saved at the end of the job if the job succeeds" if cache == "restore-and-save"
            else f"restore only ({why_save})" if not saves else f"restore only (mode {mode})")
    summary = f"pytest-megacache: directory store {path}, mode {mode}, key {cache_key}; {when}"
    return Plan(exported, outputs, notices, summary)


# --- the step -------------------------------------------------------------------------------------

def _target(path_var: str, env: Mapping[str, str]) -> str:
    path = env.get(path_var, "")
    if not path:
        raise ActionError(f"{path_var} is not set: run this action inside GitHub Actions")
    return path


def _append(path: str, values: Mapping[str, str]) -> None:
    for name, value in values.items():
        if "\n" in value or "\r" in value:  # read_inputs refuses these; a key never holds one
            raise ActionError(f"{name} would hold a line break")
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(f"{name}={value}\n" for name, value in values.items())


def main(env: Mapping[str, str] | None = None, cwd: Path | None = None,
         key_command: KeyCommand = run_key_command) -> int:
    env = os.environ if env is None else env
    try:
        env_file, output_file = _target("GITHUB_ENV", env), _target("GITHUB_OUTPUT", env)
        result = plan(env, cwd or Path.cwd(), key_command)
        _append(env_file, result.env)
        _append(output_file, result.outputs)
    except ActionError as exc:
        print(f"::error title=pytest-megacache::{exc}", flush=True)
        return 1
    for notice in result.notices:
        print(f"::notice title=pytest-megacache::{notice}")
    print(result.summary, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
