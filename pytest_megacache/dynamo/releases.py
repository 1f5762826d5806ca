"""The torch releases Dynamo reuse's wrappers were written against and run on, and what counts as one of them."""

from __future__ import annotations

import re

# Minor releases whose caching-precompile internals these wrappers were written against and run on (the cold/warm
# chain of code edits against eager, the version suite's reuse tier): 2.11 on an H100 host and on CPU, 2.12 to 2.15
# on CPU. 2.7 to 2.10 have other pieces.
CHECKED_RELEASES = ("2.11", "2.12", "2.13", "2.14", "2.15")
# Where the packages of one function recorded by several wrappers are merged into one entry (run on 2.13; on 2.11,
# an H100 host, the merged entries' backends were not found at load).
MERGED_RELEASES = ("2.11", "2.12", "2.13", "2.14", "2.15")


def release_checked(version: str, releases: tuple[str, ...] = CHECKED_RELEASES) -> bool:
    """Whether ``version`` is one of ``releases`` (minor releases; by default those these wrappers were checked on)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return bool(match) and f"{match.group(1)}.{match.group(2)}" in releases  # type: ignore[union-attr]


# The local labels of torch's own final builds (``2.13.0+cpu``, ``2.11.0+cu130``, ``2.9.1+rocm6.4``, ``2.8.0+xpu``):
# the same release built for another device. Any other label (``+gitecf3bae``, ``+nv24.10``) is a build of its own.
_OFFICIAL_LABEL = r"(?:cpu|cu\d+|rocm\d+(?:\.\d+)*|xpu|cpu[.\-_]cxx11[.\-_]abi)"
_FINAL = re.compile(rf"\d+\.\d+(?:\.\d+)?(?:\+{_OFFICIAL_LABEL})?")


def final_release(version: str) -> bool:
    """Whether ``version`` is a final release as torch publishes it, not a pre-release (``2.15.0a0+gitecf3bae``,
    ``2.14.0.dev20260101+cpu``, ``2.13.0rc1``) or a local build (``2.13.0+git1234abc``): those carry torch's main
    branch, or a change of someone's, at some point between two releases, whose internals the wrappers were never run
    on."""
    return _FINAL.fullmatch(version.strip()) is not None
