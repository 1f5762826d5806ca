"""The version matrix is declared twice, in tox.ini (one environment per torch minor) and in the compat workflow (one
job per environment): both name the same releases, every minor from 2.7 on, and the default test run leaves the
version suite (compat/) out."""

from __future__ import annotations

import configparser
import re
import sys
from pathlib import Path

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
FIRST, LAST = (2, 7), (2, 15)


def tox_envs() -> dict[str, str]:
    """torchXY environment -> its torch requirement, from tox.ini's generative section."""
    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ROOT / "tox.ini")
    [section] = [s for s in ini.sections() if s.startswith("testenv:torch{")]
    factors = re.fullmatch(r"testenv:torch\{([0-9,]+)\}", section)
    assert factors, section
    names = [f"torch{f}" for f in factors.group(1).split(",")]
    deps = dict(line.strip().split(": ", 1) for line in ini[section]["deps"].strip().splitlines())
    assert set(deps) == set(names), (deps, names)
    assert "compat" in ini[section]["commands"]
    return deps


def test_tox_has_one_environment_per_torch_minor() -> None:
    deps = tox_envs()
    wanted = {f"torch2{minor}": f"torch~=2.{minor}.0" for minor in range(FIRST[1], LAST[1] + 1)}
    assert deps == wanted


def test_the_workflow_runs_every_tox_environment() -> None:
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "compat.yml").read_text())
    include = workflow["jobs"]["torch"]["strategy"]["matrix"]["include"]
    assert {job["tox-env"] for job in include} == set(tox_envs())
    for job in include:
        assert job["tox-env"] == "torch" + job["torch"].replace(".", ""), job


def test_the_default_run_leaves_the_version_suite_out() -> None:
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["testpaths"] == ["tests"]
    assert (ROOT / "compat" / "conftest.py").is_file()
