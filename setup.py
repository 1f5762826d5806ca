"""Build hooks only (the metadata is in pyproject.toml): install ``pytest_megacache_children.pth`` into site-packages.

That file lets child processes of a test session report their own torch cache counters and wait for its restore
(``pytest_megacache/children/__init__.py``; inert unless the plugin sets ``MEGACACHE_CHILD_SPOOL``). A ``.pth`` file only
runs from a site-packages directory itself, not from inside a package, so it goes to the root of the wheel:

* a regular wheel (``pip install .``, sdist builds, tox): ``build_py`` copies it to the root of ``build_lib``,
  which bdist_wheel packs as is (the wheel's RECORD lists it, so ``pip uninstall`` removes it);
* an editable install (``pip install -e .``, setuptools' PEP 660 ``editable_wheel``): setuptools builds the
  editable wheel from its own strategy and ignores ``build_lib``, so the file is added to that wheel afterwards,
  with its line in RECORD (coverage.py adds its ``a1_coverage.pth`` to its editable wheel the same way).

The name sorts after setuptools' ``__editable__.*.pth`` files (``site`` reads them in name order), so in an
editable install the package is importable by the time this line runs.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path

# setuptools has no type information here (setuptools 84); the ignores stay quiet where it has.
from setuptools import setup  # type: ignore[import-untyped,unused-ignore]
from setuptools.command.build_py import build_py  # type: ignore[import-untyped,unused-ignore]
from setuptools.command.editable_wheel import editable_wheel  # type: ignore[import-untyped,unused-ignore]

PTH_NAME = "pytest_megacache_children.pth"
PTH_SOURCE = Path(__file__).resolve().parent / PTH_NAME


class BuildPyWithPth(build_py):  # type: ignore[misc,unused-ignore]
    """build_py, plus the .pth file at the root of build_lib (the root of the wheel: site-packages)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            self.copy_file(str(PTH_SOURCE), os.path.join(self.build_lib, PTH_NAME), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs: list[str] = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs

    def get_source_files(self) -> list[str]:
        return [*super().get_source_files(), PTH_NAME]  # into the sdist too


class EditableWheelWithPth(editable_wheel):  # type: ignore[misc,unused-ignore]
    """editable_wheel, then the .pth file added to the editable wheel it built, with its RECORD line."""

    def run(self) -> None:
        super().run()
        for wheel in Path(self.dist_dir).glob("*.whl"):
            with zipfile.ZipFile(wheel) as zf:
                names = zf.namelist()
            if "editable" in wheel.name and PTH_NAME not in names:
                add_to_wheel(wheel, PTH_NAME, PTH_SOURCE.read_bytes())


def add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Rewrite ``wheel`` with ``name`` at its root and a matching line in its ``*.dist-info/RECORD``."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")
    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        [record] = [n for n in src.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
        dst.writestr(name, data)
        for info in src.infolist():
            content = src.read(info)
            if info.filename == record:
                content = content.rstrip(b"\r\n") + f"\n{name},sha256={digest},{len(data)}\n".encode()
            dst.writestr(info, content)
    os.replace(tmp, wheel)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
