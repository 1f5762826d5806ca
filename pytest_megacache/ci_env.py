"""What the CI environment says about this run: is it a fork's pull request, and which cache scope is it.

Pure functions over an environment mapping and a working directory. They read files (GitHub's event payload,
``.git/HEAD``) and never run a subprocess (no ``git``), never raise on a missing or unreadable file, and never
import torch or pytest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .layout import SCOPE_MAX, SEGMENT_CHAR

_PULL_REF = re.compile(r"refs/pull/(\d{1,12})/(?:merge|head)")
_MAX_SMALL_FILE = 64 * 1024  # .git/HEAD, a .git file, commondir, refs/remotes/origin/HEAD
_MAX_EVENT_FILE = 64 << 20  # GitHub's event payload


@dataclass(frozen=True)
class ForkCheck:
    """Whether this run is a pull request from another repository, and why we think so.

    Truthy when ``fork`` is: ``if is_fork_pull_request(os.environ): ...`` reads naturally.
    """

    fork: bool
    reason: str

    def __bool__(self) -> bool:
        return self.fork


def _read_small(path: Path, limit: int = _MAX_SMALL_FILE) -> str | None:
    try:
        with path.open("rb") as fh:
            data = fh.read(limit + 1)
    except OSError:
        return None
    if len(data) > limit:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def event_payload(env: Mapping[str, str]) -> tuple[dict[str, Any] | None, str]:
    """GitHub's event payload (``GITHUB_EVENT_PATH``) as a dict, or None and why not."""
    path = env.get("GITHUB_EVENT_PATH")
    if not path:
        return None, "GITHUB_EVENT_PATH is not set"
    text = _read_small(Path(path), _MAX_EVENT_FILE)
    if text is None:
        return None, "the event payload at GITHUB_EVENT_PATH cannot be read"
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None, "the event payload at GITHUB_EVENT_PATH is not JSON"
    if not isinstance(doc, dict):
        return None, "the event payload at GITHUB_EVENT_PATH is not a JSON object"
    return doc, "event payload"


def payload_get(doc: object, *path: str) -> object:
    """``doc[path[0]][path[1]]...``, or None where a level is missing or not an object."""
    for part in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(part)
    return doc


def is_pull_request_event(env: Mapping[str, str]) -> bool:
    """``pull_request``, ``pull_request_target``, ``pull_request_review`` and ``pull_request_review_comment``."""
    return env.get("GITHUB_EVENT_NAME", "").startswith("pull_request")


def is_fork_pull_request(env: Mapping[str, str]) -> ForkCheck:
    """Is this a GitHub Actions run for a pull request whose head lives in another repository (a fork)?

    Decided from the event payload: the head repository (``pull_request.head.repo``) against the base
    repository (``repository``, else ``pull_request.base.repo``), by id when both have one, else by full name.
    ``head.repo.fork`` alone is not enough (in a repository that is itself a fork, every head repository has
    ``fork: true``); it decides only when the names are missing. Fails safe: a ``pull_request*`` event whose
    payload cannot be read, or that does not say where the head lives, counts as a fork.
    """
    event = env.get("GITHUB_EVENT_NAME", "")
    if not event:
        return ForkCheck(False, "not a GitHub Actions event (GITHUB_EVENT_NAME is not set)")
    if not is_pull_request_event(env):
        return ForkCheck(False, f"not a pull request event ({event})")
    doc, why = event_payload(env)
    if doc is None:
        return ForkCheck(True, f"{event} event: {why}; assuming a fork")
    head = payload_get(doc, "pull_request", "head", "repo")
    base = payload_get(doc, "repository")
    if not isinstance(base, dict):
        base = payload_get(doc, "pull_request", "base", "repo")
    if not isinstance(head, dict):
        # head.repo is null when the fork was deleted; a missing pull_request says nothing either way.
        return ForkCheck(True, f"{event} event: the payload does not name the head repository; assuming a fork")
    base = base if isinstance(base, dict) else {}
    head_name, base_name = head.get("full_name"), base.get("full_name")
    head_id, base_id = head.get("id"), base.get("id")
    label = f"{head_name if isinstance(head_name, str) else '?'} into {base_name if isinstance(base_name, str) else '?'}"
    if isinstance(head_id, int) and isinstance(base_id, int):
        if head_id != base_id:
            return ForkCheck(True, f"{event} from a fork ({label})")
        return ForkCheck(False, f"{event} from the same repository ({label})")
    if isinstance(head_name, str) and isinstance(base_name, str):
        if head_name.lower() != base_name.lower():  # GitHub's repository names are case-insensitive
            return ForkCheck(True, f"{event} from a fork ({label})")
        return ForkCheck(False, f"{event} from the same repository ({label})")
    if head.get("fork") is True:
        return ForkCheck(True, f"{event}: the head repository is a fork")
    return ForkCheck(True, f"{event} event: cannot tell the head repository from the base; assuming a fork")


def sanitize_scope(name: str) -> str:
    """Make ``name`` a scope (:func:`.layout.valid_scope`): ``[A-Za-z0-9_.+-]{1,100}``, not starting with a dot.

    ``/`` becomes ``+`` (``feature/x`` -> ``feature+x``), any other character ``_``; leading dots go, and so does
    any ``..``. A name longer than 100 characters keeps its first 91 and gains ``-`` and 8 hex digits of the
    original name's SHA-256, so long names that share a prefix stay apart. An empty result is ``_``.
    """
    out = "".join(c if SEGMENT_CHAR.fullmatch(c) else "+" if c == "/" else "_" for c in name)
    out = out.lstrip(".")
    while ".." in out:
        out = out.replace("..", "._")
    if not out:
        out = "_"
    if len(out) > SCOPE_MAX:
        suffix = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        out = out[: SCOPE_MAX - len(suffix) - 1] + "-" + suffix
    return out


def _scope_from_ref(ref: str) -> str | None:
    if m := _PULL_REF.fullmatch(ref):
        return f"pr-{m.group(1)}"
    if ref.startswith("refs/heads/") and len(ref) > len("refs/heads/"):
        return ref[len("refs/heads/") :]
    if ref.startswith("refs/tags/") and len(ref) > len("refs/tags/"):
        return "tag-" + ref[len("refs/tags/") :]
    return None


def find_git_dir(cwd: str | os.PathLike[str]) -> Path | None:
    """The git directory of the repository holding ``cwd``, found by walking up; follows a ``.git`` file.

    A ``.git`` file (a worktree or a submodule) holds ``gitdir: <path>``, relative to the file's directory.
    """
    start = Path(os.path.abspath(cwd))
    for folder in (start, *start.parents):
        dot_git = folder / ".git"
        if dot_git.is_dir():
            return dot_git
        if dot_git.is_file():
            text = _read_small(dot_git)
            if text is None or not text.startswith("gitdir:"):
                return None
            target = Path(text[len("gitdir:") :].strip())
            target = target if target.is_absolute() else folder / target
            return target if target.is_dir() else None
    return None


def _common_dir(git_dir: Path) -> Path:
    """Where shared refs live: a worktree's git dir names it in ``commondir``."""
    text = _read_small(git_dir / "commondir")
    if text is None or not text.strip():
        return git_dir
    common = Path(text.strip())
    common = common if common.is_absolute() else git_dir / common
    return common if common.is_dir() else git_dir


def _symbolic_ref(text: str | None, prefix: str) -> str | None:
    """The name after ``prefix`` in a symbolic ref file's text (``ref: refs/heads/main``), else None."""
    if text is None:
        return None
    line = text.strip()
    if not line.startswith("ref:"):
        return None
    ref = line[len("ref:") :].strip()
    if ref.startswith(prefix) and len(ref) > len(prefix):
        return ref[len(prefix) :]
    return None


def git_branch(cwd: str | os.PathLike[str]) -> tuple[str | None, str]:
    """The checked-out branch from ``HEAD`` in the git dir above ``cwd``, or None and why not."""
    git_dir = find_git_dir(cwd)
    if git_dir is None:
        return None, "no git repository above the working directory"
    head = _read_small(git_dir / "HEAD")
    if head is None:
        return None, f"{git_dir / 'HEAD'} cannot be read"
    branch = _symbolic_ref(head, "refs/heads/")
    if branch is None:
        return None, f"detached HEAD in {git_dir} (not on a branch)"
    return branch, f"git branch ({git_dir / 'HEAD'})"


def current_scope(env: Mapping[str, str], cwd: str | os.PathLike[str]) -> tuple[str | None, str]:
    """The scope this run writes to, sanitized, and where it came from; ``(None, why)`` if nothing says.

    In order: a pull request (``GITHUB_HEAD_REF`` set, or ``GITHUB_REF`` ``refs/pull/<n>/...``) is
    ``pr-<n>`` (the number from ``GITHUB_REF``, else from the event payload, else the head branch's name);
    ``GITHUB_REF`` ``refs/heads/X`` is ``X`` and ``refs/tags/X`` is ``tag-X`` (``GITHUB_REF_NAME`` with
    ``GITHUB_REF_TYPE`` when ``GITHUB_REF`` is absent); else the branch checked out in the git repository
    above ``cwd``. With None, the caller uses :func:`default_scope`.
    """
    ref = env.get("GITHUB_REF", "")
    head_ref = env.get("GITHUB_HEAD_REF", "")
    pull = _PULL_REF.fullmatch(ref)
    if head_ref or pull:
        if pull:
            return sanitize_scope(f"pr-{pull.group(1)}"), f"GITHUB_REF ({ref})"
        doc, _why = event_payload(env)
        number = payload_get(doc, "pull_request", "number")
        if isinstance(number, int) and not isinstance(number, bool) and number > 0:
            return sanitize_scope(f"pr-{number}"), "pull request number (event payload)"
        return sanitize_scope(head_ref), "GITHUB_HEAD_REF"
    if ref:
        scope = _scope_from_ref(ref)
        if scope is not None:
            return sanitize_scope(scope), f"GITHUB_REF ({ref})"
    name = env.get("GITHUB_REF_NAME", "")
    if name:
        if env.get("GITHUB_REF_TYPE") == "tag":
            return sanitize_scope("tag-" + name), "GITHUB_REF_NAME (tag)"
        return sanitize_scope(name), "GITHUB_REF_NAME"
    branch, why = git_branch(cwd)
    if branch is not None:
        return sanitize_scope(branch), why
    return None, why


def default_scope(env: Mapping[str, str], cwd: str | os.PathLike[str], explicit: str | None = None) -> str:
    """The scope every run may read: the default branch, sanitized.

    ``explicit`` if given and not blank (the caller passes ``--megacache-default-scope``, which
    :mod:`.settings` resolved from every source, ``MEGACACHE_DEFAULT_SCOPE`` included: this function does not
    read that variable), else the event payload's ``repository.default_branch``, else the branch
    ``refs/remotes/origin/HEAD`` points to in the git repository above ``cwd``, else ``main``.
    """
    if explicit and explicit.strip():
        return sanitize_scope(explicit.strip())
    doc, _why = event_payload(env)
    branch = payload_get(doc, "repository", "default_branch")
    if isinstance(branch, str) and branch:
        return sanitize_scope(branch)
    git_dir = find_git_dir(cwd)
    if git_dir is not None:
        origin_head = _read_small(_common_dir(git_dir) / "refs" / "remotes" / "origin" / "HEAD")
        origin = _symbolic_ref(origin_head, "refs/remotes/origin/")
        if origin:
            return sanitize_scope(origin)
    return "main"
