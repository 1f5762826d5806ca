"""pytest-xdist: the controller fetches once, workers load from what it staged, the controller uploads once.

- The controller restores from the store as a plain session would, then *stages* the merged, validated
  entries as one object in a private directory and writes a ``ready.json`` marker.
- Each worker reads that object through :class:`StagedStore` (waiting for the marker, bounded by the
  timeout), restores files into its *own* cache directories (shared Inductor/Triton directories race:
  pytorch/pytorch#153791) and loads the torch artifacts on its first compile.
- At its end a worker hands what it compiled that was not restored to the controller through
  ``workeroutput``: a path and a digest when it shares the controller's host, the bytes otherwise (as
  pytest-cov does for ``--tx`` workers). The controller merges all of it and uploads once.
- A worker that crashes hands nothing: only its own new artifacts are lost, and the summary says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import bundle as bundlemod
from ..bundle import Entries, Entry
from ..errors import BundleError, StoreError, redact_cut
from ..fsutil import write_atomic
from ..report import LoadStats, ProcessTimes, RestoreStats, XdistStats, as_count
from ..scratch import STAGE_PREFIX, owned_dir, owner_alive, release
from ..stores import LocalDirStore, ObjectInfo, new_object_name

STAGE_FOLDER = "staged"
OUT_FOLDER = "out"
READY = "ready.json"
KEY = "megacache"  # in workerinput and workeroutput


class StagedStore(LocalDirStore):
    """The controller's staging directory, read by a worker once the controller has written it."""

    def __init__(self, root: str | os.PathLike[str], timeout: float) -> None:
        super().__init__(root)
        self.label = f"controller:{root}"
        self.timeout = timeout

    def list(self, folder: str) -> list[ObjectInfo]:
        marker = self.root / READY
        deadline = time.monotonic() + self.timeout
        while not marker.exists():
            if time.monotonic() > deadline:
                raise StoreError(f"the xdist controller did not stage the cache within {self.timeout:g} s",
                                 "unreachable")
            time.sleep(0.05)
        try:
            ready = json.loads(marker.read_text())
        except (OSError, ValueError) as exc:
            raise StoreError(f"unreadable {marker}: {exc}", "io") from exc
        if not ready.get("ok"):
            return []  # the controller's own restore failed; it reports why
        return super().list(folder)

    def link_object(self, folder: str, name: str, max_bytes: int, dest: str) -> bool:
        """The staged object as a second name ``dest`` of its file, where the file system allows it (a worker's
        scratch directory beside the staging, in one TMPDIR): no copy, as the controller never writes it again. False
        where it is not done (another file system, not a regular file, over ``max_bytes``): it is fetched then."""
        path = self._object(folder, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
                return False
            os.link(path, dest, follow_symlinks=False)
        except OSError:
            return False
        return True


_OWNERS: dict[str, int | None] = {}  # the staging directories this process owns: their lock's descriptor


def make_stage_dir() -> Path:
    """A new staging directory owned by this process (:func:`..scratch.owned_dir`): removed by a later session once
    this one is gone, even killed."""
    path, fd, _swept = owned_dir(STAGE_PREFIX)
    _OWNERS[path] = fd
    return Path(path)


def remove_stage_dir(stage_dir: Path) -> None:
    release(str(stage_dir), _OWNERS.pop(str(stage_dir), None))


def stage(stage_dir: Path, entries: Entries, fingerprint: str, ok: bool, selections: list[str] | None = None,
          ) -> str | None:
    """Write what the controller restored for its workers (an entry a chunk at a time); the staged object's path
    (None when nothing was restored). ``selections``: the test selections of the sessions that stored what was
    restored (a worker running one of them expects to find everything cached, as a plain session would)."""
    extra = {"producer": {"selections": selections}} if selections else None
    staged = None
    if entries:
        folder = stage_dir / STAGE_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        name = new_object_name()
        # Written beside its final name, then renamed: a worker lists whole objects only.
        bundlemod.write_object(folder / f".{name}.tmp", entries, fingerprint, extra)
        os.replace(folder / f".{name}.tmp", staged := str(folder / name))
    write_atomic(stage_dir / READY, json.dumps({"ok": ok, "entries": len(entries)}).encode())
    return staged


def unpack_remote_stage(blob: bytes | None) -> Path:
    """On a worker that does not share the controller's disk: a local stage holding the object sent."""
    stage_dir = make_stage_dir()
    if blob:
        LocalDirStore(stage_dir).put(STAGE_FOLDER, new_object_name(), blob)
    (stage_dir / READY).write_text(json.dumps({"ok": True}))
    return stage_dir


def same_host(workerinput: dict[str, Any]) -> bool:
    info = workerinput.get(KEY) or {}
    stage_dir = info.get("stage")
    return bool(stage_dir) and info.get("host") == socket.gethostname() and Path(str(stage_dir)).is_dir()


def hand_over(stage_dir: Path | None, worker_id: str, entries: Entries, fingerprint: str) -> dict[str, Any]:
    """A worker's new entries as a workeroutput value: a path + digest when possible, else the bytes."""
    if not entries:
        return {"object": None}
    if stage_dir is not None:
        if not owner_alive(str(stage_dir)):  # its controller is gone (killed): no one would take it
            return {"object": None}
        out = stage_dir / OUT_FOLDER
        out.mkdir(exist_ok=True)
        target = out / f"{worker_id}-{os.getpid()}.mcb"
        bundlemod.write_object(target, entries, fingerprint)
        sha = hashlib.sha256()
        with open(target, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                sha.update(chunk)
        digest = sha.hexdigest()
        return {"object": str(target), "sha256": digest}
    blob = bundlemod.encode(entries, fingerprint)
    return {"object": None, "data": blob, "sha256": hashlib.sha256(blob).hexdigest()}


def take_over(output: dict[str, Any], fingerprint: str, scratch_dir: str | None = None) -> Entries:
    """The controller's side of :func:`hand_over`; with ``scratch_dir``, the files a worker's object holds are
    written there (a chunk at a time) rather than held in memory. Raises BundleError or OSError."""
    if output.get("data") is not None:
        blob = bytes(output["data"])
        if hashlib.sha256(blob).hexdigest() != output.get("sha256"):
            raise BundleError("worker's object does not match its digest")
        return bundlemod.decode(blob, fingerprint)[1]
    if not output.get("object"):
        return Entries()
    with open(str(output["object"]), "rb") as fh:
        sha = hashlib.sha256()
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            sha.update(chunk)
        if sha.hexdigest() != output.get("sha256"):
            raise BundleError("worker's object does not match its digest")
        return bundlemod.read_object(fh, fingerprint, scratch_dir=scratch_dir)[1].entries


def worker_dir(base: str, worker_id: str) -> str:
    return f"{base.rstrip(os.sep)}-{worker_id}"


class Takeover:
    """The controller's side of the hand-over: what each worker's ``workeroutput`` says, merged. Plain data in
    (one dict per worker), typed out; a worker whose output is missing or refused costs only its own work.

    The controller restores no files and compiles nothing: the session's figures are its workers' (files each
    restored into its own directories, what each loaded into torch, its compile threads, its Triton kernels),
    summed here and kept per worker too (:meth:`fold`, :meth:`stats`)."""

    def __init__(self, fingerprint: str, scratch_dir: Callable[[], str] | None = None) -> None:
        self.fingerprint = fingerprint
        self.scratch_dir = scratch_dir  # where the files workers hand over go (the session's scratch directory)
        self.entries = Entries()
        self.profiles: dict[tuple[str, str], list[Entry]] = {}  # every worker's copy: merged at the end
        self.dynamo: dict[tuple[str, str], list[Entry]] = {}  # every worker's copy of each Dynamo entry (merge_dynamo)
        self.dynamo_merged = 0  # Dynamo entries handed over by several workers, stored as one holding all their variants
        self.dynamo_unmerged = 0  # and those of which one worker's copy is stored (merge_dynamo says why)
        self.torch: list[dict[str, Any]] = []  # each worker's torch figures
        self.times: list[ProcessTimes] = []  # where each worker's seconds went
        self.lost: list[str] = []
        self.problems: list[str] = []
        self.notes: list[str] = []  # the workers' notes, each said once
        self.selection: str | None = None
        self.restores: list[tuple[str, dict[str, Any]]] = []  # each worker's restore figures
        self.loads: list[dict[str, Any]] = []  # what each worker loaded into torch
        self.per_worker: dict[str, dict[str, Any]] = {}

    @property
    def workers(self) -> int:
        return len(self.torch)

    def take(self, worker: str, output: dict[str, Any] | None, error: object) -> None:
        if output is None:
            self.lost.append(worker)
            self.problems.append(f"xdist worker {worker} ended without handing over its cache work "
                                 f"({error or 'no output'}); only its new artifacts are lost")
            return
        try:
            scratch = self.scratch_dir() if self.scratch_dir is not None else None
            for entry in take_over(output, self.fingerprint, scratch):
                if entry.kind in bundlemod.MUTABLE_KINDS:
                    self.profiles.setdefault(entry.ident, []).append(entry)
                else:
                    if entry.kind == bundlemod.PRECOMPILE_KIND:
                        self.dynamo.setdefault(entry.ident, []).append(entry)
                    self.entries.add(entry)
        except Exception as exc:  # noqa: BLE001 - OSError, BundleError or whatever a broken hand-over provokes
            self.problems.append(f"xdist worker {worker}'s artifacts were refused: {type(exc).__name__}: "
                                 f"{redact_cut(str(exc))}")
        torch = dict(output.get("torch", {}))
        self.torch.append(torch)
        restore = _mapping(output.get("restore"))
        self.restores.append((worker, restore))
        if isinstance(output.get("load"), dict):
            self.loads.append(output["load"])
        self.per_worker[worker] = _worker_row(torch, restore)
        if isinstance(output.get("times"), dict):
            self.times.append(ProcessTimes.from_dict(output["times"], worker))
        self.problems.extend(f"[{worker}] {problem}" for problem in output.get("problems", []))
        notes = output.get("notes")
        for note in (notes if isinstance(notes, list) else [])[:20]:
            if isinstance(note, str) and note not in self.notes:
                self.notes.append(note[:1000])
        if self.selection is None and output.get("selection"):
            # Every worker collects the whole selection: the first one's digest is the session's.
            self.selection = str(output["selection"])

    def merge_dynamo(self, merge: Callable[[list[bytes]], bytes | None] | None = None) -> None:
        """Each Dynamo entry that workers handed over in different copies (each worker traced other variants of one
        function, beside those of the stored entry) stored as one holding every copy's variants (``merge``: by default
        :func:`pytest_megacache.dynamo.merged_copies`, which imports torch: only where there are such copies).
        Keeping one worker's copy lost the others' variants: traced again in the next run, and lost again. Where
        copies cannot be merged, the first worker's is kept, as the ``(kind, name)`` union keeps it; said once."""
        errors: list[str] = []
        for ident, copies in self.dynamo.items():
            if len(copies) < 2:  # one worker's: as it came, never read here
                continue
            distinct = list(dict.fromkeys(entry.data for entry in copies))
            if len(distinct) < 2:
                continue
            try:
                if merge is None:
                    from ..dynamo import merged_copies

                    merge = merged_copies
                with warnings.catch_warnings():  # torch's own, imported here: not this session's tests'
                    warnings.simplefilter("ignore")
                    merged = merge(distinct)
            except Exception as exc:  # noqa: BLE001 - whatever torch or a copy's bytes raise: one copy is kept
                merged = None
                errors.append(f"{type(exc).__name__}: {redact_cut(str(exc))}")
            if merged is None:
                self.dynamo_unmerged += 1
                continue
            self.entries.merge([Entry(ident[0], ident[1], merged, copies[0].mode)])
            self.dynamo_merged += 1
        if not self.dynamo_unmerged:
            return
        count = self.dynamo_unmerged
        what = (f"{count} Dynamo entr{'y' if count == 1 else 'ies'} traced in several xdist workers not merged "
                "({}); one worker's copy of each is stored, and the variants the others traced are traced again in "
                "the next run")
        if errors:  # a fault: said as a problem
            self.problems.append(what.format(f"first: {errors[0]}"))
        else:  # torch named a resume function alike in two workers, say: the next run's names differ
            self.notes.append(what.format("their copies hold other code, or give one global name to two objects"))

    @property
    def single_thread(self) -> bool:
        """Every worker ran Inductor with one compile thread (the cache covered its tests)."""
        return bool(self.per_worker) and all(row["single_compile_thread"] for row in self.per_worker.values())

    def fold(self, restore: RestoreStats, load: LoadStats) -> None:
        """Add the workers' restores of files (the controller's own writes none) and loads into the session's."""
        for worker, figures in self.restores:
            restore.add_files(figures, worker)
        for figures in self.loads:
            load.add(figures)

    def stats(self, role: str) -> XdistStats:
        return XdistStats(role, self.workers, list(self.lost), dict(self.per_worker))


def _mapping(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _worker_row(torch: dict[str, Any], restore: dict[str, Any]) -> dict[str, Any]:
    """One worker's own figures, for the report's per-worker table."""
    count = as_count
    triton = _mapping(torch.get("triton"))
    refused = restore.get("files_refused")
    hits = triton.get("hits")
    return {"files_written": count(restore.get("files_written")), "files_present": count(restore.get("files_present")),
            "files_refused": len(refused) if isinstance(refused, list) else 0,
            "single_compile_thread": bool(torch.get("single_compile_thread")), "compiles": count(torch.get("compiles")),
            "triton_hits": count(hits) if hits is not None or not triton else None,
            "triton_compiled": count(triton.get("compiled"))}
