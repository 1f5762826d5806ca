"""``pytest-megacache`` / ``python -m pytest_megacache``: cache chores without a pytest session.

Commands: ``key`` (this environment's fingerprint), ``inspect`` (validate bundles, from files or from the
store), ``ls`` (what the store holds, per scope and fingerprint), ``prune`` (delete by age and/or a size
budget), ``pull`` and ``push`` (copy objects between the store and a local directory store), ``doctor`` (check
a CI setup, one line per check: :mod:`.doctor`).

The store layout these commands read is ``<prefix>/<scope>/<fingerprint key>/<object name>.mcb``
(:class:`.layout.Layout`): one segment of scope (a branch, '/' written as '+') and four of fingerprint key.
Anything else under the prefix is left alone (and counted in ``ls``).

Errors are one line on stderr, never a traceback: a bad argument or setting exits with 2, a store failure or
anything unexpected with 1. An object that fails validation is refused on a line naming it, and the others are
still processed. A reader that goes away (``pytest-megacache ls --json | head -1``) ends the command quietly
with status 141 (128 + SIGPIPE, as a process the signal killed reports it).

The store options of the commands that read a store live in :mod:`.storeopts` (shared with :mod:`.doctor`). What
``--help`` prints is plain text written for users (:data:`DESCRIPTION`, :data:`EPILOG`, one ``*_HELP`` per command),
not these docstrings.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from . import bundle as bundlemod
from . import doctor as doctormod
from .errors import BundleError, StoreError, redact
from .fingerprint import TorchUnavailable, compute
from .layout import FINGERPRINT_SEGMENTS, SCOPE_MAX, Layout, valid_key, valid_scope
from .report import human_age, human_bytes, plural
from .settings import OPTIONS, Settings, SettingsError, resolve
from .storeopts import STORE_FIELDS, add_store_options, cli_flags
from .stores import LocalDirStore, ObjectInfo, Store, from_settings

PROG = "pytest-megacache"
PROGRESS_MIN_BYTES = 4 * 1000 * 1000  # transfers above this (decimal MB, as human_bytes prints) show progress
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b?|b)?", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


class UsageProblem(Exception):
    """A bad argument or setting: one line on stderr and exit status 2."""


# --- small helpers ---------------------------------------------------------------------------------


def _say_error(message: str) -> None:
    """One line on stderr, never a traceback; credentials in a URL are masked."""
    line = " ".join(redact(message).split())
    with contextlib.suppress(OSError, ValueError):  # a closed stderr: there is nowhere left to say it
        print(f"{PROG}: {line}", file=sys.stderr)


def parse_size(text: str) -> int:
    """``500MB``, ``2GB``, ``1.5 GiB`` or plain bytes -> bytes (KB/MB/GB are decimal, like the output)."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 500MB, 2GB, 1048576)")
    unit = (match[2] or "").lower().removesuffix("b")
    return int(float(match[1]) * _UNITS[unit])


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if not 0 <= value < 1e6:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of days >= 0")
    return value


def _table(rows: list[list[str]], right: frozenset[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip() for row in rows]


def _this_key() -> str | None:
    """This environment's fingerprint key, or None without a usable torch."""
    try:
        return compute().key
    except TorchUnavailable:
        return None


# --- the store and the objects in it ---------------------------------------------------------------


@dataclass(frozen=True)
class StoredObject:
    """One object laid out as ``prefix/scope/fingerprint/name``."""

    prefix: str
    scope: str
    fingerprint: str
    info: ObjectInfo

    @property
    def folder(self) -> str:
        return Layout(self.prefix).folder(self.scope, self.fingerprint)

    @property
    def path(self) -> str:
        """The object's address below the prefix, as ``inspect --store-object`` takes it."""
        return f"{self.scope}/{self.fingerprint}/{self.info.name}"


@dataclass(frozen=True)
class ObjectFilter:
    """Which stored objects a command works on: one scope and/or one fingerprint, or all."""

    scope: str | None = None  # None: every scope
    fingerprint: str | None = None  # None: every fingerprint

    def matches(self, obj: StoredObject) -> bool:
        return self.scope in (None, obj.scope) and self.fingerprint in (None, obj.fingerprint)


def scan(store: Store, prefix: str) -> tuple[list[StoredObject], int]:
    """The objects below ``prefix`` that follow the layout, and how many others were ignored."""
    layout = Layout(prefix)
    objects: list[StoredObject] = []
    ignored = 0
    for folder, info in store.walk(prefix):
        parsed = layout.parse_folder(folder)
        if parsed is None:
            ignored += 1
            continue
        objects.append(StoredObject(prefix, *parsed, info))
    return objects, ignored


def _store_settings(args: argparse.Namespace) -> Settings:
    """The store options, through the plugin's own resolution: command line, then MEGACACHE_* (no ini)."""
    env_names = {opt.env for opt in OPTIONS if opt.name in STORE_FIELDS}
    env = {k: v for k, v in os.environ.items() if k in env_names}
    try:
        return resolve(cli=lambda name: getattr(args, name, None) if name in STORE_FIELDS else None,
                       env=env, ini=lambda _name: None)
    except SettingsError as exc:
        raise UsageProblem(cli_flags(str(exc))) from exc


def _open_store(args: argparse.Namespace) -> tuple[Store, Settings]:
    settings = _store_settings(args)
    if not (settings.bucket or settings.directory):
        raise UsageProblem("no store configured: pass --bucket or --dir (or set MEGACACHE_BUCKET or MEGACACHE_DIR)")
    try:
        return from_settings(settings), settings
    except ValueError as exc:  # botocore refuses a malformed endpoint when the client is built
        raise UsageProblem(f"cannot use this store: {exc}") from exc


def _scope(text: str | None) -> str | None:
    if text is None:
        return None
    scope = text.replace("/", "+")  # a branch name as the plugin writes it
    if not valid_scope(scope):
        raise UsageProblem(f"--scope {text!r}: a scope is one segment of letters, digits and '_.+-' "
                           f"(at most {SCOPE_MAX}, not starting with '.')")
    return scope


def _fingerprint(text: str) -> str | None:
    """``all`` -> None, ``this`` -> this environment's key, else a key checked for shape."""
    if text == "all":
        return None
    if text == "this":
        key = _this_key()
        if key is None:
            raise UsageProblem("--fingerprint this: no usable torch here to compute the fingerprint from")
        return key
    if not valid_key(text):
        raise UsageProblem(f"--fingerprint {text!r}: expected this, all or a key of {FINGERPRINT_SEGMENTS} segments "
                           "(as `pytest-megacache key` prints it)")
    return text


def _object_filter(args: argparse.Namespace) -> ObjectFilter:
    return ObjectFilter(_scope(args.scope), _fingerprint(getattr(args, "fingerprint", "all")))


# --- ls ----------------------------------------------------------------------------------------------


@dataclass
class Group:
    scope: str
    fingerprint: str
    objects: list[ObjectInfo]
    duplicated: int | None = None  # raw bytes of entries held by more than one object (ls --duplicates)
    unreadable: int = 0  # objects --duplicates could not read or validate

    @property
    def size(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def newest(self) -> float:
        return max(o.modified for o in self.objects)

    @property
    def oldest(self) -> float:
        return min(o.modified for o in self.objects)


def group(objects: Iterable[StoredObject]) -> list[Group]:
    groups: dict[tuple[str, str], Group] = {}
    for obj in objects:
        groups.setdefault((obj.scope, obj.fingerprint), Group(obj.scope, obj.fingerprint, [])).objects.append(obj.info)
    return [groups[k] for k in sorted(groups)]


def duplicated_bytes(store: Store, prefix: str, g: Group) -> tuple[int, int]:
    """Raw bytes of the entries that ``g``'s objects hold more than once (what every restore of that fingerprint
    fetches and decompresses again), and how many of its objects could not be read and validated. Reads each
    object of a fingerprint with more than one."""
    if len(g.objects) < 2:
        return 0, 0
    folder = Layout(prefix).folder(g.scope, g.fingerprint)
    seen: set[tuple[str, str]] = set()
    duplicated = unreadable = 0
    for info in g.objects:
        try:
            blob = store.get(folder, info.name, bundlemod.DEFAULT_LIMITS.max_object_bytes)
            entries = bundlemod.decode(blob, g.fingerprint)[1] if blob is not None else None
        except (StoreError, BundleError):
            entries = None
        if entries is None:
            unreadable += 1
            continue
        for entry in entries:
            if entry.ident in seen:
                duplicated += len(entry.data)
            seen.add(entry.ident)
    return duplicated, unreadable


def _group_json(g: Group, this: str | None, now: float) -> dict[str, object]:
    extra: dict[str, object] = {} if g.duplicated is None else {"duplicated_bytes": g.duplicated,
                                                                 "unreadable": g.unreadable}
    return {**extra,
        "scope": g.scope, "fingerprint": g.fingerprint, "this": g.fingerprint == this,
        "objects": len(g.objects), "bytes": g.size,
        "newest": g.newest, "oldest": g.oldest,
        "newest_age_s": round(now - g.newest, 3), "oldest_age_s": round(now - g.oldest, 3),
        "names": [{"name": o.name, "bytes": o.size, "modified": o.modified} for o in g.objects],
    }


def _ls_lines(groups: list[Group], this: str | None, now: float, verbose: bool) -> list[str]:
    dups = any(g.duplicated is not None for g in groups)
    rows = [["SCOPE", "FINGERPRINT", "OBJECTS", "SIZE", "NEWEST", "OLDEST"] + (["DUPLICATED"] if dups else [])]
    extra: dict[int, list[str]] = {}  # table row -> object lines after it (-v)
    for g in groups:
        mark = " (this)" if g.fingerprint == this else ""
        dup = [] if not dups else [human_bytes(g.duplicated or 0) + (f" ({g.unreadable} unread)" if g.unreadable
                                                                      else "")]
        rows.append([g.scope, g.fingerprint + mark, str(len(g.objects)), human_bytes(g.size),
                     human_age(now - g.newest), human_age(now - g.oldest), *dup])
        if verbose:
            extra[len(rows) - 1] = [f"    {o.name}  {human_bytes(o.size):>9}  {human_age(now - o.modified):>4}"
                                    for o in g.objects]
    lines = []
    for i, line in enumerate(_table(rows, right=frozenset({2, 3, 4, 5, 6}))):
        lines.append(line)
        lines.extend(extra.get(i, []))
    return lines


def _cmd_ls(args: argparse.Namespace) -> int:
    store, settings = _open_store(args)
    only = _object_filter(args)
    this = _this_key()
    objects, ignored = scan(store, settings.prefix)
    groups = group(o for o in objects if only.matches(o))
    if args.duplicates:
        for g in groups:
            g.duplicated, g.unreadable = duplicated_bytes(store, settings.prefix, g)
    now = time.time()
    if args.json:
        print(json.dumps([_group_json(g, this, now) for g in groups], indent=2))
        return 0
    if not groups:
        print(f"no objects in {settings.store_label()}" + ("" if only == ObjectFilter() else " matching the filter"))
    else:
        print("\n".join(_ls_lines(groups, this, now, args.verbose)))
        total = sum(g.size for g in groups)
        count = sum(len(g.objects) for g in groups)
        print(f"{plural(count, 'object')}, {human_bytes(total)}, {plural(len(groups), 'fingerprint')} in "
              f"{plural(len({g.scope for g in groups}), 'scope')} ({settings.store_label()})")
    if ignored:
        print(f"({plural(ignored, 'object')} outside the <scope>/<fingerprint>/ layout ignored)")
    return 0


# --- prune -------------------------------------------------------------------------------------------


def select_for_prune(objects: Iterable[StoredObject], older_than_days: float | None, max_bytes: int | None,
                     now: float) -> list[StoredObject]:
    """Objects older than the cutoff, then the oldest of the rest beyond the size budget; oldest first."""
    pool = sorted(objects, key=lambda o: (o.info.modified, o.info.name))
    doomed: set[StoredObject] = set()
    if older_than_days is not None:
        cutoff = now - older_than_days * 86400
        doomed.update(o for o in pool if o.info.modified < cutoff)
    if max_bytes is not None:
        kept, over = 0, False
        for obj in reversed([o for o in pool if o not in doomed]):  # newest first
            over = over or kept + obj.info.size > max_bytes
            if over:
                doomed.add(obj)
            else:
                kept += obj.info.size
    return [o for o in pool if o in doomed]


def _describe(obj: StoredObject, now: float) -> str:
    return f"{obj.path}  {human_bytes(obj.info.size)}  {human_age(now - obj.info.modified)}"


def _cmd_prune(args: argparse.Namespace) -> int:
    if args.older_than is None and args.max_bytes is None:
        raise UsageProblem("prune needs a criterion: --older-than DAYS and/or --max-bytes SIZE")
    store, settings = _open_store(args)
    only = ObjectFilter(_scope(args.scope))
    objects = [o for o in scan(store, settings.prefix)[0] if only.matches(o)]
    now = time.time()
    doomed = select_for_prune(objects, args.older_than, args.max_bytes, now)
    freed = sum(o.info.size for o in doomed)
    where = settings.store_label() + (f" (scope {only.scope})" if only.scope else "")
    left = f"{plural(len(objects) - len(doomed), 'object')} ({human_bytes(sum(o.info.size for o in objects) - freed)}) remain"
    if not doomed:
        print(f"nothing to prune in {where}: {left}")
        return 0
    if not args.yes:
        for obj in doomed:
            print(f"would delete {_describe(obj, now)}")
        print(f"dry run: nothing deleted. {len(doomed)} of {plural(len(objects), 'object')} ({human_bytes(freed)}) in {where} "
              "would go; run again with --yes to delete them")
        return 0
    for done, obj in enumerate(doomed):
        try:
            store.delete(obj.folder, obj.info.name)
        except StoreError as exc:
            raise StoreError(f"deleted {done} of {plural(len(doomed), 'object')}, then: {exc}", exc.kind) from exc
        print(f"deleted {_describe(obj, now)}")
    print(f"deleted {plural(len(doomed), 'object')} from {where}, freed {human_bytes(freed)}; {left}")
    return 0


# --- pull / push -------------------------------------------------------------------------------------


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


def _cmd_pull(args: argparse.Namespace) -> int:
    store, settings = _open_store(args)
    only = _object_filter(args)
    local = LocalDirStore(args.to)
    tally = transfer(store, local, settings.prefix, only, "pull", args.verbose)
    print(_summary("pull", tally, settings.store_label(), f"{local.label}/{settings.prefix}"))
    return 1 if tally.refused else 0


def _cmd_push(args: argparse.Namespace) -> int:
    if not Path(args.from_).is_dir():
        raise UsageProblem(f"--from {args.from_}: not a directory")
    store, settings = _open_store(args)
    only = _object_filter(args)
    local = LocalDirStore(args.from_)
    tally = transfer(local, store, settings.prefix, only, "push", args.verbose)
    print(_summary("push", tally, f"{local.label}/{settings.prefix}", settings.store_label()))
    return 1 if tally.refused else 0


# --- key / inspect -----------------------------------------------------------------------------------


def _cmd_key(args: argparse.Namespace) -> int:
    try:
        fp = compute()
    except TorchUnavailable as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"key": fp.key, "digest": fp.digest, **fp.parts}, indent=2, sort_keys=True))
    else:
        # Usable as an actions/cache key: no spaces, '/' replaced by '-'.
        print(fp.key.replace("/", "-") if args.flat else fp.key)
    return 0


def _created(seconds: float) -> str:
    if seconds <= 0:
        return ""
    try:
        return f", created {datetime.fromtimestamp(seconds, timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
    except (OverflowError, OSError, ValueError):  # decode bounds it; this is the platform's own limit
        return ""


def _show_bundle(label: str, blob: bytes, folder_key: str | None, verbose: bool) -> int:
    """Validate one bundle and print its header and entry counts (names with ``verbose``)."""
    try:
        header, entries = bundlemod.decode(blob)  # raises BundleError and nothing else, whatever the bytes
    except BundleError as exc:
        print(f"{label}: refused: {exc}")
        return 1
    created = _created(header.created)
    print(f"{label}: fingerprint {header.fingerprint}, {header.entries} entries, "
          f"{human_bytes(header.payload_size)} compressed, {human_bytes(header.raw_size)} raw{created}")
    if verbose and header.extra:
        print(f"  header extra: {json.dumps(dict(header.extra), sort_keys=True)}")
    for kind, count in entries.counts().items():
        print(f"  {kind}: {count}")
        if verbose:
            for entry in entries:
                if entry.kind == kind:
                    print(f"    {entry.name}  {human_bytes(len(entry.data))}  mode {entry.mode:o}")
    if folder_key is not None and header.fingerprint != folder_key:
        print(f"{label}: refused: its header names another fingerprint than its folder ({folder_key})")
        return 1
    return 0


def _object_ref(ref: str, prefix: str) -> StoredObject:
    """``SCOPE/FINGERPRINT/NAME`` (optionally with the prefix in front) -> the object's address."""
    parsed = Layout(prefix).parse_path(ref.strip("/"))
    if parsed is None:
        raise UsageProblem(f"--store-object {ref!r}: expected SCOPE/FINGERPRINT/NAME.mcb "
                           "(as `pytest-megacache ls -v` lists them)")
    scope, key, name = parsed
    return StoredObject(prefix, scope, key, ObjectInfo(name, 0, 0.0))


def _cmd_inspect(args: argparse.Namespace) -> int:
    if not args.paths and not args.store_objects:
        raise UsageProblem("inspect needs bundle files and/or --store-object SCOPE/FINGERPRINT/NAME")
    status = 0
    for path in args.paths:
        try:
            with open(path, "rb") as fh:
                blob = fh.read()
        except OSError as exc:
            print(f"{path}: refused: {exc}")
            status = 1
            continue
        status |= _show_bundle(path, blob, None, args.verbose)
    if args.store_objects:
        store, settings = _open_store(args)
        for ref in args.store_objects:
            obj = _object_ref(ref, settings.prefix)
            try:
                fetched = store.get(obj.folder, obj.info.name, bundlemod.DEFAULT_LIMITS.max_object_bytes)
            except StoreError as exc:
                if exc.kind != "too-large":
                    raise
                print(f"{obj.path}: refused: {exc}")
                status = 1
                continue
            if fetched is None:
                print(f"{obj.path}: not found in {settings.store_label()}")
                status = 1
                continue
            status |= _show_bundle(obj.path, fetched, obj.fingerprint, args.verbose)
    return status


# --- the parser --------------------------------------------------------------------------------------


def _add_filter(parser: argparse.ArgumentParser, fingerprint: bool = True) -> None:
    parser.add_argument("--scope", metavar="SCOPE", help="only this scope (a branch name; '/' is read as '+')")
    if fingerprint:
        parser.add_argument("--fingerprint", default="all", metavar="this|all|KEY",
                            help="only this environment's fingerprint, every one (default) or the given key")


# The help texts: plain text for users (the docstrings above are for developers).
DESCRIPTION = """\
Look after the cache pytest-megacache keeps, without running pytest: this environment's fingerprint, what a
store holds, pruning it, copying objects between a store and a local directory, and checking a CI setup."""
EPILOG = """\
The store is an S3 bucket (--bucket) or a directory (--dir); each store option falls back to its MEGACACHE_*
environment variable, as in a pytest session. Objects are kept as PREFIX/SCOPE/FINGERPRINT/NAME.mcb, where
SCOPE is a branch name ('/' written as '+') and FINGERPRINT is what `pytest-megacache key` prints. Anything
else under the prefix is left alone.

Errors are one line on stderr. Exit status: 0 when all went well; 1 when an object was refused, the store
failed or a doctor check failed; 2 for a bad argument or setting; 141 when the reader of the output went
away (as in `pytest-megacache ls | head -1`).

Run `pytest-megacache COMMAND --help` for a command's options."""
KEY_HELP = """\
Print this environment's fingerprint: the key the plugin stores and looks up compiled artifacts under. It names
torch's version, the device, Python and the platform, then a short hash of all it depends on (versions, CPU
flags, the C++ compiler, TORCHINDUCTOR_* settings and more). Worked out without importing torch; exit status 2
when torch is not installed."""
INSPECT_HELP = """\
Validate bundles, given as files or as objects in the store, and show what each holds: its fingerprint, the
number of entries and their size, when it was made, and the entries of each kind (their names with -v).
Exit status 1 when any of them is refused."""
LS_HELP = """\
List what the store holds, one line per scope and fingerprint: the number of objects, their size, and the age
of the newest and oldest. This environment's fingerprint is marked "(this)". With --duplicates it also reads
the objects of every fingerprint that has more than one and shows the raw bytes of the entries they hold more
than once (what each restore fetches again; the next read-write session merges them)."""
PRUNE_HELP = """\
Delete objects last modified more than --older-than DAYS ago, and/or the oldest ones beyond a --max-bytes budget
(the newest are kept). Without --yes it only prints what it would delete."""
PULL_HELP = """\
Copy objects from the store into a local directory store, such as a directory your CI caches between runs.
Each object is validated first; one that is there already is left as it is. Exit status 1 when any is refused."""
PUSH_HELP = """\
Copy objects from a local directory store into the store. Each object is validated first; one that is there
already is left as it is. Exit status 1 when any is refused."""
DOCTOR_HELP = """\
Check a CI setup, one line per check: torch and triton, the fingerprint, the settings, the store (for S3:
credentials and where they came from, the bucket, listing, and writing a small object that is deleted again;
for a directory: that it exists or can be made, listing, writing), the signing key, and what a session would
restore here (when nothing, the nearest stored fingerprint and what differs).

Settings come from the options below and the MEGACACHE_* environment variables, as in a pytest session; ini
files are not read. The store checks share one time budget, --megacache-timeout. Credentials in what is
printed (environment values not known to be harmless, a URL's user:password) are masked.
Exit status 0 when a session would work (warnings allowed), 1 otherwise."""


def _command(sub: Any, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=summary, description=description,
                                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    key = _command(sub, "key", "print this environment's fingerprint (an actions/cache key)", KEY_HELP)
    key.add_argument("--json", action="store_true", help="print every part of the fingerprint")
    key.add_argument("--flat", action="store_true", help="replace '/' with '-'")
    key.set_defaults(func=_cmd_key)

    inspect = _command(sub, "inspect", "validate bundles (files or store objects) and list what they hold",
                       INSPECT_HELP)
    inspect.add_argument("paths", nargs="*", metavar="FILE", help="bundle files")
    inspect.add_argument("--store-object", dest="store_objects", action="append", default=[],
                         metavar="SCOPE/FINGERPRINT/NAME", help="fetch this object from the store (repeatable)")
    inspect.add_argument("-v", "--verbose", action="store_true", help="list every entry's name")
    add_store_options(inspect)
    inspect.set_defaults(func=_cmd_inspect)

    ls = _command(sub, "ls", "fingerprints per scope: objects, size, ages", LS_HELP)
    _add_filter(ls)
    ls.add_argument("--json", action="store_true", help="a machine-readable list")
    ls.add_argument("-v", "--verbose", action="store_true", help="list every object under its fingerprint")
    ls.add_argument("--duplicates", action="store_true",
                    help="read the objects of each fingerprint and show the bytes its objects hold more than once")
    add_store_options(ls)
    ls.set_defaults(func=_cmd_ls)

    prune = _command(sub, "prune", "delete old objects and/or the oldest beyond a size budget (dry run by default)",
                     PRUNE_HELP)
    prune.add_argument("--older-than", type=_days, metavar="DAYS", help="objects last modified more than DAYS ago")
    prune.add_argument("--max-bytes", type=parse_size, metavar="SIZE",
                       help="keep the newest objects within SIZE (500MB, 2GB, bytes) in total; delete the older rest")
    _add_filter(prune, fingerprint=False)
    prune.add_argument("--yes", action="store_true", help="delete (without it: print what would be deleted)")
    add_store_options(prune)
    prune.set_defaults(func=_cmd_prune)

    pull = _command(sub, "pull", "copy objects from the store into a local directory store", PULL_HELP)
    pull.add_argument("--to", required=True, metavar="DIR", help="local directory store (created if needed)")
    _add_filter(pull)
    pull.add_argument("-v", "--verbose", action="store_true", help="a line per object copied")
    add_store_options(pull)
    pull.set_defaults(func=_cmd_pull)

    push = _command(sub, "push", "copy objects from a local directory store into the store", PUSH_HELP)
    push.add_argument("--from", dest="from_", required=True, metavar="DIR", help="local directory store")
    _add_filter(push)
    push.add_argument("-v", "--verbose", action="store_true", help="a line per object copied")
    add_store_options(push)
    push.set_defaults(func=_cmd_push)

    doctor = _command(sub, "doctor", "check a CI setup: torch, fingerprint, store, signing key, what would be restored",
                      DOCTOR_HELP)
    doctormod.add_arguments(doctor)
    doctor.set_defaults(func=doctormod.run)
    return parser


def _tolerant_output() -> None:
    """Text that the terminal's encoding cannot show (a file name of undecodable bytes) is escaped, not fatal."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="backslashreplace")


def _quiet_broken_pipe() -> None:
    """The reader went away (Python docs, "Note on SIGPIPE"): point stdout and stderr at devnull, so that the
    interpreter's final flush of what is still buffered cannot fail again and print an "Exception ignored"."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):  # no descriptor: replaced in-process
                os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


def _run(args: argparse.Namespace) -> int:
    """Run the command; every exception becomes one line on stderr and an exit status."""
    try:
        result: int = args.func(args)
    except BrokenPipeError:
        raise
    except UsageProblem as exc:
        _say_error(str(exc))
        return 2
    except StoreError as exc:
        _say_error(str(exc))
        return 1
    except KeyboardInterrupt:
        _say_error("interrupted")
        return 130
    except Exception as exc:  # noqa: BLE001 - a store's client, a bundle or the environment: one line, no traceback
        _say_error(f"{type(exc).__name__}: {exc}")
        return 1
    return result


def main(argv: Sequence[str] | None = None) -> int:
    try:
        _tolerant_output()
        args = build_parser().parse_args(argv)
        status = _run(args)
        sys.stdout.flush()  # a reader that went away shows here, where it can be handled
    except BrokenPipeError:
        _quiet_broken_pipe()
        return EXIT_BROKEN_PIPE
    return status


if __name__ == "__main__":
    raise SystemExit(main())
