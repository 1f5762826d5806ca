"""The cache flow as plain Python: restore, load, collect, merge, upload.

The pytest plugin drives it from hooks; the CLI and benchmarks can drive it directly. Nothing here
imports pytest or torch (torch is reached through :class:`TorchAdapter`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from . import bundle as bundlemod
from .bundle import Entries, Limits
from .errors import BundleError, StoreError
from .files import FileRoot
from .stores import ObjectInfo, Store, new_object_name
from .torch_adapter import LoadResult, TorchAdapter

# Store failures that make every later call fail too: report once, do not try to upload.
STORE_DOWN_KINDS = frozenset({"unreachable", "no-bucket", "denied", "credentials"})
FETCH_WORKERS = 8


@dataclass
class RestoreStats:
    attempted: bool = False
    objects_listed: int = 0
    objects_used: int = 0
    objects_rejected: int = 0
    bytes_fetched: int = 0
    entries: dict[str, int] = field(default_factory=dict)
    files_written: int = 0
    files_present: int = 0
    seconds: float = 0.0
    ok: bool = False


@dataclass
class LoadStats:
    called: bool = False
    ok: bool = False
    artifacts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None


@dataclass
class UploadStats:
    attempted: bool = False
    reason: str | None = None  # why nothing was uploaded
    session_entries: int = 0
    new_entries: dict[str, int] = field(default_factory=dict)
    objects: int = 0
    bytes: int = 0
    raw_bytes: int = 0
    compacted: int = 0  # objects merged into the uploaded one and then deleted
    files_skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class TorchStats:
    compiled: bool = False
    compiles: int = 0
    compile_seconds: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)


class CacheSession:
    """One session's traffic with the cache. Thread-safe where the restore thread is involved."""

    def __init__(
        self,
        *,
        store_factory: Callable[[], Store],
        folder: str,
        fingerprint: str,
        roots: list[FileRoot],
        reads: bool,
        writes: bool,
        compact_after: int = 8,
        limits: Limits = bundlemod.DEFAULT_LIMITS,
    ) -> None:
        self._store_factory = store_factory
        self._store: Store | None = None
        self.folder = folder
        self.fingerprint = fingerprint
        self.roots = roots
        self.reads = reads
        self.writes = writes
        self.compact_after = compact_after
        self.limits = limits
        self.problems: list[str] = []
        self._problem_lock = threading.Lock()
        self._reported = 0
        self.store_down = False
        self.restored = Entries()
        self.restored_objects: list[ObjectInfo] = []
        self.before: dict[str, set[str]] = {}
        self.restore_stats = RestoreStats()
        self.load_stats = LoadStats()
        self.upload_stats = UploadStats()
        self.torch_stats = TorchStats()
        self._thread: threading.Thread | None = None
        self._restore_done = threading.Event()
        self._loaded = False

    # --- problems ---------------------------------------------------------------------------------
    def problem(self, message: str) -> None:
        with self._problem_lock:
            self.problems.append(message)

    def new_problems(self) -> list[str]:
        """Problems not yet handed out (the plugin warns about each exactly once)."""
        with self._problem_lock:
            out = self.problems[self._reported :]
            self._reported = len(self.problems)
        return out

    def _store_error(self, what: str, exc: StoreError) -> None:
        if exc.kind in STORE_DOWN_KINDS:
            self.store_down = True
        self.problem(f"{what}: {exc}")

    def store(self) -> Store:
        if self._store is None:
            self._store = self._store_factory()
        return self._store

    # --- restore ----------------------------------------------------------------------------------
    def start_restore(self, background: bool = True) -> None:
        if not self.reads:
            self._snapshot()
            self._restore_done.set()
            return
        if background:
            self._thread = threading.Thread(target=self._restore_guarded, name="megacache-restore", daemon=True)
            self._thread.start()
        else:
            self._restore_guarded()

    def wait_restore(self, timeout: float) -> bool:
        """Wait for the restore; False (and a problem) if it did not finish in time."""
        if self._restore_done.wait(timeout):
            return True
        self.problem(f"restore did not finish within {timeout:g} s; going on without it")
        return False

    def _restore_guarded(self) -> None:
        try:
            self._restore()
        except Exception as exc:  # noqa: BLE001 - a cache bug must never fail the session
            self.problem(f"restore failed unexpectedly: {type(exc).__name__}: {exc}")
        finally:
            self._snapshot()
            self._restore_done.set()

    def _snapshot(self) -> None:
        self.before = {root.kind: root.snapshot() for root in self.roots}

    def _fetch(self, store: Store, info: ObjectInfo) -> tuple[ObjectInfo, int, Entries | None]:
        try:
            blob = store.get(self.folder, info.name, self.limits.max_object_bytes)
        except StoreError as exc:
            self._store_error(f"fetching {info.name}", exc)
            return info, 0, None
        if blob is None:  # deleted by a concurrent compaction: its content is in a newer object
            return info, 0, None
        try:
            _header, entries = bundlemod.decode(blob, self.fingerprint, self.limits)
        except BundleError as exc:
            self.problem(f"refused {self.folder}/{info.name}: {exc}")
            return info, len(blob), None
        return info, len(blob), entries

    def _restore(self) -> None:
        stats = self.restore_stats
        stats.attempted = True
        start = time.perf_counter()
        try:
            store = self.store()
            listing = store.list(self.folder)
        except StoreError as exc:
            self._store_error("restore", exc)
            stats.seconds = time.perf_counter() - start
            return
        stats.objects_listed = len(listing)
        with ThreadPoolExecutor(max_workers=max(1, min(FETCH_WORKERS, len(listing)))) as pool:
            results = list(pool.map(lambda info: self._fetch(store, info), listing))
        merged = Entries()
        for info, size, entries in results:
            stats.bytes_fetched += size
            if entries is None:
                stats.objects_rejected += size > 0
                continue
            merged.update(entries)
            self.restored_objects.append(info)
        stats.objects_used = len(self.restored_objects)
        try:
            for root in self.roots:
                written, present = root.restore(merged)
                stats.files_written += written
                stats.files_present += present
        except (OSError, BundleError) as exc:
            self.problem(f"restoring compiled files failed ({exc}); those kernels will be rebuilt")
        self.restored = merged
        stats.entries = merged.counts()
        stats.ok = True
        stats.seconds = time.perf_counter() - start

    # --- load -------------------------------------------------------------------------------------
    def load_into_torch(self, timeout: float, loader: Callable[[bytes], LoadResult] = TorchAdapter.load) -> None:
        """Called on the first compile: wait for the restore, validate, hand torch its artifacts."""
        if self._loaded:
            return
        self._loaded = True
        if not self.reads:
            return
        if not self.wait_restore(timeout):
            return
        try:
            container = self.restored.torch_container()
        except BundleError as exc:
            self.problem(f"restored artifacts refused: {exc}")
            return
        if container is None:
            return
        result = loader(container)
        self.load_stats = LoadStats(True, result.ok, result.artifacts, result.seconds, result.error)
        if not result.ok:
            self.problem(f"torch did not load the restored artifacts: {result.error}")

    # --- collect, merge, upload ------------------------------------------------------------------
    def collect(self, adapter: TorchAdapter) -> Entries:
        """What this session compiled or hit: torch's artifacts plus the files it added."""
        session = Entries()
        try:
            container = adapter.save()
        except Exception as exc:  # noqa: BLE001
            self.problem(f"torch.compiler.save_cache_artifacts failed: {type(exc).__name__}: {exc}")
            container = None
        if container is not None:
            try:
                session.update(bundlemod.entries_from_torch(container))
            except BundleError as exc:
                self.problem(f"torch's saved artifacts failed validation, not uploading them: {exc}")
        for root in self.roots:
            entries, skipped = root.collect(self.before.get(root.kind, set()))
            session.update(entries)
            self.upload_stats.files_skipped.extend(skipped)
        return session

    def finish(self, adapter: TorchAdapter, timeout: float) -> None:
        """Record torch's counters, then upload what is new."""
        self.torch_stats = TorchStats(adapter.compiled_anything(), adapter.compiles, adapter.compile_seconds,
                                      adapter.counters())
        up = self.upload_stats
        # Wait even when nothing compiled, so a broken store is reported in every session.
        if self.reads and not self.wait_restore(timeout):
            up.reason = "restore unfinished"
            return
        if not self.writes:
            up.reason = "read-only mode"
            return
        if not self.torch_stats.compiled:
            up.reason = "nothing was compiled"
            return
        if self.store_down:
            up.reason = "store unavailable"
            return
        start = time.perf_counter()
        session = self.collect(adapter)
        up.session_entries = len(session)
        new = session.minus(self.restored)
        up.new_entries = new.counts()
        if not new:
            up.reason = "nothing new"
            return
        up.attempted = True
        compact = len(self.restored_objects) + 1 > self.compact_after
        payload = Entries(self.restored) if compact else Entries()
        payload.update(new)
        blob = bundlemod.encode(payload, self.fingerprint)
        try:
            store = self.store()
            store.put(self.folder, new_object_name(), blob)
        except StoreError as exc:
            self._store_error("upload", exc)
            up.reason = "upload failed"
            up.seconds = time.perf_counter() - start
            return
        up.objects, up.bytes, up.raw_bytes = 1, len(blob), payload.raw_bytes()
        if compact:
            # The new object holds everything the restored ones did; delete only those.
            for info in self.restored_objects:
                try:
                    store.delete(self.folder, info.name)
                    up.compacted += 1
                except StoreError as exc:
                    self.problem(f"compaction could not delete {info.name}: {exc}")
                    break
        up.seconds = time.perf_counter() - start

    def stats(self) -> dict[str, Any]:
        return {
            "restore": asdict(self.restore_stats),
            "load": asdict(self.load_stats),
            "torch": asdict(self.torch_stats),
            "upload": asdict(self.upload_stats),
        }
