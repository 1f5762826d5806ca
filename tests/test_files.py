"""Compiled files carried as file entries: snapshot, collect and a restore that never escapes its root."""

from __future__ import annotations

import getpass
import os
import stat
import tempfile
from pathlib import Path

import pytest

from pytest_megacache.bundle import Entries, Entry
from pytest_megacache.errors import BundleError
from pytest_megacache.files import EXCLUDED_TOP, FileRoot, inductor_cache_dir


def write(path: Path, data: bytes = b"data", mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    return path


def tree(root: Path) -> dict[str, bytes]:
    """Every regular file below ``root``, by relative POSIX path."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def root(tmp_path: Path) -> FileRoot:
    return FileRoot("inductor", tmp_path / "cache")


# --- snapshot and collect ----------------------------------------------------------------------------


def test_kind_names_the_root(root: FileRoot) -> None:
    assert root.kind == "file/inductor"
    assert FileRoot("triton", Path("/x")).kind == "file/triton"


def test_snapshot_of_a_missing_directory_is_empty(root: FileRoot) -> None:
    assert root.snapshot() == set()


def test_collect_picks_up_only_new_files(root: FileRoot) -> None:
    write(root.path / "ab" / "old.so", b"old")
    before = root.snapshot()
    assert before == {"ab/old.so"}
    write(root.path / "ab" / "cabc.so", b"\x7fELF", 0o755)
    write(root.path / "ab" / "cabc.cpp", b"// source", 0o644)
    write(root.path / "top.json", b"{}", 0o600)

    entries, skipped = root.collect(before)

    assert skipped == []
    assert {(e.kind, e.name, e.data, e.mode) for e in entries} == {
        ("file/inductor", "ab/cabc.so", b"\x7fELF", 0o755),
        ("file/inductor", "ab/cabc.cpp", b"// source", 0o644),
        ("file/inductor", "top.json", b"{}", 0o644),
    }


@pytest.mark.parametrize("top", sorted(EXCLUDED_TOP))
def test_collect_skips_excluded_directories(root: FileRoot, top: str) -> None:
    before = root.snapshot()
    write(root.path / top / "ab" / "entry.bin")
    write(root.path / "kept" / "kernel.so")
    entries, skipped = root.collect(before)
    assert [e.name for e in entries] == ["kept/kernel.so"]
    assert skipped == []
    assert not any(name.startswith(top + "/") for name in root.snapshot())


def test_excluded_directories_are_the_expected_ones() -> None:
    assert frozenset({"fxgraph", "aotautograd", "locks", "dynamo", "precompiled_headers", "triton"}) == EXCLUDED_TOP


@pytest.mark.parametrize(
    "name", ["ab/kernel.so.lock", "ab/tmpx8d7s", "ab/.hidden", "ab/kernel.so.tmp123", "ab/kernel.cpp~",
             ".tmp-megacache-abc", "tmpdir/kernel.so"],
)
def test_collect_skips_lock_and_temp_files(root: FileRoot, name: str) -> None:
    before = root.snapshot()
    write(root.path / name)
    write(root.path / "ab" / "kept.so")
    entries, skipped = root.collect(before)
    assert [e.name for e in entries] == ["ab/kept.so"]
    assert skipped == []


def test_collect_reports_unportable_names(root: FileRoot) -> None:
    before = root.snapshot()
    write(root.path / "ab" / "has space.so")
    entries, skipped = root.collect(before)
    assert len(entries) == 0
    assert skipped == ["ab/has space.so: name not portable"]


def test_collect_ignores_symlinks(root: FileRoot, tmp_path: Path) -> None:
    secret = write(tmp_path / "secret.txt", b"secret")
    root.path.mkdir()
    before = root.snapshot()
    (root.path / "link.so").symlink_to(secret)
    entries, _ = root.collect(before)
    assert len(entries) == 0


# --- restore -----------------------------------------------------------------------------------------


def test_restore_round_trip_with_modes(root: FileRoot, tmp_path: Path) -> None:
    before = root.snapshot()
    write(root.path / "ab" / "k.so", b"shared object", 0o755)
    write(root.path / "ab" / "k.cpp", b"source", 0o644)
    entries, _ = root.collect(before)

    fresh = FileRoot("inductor", tmp_path / "fresh" / "cache")
    assert fresh.restore(entries) == (2, 0)
    assert tree(fresh.path) == {"ab/k.so": b"shared object", "ab/k.cpp": b"source"}
    assert stat.S_IMODE((fresh.path / "ab" / "k.so").stat().st_mode) == 0o755
    assert stat.S_IMODE((fresh.path / "ab" / "k.cpp").stat().st_mode) == 0o644
    # No temp files are left behind.
    assert sorted(p.name for p in (fresh.path / "ab").iterdir()) == ["k.cpp", "k.so"]


def test_restore_never_overwrites(root: FileRoot) -> None:
    write(root.path / "ab" / "k.so", b"original", 0o644)
    entries = [Entry("file/inductor", "ab/k.so", b"replacement", 0o755),
               Entry("file/inductor", "ab/new.so", b"new", 0o644)]
    assert root.restore(entries) == (1, 1)
    assert (root.path / "ab" / "k.so").read_bytes() == b"original"
    assert stat.S_IMODE((root.path / "ab" / "k.so").stat().st_mode) == 0o644
    assert (root.path / "ab" / "new.so").read_bytes() == b"new"
    # A second restore finds everything present.
    assert root.restore(entries) == (0, 2)


def test_restore_drops_unsafe_mode_bits(root: FileRoot) -> None:
    root.restore([Entry("file/inductor", "k.so", b"x", 0o6777)])
    assert stat.S_IMODE((root.path / "k.so").stat().st_mode) == 0o755


def test_restore_ignores_other_roots_and_torch_entries(root: FileRoot) -> None:
    entries = Entries([Entry("file/triton", "a/b.cubin", b"t"), Entry("torch/pgo", "code_state_x", b"p"),
                       Entry("file/inductor", "a/b.so", b"i")])
    assert root.restore(entries) == (1, 0)
    assert tree(root.path) == {"a/b.so": b"i"}


def test_restore_does_not_follow_an_existing_symlink(root: FileRoot, tmp_path: Path) -> None:
    victim = write(tmp_path / "victim.txt", b"untouched")
    root.path.mkdir()
    (root.path / "k.so").symlink_to(victim)
    assert root.restore([Entry("file/inductor", "k.so", b"overwrite?")]) == (0, 1)
    assert victim.read_bytes() == b"untouched"


@pytest.mark.parametrize("name", ["../x.so", "/abs/x.so", "a/../../x.so", ".hidden"])
def test_restore_refuses_unsafe_names(root: FileRoot, tmp_path: Path, name: str) -> None:
    with pytest.raises(BundleError, match="unsafe file path"):
        root.restore([Entry("file/inductor", name, b"evil")])
    assert not (tmp_path / "x.so").exists()


@pytest.mark.parametrize("name", ["evil/x.so", "evil/sub/x.so", "evil/sub/deeper/x.so"])
def test_restore_refuses_a_symlinked_directory_leading_outside(root: FileRoot, tmp_path: Path, name: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root.path.mkdir()
    (root.path / "evil").symlink_to(outside, target_is_directory=True)
    with pytest.raises(BundleError, match="resolves outside"):
        root.restore([Entry("file/inductor", "fine.so", b"ok"), Entry("file/inductor", name, b"evil")])
    assert list(outside.iterdir()) == []  # not a file, not even a directory
    assert (root.path / "fine.so").read_bytes() == b"ok"  # entries before the bad one are whole files


def test_restore_allows_a_symlinked_directory_inside_the_root(root: FileRoot) -> None:
    (root.path / "real").mkdir(parents=True)
    (root.path / "alias").symlink_to(root.path / "real", target_is_directory=True)
    assert root.restore([Entry("file/inductor", "alias/k.so", b"x")]) == (1, 0)
    assert (root.path / "real" / "k.so").read_bytes() == b"x"


def test_restore_through_a_symlinked_root(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    linked = FileRoot("inductor", tmp_path / "link")
    assert linked.restore([Entry("file/inductor", "a/k.so", b"x")]) == (1, 0)
    assert (tmp_path / "real" / "a" / "k.so").read_bytes() == b"x"


# --- inductor_cache_dir ------------------------------------------------------------------------------


def test_inductor_cache_dir_honours_the_variable(tmp_path: Path) -> None:
    assert inductor_cache_dir({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}) == tmp_path / "ind"


def test_inductor_cache_dir_makes_a_relative_setting_absolute(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert inductor_cache_dir({"TORCHINDUCTOR_CACHE_DIR": "rel/dir"}) == tmp_path / "rel" / "dir"


def test_inductor_cache_dir_reads_the_process_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "from-env"))
    assert inductor_cache_dir() == tmp_path / "from-env"


def test_inductor_cache_dir_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    expected = Path(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}").absolute()
    assert inductor_cache_dir() == expected
    assert inductor_cache_dir({"TORCHINDUCTOR_CACHE_DIR": ""}) == expected


def test_inductor_cache_dir_sanitizes_the_user_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(getpass, "getuser", lambda: "DOMAIN\\user:x")
    assert inductor_cache_dir({}).name == "torchinductor_DOMAIN_user_x"


def test_inductor_cache_dir_without_a_user_name(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_user() -> str:
        raise OSError("no user")

    monkeypatch.setattr(getpass, "getuser", no_user)
    assert inductor_cache_dir({}).name == f"torchinductor_uid_{os.getuid()}"


def test_triton_root_leaves_inductor_kernels_to_fx_entries(tmp_path: Path) -> None:
    from pytest_megacache.files import FileRoot

    root = FileRoot("triton", tmp_path)
    user = tmp_path / "AAAAUSERHASH"
    user.mkdir()
    (user / "fused_bias_gelu.cubin").write_bytes(b"cubin")
    (user / "__grp__fused_bias_gelu.json").write_text("{}")
    inductor = tmp_path / "BBBBINDUCTORHASH"
    inductor.mkdir()
    (inductor / "triton_poi_fused_add_0.cubin").write_bytes(b"cubin")
    (inductor / "__grp__triton_poi_fused_add_0.json").write_text("{}")
    entries, skipped = root.collect(set())
    assert sorted(e.name for e in entries) == ["AAAAUSERHASH/__grp__fused_bias_gelu.json",
                                               "AAAAUSERHASH/fused_bias_gelu.cubin"]
    assert skipped == []
    # The inductor root keeps its own rules: a triton_* name there is an ordinary file.
    assert len(FileRoot("inductor", tmp_path).collect(set())[0]) == 4
