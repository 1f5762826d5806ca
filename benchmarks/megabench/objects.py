"""Restore time against the number of objects: the same entries (a workload's bundle, read back from its bucket,
and synthetic files) stored as 1 object and as 8, each restored by the plugin's own restore."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from .console import say
from .runner import S3


def _synthetic_entries(count: int = 128, size: int = 128 * 1024) -> Any:
    from pytest_megacache.bundle import Entries, Entry

    entries = Entries()
    for i in range(count):
        # Half random, half repetitive: compresses roughly like compiled kernels do. Named as kernel sources
        # (.cpp travel too): random bytes named .so would be refused as cut-short ELF files, as they should.
        data = os.urandom(size // 2) + bytes(range(256)) * (size // 512)
        entries.add(Entry("file/inductor", f"bench{i % 16:02d}/kernel_{i:04d}.cpp", data, 0o644))
    return entries


def _bucket_entries(s3: S3, bucket: str) -> Any:
    from pytest_megacache import bundle
    from pytest_megacache.bundle import Entries
    from pytest_megacache.stores import S3Store

    store = S3Store(bucket, s3.client())
    merged = Entries()
    for folder, info in store.walk(_top_prefix(s3, bucket)):
        blob = store.get(folder, info.name, 1 << 31)
        if blob is not None:
            merged.update(bundle.decode(blob)[1])
    return merged


def _top_prefix(s3: S3, bucket: str) -> str:
    keys = s3.keys(bucket)
    if not keys:
        raise RuntimeError(f"bucket {bucket} is empty")
    return str(keys[0].split("/", 1)[0])


def restore_once(store: Any, folder: str, fingerprint: str, dest: Path) -> tuple[float, int, int]:
    """The plugin's own restore (pytest_megacache.core): list, fetch in parallel, validate, merge, write the
    files. Returns (seconds, objects, entries)."""
    from pytest_megacache.core import CacheSession
    from pytest_megacache.files import FileRoot

    start = time.perf_counter()
    session = CacheSession(store_factory=lambda: store, folder=folder, fingerprint=fingerprint,
                           roots=[FileRoot("inductor", dest)], reads=True, writes=False)
    session.start_restore(background=False)
    if not session.restore_stats.ok or session.problems:
        raise RuntimeError(f"restore failed: {'; '.join(session.problems)}")
    return time.perf_counter() - start, session.restore_stats.objects_used, len(session.restored)


def bench_objects(s3: S3, work: Path, repeats: int, populated: str | None, wl_name: str | None) -> list[dict[str, Any]]:
    from pytest_megacache import bundle
    from pytest_megacache.bundle import Entries
    from pytest_megacache.stores import S3Store

    datasets: list[tuple[str, Any]] = []
    if populated:
        try:
            datasets.append((f"{wl_name} bundle", _bucket_entries(s3, populated)))
        except Exception as exc:  # noqa: BLE001 - reported, the synthetic dataset still runs
            say(f"note: could not read the {wl_name} bundle back for the objects check: {exc}")
    datasets.append(("synthetic 128 x 128 KB files", _synthetic_entries()))
    bucket = s3.create_bucket(f"bench-objects-{os.getpid()}")
    store = S3Store(bucket, s3.client())
    fingerprint = "bench-objects-check"
    rows = []
    for d, (label, entries) in enumerate(datasets):
        items = list(entries)
        row: dict[str, Any] = {"dataset": label, "entries": len(items), "raw_bytes": sum(len(e.data) for e in items)}
        for split in (1, 8):
            folder = f"objects-check/d{d}/split{split}"
            stored = 0
            for k in range(split):
                part = Entries(items[k::split])
                if len(part):
                    blob = bundle.encode(part, fingerprint)
                    stored += len(blob)
                    store.put(folder, f"part-{k:02d}.mcb", blob)
            seconds = []
            for i in range(repeats):
                secs, objects, count = restore_once(store, folder, fingerprint, work / "objects" / f"d{d}-s{split}-r{i}")
                if count != len(items):
                    raise RuntimeError(f"objects check: restored {count} entries of {len(items)}")
                seconds.append(secs)
            row[f"split{split}"] = {"objects": objects, "stored_bytes": stored, "seconds": seconds,
                                    "median": statistics.median(seconds)}
        rows.append(row)
    return rows
