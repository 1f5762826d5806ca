"""``pytest-megacache pull`` and ``push``: copy objects between the store and a local directory store.

Each object is fetched and validated (:func:`.bundle.decode`, against its folder's fingerprint) before it is
written; one already present is left as it is, never overwritten, and one refused is named on stderr while the
others are still copied. Transfers over :data:`PROGRESS_MIN_BYTES` show their progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from .. import bundle as bundlemod
from ..errors import BundleError, StoreError
from ..report import human_bytes, plural
from ..stores import LocalDirStore, Store
from .storeobjects import PROG, ObjectFilter, StoredObject, UsageProblem, object_filter, open_store, scan

PROGRESS_MIN_BYTES = 4 * 1000 * 1000  # transfers above this (decimal MB, as human_bytes prints) show progress


class Progress:
    """Bytes done / total on one rewritten stderr line for a TTY; one summary line otherwise.
    Silent for transfers of PROGRESS_MIN_BYTES or less."""

    def __init__(self, verb: str, total: int, stream: TextIO) -> None:
        self.verb, self.total, self.stream = verb, total, stream
        self.enabled = total > PROGRESS_MIN_BYTES
        self.tty = self.enabled and stream.isatty()
        self.done = 0
        self.width = 0
        self.start = time.monotonic()

    def _line(self) -> str:
        return f"{self.verb}: {human_bytes(self.done)} / {human_bytes(self.total)}"

    def advance(self, n: int) -> None:
        self.done += n
        if self.tty:
            line = self._line()
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
            self.stream.flush()

    def note(self, message: str) -> None:
        """A message that must not be glued to the progress line."""
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.width = 0
        print(message, file=self.stream)

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
        elif self.enabled:
            seconds = max(time.monotonic() - self.start, 1e-6)
            self.stream.write(f"{self._line()} in {seconds:.1f} s ({human_bytes(self.done / seconds)}/s)\n")
        self.stream.flush()


@dataclass
class Tally:
    copied: int = 0
    bytes: int = 0
    present: int = 0
    refused: int = 0
    vanished: int = 0


def _fetch_valid(src: Store, obj: StoredObject) -> tuple[bytes | None, str | None]:
    """The object's bytes once validated, or (None, why it was refused); (None, None) if it vanished."""
    try:
        blob = src.get(obj.folder, obj.info.name, bundlemod.DEFAULT_LIMITS.max_object_bytes)
    except StoreError as exc:
        if exc.kind == "too-large":
            return None, str(exc)
        raise
    if blob is None:
        return None, None
    try:
        bundlemod.decode(blob, expected_fingerprint=obj.fingerprint)
    except BundleError as exc:
        return None, str(exc)
    return blob, None


def _keep_mtime(dst: Store, obj: StoredObject) -> None:
    """A pulled file keeps the source's modification time, so ``prune --older-than`` still means something."""
    if isinstance(dst, LocalDirStore):
        with contextlib.suppress(OSError):
            path = dst.root.joinpath(*obj.folder.split("/"), obj.info.name)
            os.utime(path, (obj.info.modified, obj.info.modified))


def transfer(src: Store, dst: Store, prefix: str, only: ObjectFilter, verb: str, verbose: bool = False,
             stream: TextIO | None = None) -> Tally:
    """Copy the objects ``only`` matches that are missing from ``dst`` (never overwriting), validating each one
    first."""
    stream = stream or sys.stderr
    wanted = [o for o in scan(src, prefix)[0] if only.matches(o)]
    present = {(folder, info.name) for folder, info in dst.walk(prefix)}
    todo = [o for o in wanted if (o.folder, o.info.name) not in present]
    tally = Tally(present=len(wanted) - len(todo))
    progress = Progress(verb, sum(o.info.size for o in todo), stream)
    for obj in todo:
        blob, refusal = _fetch_valid(src, obj)
        if blob is None:
            if refusal is None:
                tally.vanished += 1
            else:
                tally.refused += 1
                progress.note(f"{PROG}: refused {obj.path}: {refusal}")
            progress.advance(obj.info.size)
            continue
        dst.put(obj.folder, obj.info.name, blob)
        _keep_mtime(dst, obj)
        tally.copied += 1
        tally.bytes += len(blob)
        progress.advance(obj.info.size)
        if verbose:
            progress.note(f"{verb} {obj.path} ({human_bytes(len(blob))})")
    progress.finish()
    return tally


def _summary(verb: str, tally: Tally, src_label: str, dst_label: str) -> str:
    past = {"pull": "pulled", "push": "pushed"}[verb]
    line = f"{past} {plural(tally.copied, 'object')} ({human_bytes(tally.bytes)}) from {src_label} to {dst_label}"
    notes = [f"{tally.present} already present"] if tally.present else []
    notes += [f"{tally.refused} refused"] if tally.refused else []
    notes += [f"{tally.vanished} gone before they could be read"] if tally.vanished else []
    return line + ("; " + ", ".join(notes) if notes else "")


def cmd_pull(args: argparse.Namespace) -> int:
    store, settings = open_store(args)
    only = object_filter(args)
    local = LocalDirStore(args.to)
    tally = transfer(store, local, settings.prefix, only, "pull", args.verbose)
    print(_summary("pull", tally, settings.store_label(), f"{local.label}/{settings.prefix}"))
    return 1 if tally.refused else 0


def cmd_push(args: argparse.Namespace) -> int:
    if not Path(args.from_).is_dir():
        raise UsageProblem(f"--from {args.from_}: not a directory")
    store, settings = open_store(args)
    only = object_filter(args)
    local = LocalDirStore(args.from_)
    tally = transfer(local, store, settings.prefix, only, "push", args.verbose)
    print(_summary("push", tally, f"{local.label}/{settings.prefix}", settings.store_label()))
    return 1 if tally.refused else 0
