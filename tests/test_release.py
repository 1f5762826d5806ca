"""Release hygiene: the sdist and the wheel build from a copy of the repository, pass `twine check --strict`, and
hold what a user relies on (py.typed, the entry points, the license); the release workflow's tag check works.

Offline: `python -m build --no-isolation` builds with this environment's setuptools. `build` and `twine` are in the
`test` extra; without them these tests fail (they are never skipped), since CI must check the distributions.
"""

from __future__ import annotations

import configparser
import importlib.util
import io
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    import tomli as tomllib

from .conftest import removed_unless_failed

ROOT = Path(__file__).resolve().parent.parent
CHECK_RELEASE = ROOT / ".github" / "scripts" / "check_release.py"
PACKAGE = "pytest_megacache"
# Not part of a fresh clone: .gitignore's entries, the git directory and local wheel caches.
NOT_IN_A_CLONE = (".git", ".venv", ".tox", "*.egg-info", "__pycache__", ".pytest_cache", ".mypy_cache",
                  ".ruff_cache", "build", "dist", ".megacache", ".whl")


def _load_check_release() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_release", CHECK_RELEASE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_release = _load_check_release()


@dataclass(frozen=True)
class Dists:
    sdist: Path
    wheel: Path


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Dists:
    missing = [name for name in ("build", "twine") if importlib.util.find_spec(name) is None]
    assert not missing, f"{missing} not installed: they are in the test extra (pip install -e '.[test]')"
    tmp = removed_unless_failed(request, tmp_path_factory.mktemp("release"))
    src, out = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_IN_A_CLONE))
    # Without --sdist/--wheel, build makes the sdist and then the wheel from the sdist: a file the sdist lacks
    # breaks the wheel too.
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in out.iterdir())
    return Dists(sdists[0], wheels[0])


def twine_check(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, paths)],
                          capture_output=True, text=True, timeout=120)


def wheel_metadata(wheel: Path) -> tuple[list[str], Any, configparser.ConfigParser]:
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        (info,) = {n.split("/")[0] for n in names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)}
        metadata = HeaderParser().parsestr(whl.read(f"{info}/METADATA").decode())
        entry_points = configparser.ConfigParser(delimiters=("=",))
        entry_points.optionxform = str  # type: ignore[assignment,method-assign]
        entry_points.read_string(whl.read(f"{info}/entry_points.txt").decode())
    return names, metadata, entry_points


# --- twine ----------------------------------------------------------------------------------------

def test_twine_check_strict_passes(dists: Dists) -> None:
    proc = twine_check(dists.sdist, dists.wheel)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2, proc.stdout


def test_twine_check_strict_fails_on_a_broken_description(dists: Dists, tmp_path: Path) -> None:
    """The check can fail: the same wheel with a long description that does not render."""
    broken = tmp_path / dists.wheel.name
    with zipfile.ZipFile(dists.wheel) as src, zipfile.ZipFile(broken, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(".dist-info/METADATA"):
                head = data.decode().split("\n\n", 1)[0].replace("text/markdown", "text/x-rst")
                data = (head + "\n\nTitle\n=====\n\n.. broken-directive::\n\n`unclosed\n").encode()
            dst.writestr(info, data)
    proc = twine_check(broken)
    assert proc.returncode != 0, proc.stdout + proc.stderr


# --- the wheel ------------------------------------------------------------------------------------

def test_wheel_holds_the_package_and_py_typed(dists: Dists) -> None:
    names, _, _ = wheel_metadata(dists.wheel)
    assert f"{PACKAGE}/py.typed" in names, "Typing :: Typed needs the marker"
    modules = {f"{PACKAGE}/{p.name}" for p in (ROOT / PACKAGE).glob("*.py")}
    assert modules <= set(names), sorted(modules - set(names))
    assert not [n for n in names if n.startswith(("tests/", "action/", "benchmarks/", "demo/", "example_project/"))]


def test_wheel_holds_the_children_pth_at_its_root(dists: Dists) -> None:
    """setup.py's build_py hook: the line child processes run at start, in site-packages itself, with its RECORD
    line (so that pip uninstall removes it)."""
    from pytest_megacache.children import PTH_LINE

    name = "pytest_megacache_children.pth"
    with zipfile.ZipFile(dists.wheel) as whl:
        assert whl.read(name).decode() == PTH_LINE
        [record] = [n for n in whl.namelist() if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)]
        assert any(line.startswith(f"{name},sha256=") for line in whl.read(record).decode().splitlines())


def test_wheel_entry_points_are_pyprojects(dists: Dists, pyproject: dict[str, Any]) -> None:
    _, _, entry_points = wheel_metadata(dists.wheel)
    project = pyproject["project"]
    assert dict(entry_points["pytest11"]) == project["entry-points"]["pytest11"]
    assert dict(entry_points["console_scripts"]) == project["scripts"]
    assert entry_points["pytest11"]["megacache"] == f"{PACKAGE}.plugin", "-p no:megacache names this entry point"


def test_wheel_license_metadata(dists: Dists, pyproject: dict[str, Any]) -> None:
    names, metadata, _ = wheel_metadata(dists.wheel)
    assert metadata["License-Expression"] == pyproject["project"]["license"]
    assert metadata.get_all("License-File") == ["LICENSE"]
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    with zipfile.ZipFile(dists.wheel) as whl:
        assert whl.read(license_file) == (ROOT / "LICENSE").read_bytes()
    assert metadata["Version"] == pyproject["project"]["version"]
    assert metadata["Description-Content-Type"] == "text/markdown"


def test_license_file_is_the_declared_license(pyproject: dict[str, Any]) -> None:
    text = (ROOT / "LICENSE").read_text()
    assert pyproject["project"]["license"] == "MIT"
    assert text.startswith("MIT License\n") and "Permission is hereby granted, free of charge" in text
    assert re.search(r"^Copyright \(c\) \d{4} \S", text, re.M)


# --- the sdist ------------------------------------------------------------------------------------

def test_sdist_holds_license_changelog_and_sources(dists: Dists, pyproject: dict[str, Any]) -> None:
    with tarfile.open(dists.sdist) as sdist:
        names = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
        top = {m.name.split("/", 1)[0] for m in sdist.getmembers()}
        assert len(top) == 1
        (root,) = top
        pkg_info = sdist.extractfile(f"{root}/PKG-INFO")
        assert pkg_info is not None
        metadata = HeaderParser().parse(io.TextIOWrapper(pkg_info, encoding="utf-8"))
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "PKG-INFO"} <= names
    assert {f"{PACKAGE}/{p.name}" for p in (ROOT / PACKAGE).iterdir() if p.suffix in {".py", ".typed"}} <= names
    assert metadata["Version"] == pyproject["project"]["version"]


# --- the changelog and the tag check ---------------------------------------------------------------

def test_changelog_has_a_section_for_this_version(pyproject: dict[str, Any]) -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    version = pyproject["project"]["version"]
    assert text.startswith("# Changelog\n") and "keepachangelog.com" in text
    sections = re.findall(rf"^## \[{re.escape(version)}\] - (\d{{4}}-\d{{2}}-\d{{2}}|Unreleased)$", text, re.M)
    assert len(sections) == 1, f"want one '## [{version}] - <date or Unreleased>' section"
    assert re.search(r"^### (Added|Changed|Fixed|Removed|Deprecated|Security)$", text, re.M)


def dated(changelog: str, version: str) -> str:
    return changelog.replace(f"## [{version}] - Unreleased", f"## [{version}] - 2026-12-01")


def test_check_release_accepts_the_matching_tag(dists: Dists, pyproject: dict[str, Any]) -> None:
    version = pyproject["project"]["version"]
    changelog = dated((ROOT / "CHANGELOG.md").read_text(), version)
    assert check_release.problems(f"v{version}", changelog, [dists.sdist, dists.wheel]) == []


@pytest.mark.parametrize(("case", "message"), [
    ("another version", "but the tag"),
    ("no v", "is not v<version>"),
    ("undated changelog", "has no release date"),
    ("no changelog section", "has 0 sections"),
    ("wheel only", "want both an sdist and a wheel"),
    ("nothing built", "no distribution"),
])
def test_check_release_refuses(dists: Dists, pyproject: dict[str, Any], case: str, message: str) -> None:
    version = pyproject["project"]["version"]
    tag, changelog, paths = f"v{version}", dated((ROOT / "CHANGELOG.md").read_text(), version), [dists.sdist, dists.wheel]
    if case == "another version":
        tag = f"v{version}.post9"
    elif case == "no v":
        tag = version
    elif case == "undated changelog":
        changelog = changelog.replace(f"## [{version}] - 2026-12-01", f"## [{version}] - Unreleased")
    elif case == "no changelog section":
        changelog = changelog.replace(f"## [{version}]", "## [9.9.9]")
    elif case == "wheel only":
        paths = [dists.wheel]
    elif case == "nothing built":
        paths = []
    found = check_release.problems(tag, changelog, paths)
    assert any(message in p for p in found), found


def test_check_release_command(dists: Dists, tmp_path: Path) -> None:
    """As release.yml runs it: exit 1 and a workflow error for the repository's undated section (or a mismatch)."""
    proc = subprocess.run([sys.executable, str(CHECK_RELEASE), "v0.0.0-not-this", str(ROOT / "CHANGELOG.md"),
                           str(dists.sdist), str(dists.wheel)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "::error title=release::" in proc.stdout, proc.stdout + proc.stderr
