#!/usr/bin/env python3
"""Before publishing: the tag names the version the built distributions carry, and CHANGELOG.md has a dated
section for it.

    python .github/scripts/check_release.py TAG CHANGELOG DIST...

``TAG`` is ``v`` followed by the version exactly as the distributions' metadata gives it (``v0.1.0`` for
``Version: 0.1.0``); each ``DIST`` is a wheel (``*.whl``, its ``*.dist-info/METADATA``) or an sdist
(``*.tar.gz``, its top-level ``PKG-INFO``). The changelog needs ``## [VERSION] - YYYY-MM-DD``. Prints every
problem and exits 1 if there is one. Standard library only (tests/test_release.py runs it on real builds).
"""

from __future__ import annotations

import re
import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path


def _version(metadata: str) -> str | None:
    value = HeaderParser().parsestr(metadata).get("Version")
    return value.strip() if isinstance(value, str) else None


def dist_version(path: Path) -> str | None:
    """The ``Version`` in a wheel's METADATA or an sdist's PKG-INFO; None when it has none."""
    if path.name.endswith(".whl"):
        with zipfile.ZipFile(path) as whl:
            names = [n for n in whl.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
            return _version(whl.read(names[0]).decode("utf-8")) if len(names) == 1 else None
    if path.name.endswith(".tar.gz"):
        with tarfile.open(path, "r:gz") as sdist:
            members = [m for m in sdist.getmembers() if re.fullmatch(r"[^/]+/PKG-INFO", m.name) and m.isfile()]
            handle = sdist.extractfile(members[0]) if len(members) == 1 else None
            return _version(handle.read().decode("utf-8")) if handle is not None else None
    return None


def changelog_problems(text: str, version: str) -> list[str]:
    heading = re.compile(rf"^## \[{re.escape(version)}\](.*)$", re.M)
    found = heading.findall(text)
    if len(found) != 1:
        return [f"CHANGELOG.md has {len(found)} sections for {version} (wants one: ## [{version}] - YYYY-MM-DD)"]
    if not re.fullmatch(r" - \d{4}-\d{2}-\d{2}\s*", found[0]):
        return [f"CHANGELOG.md's section for {version} has no release date (## [{version}] - YYYY-MM-DD)"]
    return []


def problems(tag: str, changelog: str, dists: list[Path]) -> list[str]:
    if not re.fullmatch(r"v\d[0-9A-Za-z.+!-]*", tag):
        return [f"tag {tag!r} is not v<version>"]
    version = tag[1:]
    found: list[str] = []
    if not dists:
        found.append("no distribution to check")
    kinds = {p.name.endswith(".whl") for p in dists}
    if dists and kinds != {True, False}:
        found.append("want both an sdist and a wheel")
    for path in dists:
        have = dist_version(path)
        if have != version:
            found.append(f"{path.name}: version {have!r}, but the tag {tag!r} names {version!r}")
    return found + changelog_problems(changelog, version)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    tag, changelog, dists = argv[0], Path(argv[1]).read_text(encoding="utf-8"), [Path(a) for a in argv[2:]]
    found = problems(tag, changelog, dists)
    for problem in found:
        print(f"::error title=release::{problem}")
    if not found:
        print(f"{tag}: {', '.join(p.name for p in dists)} and CHANGELOG.md agree")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
