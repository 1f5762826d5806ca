"""Budgets and containment in the cache flow, without torch: a store that never answers, a client that cannot be
built, a listing that never ends, a compaction that would write an object no restore accepts, one hostile
object among good ones. The pytest sessions that make the same faults happen over HTTP are in test_faults.py."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import bundle as bundlemod
from pytest_megacache.bundle import Entries, Entry, Limits
from pytest_megacache.core import CacheSession
from pytest_megacache.errors import StoreError
from pytest_megacache.restore import Restore
from pytest_megacache.settings import Settings
from pytest_megacache.stores import LocalDirStore, MemoryStore, ObjectInfo, S3Store, Store, from_settings
from pytest_megacache.stores.deadline import Deadline, bounded, bounded_map

from ..test_core import FOLDER, FP, KEY_A, KEY_B, FakeTorch, run, session, stored_keys


def test_bounded_gives_up_at_the_deadline_and_leaves_a_daemon_behind() -> None:
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(StoreError, match=r"probe did not finish within the budget of the probe \(0\.3 s\)") as caught:
        bounded(release.wait, Deadline(0.3, "the probe"), "probe")
    # Not before the budget; at it, give or take a loaded machine's delays (the call itself never returns).
    assert 0.25 < time.monotonic() - start < 10
    assert caught.value.kind == "timeout"
    stuck = [t for t in threading.enumerate() if t.name == "megacache-probe"]
    assert stuck and all(t.daemon for t in stuck)  # never joined at interpreter exit
    release.set()


def test_bounded_turns_any_exception_into_a_store_error() -> None:
    def broken() -> None:
        raise ValueError("Invalid endpoint: 127.0.0.1:5000")

    with pytest.raises(StoreError, match="ValueError: Invalid endpoint") as caught:
        bounded(broken, Deadline(5, "x"), "connecting")
    assert caught.value.kind == "config"


def test_bounded_map_keeps_order_and_marks_what_missed_the_deadline() -> None:
    gate = threading.Event()

    def work(i: int) -> int:
        if i == 2:
            gate.wait()
        if i == 3:
            raise OSError("disk")
        return i * 10

    out = bounded_map(work, [0, 1, 2, 3], Deadline(0.5, "the fetch"), workers=4)
    gate.set()
    assert out[:2] == [0, 10]
    assert isinstance(out[2], StoreError) and out[2].kind == "timeout"
    assert isinstance(out[3], StoreError) and "OSError: disk" in str(out[3])


class HangingStore(MemoryStore):
    """Lists its objects, then never delivers one: a trickling or silent endpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def get(self, folder: str, name: str, max_bytes: int) -> bytes | None:
        self.release.wait()
        return super().get(folder, name, max_bytes)


def test_the_restore_budget_is_paid_once_and_said_once(tmp_path: Path) -> None:
    store = HangingStore()
    run(store, tmp_path, "cold", [KEY_A])  # one object to list
    budget = 1.5
    s = CacheSession(store_factory=lambda: store, folder=FOLDER, fingerprint=FP, roots=[], reads=True, writes=True,
                     restore_timeout=budget)
    s.start_restore()
    start = time.monotonic()
    s.load_into_torch(loader=lambda _blob: pytest.fail("nothing was restored, nothing may be loaded"))  # type: ignore[arg-type,return-value]
    first = time.monotonic() - start
    again = time.monotonic()
    assert s.wait_restore() is True  # every later wait (each test, session end) returns at once
    s.finish(FakeTorch([KEY_B]))  # type: ignore[arg-type]
    later = time.monotonic() - again
    # The first wait pays the budget (the fetch never returns); paying it again would cost a whole budget more,
    # since the fetch still hangs: both later calls together take less than one.
    assert budget - 0.2 < first < budget + 10, first
    assert later < budget, later
    assert s.problems == ["restore: 1 of 1 objects were not fetched within the budget of the restore (1.5 s, "
                          "--megacache-timeout); the session went on without them"]
    assert s.upload_stats.reason == "store unavailable"  # what did not deliver in time gets no upload either
    store.release.set()


def test_a_restore_stuck_past_its_grace_is_abandoned_and_writes_nothing(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    run(store, tmp_path, "cold", [KEY_A])
    real_commit = Restore._commit
    resume = threading.Event()

    def slow_commit(self: Restore) -> bool:  # local work (a huge merge, a starved CPU) past the grace
        resume.wait()
        return real_commit(self)

    monkeypatch.setattr(Restore, "_commit", slow_commit)
    s = CacheSession(store_factory=lambda: store, folder=FOLDER, fingerprint=FP, roots=[], reads=True, writes=True,
                     restore_timeout=0.3)
    s.start_restore()
    start = time.monotonic()
    assert s.wait_restore() is False
    assert time.monotonic() - start < 0.3 + 1.0 + 10  # the budget and its grace, not the commit's wait (forever)
    assert s.wait_restore() is False
    resume.set()
    assert s.restore._thread is not None
    s.restore._thread.join(5)
    assert len(s.restored) == 0 and s.restore_stats.ok is False  # abandoned: nothing written after the fact
    s.finish(FakeTorch([KEY_B]))  # type: ignore[arg-type]
    assert s.problems == ["restore did not finish within 0.3 s (--megacache-timeout); the session went on without it "
                          "and uploads nothing"]
    assert s.upload_stats.reason == "restore unfinished"


class SlowPut(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def put(self, folder: str, name: str, data: bytes) -> None:
        self.release.wait()


def test_the_upload_has_its_own_budget(tmp_path: Path) -> None:
    store = SlowPut()
    s = CacheSession(store_factory=lambda: store, folder=FOLDER, fingerprint=FP, roots=[], reads=True, writes=True,
                     upload_timeout=0.4)
    s.start_restore(background=False)
    start = time.monotonic()
    s.finish(FakeTorch([KEY_A]))  # type: ignore[arg-type]
    assert time.monotonic() - start < 0.4 + 10  # the 0.4 s budget, not the put's wait (forever)
    store.release.set()
    assert s.upload_stats.reason == "upload failed"
    assert s.problems == ["upload: upload did not finish within the budget of the upload (0.4 s, --megacache-upload-timeout)"]


@pytest.mark.parametrize(("env", "expected"), [
    ({"AWS_PROFILE": "does-not-exist"}, "ProfileNotFound"),
    ({"AWS_ENDPOINT_URL_S3": "127.0.0.1:5000"}, "ValueError"),
])
def test_a_client_that_cannot_be_built_is_one_problem_and_no_upload(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str) -> None:
    """boto3 raises these while building the client (outside any S3 call): they are store faults like any other."""
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**env, "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE":
                       str(tmp_path / "none"), "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    s = CacheSession(store_factory=lambda: from_settings(Settings(bucket="some-bucket")), folder=FOLDER,
                     fingerprint=FP, roots=[], reads=True, writes=True)
    s.start_restore(background=False)
    s.finish(FakeTorch([KEY_A]))  # type: ignore[arg-type]
    assert len(s.problems) == 1 and expected in s.problems[0], s.problems
    assert s.upload_stats.reason == "store unavailable"


class EndlessListing:
    """An S3 endpoint that says every page is truncated and gives no continuation token."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.calls = 0

    def list_objects_v2(self, **kwargs: Any) -> dict[str, Any]:
        self.calls += 1
        page: dict[str, Any] = {"Contents": [], "IsTruncated": True}
        if self.token is not None:
            page["NextContinuationToken"] = self.token
        return page


@pytest.mark.parametrize("token", [None, "same-token-again"])
def test_a_truncated_listing_without_a_new_token_ends(token: str | None) -> None:
    client = EndlessListing(token)
    store = S3Store("bucket", client)
    with pytest.raises(StoreError, match="truncated but gave no new continuation token"):
        store.list(FOLDER)
    with pytest.raises(StoreError, match="truncated"):
        store.walk("pytest-megacache")
    assert client.calls <= 4


def test_compaction_never_writes_an_object_a_restore_would_refuse(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    for i, key in enumerate([KEY_A, KEY_B]):
        run(store, tmp_path, f"w{i}", [key])
    before = sorted(p.name for p in (tmp_path / "store").rglob("*.mcb"))
    one = max(p.stat().st_size for p in (tmp_path / "store").rglob("*.mcb"))
    # A limit that one object meets and the merged whole would not.
    compactor = CacheSession(store_factory=lambda: store, folder=FOLDER, fingerprint=FP, roots=[], reads=True,
                             writes=True, compact_after=2, limits=Limits(max_object_bytes=one + 40))
    compactor.start_restore(background=False)
    compactor.finish(FakeTorch([KEY_A, KEY_B, "fd" + "d" * 50]))  # type: ignore[arg-type]
    after = sorted(p.name for p in (tmp_path / "store").rglob("*.mcb"))
    assert set(before) < set(after) and len(after) == 3  # nothing deleted, the new entry uploaded on its own
    assert compactor.upload_stats.compacted == 0 and compactor.upload_stats.new_entries == {"torch/inductor": 1}
    assert any("compaction skipped" in note for note in compactor.notes)
    for path in (tmp_path / "store").rglob("*.mcb"):  # and every stored object is one a restore accepts
        bundlemod.decode(path.read_bytes(), FP, compactor.limits)


def test_new_entries_over_the_limit_are_not_uploaded(tmp_path: Path) -> None:
    store = MemoryStore()
    s = CacheSession(store_factory=lambda: store, folder=FOLDER, fingerprint=FP, roots=[], reads=True, writes=True,
                     limits=Limits(max_object_bytes=64))
    s.start_restore(background=False)
    s.finish(FakeTorch([KEY_A]))  # type: ignore[arg-type]
    assert not store.objects and s.upload_stats.reason == "over the restore limits"
    assert len(s.problems) == 1 and "no session could restore it" in s.problems[0]


def hostile(good: bytes, **fields: str) -> bytes:
    """``good`` with raw JSON text spliced into its header (numbers Python's json reads as huge ints or inf)."""
    header_len = int.from_bytes(good[5:9], "big")
    doc = good[9:9 + header_len].decode()
    for name, literal in fields.items():
        doc = doc.replace(f'"{name}":', f'"{name}":{literal},"_was_{name}":', 1)
    header = doc.encode()
    return good[:5] + len(header).to_bytes(4, "big") + header + good[9 + header_len:]


@pytest.mark.parametrize("fields", [{"created": "1" + "0" * 400}, {"created": "1e400"}, {"entries": "9" * 400},
                                    {"payload_size": "9" * 5000}, {"raw_size": "-1"}])
@pytest.mark.parametrize("signed", [False, True])
def test_one_hostile_object_is_named_and_the_others_load(tmp_path: Path, fields: dict[str, str], signed: bool) -> None:
    key = b"k" * 32
    good = bundlemod.encode(Entries([Entry("torch/inductor", KEY_A, b"graph a")]), FP,
                            signing_key=key if signed else None)
    bad = hostile(bundlemod.encode(Entries([Entry("torch/inductor", KEY_B, b"graph b")]), FP), **fields)
    assert bad != good and fields[next(iter(fields))].encode() in bad  # the hostility is in the header's numbers
    store: Store = MemoryStore()
    store.put(FOLDER, "20260101T000000000-1-aaaaaaaaaaaa.mcb", bad)
    store.put(FOLDER, "20260101T000001000-1-bbbbbbbbbbbb.mcb", good)
    s = CacheSession(store_factory=lambda: store, folder=FOLDER, fingerprint=FP, roots=[], reads=True, writes=True,
                     signing_keys=[key] if signed else ())
    s.start_restore(background=False)
    assert s.restore_stats.ok and s.restore_stats.objects_used == 1 and s.restore_stats.objects_rejected == 1
    assert {e.name for e in s.restored} == {KEY_A}
    assert len(s.problems) == 1 and s.problems[0].startswith(f"refused {FOLDER}/20260101T000000000-1-aaaaaaaaaaaa.mcb")


def test_a_session_compiling_only_new_graphs_gets_a_note_never_a_problem(tmp_path: Path) -> None:
    store = MemoryStore()
    run(store, tmp_path, "cold", [KEY_A], meta={"selection": "shard-1"})
    other = session(store, tmp_path, "other-shard")
    other.start_restore(background=False)
    other.finish(FakeTorch([KEY_B]))  # type: ignore[arg-type]
    other.check_unused("shard-2")
    assert other.problems == [] and len(other.notes) == 1 and "compiled only graphs they do not hold" in other.notes[0]
    same = session(store, tmp_path, "same-shard")
    same.start_restore(background=False)
    same.finish(FakeTorch(["fe" + "e" * 50]))  # type: ignore[arg-type]
    same.check_unused("shard-1")  # the same tests as the run that stored it: the code or a setting changed
    assert same.problems == [] and len(same.notes) == 1 and "stored by a run of these same tests" in same.notes[0]
    assert stored_keys(store) >= {KEY_A, KEY_B}


def test_listing_faults_mark_the_store_down_whatever_their_kind(tmp_path: Path) -> None:
    """A 503 classifies as 'other', yet a store that cannot list will not take an upload: not tried again."""
    class Unavailable(MemoryStore):
        def list(self, folder: str) -> list[ObjectInfo]:
            raise StoreError("S3 list failed: 503 SlowDown", "other")

        def put(self, folder: str, name: str, data: bytes) -> None:
            pytest.fail("no upload to a store that failed the restore")

    s, _ = run(Unavailable(), tmp_path, "x", [KEY_A])
    assert s.problems == ["restore: S3 list failed: 503 SlowDown"]
    assert s.upload_stats.reason == "store unavailable"


def test_one_artifact_with_an_unsafe_key_is_left_out_and_named(tmp_path: Path) -> None:
    class OddKey(FakeTorch):
        def save(self) -> bytes | None:
            good = super().save()
            assert good is not None
            # torchfmt.serialize refuses unsafe keys, so the odd one is spliced into a container by hand.
            from ..test_torchfmt import VERSION, seal, section
            return seal(VERSION + section("inductor", [(KEY_A, b"graph a"), ("../../escape", b"x")]))

    s, _ = run(MemoryStore(), tmp_path, "odd", [KEY_A])
    assert s.upload_stats.objects == 1
    odd = session(MemoryStore(), tmp_path, "odd2")
    odd.start_restore(background=False)
    odd.finish(OddKey([KEY_A]))  # type: ignore[arg-type]
    assert odd.upload_stats.new_entries == {"torch/inductor": 1}  # the good artifact is uploaded
    assert odd.problems == ["not uploading 1 of torch's artifacts: unsafe inductor key '../../escape'"]


def test_a_logger_made_while_the_loggers_are_listed_fails_nothing() -> None:
    """A store's client makes loggers in the plugin's threads while pytest lists every logger (its logging plugin,
    at each phase): once a store thread has started, a logger made during that listing changes nothing of it."""
    manager = logging.Logger.manager
    for n in range(3):
        logging.getLogger(f"megacache-tests.present-{n}")
    before = dict(manager.loggerDict)
    bounded(lambda: None, Deadline(5.0, "the restore"), "probing")  # a store operation's thread
    assert dict(manager.loggerDict) == before  # the same loggers, none lost
    listed = 0
    for _logger in manager.loggerDict.values():  # as pytest lists them, a logger made meanwhile (another thread's)
        logging.getLogger(f"megacache-tests.made-while-listed-{listed}")
        listed += 1
    assert listed == len(before) and f"megacache-tests.made-while-listed-{listed - 1}" in manager.loggerDict
