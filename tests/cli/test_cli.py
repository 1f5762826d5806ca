"""The command line: ls, prune, pull, push and inspect over a real directory store and a real S3 endpoint
(moto's server over HTTP), called in-process through ``cli.main`` and, for the entry point, as a subprocess."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_megacache import bundle, cli
from pytest_megacache.bundle import Entries, Entry
from pytest_megacache.cli import commands, storeobjects, storeopts, transfer
from pytest_megacache.cli.storeobjects import ObjectFilter, StoredObject
from pytest_megacache.fingerprint import TorchUnavailable
from pytest_megacache.report import human_bytes
from pytest_megacache.stores import LocalDirStore, MemoryStore, ObjectInfo, S3Store, Store

from ..bundle.test_bundle import build_hostile
from ..conftest import S3Server, free_port

PREFIX = "pytest-megacache"
FP_A = "torch-2.13.0+cpu/cpu-avx2-t2/py3.11-linux-x86_64/0123456789ab"
FP_B = "torch-2.12.0+cpu/cpu-avx2-t2/py3.11-linux-x86_64/ba9876543210"
ROOT = Path(__file__).resolve().parents[2]
DAY = 86400.0


def obj_name(n: int) -> str:
    """Time-sortable like stores.new_object_name: a larger n is a newer name."""
    return f"202501{n + 1:02d}T000000-1-{n:012x}.mcb"


def make_blob(fingerprint: str, n: int = 0, size: int = 2000) -> bytes:
    entries = Entries([Entry("file/inductor", f"ab/k{n}.so", os.urandom(size)),
                       Entry("file/inductor", f"cd/k{n}.h", b"#pragma once\n" * 4)])
    return bundle.encode(entries, fingerprint)


def put(store: Store, scope: str, fingerprint: str, n: int, size: int = 2000) -> bytes:
    data = make_blob(fingerprint, n, size)
    store.put(f"{PREFIX}/{scope}/{fingerprint}", obj_name(n), data)
    return data


def populate(store: Store) -> dict[tuple[str, str], list[int]]:
    """Two scopes, two fingerprints: main/A x2, main/B x1, feature+x/A x1; returns the sizes per group."""
    sizes: dict[tuple[str, str], list[int]] = {}
    for n, (scope, fp) in enumerate([("main", FP_A), ("main", FP_A), ("main", FP_B), ("feature+x", FP_A)]):
        sizes.setdefault((scope, fp), []).append(len(put(store, scope, fp, n, size=1000 * (n + 1))))
    return sizes


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def ls_json(capsys: pytest.CaptureFixture[str], *store_args: str) -> list[dict[str, Any]]:
    rc, out, err = run(capsys, "ls", "--json", *store_args)
    assert rc == 0, err
    rows: list[dict[str, Any]] = json.loads(out)
    return rows


def summary(rows: list[dict[str, Any]]) -> list[tuple[str, str, int, int]]:
    return [(r["scope"], r["fingerprint"], r["objects"], r["bytes"]) for r in rows]


def expected(sizes: dict[tuple[str, str], list[int]]) -> list[tuple[str, str, int, int]]:
    return [(scope, fp, len(s), sum(s)) for (scope, fp), s in sorted(sizes.items())]


def dir_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.mcb")) if p.is_file()}


def s3_objects(server: S3Server, bucket: str) -> dict[str, bytes]:
    client = server.client()
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in server.keys(bucket)}


def set_age(root: Path, scope: str, fingerprint: str, n: int, days: float) -> None:
    when = time.time() - days * DAY
    os.utime(root.joinpath(PREFIX, scope, *fingerprint.split("/"), obj_name(n)), (when, when))


@pytest.fixture(autouse=True)
def _no_torch_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """'this' fingerprint is none unless a test says otherwise: output must not depend on the machine."""
    def unavailable() -> Any:
        raise TorchUnavailable("torch is not installed")

    monkeypatch.setattr(storeobjects, "compute", unavailable)
    monkeypatch.setattr(commands, "compute", unavailable)


@pytest.fixture
def s3_store(s3_env: S3Server) -> tuple[S3Store, list[str]]:
    """A fresh bucket, and the CLI's store options for it."""
    bucket = s3_env.new_bucket()
    return S3Store(bucket, s3_env.client()), ["--bucket", bucket, "--endpoint-url", s3_env.url]


# --- store options -----------------------------------------------------------------------------------


def test_no_store_configured(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "ls")
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and "no store configured" in err


def test_bad_setting_uses_the_plugins_validation(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, _out, err = run(capsys, "ls", "--bucket", "Not_A_Bucket")
    assert rc == 2
    assert "'Not_A_Bucket' is not a valid S3 bucket name" in err and err.count("\n") == 1
    rc, _out, err = run(capsys, "ls", "--bucket", "my-bucket", "--dir", str(tmp_path))
    assert rc == 2 and "not both" in err


@pytest.mark.parametrize(
    ("argv", "named", "plugin_flag"),
    [(["--bucket", "My_Bucket!"], ["command line (--bucket)"], "--megacache-bucket"),
     (["--megacache-bucket", "My_Bucket!"], ["command line (--bucket)"], "--megacache-bucket"),
     (["--bucket", "my-bucket", "--dir", "somewhere"], ["(--bucket)", "(--dir)"], "--megacache-"),
     (["--dir", "d", "--prefix", "a/../b"], ["command line (--prefix)"], "--megacache-prefix"),
     (["--bucket", "my-bucket", "--endpoint-url", "ftp://x"], ["command line (--endpoint-url)"], "--megacache-endpoint-url")],
    ids=["bucket", "bucket-alias", "both", "prefix", "endpoint-url"],
)
def test_setting_errors_name_the_cli_flags(capsys: pytest.CaptureFixture[str], argv: list[str], named: list[str],
                                           plugin_flag: str) -> None:
    # settings.py names the plugin's flags (--megacache-bucket); the CLI's message names its own.
    rc, out, err = run(capsys, "ls", *argv)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert all(text in err for text in named), err
    assert plugin_flag not in err, err


def test_setting_errors_from_the_environment_name_the_variable(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGACACHE_BUCKET", "My_Bucket!")
    rc, _out, err = run(capsys, "ls")
    assert rc == 2 and "environment (MEGACACHE_BUCKET)" in err and "--" not in err


def test_cli_flags_rewrites_only_store_flags() -> None:
    text = "a (--megacache-bucket), b (--megacache-dir), c (--megacache-mode), d (--megacache-directory-x)"
    assert storeopts.cli_flags(text) == "a (--bucket), b (--dir), c (--megacache-mode), d (--megacache-directory-x)"


COMMANDS = ("key", "inspect", "ls", "prune", "pull", "push", "doctor")
# What developer docstrings hold and users should not read: Sphinx roles, reST literals, code references.
MARKUP = (":mod:", ":class:", ":func:", ":data:", ":meth:", ":attr:", "``", "::", "`.", "_cmd_", "_add_")


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_is_plain_text_with_a_description(capsys: pytest.CaptureFixture[str], command: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"] if command else ["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert not [m for m in MARKUP if m in out], out
    usage, description = out.split("\n\n")[:2]
    assert usage.startswith(f"usage: pytest-megacache {command}".rstrip())
    assert len(description) > 80 and not description.startswith(("options:", "positional arguments:")), out
    if not command:
        assert all(f"    {c} " in out for c in COMMANDS), out  # each command listed with its one-line summary


def test_the_commands_and_the_doctor_import_no_circle() -> None:
    """Each module of the command line imports on its own, first in a fresh interpreter (a circle among them fails
    the one that comes first), and the plugin loads none of them."""
    for module in ("cli.doctor", "cli.storeopts", "cli.storeobjects", "cli.commands", "cli.transfer", "cli"):
        subprocess.run([sys.executable, "-c", f"import pytest_megacache.{module}"], check=True)
    code = ("import sys; import pytest_megacache.plugin; "
            "print(sorted(m for m in sys.modules if m.startswith('pytest_megacache.cli')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_store_options_fall_back_to_the_environment(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalDirStore(tmp_path)
    put(store, "main", FP_A, 0)
    store.put(f"custom/main/{FP_B}", obj_name(1), make_blob(FP_B, 1))
    monkeypatch.setenv("MEGACACHE_DIR", str(tmp_path))
    assert summary(ls_json(capsys))[0][:3] == ("main", FP_A, 1)
    monkeypatch.setenv("MEGACACHE_PREFIX", "custom")
    assert summary(ls_json(capsys))[0][:3] == ("main", FP_B, 1)
    assert summary(ls_json(capsys, "--prefix", PREFIX))[0][:3] == ("main", FP_A, 1)  # the flag wins


# --- ls ----------------------------------------------------------------------------------------------


def test_ls_on_an_empty_store(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = run(capsys, "ls", "--dir", str(tmp_path / "nothing-yet"))
    assert rc == 0, err
    assert out.startswith("no objects in dir:")
    assert ls_json(capsys, "--dir", str(tmp_path)) == []


def _table_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    assert lines[0].split() == ["SCOPE", "FINGERPRINT", "OBJECTS", "SIZE", "NEWEST", "OLDEST"]
    return [line.split() for line in lines[1:] if line and not line[0].isdigit() and not line.startswith(("(", " "))]


def _check_ls(capsys: pytest.CaptureFixture[str], store_args: list[str], sizes: dict[tuple[str, str], list[int]]) -> None:
    assert summary(ls_json(capsys, *store_args)) == expected(sizes)
    rc, out, err = run(capsys, "ls", *store_args)
    assert rc == 0, err
    rows = _table_rows(out)
    # scope, fingerprint, objects, size (two words), newest, oldest
    assert [(r[0], r[1], int(r[2]), f"{r[3]} {r[4]}") for r in rows] == [
        (scope, fp, n, human_bytes(total)) for scope, fp, n, total in expected(sizes)]
    assert {r[5][-1] for r in rows} | {r[6][-1] for r in rows} <= {"s", "m"}  # just written: seconds old
    total = sum(sum(s) for s in sizes.values())
    assert f"4 objects, {human_bytes(total)}, 3 fingerprints in 2 scopes" in out


def test_ls_over_a_dir_store(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    sizes = populate(LocalDirStore(tmp_path))
    _check_ls(capsys, ["--dir", str(tmp_path)], sizes)


def test_ls_over_s3(capsys: pytest.CaptureFixture[str], s3_store: tuple[S3Store, list[str]]) -> None:
    store, args = s3_store
    sizes = populate(store)
    _check_ls(capsys, args, sizes)


def test_ls_filters_and_ages(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    populate(LocalDirStore(tmp_path))
    set_age(tmp_path, "main", FP_A, 0, days=3)
    set_age(tmp_path, "main", FP_A, 1, days=0.25)
    d = ["--dir", str(tmp_path)]
    assert [(r["scope"], r["fingerprint"]) for r in ls_json(capsys, *d, "--scope", "main")] == [
        ("main", FP_B), ("main", FP_A)]
    assert [r["scope"] for r in ls_json(capsys, *d, "--fingerprint", FP_A)] == ["feature+x", "main"]
    assert [r["scope"] for r in ls_json(capsys, *d, "--scope", "feature/x")] == ["feature+x"]  # a branch name
    rc, out, _err = run(capsys, "ls", *d, "--scope", "main", "--fingerprint", FP_A, "-v")
    assert rc == 0
    row = _table_rows(out)[0]
    assert row[5:] == ["6h", "3d"]  # newest, oldest
    assert f"    {obj_name(0)}" in out and f"    {obj_name(1)}" in out


def test_ls_bad_filters(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for extra in (["--fingerprint", "torch-2.13.0/cpu"], ["--scope", "a b"], ["--scope", ".."],
                  ["--fingerprint", "this"]):
        rc, out, err = run(capsys, "ls", "--dir", str(tmp_path), *extra)
        assert rc == 2, extra
        assert out == "" and err.count("\n") == 1


def test_ls_marks_this_fingerprint(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    populate(LocalDirStore(tmp_path))
    monkeypatch.setattr(storeobjects, "compute", lambda: SimpleNamespace(key=FP_B))
    rows = ls_json(capsys, "--dir", str(tmp_path))
    assert [r["fingerprint"] for r in rows if r["this"]] == [FP_B]
    rc, out, _err = run(capsys, "ls", "--dir", str(tmp_path))
    assert rc == 0
    assert [line for line in out.splitlines() if "(this)" in line] == [
        line for line in out.splitlines() if FP_B in line]
    assert summary(ls_json(capsys, "--dir", str(tmp_path), "--fingerprint", "this"))[0][:2] == ("main", FP_B)


def test_ls_without_torch_marks_nothing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    populate(LocalDirStore(tmp_path))
    rc, out, _err = run(capsys, "ls", "--dir", str(tmp_path))
    assert rc == 0 and FP_A in out and "(this)" not in out
    assert not any(r["this"] for r in ls_json(capsys, "--dir", str(tmp_path)))


def test_ls_ignores_foreign_and_malformed_keys(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    data = put(store, "main", FP_A, 0)
    store.put(f"{PREFIX}/{FP_A}", obj_name(1), data)  # the old layout: no scope
    store.put(f"{PREFIX}/main/{FP_A}/extra", obj_name(2), data)  # too deep
    store.put(f"{PREFIX}/main/short", obj_name(3), data)  # too shallow
    store.put(f"{PREFIX}-other/main/{FP_A}", obj_name(4), data)  # a sibling prefix
    folder = tmp_path.joinpath(PREFIX, "main", *FP_A.split("/"))
    (folder / "notes.txt").write_text("not an object")
    (folder / "bad name.mcb").write_bytes(data)
    rows = ls_json(capsys, "--dir", str(tmp_path))
    assert summary(rows) == [("main", FP_A, 1, len(data))]
    assert [o["name"] for o in rows[0]["names"]] == [obj_name(0)]
    rc, out, _err = run(capsys, "ls", "--dir", str(tmp_path))
    assert rc == 0
    assert "(3 objects outside the <scope>/<fingerprint>/ layout ignored)" in out
    assert "extra" not in out and "short" not in out


def test_ls_reads_scopes_as_the_layout_defines_them(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # One definition of a scope (layout.valid_scope), also for what ls lists and --scope takes: a folder part
    # the store accepts but no session can write as a scope (a leading dot, over 100 characters) is foreign.
    store = LocalDirStore(tmp_path)
    data = put(store, "main", FP_A, 0)
    store.put(f"{PREFIX}/{'s' * 101}/{FP_A}", obj_name(2), data)
    put(store, "s" * 100, FP_A, 3)
    assert [r["scope"] for r in ls_json(capsys, "--dir", str(tmp_path))] == ["main", "s" * 100]
    rc, out, _err = run(capsys, "ls", "--dir", str(tmp_path))
    assert rc == 0 and "(1 object outside the <scope>/<fingerprint>/ layout ignored)" in out
    memory = MemoryStore()  # the directory store's walk skips dot-directories itself; S3 and memory do not
    memory.put(f"{PREFIX}/main/{FP_A}", obj_name(0), data)
    memory.put(f"{PREFIX}/.hidden/{FP_A}", obj_name(1), data)
    objects, ignored = storeobjects.scan(memory, PREFIX)
    assert [(o.scope, o.fingerprint, o.info.name) for o in objects] == [("main", FP_A, obj_name(0))] and ignored == 1
    for scope in (".hidden", "s" * 101):
        rc, out, err = run(capsys, "ls", "--dir", str(tmp_path), "--scope", scope)
        assert rc == 2 and out == "" and "a scope is one segment" in err, scope


def test_object_filter() -> None:
    a = StoredObject(PREFIX, "main", FP_A, ObjectInfo(obj_name(0), 1, 0.0))
    b = StoredObject(PREFIX, "feature+x", FP_B, ObjectInfo(obj_name(1), 1, 0.0))
    assert a.folder == f"{PREFIX}/main/{FP_A}" and a.path == f"main/{FP_A}/{obj_name(0)}"
    assert [ObjectFilter().matches(o) for o in (a, b)] == [True, True]
    assert [ObjectFilter(scope="main").matches(o) for o in (a, b)] == [True, False]
    assert [ObjectFilter(fingerprint=FP_B).matches(o) for o in (a, b)] == [False, True]
    assert [ObjectFilter("main", FP_B).matches(o) for o in (a, b)] == [False, False]


# --- prune -------------------------------------------------------------------------------------------


def test_prune_needs_a_criterion(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    put(LocalDirStore(tmp_path), "main", FP_A, 0)
    rc, out, err = run(capsys, "prune", "--dir", str(tmp_path), "--yes")
    assert rc == 2 and out == ""
    assert "--older-than" in err and err.count("\n") == 1
    assert len(dir_files(tmp_path)) == 1


def test_prune_by_age_dry_run_then_yes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    populate(LocalDirStore(tmp_path))
    ages = {("main", FP_A, 0): 30, ("main", FP_A, 1): 2, ("main", FP_B, 2): 9, ("feature+x", FP_A, 3): 40}
    for (scope, fp, n), days in ages.items():
        set_age(tmp_path, scope, fp, n, days)
    d = ["--dir", str(tmp_path)]
    before = dir_files(tmp_path)
    listing = ls_json(capsys, *d)

    rc, out, err = run(capsys, "prune", *d, "--older-than", "7")
    assert rc == 0, err
    assert "dry run: nothing deleted" in out and "3 of 4 objects" in out
    assert out.count("would delete ") == 3
    assert dir_files(tmp_path) == before
    assert ls_json(capsys, *d) == [{**r, "newest_age_s": pytest.approx(r["newest_age_s"], abs=60),
                                    "oldest_age_s": pytest.approx(r["oldest_age_s"], abs=60)} for r in listing]

    rc, out, err = run(capsys, "prune", *d, "--older-than", "7", "--scope", "main", "--yes")
    assert rc == 0, err
    assert "deleted 2 objects" in out and "dry run" not in out
    remaining = {path.rsplit("/", 1)[-1] for path in dir_files(tmp_path)}
    assert remaining == {obj_name(1), obj_name(3)}  # feature+x was outside --scope


def test_prune_by_size_budget_over_s3(capsys: pytest.CaptureFixture[str], s3_env: S3Server,
                                      s3_store: tuple[S3Store, list[str]]) -> None:
    store, args = s3_store
    sizes = [len(put(store, scope, FP_A, n, size=3000)) for n, scope in enumerate(["main", "pr-1", "main", "pr-2"])]
    before = s3_env.keys(store.bucket)
    budget = sizes[3] + sizes[2] + sizes[1] // 2  # the two newest fit, the third does not

    rc, out, err = run(capsys, "prune", *args, "--max-bytes", str(budget))
    assert rc == 0, err
    assert "dry run" in out and f"({human_bytes(sizes[0] + sizes[1])})" in out
    assert s3_env.keys(store.bucket) == before

    rc, out, err = run(capsys, "prune", *args, "--max-bytes", str(budget), "--yes")
    assert rc == 0, err
    assert f"freed {human_bytes(sizes[0] + sizes[1])}" in out
    assert [k.rsplit("/", 1)[-1] for k in s3_env.keys(store.bucket)] == [obj_name(2), obj_name(3)]


def test_prune_selection_combines_age_and_budget() -> None:
    now = 1_000_000.0

    def obj(n: int, days: float, size: int) -> StoredObject:
        return StoredObject(PREFIX, "main", FP_A, ObjectInfo(obj_name(n), size, now - days * DAY))

    objects = [obj(0, 10, 100), obj(1, 5, 100), obj(2, 3, 100), obj(3, 1, 100), obj(4, 0, 100)]
    names = lambda sel: [o.info.name for o in sel]  # noqa: E731
    assert names(commands.select_for_prune(objects, 7, None, now)) == [obj_name(0)]
    assert names(commands.select_for_prune(objects, None, 250, now)) == [obj_name(0), obj_name(1), obj_name(2)]
    assert names(commands.select_for_prune(objects, 4, 150, now)) == [obj_name(0), obj_name(1), obj_name(2), obj_name(3)]
    assert commands.select_for_prune(objects, None, 10_000, now) == []


@pytest.mark.parametrize(("text", "value"), [("500MB", 500_000_000), ("2GB", 2_000_000_000), ("1048576", 1048576),
                                             ("1.5 kb", 1500), ("2GiB", 2 << 30), ("10b", 10)])
def test_parse_size(text: str, value: int) -> None:
    assert cli.parse_size(text) == value


def test_prune_refuses_a_bad_size(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["prune", "--dir", str(tmp_path), "--max-bytes", "lots"])
    assert info.value.code == 2
    assert "is not a size" in capsys.readouterr().err


# --- pull / push -------------------------------------------------------------------------------------


def test_pull_then_push_round_trip(capsys: pytest.CaptureFixture[str], s3_env: S3Server,
                                   s3_store: tuple[S3Store, list[str]], tmp_path: Path) -> None:
    store, args = s3_store
    populate(store)
    original = s3_objects(s3_env, store.bucket)
    local = tmp_path / "local"

    rc, out, err = run(capsys, "pull", *args, "--to", str(local))
    assert rc == 0, err
    assert "pulled 4 objects" in out
    assert dir_files(local) == original  # same keys below the directory, same bytes
    listed = {(r["scope"], r["fingerprint"]): r for r in ls_json(capsys, *args)}
    for scope, fp in listed:
        for o in listed[scope, fp]["names"]:
            mtime = local.joinpath(PREFIX, scope, *fp.split("/"), o["name"]).stat().st_mtime
            assert mtime == pytest.approx(o["modified"], abs=1)  # the source's time, for prune

    rc, out, _err = run(capsys, "pull", *args, "--to", str(local))
    assert rc == 0 and "pulled 0 objects" in out and "4 already present" in out

    other = s3_env.new_bucket()
    rc, out, err = run(capsys, "push", "--from", str(local), "--bucket", other, "--endpoint-url", s3_env.url)
    assert rc == 0, err
    assert "pushed 4 objects" in out
    assert s3_objects(s3_env, other) == original


def test_pull_and_push_object_filter(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    populate(LocalDirStore(tmp_path / "src"))
    rc, out, err = run(capsys, "pull", "--dir", str(tmp_path / "src"), "--to", str(tmp_path / "dst"),
                       "--scope", "main", "--fingerprint", FP_A)
    assert rc == 0, err
    assert sorted(p.rsplit("/", 1)[-1] for p in dir_files(tmp_path / "dst")) == [obj_name(0), obj_name(1)]
    rc, out, err = run(capsys, "push", "--from", str(tmp_path / "src"), "--dir", str(tmp_path / "dst"),
                       "--scope", "feature+x")
    assert rc == 0, err
    assert "pushed 1 object " in out
    assert len(dir_files(tmp_path / "dst")) == 3


def test_pull_refuses_a_corrupt_object(capsys: pytest.CaptureFixture[str], s3_env: S3Server,
                                       s3_store: tuple[S3Store, list[str]], tmp_path: Path) -> None:
    store, args = s3_store
    good = put(store, "main", FP_A, 0)
    flipped = bytearray(put(store, "main", FP_A, 1))
    flipped[-5] ^= 0xFF
    store.put(f"{PREFIX}/main/{FP_A}", obj_name(2), bytes(flipped))  # payload no longer matches its SHA-256
    store.put(f"{PREFIX}/main/{FP_A}", obj_name(3), make_blob(FP_B))  # another fingerprint's bundle
    store.put(f"{PREFIX}/main/{FP_A}", obj_name(4), b"not a bundle")
    local = tmp_path / "local"

    rc, out, err = run(capsys, "pull", *args, "--to", str(local))
    assert rc == 1
    refused = [line for line in err.splitlines() if "refused" in line]
    assert [line.split()[2].rsplit("/", 1)[-1].rstrip(":") for line in refused] == [obj_name(2), obj_name(3), obj_name(4)]
    assert "SHA-256" in refused[0] and "fingerprint" in refused[1] and "bad magic" in refused[2]
    assert "pulled 2 objects" in out and "3 refused" in out
    files = dir_files(local)
    assert sorted(p.rsplit("/", 1)[-1] for p in files) == [obj_name(0), obj_name(1)]
    assert files[f"{PREFIX}/main/{FP_A}/{obj_name(0)}"] == good


def test_push_never_overwrites(capsys: pytest.CaptureFixture[str], s3_env: S3Server,
                               s3_store: tuple[S3Store, list[str]], tmp_path: Path) -> None:
    store, args = s3_store
    local = LocalDirStore(tmp_path)
    put(local, "main", FP_A, 0)
    fresh = put(local, "main", FP_A, 1)
    theirs = put(store, "main", FP_A, 0)  # same name, other bytes, already in the bucket

    rc, out, err = run(capsys, "push", *args, "--from", str(tmp_path))
    assert rc == 0, err
    assert "pushed 1 object " in out and "1 already present" in out
    folder = f"{PREFIX}/main/{FP_A}"
    assert s3_objects(s3_env, store.bucket) == {f"{folder}/{obj_name(0)}": theirs, f"{folder}/{obj_name(1)}": fresh}


def test_push_from_a_missing_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = run(capsys, "push", "--from", str(tmp_path / "nope"), "--dir", str(tmp_path))
    assert rc == 2 and "not a directory" in err and out == ""


def test_progress_summary_for_a_large_transfer(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    put(LocalDirStore(tmp_path / "src"), "main", FP_A, 0, size=5_000_000)  # random bytes: stays ~5 MB compressed
    rc, _out, err = run(capsys, "pull", "--dir", str(tmp_path / "src"), "--to", str(tmp_path / "dst"))
    assert rc == 0
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pull: 5.0 MB / 5.0 MB in ")  # stderr is not a TTY here
    rc, _out, err = run(capsys, "pull", "--dir", str(tmp_path / "src"), "--to", str(tmp_path / "dst2"),
                        "--scope", "nothing")
    assert rc == 0 and err == ""  # small (empty) transfers stay quiet


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_tty() -> None:
    stream = _Tty()
    progress = transfer.Progress("push", 9_000_000, stream)
    progress.advance(3_000_000)
    progress.note("push: refused x")
    progress.advance(6_000_000)
    progress.finish()
    text = stream.getvalue()
    assert "\rpush: 3.0 MB / 9.0 MB" in text and "\rpush: 9.0 MB / 9.0 MB" in text
    assert "push: refused x\n" in text and text.endswith("\n")
    quiet = _Tty()
    small = transfer.Progress("push", 4_000_000, quiet)
    small.advance(4_000_000)
    small.finish()
    assert quiet.getvalue() == ""


# --- failures ----------------------------------------------------------------------------------------


def test_unreachable_endpoint_is_one_line(capsys: pytest.CaptureFixture[str], s3_env: S3Server,
                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-do-not-print")
    closed = f"http://127.0.0.1:{free_port()}"
    for argv in (["ls"], ["prune", "--older-than", "1"], ["pull", "--to", str(tmp_path)]):
        start = time.monotonic()
        rc, out, err = run(capsys, *argv, "--bucket", "some-bucket", "--endpoint-url", closed)
        assert rc == 1, argv
        assert time.monotonic() - start < 15
        assert err.count("\n") == 1 and err.startswith("pytest-megacache: S3 list")
        assert "Traceback" not in err and "s3cr3t" not in out + err


def test_credentials_in_an_endpoint_url_are_masked(capsys: pytest.CaptureFixture[str], s3_env: S3Server) -> None:
    rc, _out, err = run(capsys, "ls", "--bucket", "some-bucket",
                        "--endpoint-url", f"http://user:hunter2@127.0.0.1:{free_port()}")
    assert rc == 1
    assert "hunter2" not in err and err.count("\n") == 1


def test_missing_bucket(capsys: pytest.CaptureFixture[str], s3_env: S3Server) -> None:
    rc, _out, err = run(capsys, "ls", "--bucket", "mc-no-such-bucket-here", "--endpoint-url", s3_env.url)
    assert rc == 1 and "NoSuchBucket" in err and err.count("\n") == 1


# --- inspect -----------------------------------------------------------------------------------------


def test_inspect_a_store_object(capsys: pytest.CaptureFixture[str], s3_store: tuple[S3Store, list[str]]) -> None:
    store, args = s3_store
    put(store, "main", FP_A, 0)
    store.put(f"{PREFIX}/main/{FP_A}", obj_name(1), make_blob(FP_B))
    ref = f"main/{FP_A}/{obj_name(0)}"

    rc, out, err = run(capsys, "inspect", *args, "--store-object", ref)
    assert rc == 0, err
    assert out.startswith(f"{ref}: fingerprint {FP_A}, 2 entries")
    assert "  file/inductor: 2\n" in out and "ab/k0.so" not in out

    rc, out, _err = run(capsys, "inspect", *args, "-v", "--store-object", f"{PREFIX}/{ref}")
    assert rc == 0
    assert "    ab/k0.so  2.0 KB  mode 644" in out and "    cd/k0.h" in out

    rc, out, _err = run(capsys, "inspect", *args, "--store-object", f"main/{FP_A}/{obj_name(1)}",
                        "--store-object", f"main/{FP_A}/{obj_name(9)}")
    assert rc == 1
    assert "refused: its header names another fingerprint" in out
    assert f"{obj_name(9)}: not found" in out

    for bad in ("main/x.mcb", f"../{FP_A}/{obj_name(0)}", f"main/{FP_A}/notes.txt"):
        rc, out, err = run(capsys, "inspect", *args, "--store-object", bad)
        assert rc == 2 and "SCOPE/FINGERPRINT/NAME" in err, bad


def test_inspect_files_still_work(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good, bad = tmp_path / "good.mcb", tmp_path / "bad.mcb"
    good.write_bytes(make_blob(FP_A))
    bad.write_bytes(b"PMCB garbage")
    rc, out, _err = run(capsys, "inspect", str(good), str(bad))
    assert rc == 1
    assert f"{good}: fingerprint {FP_A}, 2 entries" in out and f"{bad}: refused" in out
    rc, _out, err = run(capsys, "inspect")
    assert rc == 2 and "--store-object" in err


# --- the entry point ---------------------------------------------------------------------------------


def _subprocess(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    return subprocess.run([sys.executable, "-m", "pytest_megacache", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**full_env, **(env or {})})


def test_entry_point_ls_and_prune(tmp_path: Path) -> None:
    populate(LocalDirStore(tmp_path))
    proc = _subprocess("ls", "--json", env={"MEGACACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert [(r["scope"], r["fingerprint"], r["objects"]) for r in json.loads(proc.stdout)] == [
        ("feature+x", FP_A, 1), ("main", FP_B, 1), ("main", FP_A, 2)]  # FP_B is torch-2.12
    proc = _subprocess("prune", "--dir", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "--max-bytes" in proc.stderr


def test_entry_point_unreachable_s3(s3_server: S3Server) -> None:
    proc = _subprocess("ls", "--bucket", "some-bucket", env={**s3_server.env(),
                                                             "MEGACACHE_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})
    assert proc.returncode == 1
    assert proc.stdout == "" and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


# --- hostile objects and unexpected failures ---------------------------------------------------------

# Header values that used to escape bundle.decode as OverflowError / ValueError / RecursionError (a traceback).
HOSTILE_CREATED = {
    "created-400-digit-int": ("created", "1" + "0" * 400),
    "created-1e400": ("created", "1e400"),
    "created-NaN": ("created", "NaN"),
    "created-5000-digit-int": ("created", "9" * 5000),
    "extra-400-digit-int": ("cold_seconds", '{"inductor:k": ' + "1" * 400 + "}"),
    "extra-deep-nesting": ("producer", "[" * 20_000 + "]" * 20_000),
}


def plant_hostile(store: Store) -> dict[str, bytes]:
    """Two good objects and every hostile one in main/FP_A; returns the hostile ones by object name."""
    put(store, "main", FP_A, 0)
    put(store, "main", FP_A, 1)
    hostile = {}
    for n, (field, text) in enumerate(HOSTILE_CREATED.values(), start=2):
        hostile[obj_name(n)] = build_hostile(field, text, fingerprint=FP_A)
        store.put(f"{PREFIX}/main/{FP_A}", obj_name(n), hostile[obj_name(n)])
    return hostile


def test_pull_refuses_hostile_headers_and_copies_the_rest(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    hostile = plant_hostile(LocalDirStore(tmp_path / "src"))
    rc, out, err = run(capsys, "pull", "--dir", str(tmp_path / "src"), "--to", str(tmp_path / "dst"))
    assert rc == 1
    assert "Traceback" not in err
    refused = err.splitlines()
    assert len(refused) == len(hostile), err  # one line per bad object, and nothing else
    assert sorted(line.split()[2].rsplit("/", 1)[-1].rstrip(":") for line in refused) == sorted(hostile)
    assert all(line.startswith("pytest-megacache: refused main/") for line in refused)
    assert "pulled 2 objects" in out and f"{len(hostile)} refused" in out
    assert sorted(p.rsplit("/", 1)[-1] for p in dir_files(tmp_path / "dst")) == [obj_name(0), obj_name(1)]


def test_push_refuses_hostile_headers_too(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    hostile = plant_hostile(LocalDirStore(tmp_path / "local"))
    rc, out, err = run(capsys, "push", "--from", str(tmp_path / "local"), "--dir", str(tmp_path / "dst"))
    assert rc == 1 and len(err.splitlines()) == len(hostile) and "pushed 2 objects" in out


def test_inspect_refuses_hostile_headers_and_shows_the_rest(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    hostile = plant_hostile(LocalDirStore(tmp_path))
    refs = [f"main/{FP_A}/{name}" for name in [obj_name(0), *hostile, obj_name(1)]]
    rc, out, err = run(capsys, "inspect", "--dir", str(tmp_path), *(a for ref in refs for a in ("--store-object", ref)))
    assert rc == 1 and err == ""
    lines = [line for line in out.splitlines() if not line.startswith(" ")]
    assert [line.split(":", 1)[0] for line in lines] == refs  # one line per object, in order
    assert [ref for ref, line in zip(refs, lines, strict=True) if ": refused: " in line] == refs[1:-1]
    assert lines[0].startswith(f"{refs[0]}: fingerprint {FP_A}, 2 entries")
    assert lines[-1].startswith(f"{refs[-1]}: fingerprint {FP_A}, 2 entries")

    files = []
    for name, blob in hostile.items():
        files.append(tmp_path / name)
        files[-1].write_bytes(blob)
    rc, out, err = run(capsys, "inspect", "-v", *map(str, files))
    assert rc == 1 and err == ""
    assert [line.split(": refused: ")[0] for line in out.splitlines()] == list(map(str, files))


def test_entry_point_pull_and_inspect_on_hostile_objects(tmp_path: Path) -> None:
    hostile = plant_hostile(LocalDirStore(tmp_path / "src"))
    proc = _subprocess("pull", "--dir", str(tmp_path / "src"), "--to", str(tmp_path / "dst"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == len(hostile) and "pulled 2 objects" in proc.stdout
    first = next(iter(hostile))
    proc = _subprocess("inspect", "--dir", str(tmp_path / "src"), "--store-object", f"main/{FP_A}/{first}")
    assert proc.returncode == 1 and proc.stderr == ""
    assert proc.stdout.startswith(f"main/{FP_A}/{first}: refused: ") and proc.stdout.count("\n") == 1


class Boom(Exception):
    pass


def _explode(*_args: object, **_kwargs: object) -> Any:
    raise Boom("the store's client fell over")


@pytest.mark.parametrize(
    ("argv", "target"),
    [(["ls"], "walk"), (["prune", "--older-than", "1"], "walk"), (["pull", "--to", "TMP/dst"], "walk"),
     (["push", "--from", "TMP/src"], "walk"), (["inspect", "--store-object", f"main/{FP_A}/{obj_name(0)}"], "get"),
     (["pull", "--to", "TMP/dst"], "get"), (["prune", "--older-than", "0", "--yes"], "delete"),
     (["ls"], "from_settings"), (["pull", "--to", "TMP/dst"], "decode")],
)
def test_unexpected_exceptions_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, argv: list[str], target: str) -> None:
    put(LocalDirStore(tmp_path / "src"), "main", FP_A, 0)
    if target == "from_settings":
        monkeypatch.setattr(storeobjects, "from_settings", _explode)
    elif target == "decode":
        monkeypatch.setattr(bundle, "decode", _explode)
    else:
        monkeypatch.setattr(LocalDirStore, target, _explode)
    argv = [a.replace("TMP", str(tmp_path)) for a in argv]
    store = tmp_path / ("dst" if argv[0] == "push" else "src")  # push reads --from, the others the store
    rc, _out, err = run(capsys, *argv, "--dir", str(store))
    assert rc == 1
    assert err == "pytest-megacache: Boom: the store's client fell over\n"


def test_key_with_a_broken_torch_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(commands, "compute", broken)
    rc, out, err = run(capsys, "key")
    assert rc == 1 and out == ""
    assert err == "pytest-megacache: RuntimeError: CUDA driver initialization failed\n"


def test_undecodable_file_names_are_printed_escaped(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad-\xff.mcb")  # a surrogate-escaped str
    with open(path, "wb") as fh:
        fh.write(b"not a bundle")
    rc, out, err = run(capsys, "inspect", path)
    assert rc == 1 and err == ""
    assert "bad-\\udcff.mcb: refused: " in out


# --- a reader that goes away -------------------------------------------------------------------------


def many_objects(root: Path, count: int = 5000) -> None:
    """``count`` objects with long names (ls lists names, never reads objects): over 1 MB of ``ls --json``."""
    folder = root.joinpath(PREFIX, "main", *FP_A.split("/"))
    folder.mkdir(parents=True)
    for n in range(count):
        (folder / f"{n:08d}-{'x' * 180}.mcb").write_bytes(b"")


@pytest.mark.parametrize("argv", [["ls", "--json"], ["ls", "-v"]], ids=["json", "verbose"])
def test_entry_point_piped_into_head(tmp_path: Path, argv: list[str]) -> None:
    many_objects(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    writer = subprocess.Popen([sys.executable, "-m", "pytest_megacache", *argv, "--dir", str(tmp_path)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert writer.stdout is not None and writer.stderr is not None
    head = subprocess.Popen(["head", "-1"], stdin=writer.stdout, stdout=subprocess.PIPE)
    writer.stdout.close()  # head holds the only read end: when it exits, the writer's pipe is broken
    first, _ = head.communicate(timeout=120)
    err = writer.stderr.read().decode()
    writer.stderr.close()
    assert writer.wait(timeout=120) == cli.EXIT_BROKEN_PIPE, err
    assert err == ""  # no traceback, no "Exception ignored ... BrokenPipeError"
    assert first == (b"[\n" if argv[1] == "--json" else b"SCOPE" + first[5:])
    # The output really did not fit: ls --json without the early exit is larger than any pipe buffer.
    full = _subprocess(*argv, "--dir", str(tmp_path))
    assert full.returncode == 0 and len(full.stdout) > 1 << 20


def test_broken_pipe_in_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Closed(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stdout", Closed())
    monkeypatch.setattr(sys, "stderr", stderr)
    populate(LocalDirStore(tmp_path))
    assert cli.main(["ls", "--dir", str(tmp_path)]) == cli.EXIT_BROKEN_PIPE
    assert stderr.getvalue() == ""
