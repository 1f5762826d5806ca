"""The pytest side without compiling anything: options, precedence, removal, reports, fail-open paths.

The sessions whose tests import torch (the restore starts then) are marked ``torch``: they take seconds."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import S3Server, fake_elf, free_port

PLAIN_TEST = "def test_ok():\n    assert True\n"
# A session that imports torch starts the restore (without compiling anything).
TORCH_TEST = "import torch\n\ndef test_ok():\n    assert torch.ones(1).sum() == 1\n"
# Its subprocess imports torch: seconds, so outside the fast tier (-m "not torch").
starts_torch = pytest.mark.torch


def test_help_lists_the_option_group(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["*torch.compile cache (pytest-megacache)*", "*--megacache-bucket=BUCKET*",
                                 "*--megacache-dir*", "*--megacache-mode*", "*--megacache-strict*", "*--megacache-report*"])


def test_off_without_a_store(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(PLAIN_TEST)
    result = pytester.runpytest_subprocess()
    result.stdout.fnmatch_lines(["megacache: off (no store configured*"])
    assert result.ret == 0


@pytest.mark.parametrize(
    ("args", "env", "ini", "expected"),
    [
        (["--megacache-mode", "bogus"], {}, "", "*command line (--megacache-mode): mode 'bogus' is not one of*"),
        ([], {"MEGACACHE_MODE": "bogus"}, "", "*environment (MEGACACHE_MODE): mode 'bogus'*"),
        ([], {}, "megacache_mode = bogus", "*ini file (megacache_mode): mode 'bogus'*"),
        (["--megacache-bucket", "Bad_Bucket"], {}, "", "*is not a valid S3 bucket name*"),
        (["--megacache-dir", "x", "--megacache-bucket", "abc"], {}, "", "*not both*"),
    ],
)
def test_bad_values_are_usage_errors_naming_their_source(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str], ini: str,
    expected: str,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(PLAIN_TEST)
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([expected])


def test_cli_beats_env_beats_ini(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\nmegacache_dir = from-ini\nmegacache_prefix = ini-prefix\nmegacache_mode = read\n"
                     "megacache_precompile = yes\n")
    monkeypatch.setenv("MEGACACHE_PREFIX", "env-prefix")
    monkeypatch.setenv("MEGACACHE_MODE", "write")
    pytester.makepyfile(PLAIN_TEST)
    report = pytester.path / "r.json"
    result = pytester.runpytest_subprocess("--megacache-mode", "readwrite", "--megacache-report", str(report),
                                           "--megacache-no-precompile")
    assert result.ret == 0
    settings = json.loads(report.read_text())["settings"]
    assert settings["precompile"] is False and settings["dynamo_reuse"]["on"] is False  # the negation, over the ini
    assert settings["dynamo_reuse"]["why"].startswith("turned off")
    assert settings["mode"] == "readwrite"  # CLI
    assert settings["prefix"] == "env-prefix"  # env over ini
    assert settings["directory"] == "from-ini"  # ini over default
    result.stdout.fnmatch_lines(["megacache: dir:from-ini/env-prefix [[]readwrite[]] scope main torch-*"])


def test_p_no_megacache_removes_the_plugin(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    report = pytester.path / "r.json"
    monkeypatch.setenv("MEGACACHE_DIR", str(pytester.path / "store"))
    monkeypatch.setenv("MEGACACHE_REPORT", str(report))
    pytester.makepyfile(PLAIN_TEST)
    result = pytester.runpytest_subprocess("-p", "no:megacache")
    assert result.ret == 0
    assert not any(line.startswith("megacache") or "megacache-0" in line for line in result.outlines)
    assert not report.exists()
    with_plugin = pytester.runpytest_subprocess()
    with_plugin.stdout.fnmatch_lines(["megacache: dir:*", "*- megacache -*", "idle: *"])
    assert report.exists()


@starts_torch
def test_report_schema_and_step_summary(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = pytester.path / "summary.md"
    report = pytester.path / "r.json"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    pytester.makepyfile(TORCH_TEST)
    result = pytester.runpytest_subprocess("--megacache-dir", str(pytester.path / "store"), "--megacache-report",
                                           str(report))
    assert result.ret == 0
    doc = json.loads(report.read_text())
    assert doc["schema"] == "pytest-megacache/report" and doc["version"] == 2
    assert set(doc) >= {"enabled", "reason", "settings", "fingerprint", "restore", "load", "torch", "upload",
                        "problems", "scope", "notes", "idle"}
    assert doc["fingerprint"]["key"].startswith("torch-")
    assert doc["restore"]["attempted"] is True and doc["restore"]["ok"] is True
    assert doc["upload"]["reason"] == "nothing was compiled"
    assert "### pytest-megacache" in summary.read_text()


@starts_torch
def test_unwritable_directory_store_fails_open(pytester: pytest.Pytester) -> None:
    blocker = pytester.path / "not-a-dir"
    blocker.write_text("a file where the store directory should be")
    pytester.makepyfile(TORCH_TEST)
    report = pytester.path / "r.json"
    result = pytester.runpytest_subprocess("--megacache-dir", str(blocker / "store"), "--megacache-report", str(report))
    assert result.ret == 0
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*MegacacheWarning: restore: cannot list*"])


@starts_torch
def test_dead_endpoint_costs_seconds_not_minutes(pytester: pytest.Pytester, s3_server: S3Server,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    pytester.makepyfile(TORCH_TEST)
    start = time.monotonic()
    result = pytester.runpytest_subprocess("--megacache-bucket", "some-bucket", "--megacache-endpoint-url",
                                           f"http://127.0.0.1:{free_port()}")
    elapsed = time.monotonic() - start
    assert result.ret == 0
    warnings = [line for line in result.outlines if "MegacacheWarning" in line]
    assert len(warnings) == 1 and "Could not connect" in warnings[0]
    assert elapsed < 60


@pytest.mark.parametrize(
    ("torch_files", "expected"),
    [
        ({"torch.py": ""}, "torch is not installed"),
        ({"torch/__init__.py": "", "torch/version.py": "__version__ = '2.6.0'\ngit_version = 'x'\ncuda = None\n"},
         "torch 2.6.0 is older than 2.7"),
    ],
)
def test_missing_or_old_torch_warns_once(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                         torch_files: dict[str, str], expected: str) -> None:
    shadow = pytester.path / "shadow"
    for rel, text in torch_files.items():
        (shadow / rel).parent.mkdir(parents=True, exist_ok=True)
        (shadow / rel).write_text(text)
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    pytester.makepyfile(PLAIN_TEST)
    result = pytester.runpytest_subprocess("--megacache-dir", str(pytester.path / "store"))
    assert result.ret == 0
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines([f"megacache: off ({expected}*",
                                 f"*MegacacheWarning: pytest-megacache is inactive: {expected}*"])


def bundle_in_a_directory_store(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                entries: list[Any]) -> tuple[Path, Path]:
    """One object holding ``entries`` for this environment's fingerprint in a directory store, and
    TORCHINDUCTOR_CACHE_DIR pointed at a fresh folder. Returns (that folder, the store)."""
    from pytest_megacache import bundle as bundlemod
    from pytest_megacache.fingerprint import compute

    inductor = pytester.path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    store = pytester.path / "store"
    key = compute().key
    folder = store.joinpath("pytest-megacache", "main", *key.split("/"))
    folder.mkdir(parents=True)
    (folder / "20260101T000000-1-abcdef.mcb").write_bytes(bundlemod.encode(bundlemod.Entries(entries), key))
    return inductor, store


@starts_torch
def test_restored_files_are_written_into_the_inductor_cache_dir(pytester: pytest.Pytester,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A stored file entry lands in TORCHINDUCTOR_CACHE_DIR before tests run (no compile needed to check)."""
    from pytest_megacache.bundle import Entry

    inductor, store = bundle_in_a_directory_store(pytester, monkeypatch,
                                                  [Entry("file/inductor", "ab/cabc.so", fake_elf(b"-kernel"), 0o755)])
    pytester.makepyfile(textwrap.dedent(
        """
        import torch

        def test_ok():
            assert True
        """
    ))
    result = pytester.runpytest_subprocess("--megacache-dir", str(store), "--megacache-mode", "read")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["restored 1/1 objects*1 files written*"])
    kernel = Path(inductor, "ab", "cabc.so")
    assert kernel.read_bytes() == fake_elf(b"-kernel")
    assert kernel.stat().st_mode & 0o777 == 0o755


@starts_torch
def test_a_truncated_kernel_file_in_a_bundle_is_refused_not_written(pytester: pytest.Pytester,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A .so cut short (collected mid-build by an older version) would make the import fail with "file too
    short": it is not written, the session warns once, and Inductor rebuilds the kernel."""
    from pytest_megacache.bundle import Entry

    whole = fake_elf(b"-kernel")
    cut = bytearray(fake_elf(bytes(200)))
    cut[0x28:0x30] = (180).to_bytes(8, "little")  # section headers declared at 180 (+ 1 x 64 bytes) ...
    cut[0x3A:0x3E] = (64).to_bytes(2, "little") + (1).to_bytes(2, "little")
    inductor, store = bundle_in_a_directory_store(pytester, monkeypatch, [
        Entry("file/inductor", "ab/cwhole.so", whole, 0o755),
        Entry("file/inductor", "cd/ccut.so", bytes(cut[:200]), 0o755)])  # ... but it ends at 200
    pytester.makepyfile("import torch\n\ndef test_ok():\n    assert True\n")
    result = pytester.runpytest_subprocess("--megacache-dir", str(store), "--megacache-mode", "read",
                                           "--megacache-report", "report.json")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*1 restored files were refused and not written*cd/ccut.so: truncated ELF*"])
    assert Path(inductor, "ab", "cwhole.so").read_bytes() == whole
    assert not Path(inductor, "cd", "ccut.so").exists()
    report = json.loads((pytester.path / "report.json").read_text())
    assert report["restore"]["files_written"] == 1
    assert report["restore"]["files_refused"] == ["cd/ccut.so: truncated ELF file (200 of at least 244 bytes)"]


def test_a_session_that_never_imports_torch_restores_nothing(pytester: pytest.Pytester) -> None:
    """Zero cost when idle: no restore, no upload, none of the cache machinery imported."""
    pytester.makeconftest(textwrap.dedent(
        """
        import json, os, sys

        def pytest_unconfigure(config):
            mods = ("pytest_megacache.core", "pytest_megacache.bundle", "zstandard", "boto3", "torch")
            with open(os.environ["MODS_OUT"], "w") as fh:
                json.dump({m: m in sys.modules for m in mods}, fh)
        """
    ))
    pytester.makepyfile(PLAIN_TEST)
    mods, report = pytester.path / "mods.json", pytester.path / "r.json"
    store = pytester.path / "store"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MODS_OUT", str(mods))
        mp.setenv("MEGACACHE_PRECOMPILE", "1")  # Dynamo reuse is installed where torch._dynamo is imported, not before
        result = pytester.runpytest_subprocess("--megacache-dir", str(store), "--megacache-report", str(report))
    assert result.ret == 0
    result.stdout.fnmatch_lines(["idle: the session never imported torch*"])
    assert json.loads(mods.read_text()) == dict.fromkeys(
        ("pytest_megacache.core", "pytest_megacache.bundle", "zstandard", "boto3", "torch"), False)
    doc = json.loads(report.read_text())
    assert doc["idle"] is True and "restore" not in doc
    assert not store.exists()
    assert doc["settings"]["dynamo_reuse"]["on"] is True and doc["settings"]["dynamo_reuse"]["why"].startswith("asked")


@starts_torch
def test_credentials_never_reach_warnings_or_the_report(pytester: pytest.Pytester, s3_server: S3Server,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2-secret-access-key")
    monkeypatch.setenv("MEGACACHE_SIGNING_KEY", "a-signing-key-of-32-characters!!")
    pytester.makepyfile(TORCH_TEST)
    report = pytester.path / "r.json"
    result = pytester.runpytest_subprocess(
        "--megacache-bucket", "some-bucket", "--megacache-report", str(report),
        "--megacache-endpoint-url", f"http://userpart:pass-in-url@127.0.0.1:{free_port()}")
    assert result.ret == 0
    warnings = [line for line in result.outlines if "MegacacheWarning" in line]
    assert len(warnings) == 1, result.outlines  # the unreachable endpoint was reported...
    everything = "\n".join(result.outlines + result.errlines) + report.read_text()
    for secret in ("pass-in-url", "userpart", "hunter2-secret-access-key", "a-signing-key-of-32-characters!!"):
        assert secret not in everything  # ...without any credential in it
    assert "***@127.0.0.1" in report.read_text()


def test_a_store_path_taken_for_a_test_path_is_named(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """pytest reads `--megacache-dir /elsewhere` as a test path when deciding its rootdir (the option is not
    known yet): the ini is missed. The plugin says so and how to write it; `=` works."""
    pytester.makeini("[pytest]\nmegacache_prefix = from-ini\n")
    pytester.makepyfile(PLAIN_TEST)
    store = tmp_path / "elsewhere"
    store.mkdir()
    spaced = pytester.runpytest_subprocess("--megacache-dir", str(store))
    spaced.stdout.fnmatch_lines(["*pytest took the --megacache-dir value for a test path*--megacache-dir=*"])
    joined = pytester.runpytest_subprocess(f"--megacache-dir={store}")
    assert joined.ret == 0
    assert not any("test path" in line for line in joined.outlines)
    joined.stdout.fnmatch_lines([f"megacache: dir:{store}/from-ini *"])
