"""The store layout: ``<prefix>/<scope>/<fingerprint key>/<object name>``, built and parsed by one value."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from pytest_megacache.ci_env import sanitize_scope
from pytest_megacache.layout import (
    FINGERPRINT_SEGMENTS,
    SCOPE_MAX,
    SEGMENT_MAX,
    Layout,
    valid_key,
    valid_object_name,
    valid_prefix,
    valid_scope,
    valid_segment,
)

PREFIX = "pytest-megacache"
KEY = "torch-2.13.0+cpu/cpu-avx2-t2/py3.11-linux-x86_64/0123456789ab"
GPU_KEY = "torch-2.11.0+cu130/cuda13.0-nvidia-h100-80gb-hbm3/py3.11-linux-x86_64/8c1d2e3f4a5b"
NAME = "20250101T000000123-42-0123456789ab.mcb"

GOOD_SCOPES = ["main", "feature+x", "pr-42", "tag-v1.2", "release-1.2_rc+3", "a..b", "_", "+x", "s" * SCOPE_MAX]
BAD_SCOPES = ["", ".", "..", ".hidden", "a/b", "a b", "s" * (SCOPE_MAX + 1), "ü", "x\n", "a\\b"]


# --- the parts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scope", GOOD_SCOPES)
def test_valid_scope(scope: str) -> None:
    assert valid_scope(scope)
    assert valid_segment(scope)  # every scope is a segment a store accepts


@pytest.mark.parametrize("scope", BAD_SCOPES)
def test_invalid_scope(scope: str) -> None:
    assert not valid_scope(scope)


def test_segments_are_broader_than_scopes() -> None:
    # A store's folder parts include prefix parts: a leading dot and up to 200 characters are fine there.
    for part in (".cache", "s" * SEGMENT_MAX, "torch-2.13.0+cpu"):
        assert valid_segment(part), part
    assert not valid_scope(".cache") and not valid_scope("s" * SEGMENT_MAX)
    for part in ("", ".", "..", "s" * (SEGMENT_MAX + 1), "a/b", "a b", "\x00"):
        assert not valid_segment(part), part


def test_valid_key() -> None:
    assert FINGERPRINT_SEGMENTS == 4
    assert valid_key(KEY) and valid_key(GPU_KEY)
    for bad in ("", KEY.rsplit("/", 1)[0], KEY + "/extra", "a//b/c", "a/../b/c", f"/{KEY}", f"{KEY}/", "a b/c/d/e"):
        assert not valid_key(bad), bad


def test_valid_prefix() -> None:
    for good in ("pytest-megacache", "team/ci", ".cache/megacache", "a_b.c"):
        assert valid_prefix(good), good
    for bad in ("", "/x", "x/", "a//b", "a/../b", "..", "a..b", "a b", "a+b"):
        assert not valid_prefix(bad), bad


def test_valid_object_name() -> None:
    assert valid_object_name(NAME)
    for bad in ("", ".mcb", "x.txt", "a/b.mcb", "../a.mcb", "-a.mcb", "a..b.mcb", "a" * 210 + ".mcb"):
        assert not valid_object_name(bad), bad


def test_sanitized_branches_are_scopes() -> None:
    for branch in ("feature/x", "../../etc", "." * 5, "x" * 300, "é/ü", "refs/heads/main", ""):
        assert valid_scope(sanitize_scope(branch)), branch


# --- both directions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [PREFIX, "team/ci/cache", ".cache"])
@pytest.mark.parametrize("scope", GOOD_SCOPES)
def test_folder_round_trip(prefix: str, scope: str) -> None:
    lay = Layout(prefix)
    for key in (KEY, GPU_KEY):
        folder = lay.folder(scope, key)
        assert folder == f"{prefix}/{scope}/{key}"
        assert lay.parse_folder(folder) == (scope, key)
        assert lay.parse_object(f"{folder}/{NAME}") == (scope, key, NAME)
        assert lay.parse_path(f"{scope}/{key}/{NAME}") == (scope, key, NAME)
        assert lay.parse_path(f"{folder}/{NAME}") == (scope, key, NAME)


@pytest.mark.parametrize("scope", BAD_SCOPES)
def test_folder_refuses_a_bad_scope(scope: str) -> None:
    with pytest.raises(ValueError, match="scope"):
        Layout(PREFIX).folder(scope, KEY)


@pytest.mark.parametrize("key", ["", "a/b/c", f"{KEY}/x", "a/../b/c", "a/b/c/d e"])
def test_folder_refuses_a_bad_key(key: str) -> None:
    with pytest.raises(ValueError, match="fingerprint key"):
        Layout(PREFIX).folder("main", key)


@pytest.mark.parametrize("prefix", ["", "/", "a//b", "a/../b", "a b", "/lead", "trail/"])
def test_a_bad_prefix_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        Layout(prefix)


@pytest.mark.parametrize(
    "folder",
    [
        f"{PREFIX}/{KEY}",  # the old layout: no scope
        f"{PREFIX}/main/{KEY}/extra",  # too deep
        f"{PREFIX}/main/short",  # too shallow
        f"{PREFIX}/main",
        PREFIX,
        "",
        f"{PREFIX}-other/main/{KEY}",  # a sibling prefix
        f"other/{PREFIX}/main/{KEY}",
        f"{PREFIX}/.hidden/{KEY}",  # a segment a store takes, but no scope
        f"{PREFIX}/{'s' * (SCOPE_MAX + 1)}/{KEY}",
        f"{PREFIX}/../{KEY}",
        f"{PREFIX}//main/{KEY}",
        f"{PREFIX}/main/{KEY}/",
        f"/{PREFIX}/main/{KEY}",
    ],
)
def test_parse_folder_refuses_what_is_outside_the_layout(folder: str) -> None:
    lay = Layout(PREFIX)
    assert lay.parse_folder(folder) is None
    assert lay.parse_object(f"{folder}/{NAME}") is None


def test_parse_object_refuses_bad_names() -> None:
    lay = Layout(PREFIX)
    folder = lay.folder("main", KEY)
    for name in ("notes.txt", "bad name.mcb", ".x.mcb", ""):
        assert lay.parse_object(f"{folder}/{name}") is None, name
    assert lay.parse_object(folder) is None  # a folder is no object
    assert lay.parse_path(f"main/{KEY}") is None
    assert lay.parse_path(f"../{KEY}/{NAME}") is None


def test_parse_path_is_not_fooled_by_a_scope_named_like_the_prefix() -> None:
    lay = Layout("main")
    assert lay.parse_path(f"main/{KEY}/{NAME}") == ("main", KEY, NAME)
    assert lay.parse_path(f"main/main/{KEY}/{NAME}") == ("main", KEY, NAME)


def test_layout_is_a_frozen_value() -> None:
    lay = Layout(PREFIX)
    assert lay == Layout(PREFIX) and hash(lay) == hash(Layout(PREFIX))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.prefix = "other"  # type: ignore[misc]


def test_importing_the_layout_is_light() -> None:
    code = ("import sys; import pytest_megacache.layout; "
            "print(sorted(m for m in ('boto3', 'botocore', 'zstandard', 'torch', 'pytest') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
