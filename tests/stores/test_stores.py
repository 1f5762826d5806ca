"""One contract for every store backend (memory, local directory, S3 through a real moto server), then
each backend's own failure classification, exercised for real."""

from __future__ import annotations

import io
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import stores
from pytest_megacache.errors import StoreError
from pytest_megacache.layout import valid_object_name
from pytest_megacache.stores import LocalDirStore, MemoryStore, ObjectInfo, S3Store, Store

from ..conftest import S3Server, free_port
from ..faultproxy import FaultProxy

FOLDER = "pytest-megacache/torch-2.13.0/cpu-avx2-t4/py3.11-linux-x86_64/0123456789ab"


@dataclass
class Backend:
    name: str
    store: Store
    # Writes objects with foreign names into a folder behind the store's back; None where impossible.
    plant_foreign: Callable[[str], list[str]] | None = None


def _memory_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return Backend("memory", MemoryStore())


def _dir_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    root = tmp_path / "store"

    def plant(folder: str) -> list[str]:
        path = root.joinpath(*folder.split("/"))
        path.mkdir(parents=True, exist_ok=True)
        (path / "notes.txt").write_text("not an object")
        (path / ".tmp-x").write_bytes(b"half-written")
        (path / ".tmp-abc.mcb").write_bytes(b"hidden temp with the suffix")
        (path / "dir.mcb").mkdir()
        (path / "link.mcb").symlink_to(path / "notes.txt")
        return ["notes.txt", ".tmp-x", ".tmp-abc.mcb", "dir.mcb", "link.mcb"]

    return Backend("dir", LocalDirStore(root), plant)


@pytest.fixture(scope="module")
def s3_clients(s3_server: S3Server) -> dict[str, Any]:
    """boto3 clients are slow to build: one plain client, and one built by make_s3_client from the S3
    environment (boto3 reads credentials and the region when the client is made), shared by the module."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3_server.env().items():
            mp.setenv(key, value)
        env_client = stores.make_s3_client(endpoint_url=s3_server.url)
    return {"raw": s3_server.client(), "env": env_client}


def _new_bucket(client: Any) -> str:
    bucket = f"mc-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=bucket)
    return bucket


def _s3_planter(client: Any, bucket: str) -> Callable[[str], list[str]]:
    def plant(folder: str) -> list[str]:
        names = ["../evil.mcb", "sub/x.mcb", "evil name.mcb", "notes.txt", ".hidden.mcb", "x.mcb.part"]
        for name in names:
            client.put_object(Bucket=bucket, Key=f"{folder}/{name}", Body=b"foreign")
        # A sibling folder whose name extends this one must not leak in either.
        client.put_object(Bucket=bucket, Key=f"{folder}-other/20240101T000000-1-abc.mcb", Body=b"sibling")
        stored = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=folder)["Contents"]}
        assert {f"{folder}/{n}" for n in names} <= stored, stored  # the server kept the hostile keys as given
        return names

    return plant


def _s3_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    client = request.getfixturevalue("s3_clients")["raw"]
    bucket = _new_bucket(client)
    return Backend("s3", S3Store(bucket, client), _s3_planter(client, bucket))


def _s3_env_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    request.getfixturevalue("s3_env")  # the S3 environment stays set while the store is used
    clients = request.getfixturevalue("s3_clients")
    bucket = _new_bucket(clients["raw"])
    return Backend("s3-env", S3Store(bucket, clients["env"]), _s3_planter(clients["raw"], bucket))


BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], Backend]] = {
    "memory": _memory_backend,
    "dir": _dir_backend,
    "s3": _s3_backend,
    "s3-env": _s3_env_backend,
}


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return BACKENDS[request.param](request, tmp_path)


@pytest.fixture
def store(backend: Backend) -> Store:
    return backend.store


def name(n: int) -> str:
    return f"20250101T000000-1-{n:012x}.mcb"


# --- the contract ------------------------------------------------------------------------------------


def test_list_of_an_empty_folder(store: Store) -> None:
    assert store.list(FOLDER) == []


def test_put_then_list(store: Store) -> None:
    start = time.time()
    store.put(FOLDER, name(1), b"x" * 1234)
    listing = store.list(FOLDER)
    assert [(o.name, o.size) for o in listing] == [(name(1), 1234)]
    assert isinstance(listing[0], ObjectInfo)
    assert abs(listing[0].modified - start) < 300


def test_list_is_sorted_and_complete(store: Store) -> None:
    for n in (3, 1, 2):
        store.put(FOLDER, name(n), bytes(n))
    assert [(o.name, o.size) for o in store.list(FOLDER)] == [(name(1), 1), (name(2), 2), (name(3), 3)]


def test_get_returns_the_bytes(store: Store) -> None:
    data = bytes(range(256)) * 40
    store.put(FOLDER, name(1), data)
    assert store.get(FOLDER, name(1), max_bytes=len(data)) == data


def test_head_reads_only_the_first_bytes(store: Store) -> None:
    """The why-miss diagnosis reads one header this way (a ranged GET on S3), never a whole object."""
    data = bytes(range(256)) * 40
    store.put(FOLDER, name(1), data)
    assert store.head(FOLDER, name(1), 100) == data[:100]
    assert store.head(FOLDER, name(1), len(data) + 50) == data  # more than there is: all of it
    assert store.head(FOLDER, name(9), 100) is None


def test_empty_object_is_not_missing(store: Store) -> None:
    store.put(FOLDER, name(1), b"")
    assert store.get(FOLDER, name(1), max_bytes=0) == b""
    assert [o.size for o in store.list(FOLDER)] == [0]


def test_get_of_a_missing_name(store: Store) -> None:
    assert store.get(FOLDER, name(9), max_bytes=100) is None
    store.put(FOLDER, name(1), b"x")
    assert store.get(FOLDER, name(9), max_bytes=100) is None
    assert store.get(FOLDER + "/elsewhere", name(1), max_bytes=100) is None


def test_get_over_max_bytes(store: Store) -> None:
    store.put(FOLDER, name(1), b"y" * 101)
    with pytest.raises(StoreError, match="over the limit of 100") as info:
        store.get(FOLDER, name(1), max_bytes=100)
    assert info.value.kind == "too-large"
    assert store.get(FOLDER, name(1), max_bytes=101) == b"y" * 101


def test_fetch_and_put_file_stream_whole_objects(store: Store, tmp_path: Path) -> None:
    """Objects go to and from files a chunk at a time: several chunks, a missing name, a limit, an existing name."""
    data = bytes(range(256)) * 9000  # over two chunks
    source = tmp_path / "object"
    source.write_bytes(data)
    store.put_file(FOLDER, name(1), str(source))
    assert store.get(FOLDER, name(1), max_bytes=len(data)) == data
    got = io.BytesIO()
    assert store.fetch(FOLDER, name(1), len(data), got) and got.getvalue() == data
    assert not store.fetch(FOLDER, name(9), len(data), io.BytesIO())
    with pytest.raises(StoreError, match=f"over the limit of {len(data) - 1}") as info:
        store.fetch(FOLDER, name(1), len(data) - 1, io.BytesIO())
    assert info.value.kind == "too-large"
    with pytest.raises(StoreError):
        store.put_file(FOLDER, name(2), str(tmp_path / "missing"))
    assert [o.name for o in store.list(FOLDER)] == [name(1)]


def test_delete_then_get(store: Store) -> None:
    store.put(FOLDER, name(1), b"x")
    store.put(FOLDER, name(2), b"y")
    store.delete(FOLDER, name(1))
    assert store.get(FOLDER, name(1), max_bytes=10) is None
    assert [o.name for o in store.list(FOLDER)] == [name(2)]


def test_delete_of_a_missing_object(store: Store) -> None:
    store.delete(FOLDER, name(7))  # must not raise
    assert store.list(FOLDER) == []


def test_folders_are_separate(store: Store) -> None:
    store.put("p/fp-a", name(1), b"a")
    store.put("p/fp-a/nested", name(2), b"nested")
    store.put("p/fp-b", name(3), b"b")
    assert [o.name for o in store.list("p/fp-a")] == [name(1)]
    assert [o.name for o in store.list("p/fp-a/nested")] == [name(2)]
    assert [o.name for o in store.list("p/fp-b")] == [name(3)]
    assert store.list("p") == []


def test_folder_slashes_are_normalized(store: Store) -> None:
    store.put("/p/fp/", name(1), b"x")
    assert [o.name for o in store.list("p/fp")] == [name(1)]
    assert store.get("p/fp/", name(1), max_bytes=10) == b"x"


@pytest.mark.parametrize("backend", ["dir", "s3", "s3-env"], indirect=True)  # memory holds only what put() took
def test_listing_ignores_foreign_names(backend: Backend) -> None:
    assert backend.plant_foreign is not None
    backend.store.put(FOLDER, name(1), b"real")
    planted = backend.plant_foreign(FOLDER)
    assert len(planted) >= 5
    assert [o.name for o in backend.store.list(FOLDER)] == [name(1)]


@pytest.mark.parametrize("bad_folder", ["a/../b", "..", "a/./b", "", "a//b", "a b", "a/\x00"])
def test_unsafe_folder(store: Store, bad_folder: str) -> None:
    with pytest.raises(StoreError, match="unsafe folder"):
        store.list(bad_folder)
    with pytest.raises(StoreError, match="unsafe folder"):
        store.put(bad_folder, name(1), b"x")
    with pytest.raises(StoreError, match="unsafe folder"):
        store.get(bad_folder, name(1), max_bytes=10)
    with pytest.raises(StoreError, match="unsafe folder"):
        store.delete(bad_folder, name(1))


@pytest.mark.parametrize("bad_name", ["../x.mcb", "a/b.mcb", "x.txt", ".x.mcb", "a..b.mcb", "x .mcb", ".mcb"])
def test_put_refuses_bad_object_names(store: Store, bad_name: str) -> None:
    with pytest.raises(StoreError, match="bad object name"):
        store.put(FOLDER, bad_name, b"x")
    assert store.list(FOLDER) == []


def test_new_object_names_are_unique_and_valid() -> None:
    names = [stores.new_object_name() for _ in range(1000)]
    assert len(set(names)) == 1000
    assert all(valid_object_name(n) for n in names)
    assert all(re.fullmatch(rf"\d{{8}}T\d{{9}}-{os.getpid()}-[0-9a-f]{{12}}\.mcb", n) for n in names)


def test_new_object_names_are_accepted_by_every_store(store: Store) -> None:
    object_name = stores.new_object_name()
    store.put(FOLDER, object_name, b"z")
    assert store.get(FOLDER, object_name, max_bytes=1) == b"z"


def test_valid_object_name() -> None:
    assert valid_object_name("20250101T000000-1-abc.mcb")
    for bad in ("../a.mcb", "a/b.mcb", "a.mcb/", "-a.mcb", "a.mcbx", "a" * 210 + ".mcb", "a..mcb"):
        assert not valid_object_name(bad), bad


def test_validate_folder_normalizes() -> None:
    assert stores.validate_folder("/a/b/") == "a/b"
    assert stores.validate_folder("pytest-megacache/torch-2.13.0+cpu/x") == "pytest-megacache/torch-2.13.0+cpu/x"


def test_validate_folder_takes_any_segment_not_only_scopes() -> None:
    # The stores' rule is the layout's broadest: a prefix part may start with a dot and a segment may be
    # 200 characters long, which a scope may not.
    assert stores.validate_folder(".cache/pytest-megacache/main") == ".cache/pytest-megacache/main"
    assert stores.validate_folder("p/" + "s" * 200) == "p/" + "s" * 200
    with pytest.raises(StoreError, match="unsafe folder"):
        stores.validate_folder("p/" + "s" * 201)


# --- S3: failures, classified for real ---------------------------------------------------------------


def test_s3_bucket_that_does_not_exist(s3_clients: dict[str, Any]) -> None:
    store = S3Store("mc-no-such-bucket-here", s3_clients["raw"])
    for call in (lambda: store.list(FOLDER), lambda: store.put(FOLDER, name(1), b"x"),
                 lambda: store.get(FOLDER, name(1), max_bytes=10)):
        with pytest.raises(StoreError, match=r"(?i)bucket") as info:
            call()
        assert info.value.kind == "no-bucket"


def test_s3_endpoint_on_a_closed_port(s3_env: S3Server) -> None:
    client = stores.make_s3_client(endpoint_url=f"http://127.0.0.1:{free_port()}")
    store = S3Store("some-bucket", client)
    start = time.monotonic()
    with pytest.raises(StoreError) as info:
        store.list(FOLDER)
    assert info.value.kind == "unreachable"
    with pytest.raises(StoreError) as info:
        store.get(FOLDER, name(1), max_bytes=10)
    assert info.value.kind == "unreachable"
    assert time.monotonic() - start < 15


def test_s3_client_finds_the_endpoint_in_the_environment(s3_env: S3Server) -> None:
    bucket = s3_env.new_bucket()
    store = S3Store(bucket, stores.make_s3_client())  # AWS_ENDPOINT_URL_S3 from s3_env
    store.put(FOLDER, name(1), b"via env")
    assert s3_env.keys(bucket) == [f"{FOLDER}/{name(1)}"]


def test_a_put_that_landed_and_lost_its_answer_is_stored_not_failed(s3_env: S3Server, tmp_path: Path) -> None:
    """The first attempt of a conditional PUT lands and its answer is lost (a reset): botocore's retry finds the name
    taken, by these very bytes, so the PUT succeeded. A name taken by other bytes still fails as taken."""
    bucket = s3_env.new_bucket()
    with FaultProxy(s3_env.url) as proxy:
        store = S3Store(bucket, stores.make_s3_client(endpoint_url=proxy.url))
        proxy.mode = "lose-put-response"
        store.put(FOLDER, name(1), b"landed" * 1000)
        path = tmp_path / "object"
        path.write_bytes(b"from a file" * 1000)
        store.put_file(FOLDER, name(2), str(path))  # the body read again from the file, for the digest
        puts = [(path_query, mode) for method, path_query, mode in proxy.requests if method == "PUT"]
        assert [mode for _, mode in puts] == ["lose-put-response"] * 4  # each forwarded twice: landed, then retried
        assert store.get(FOLDER, name(1), max_bytes=10_000) == b"landed" * 1000
        assert store.get(FOLDER, name(2), max_bytes=20_000) == b"from a file" * 1000
        proxy.mode = None
        with pytest.raises(StoreError, match="already exists"):  # the name taken by other bytes: taken
            store.put(FOLDER, name(1), b"other bytes")
    assert s3_env.keys(bucket) == [f"{FOLDER}/{name(1)}", f"{FOLDER}/{name(2)}"]


def test_s3_without_credentials(s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("AWS_") and key != "AWS_CA_BUNDLE":
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = S3Store("some-bucket", stores.make_s3_client(endpoint_url=s3_server.url))
    with pytest.raises(StoreError) as info:
        store.list(FOLDER)
    assert info.value.kind == "credentials"


# --- the local directory: failures -------------------------------------------------------------------


def _assert_io(call: Callable[[], Any]) -> None:
    with pytest.raises(StoreError) as info:
        call()
    assert info.value.kind == "io", info.value


def test_dir_store_with_a_file_where_the_directory_should_be(tmp_path: Path) -> None:
    blocker = tmp_path / "store"
    blocker.write_text("I am a file")
    store = LocalDirStore(blocker)
    _assert_io(lambda: store.put(FOLDER, name(1), b"x"))
    _assert_io(lambda: store.list(FOLDER))
    _assert_io(lambda: store.get(FOLDER, name(1), max_bytes=10))
    assert blocker.read_text() == "I am a file"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_dir_store_on_a_read_only_directory(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(0o500)
    try:
        _assert_io(lambda: LocalDirStore(root).put(FOLDER, name(1), b"x"))
    finally:
        root.chmod(0o700)
    assert list(root.iterdir()) == []


def test_dir_store_leaves_no_temp_files(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    store.put(FOLDER, name(1), b"x")
    folder = tmp_path.joinpath(*FOLDER.split("/"))
    assert [p.name for p in folder.iterdir()] == [name(1)]


def test_dir_store_does_not_overwrite(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    store.put(FOLDER, name(1), b"first")
    with pytest.raises(StoreError, match="already exists"):
        store.put(FOLDER, name(1), b"second")
    assert store.get(FOLDER, name(1), max_bytes=10) == b"first"
    folder = tmp_path.joinpath(*FOLDER.split("/"))
    assert [p.name for p in folder.iterdir()] == [name(1)]


def test_dir_store_does_not_overwrite_an_object_that_appears_while_it_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer's object lands just before this put moves its file into place: theirs stays."""
    store = LocalDirStore(tmp_path)
    folder = tmp_path.joinpath(*FOLDER.split("/"))

    def racing(real: Callable[..., None]) -> Callable[..., None]:
        def move(src: Any, dst: Any, **kw: Any) -> None:
            if not (folder / name(1)).exists():
                (folder / name(1)).write_bytes(b"theirs")
            real(src, dst, **kw)
        return move

    monkeypatch.setattr(os, "link", racing(os.link))
    monkeypatch.setattr(os, "replace", racing(os.replace))
    with pytest.raises(StoreError, match="already exists"):
        store.put(FOLDER, name(1), b"mine")
    monkeypatch.undo()
    assert store.get(FOLDER, name(1), max_bytes=10) == b"theirs"
    assert [p.name for p in folder.iterdir()] == [name(1)]


def test_dir_store_lists_what_stays_when_an_object_is_deleted_while_it_lists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another session's compaction deletes an object between the folder's read and that object's stat: the
    listing (and the walk) go on without it, rather than coming back empty or failing."""
    store = LocalDirStore(tmp_path)
    for i in (1, 2, 3):
        store.put(FOLDER, name(i), b"x" * i)
    folder = tmp_path.joinpath(*FOLDER.split("/"))
    real_scandir, real_lstat = os.scandir, os.lstat

    class Entries:  # os.scandir's iterator, deleting the second object once the folder was read
        def __init__(self, path: Any) -> None:
            with real_scandir(path) as it:
                self.items = sorted(it, key=lambda e: e.name)
            (folder / name(2)).unlink(missing_ok=True)

        def __enter__(self) -> Any:
            return iter(self.items)

        def __exit__(self, *exc: Any) -> None:
            return None

    monkeypatch.setattr(os, "scandir", Entries)
    assert [(o.name, o.size) for o in store.list(FOLDER)] == [(name(1), 1), (name(3), 3)]
    monkeypatch.undo()
    store.put(FOLDER, name(2), b"xx")

    def lstat(path: Any, *args: Any, **kw: Any) -> Any:
        if os.path.basename(path) == name(2):
            (folder / name(2)).unlink(missing_ok=True)
        return real_lstat(path, *args, **kw)

    monkeypatch.setattr(os, "lstat", lstat)
    assert [info.name for _f, info in store.walk(FOLDER)] == [name(1), name(3)]


def test_dir_store_get_does_not_follow_a_link(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    store.put(FOLDER, name(1), b"x")
    secret = tmp_path / "secret"
    secret.write_bytes(b"not the store's")
    folder = tmp_path.joinpath("store", *FOLDER.split("/"))
    (folder / name(2)).symlink_to(secret)
    with pytest.raises(StoreError) as info:
        store.get(FOLDER, name(2), max_bytes=100)
    assert info.value.kind == "io" and "a symbolic link" in str(info.value)
    assert b"not the store's" not in str(info.value).encode()


def test_a_put_to_a_taken_name_keeps_the_object_and_says_so(store: Store, tmp_path: Path) -> None:
    """Every store alike: the object there stays, byte for byte, and the put raises (S3: a conditional PUT)."""
    store.put(FOLDER, name(1), b"first")
    with pytest.raises(StoreError, match="already exists"):
        store.put(FOLDER, name(1), b"second")
    other = tmp_path / "other"
    other.write_bytes(b"third")
    with pytest.raises(StoreError, match="already exists"):
        store.put_file(FOLDER, name(1), str(other))
    assert store.get(FOLDER, name(1), max_bytes=10) == b"first"
    assert [info.name for info in store.list(FOLDER)] == [name(1)]


class NoConditionalWrites:
    """An S3-compatible endpoint that answers a conditional PUT with 501 NotImplemented, and stores nothing then."""

    def __init__(self, client: Any) -> None:
        self.client, self.meta = client, client.meta
        self.conditional: list[bool] = []

    def put_object(self, **kwargs: Any) -> Any:
        from botocore.exceptions import ClientError

        self.conditional.append("IfNoneMatch" in kwargs)
        if "IfNoneMatch" in kwargs:
            raise ClientError({"Error": {"Code": "NotImplemented", "Message": "A header you provided implies "
                                         "functionality that is not implemented"},
                               "ResponseMetadata": {"HTTPStatusCode": 501}}, "PutObject")
        return self.client.put_object(**kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.client, attr)


def test_an_endpoint_without_conditional_writes_gets_a_plain_put(s3_clients: dict[str, Any], tmp_path: Path) -> None:
    """Where the condition is not implemented, the object is stored all the same (its unique name guards it)."""
    client = NoConditionalWrites(s3_clients["raw"])
    store = S3Store(_new_bucket(s3_clients["raw"]), client)
    store.put(FOLDER, name(1), b"bytes")
    path = tmp_path / "object"
    path.write_bytes(b"from a file" * 1000)
    store.put_file(FOLDER, name(2), str(path))  # the body is read again, whole, for the plain PUT
    assert client.conditional == [True, False, True, False]
    assert store.get(FOLDER, name(1), max_bytes=100) == b"bytes"
    assert store.get(FOLDER, name(2), max_bytes=100_000) == b"from a file" * 1000


def test_from_settings_picks_the_backend(tmp_path: Path, s3_env: S3Server) -> None:
    from pytest_megacache.settings import Settings

    assert isinstance(stores.from_settings(Settings(directory=str(tmp_path))), LocalDirStore)
    s3 = stores.from_settings(Settings(bucket="my-bucket", endpoint_url=s3_env.url))
    assert isinstance(s3, S3Store) and s3.bucket == "my-bucket"
    with pytest.raises(StoreError, match="no store configured"):
        stores.from_settings(Settings())


def test_walk_finds_objects_at_every_depth(store: Store) -> None:
    store.put("p/main/fp-a", "a.mcb", b"1")
    store.put("p/main/fp-b/x", "b.mcb", b"22")
    store.put("p/feature+x/fp-a", "c.mcb", b"333")
    store.put("other/fp-a", "d.mcb", b"4")
    store.put("pp/fp", "e.mcb", b"5")  # shares the prefix's first letters, not the prefix
    found = [(folder, info.name, info.size) for folder, info in store.walk("p")]
    assert found == [("p/feature+x/fp-a", "c.mcb", 3), ("p/main/fp-a", "a.mcb", 1), ("p/main/fp-b/x", "b.mcb", 2)]
    assert store.walk("nothing-here") == []
