"""CI environment detection: fork pull requests, cache scopes and the default scope, from env and files only."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import ci_env
from pytest_megacache.ci_env import current_scope, default_scope, is_fork_pull_request, sanitize_scope
from pytest_megacache.layout import valid_scope

BASE = {"id": 100, "full_name": "octo/project", "fork": False, "default_branch": "trunk"}
FORK = {"id": 200, "full_name": "mallory/project", "fork": True}


def event(tmp_path: Path, payload: Any, name: str = "pull_request", **extra: str) -> dict[str, str]:
    path = tmp_path / "event.json"
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return {"GITHUB_ACTIONS": "true", "GITHUB_EVENT_NAME": name, "GITHUB_EVENT_PATH": str(path), **extra}


def pr_payload(head: Any, base: Any = BASE, number: int = 42) -> dict[str, Any]:
    return {"number": number, "pull_request": {"number": number, "head": {"ref": "feature/x", "repo": head},
                                               "base": {"ref": "trunk", "repo": base}},
            "repository": base}


@pytest.fixture
def nowhere(tmp_path: Path) -> Path:
    """A directory with no git repository above it."""
    where = tmp_path / "nowhere"
    where.mkdir()
    if ci_env.find_git_dir(where) is not None:
        pytest.skip("the temporary directory is inside a git repository")
    return where


def fake_repo(root: Path, head: str, origin_head: str | None = None) -> Path:
    git = root / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text(head)
    if origin_head is not None:
        (git / "refs" / "remotes" / "origin").mkdir(parents=True)
        (git / "refs" / "remotes" / "origin" / "HEAD").write_text(origin_head)
    return git


# --- fork detection ----------------------------------------------------------------------------------


def test_fork_pull_request(tmp_path: Path) -> None:
    check = is_fork_pull_request(event(tmp_path, pr_payload(FORK)))
    assert check.fork is True
    assert bool(check) is True
    assert "mallory/project into octo/project" in check.reason


def test_same_repository_pull_request(tmp_path: Path) -> None:
    check = is_fork_pull_request(event(tmp_path, pr_payload(BASE)))
    assert check.fork is False
    assert not check
    assert "same repository" in check.reason


def test_same_repository_pull_request_in_a_repository_that_is_itself_a_fork(tmp_path: Path) -> None:
    own_fork = {"id": 300, "full_name": "me/project", "fork": True}
    assert is_fork_pull_request(event(tmp_path, pr_payload(own_fork, own_fork))).fork is False


def test_fork_decided_by_name_when_ids_are_missing(tmp_path: Path) -> None:
    head = {"full_name": "Octo/Project", "fork": False}
    base = {"full_name": "octo/project"}
    assert is_fork_pull_request(event(tmp_path, pr_payload(head, base))).fork is False
    other = {"full_name": "mallory/project"}
    assert is_fork_pull_request(event(tmp_path, pr_payload(other, base))).fork is True


def test_fork_flag_decides_only_without_names(tmp_path: Path) -> None:
    assert is_fork_pull_request(event(tmp_path, pr_payload({"fork": True}, {}))).fork is True
    check = is_fork_pull_request(event(tmp_path, pr_payload({"fork": False}, {})))
    assert check.fork is True  # cannot tell: fail safe
    assert "assuming a fork" in check.reason


@pytest.mark.parametrize("name", ["pull_request_target", "pull_request_review", "pull_request_review_comment"])
def test_other_pull_request_events(tmp_path: Path, name: str) -> None:
    assert is_fork_pull_request(event(tmp_path, pr_payload(FORK), name=name)).fork is True
    assert is_fork_pull_request(event(tmp_path, pr_payload(BASE), name=name)).fork is False


@pytest.mark.parametrize("name", ["push", "schedule", "workflow_dispatch", "merge_group"])
def test_non_pull_request_events_are_not_forks(tmp_path: Path, name: str) -> None:
    # Even with a payload that looks like a fork's pull request: the event decides first.
    check = is_fork_pull_request(event(tmp_path, pr_payload(FORK), name=name))
    assert check.fork is False
    assert f"not a pull request event ({name})" in check.reason


def test_outside_github_actions() -> None:
    check = is_fork_pull_request({})
    assert check.fork is False
    assert "GITHUB_EVENT_NAME is not set" in check.reason


@pytest.mark.parametrize(
    ("payload", "why"),
    [("{not json", "not JSON"), ("[1, 2]", "not a JSON object"), (None, "cannot be read")],
)
def test_unreadable_payload_is_treated_as_a_fork(tmp_path: Path, payload: str | None, why: str) -> None:
    env = event(tmp_path, payload or "{}")
    if payload is None:
        env["GITHUB_EVENT_PATH"] = str(tmp_path / "missing.json")
    check = is_fork_pull_request(env)
    assert check.fork is True
    assert why in check.reason and "assuming a fork" in check.reason


def test_missing_event_path_is_treated_as_a_fork() -> None:
    check = is_fork_pull_request({"GITHUB_EVENT_NAME": "pull_request"})
    assert check.fork is True
    assert "GITHUB_EVENT_PATH is not set" in check.reason


def test_deleted_fork_is_treated_as_a_fork(tmp_path: Path) -> None:
    # head.repo is null when the fork has been deleted.
    check = is_fork_pull_request(event(tmp_path, pr_payload(None)))
    assert check.fork is True
    assert "does not name the head repository" in check.reason


# --- sanitize_scope ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "scope"),
    [
        ("main", "main"),
        ("feature/x", "feature+x"),
        ("user/feat/deep", "user+feat+deep"),
        ("release-1.2_rc+3", "release-1.2_rc+3"),
        ("weird name:with*chars", "weird_name_with_chars"),
        ("..hidden", "hidden"),
        ("./x", "+x"),
        ("a..b", "a._b"),
        ("ümlaut", "_mlaut"),
        ("", "_"),
        ("...", "_"),
    ],
)
def test_sanitize_scope(name: str, scope: str) -> None:
    assert sanitize_scope(name) == scope


def test_sanitize_scope_truncates_long_names_with_a_hash() -> None:
    a, b = "x" * 150 + "a", "x" * 150 + "b"
    sa, sb = sanitize_scope(a), sanitize_scope(b)
    assert len(sa) == len(sb) == 100
    assert sa != sb
    assert sa.startswith("x" * 91 + "-")
    assert sanitize_scope("y" * 100) == "y" * 100  # exactly 100: kept whole


@pytest.mark.parametrize("name", ["feature/x", "x" * 300, "../../etc/passwd", ".", "a b/c\\d", "\x00\n", "refs/heads/é"])
def test_sanitized_scope_is_one_safe_segment(name: str) -> None:
    scope = sanitize_scope(name)
    assert re.fullmatch(r"[A-Za-z0-9_+\-][A-Za-z0-9_.+\-]{0,99}", scope)
    assert ".." not in scope
    assert valid_scope(scope)  # what the settings, the CLI and the layout accept as a scope


# --- current_scope -----------------------------------------------------------------------------------


def test_push_to_a_branch_with_a_slash(nowhere: Path) -> None:
    env = {"GITHUB_REF": "refs/heads/feature/new-cache", "GITHUB_REF_NAME": "feature/new-cache"}
    assert current_scope(env, nowhere) == ("feature+new-cache", "GITHUB_REF (refs/heads/feature/new-cache)")


def test_pull_request(tmp_path: Path, nowhere: Path) -> None:
    env = event(tmp_path, pr_payload(FORK, number=7), GITHUB_REF="refs/pull/7/merge", GITHUB_HEAD_REF="feature/x",
                GITHUB_REF_NAME="7/merge")
    assert current_scope(env, nowhere) == ("pr-7", "GITHUB_REF (refs/pull/7/merge)")


def test_pull_request_target_takes_the_number_from_the_payload(tmp_path: Path, nowhere: Path) -> None:
    # pull_request_target runs on the base branch's ref: it must not be mistaken for a push to it.
    env = event(tmp_path, pr_payload(FORK, number=9), name="pull_request_target", GITHUB_REF="refs/heads/main",
                GITHUB_HEAD_REF="feature/x")
    assert current_scope(env, nowhere) == ("pr-9", "pull request number (event payload)")


def test_pull_request_without_a_number_uses_the_head_branch(nowhere: Path) -> None:
    assert current_scope({"GITHUB_HEAD_REF": "feature/x"}, nowhere) == ("feature+x", "GITHUB_HEAD_REF")


def test_pull_request_review_without_head_ref(nowhere: Path) -> None:
    assert current_scope({"GITHUB_REF": "refs/pull/12/merge"}, nowhere)[0] == "pr-12"


def test_tag(nowhere: Path) -> None:
    assert current_scope({"GITHUB_REF": "refs/tags/v1.2.0"}, nowhere)[0] == "tag-v1.2.0"
    assert current_scope({"GITHUB_REF_NAME": "v1", "GITHUB_REF_TYPE": "tag"}, nowhere) == (
        "tag-v1", "GITHUB_REF_NAME (tag)")


def test_ref_name_without_ref(nowhere: Path) -> None:
    assert current_scope({"GITHUB_REF_NAME": "dev/a", "GITHUB_REF_TYPE": "branch"}, nowhere) == (
        "dev+a", "GITHUB_REF_NAME")


def test_github_ref_wins_over_the_local_git_branch(tmp_path: Path) -> None:
    fake_repo(tmp_path, "ref: refs/heads/local\n")
    assert current_scope({"GITHUB_REF": "refs/heads/ci"}, tmp_path)[0] == "ci"


def test_local_git_repository(tmp_path: Path) -> None:
    git = fake_repo(tmp_path, "ref: refs/heads/feature/local\n")
    sub = tmp_path / "src" / "pkg"
    sub.mkdir(parents=True)
    scope, source = current_scope({}, sub)
    assert scope == "feature+local"
    assert str(git / "HEAD") in source


def test_worktree_git_file(tmp_path: Path) -> None:
    main = tmp_path / "main"
    git = fake_repo(main, "ref: refs/heads/main\n")
    worktree_git = git / "worktrees" / "wt"
    worktree_git.mkdir(parents=True)
    (worktree_git / "HEAD").write_text("ref: refs/heads/wt-branch\n")
    (worktree_git / "commondir").write_text("../..\n")
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / ".git").write_text(f"gitdir: {worktree_git}\n")
    assert current_scope({}, wt)[0] == "wt-branch"


def test_relative_gitdir_in_a_git_file(tmp_path: Path) -> None:
    real = tmp_path / "store" / "modules" / "sub"
    real.mkdir(parents=True)
    (real / "HEAD").write_text("ref: refs/heads/sub-branch\n")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / ".git").write_text("gitdir: ../store/modules/sub\n")
    assert current_scope({}, checkout)[0] == "sub-branch"


def test_detached_head(tmp_path: Path) -> None:
    fake_repo(tmp_path, "0123456789abcdef0123456789abcdef01234567\n")
    scope, why = current_scope({}, tmp_path)
    assert scope is None
    assert "detached HEAD" in why


def test_nothing_at_all(nowhere: Path) -> None:
    scope, why = current_scope({}, nowhere)
    assert scope is None
    assert "no git repository" in why


def test_broken_git_file(tmp_path: Path) -> None:
    (tmp_path / ".git").write_text("not a gitdir line\n")
    assert current_scope({}, tmp_path)[0] is None


# --- default_scope -----------------------------------------------------------------------------------


def test_default_scope_precedence(tmp_path: Path, nowhere: Path) -> None:
    repo = tmp_path / "repo"
    fake_repo(repo, "ref: refs/heads/feature\n", origin_head="ref: refs/remotes/origin/develop\n")
    env = event(tmp_path, pr_payload(BASE))
    assert default_scope(env, repo, explicit="release/2.x") == "release+2.x"  # explicit setting first
    assert default_scope(env, repo) == "trunk"  # then the event payload
    assert default_scope({}, repo) == "develop"  # then origin/HEAD
    assert default_scope({}, nowhere) == "main"  # then main


def test_default_scope_ignores_an_empty_setting_and_a_bad_payload(tmp_path: Path, nowhere: Path) -> None:
    env = event(tmp_path, "{broken")
    assert default_scope(env, nowhere, explicit="  ") == "main"


def test_default_scope_does_not_read_the_setting_from_the_environment(tmp_path: Path, nowhere: Path) -> None:
    # settings.resolve reads MEGACACHE_DEFAULT_SCOPE (once, with the other sources); the caller passes it in.
    env = event(tmp_path, pr_payload(BASE), MEGACACHE_DEFAULT_SCOPE="release")
    assert default_scope(env, nowhere) == "trunk"
    assert default_scope(env, nowhere, explicit="release") == "release"


def test_default_scope_from_a_worktree_reads_the_common_dir(tmp_path: Path) -> None:
    git = fake_repo(tmp_path / "main", "ref: refs/heads/x\n", origin_head="ref: refs/remotes/origin/master\n")
    worktree_git = git / "worktrees" / "wt"
    worktree_git.mkdir(parents=True)
    (worktree_git / "HEAD").write_text("ref: refs/heads/y\n")
    (worktree_git / "commondir").write_text("../..\n")
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / ".git").write_text(f"gitdir: {worktree_git}\n")
    assert default_scope({}, wt) == "master"


def test_default_scope_without_origin_head(tmp_path: Path) -> None:
    fake_repo(tmp_path, "ref: refs/heads/feature\n")
    assert default_scope({}, tmp_path) == "main"
