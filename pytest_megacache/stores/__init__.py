"""The stores: where objects live, and the deadline every operation on them runs under (:mod:`.deadline`).
This module, the family's front door, is the backends' small interface with S3, local-directory and in-memory ones.

Objects are immutable and uniquely named; nothing is ever overwritten, so concurrent writers cannot lose
each other's work, and readers never see a partial object (S3 PUTs are atomic; the directory store
writes a temp file and renames it). A put to a name that is taken keeps the object there and raises
:class:`StoreError` in every store (S3: a conditional PUT, ``If-None-Match: *``). Names are validated on the way
in and on the way out of a listing.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from ..errors import StoreError, redact_cut
from ..fsutil import TooLarge, copy_regular, write_atomic
from ..layout import OBJECT_SUFFIX, valid_object_name, valid_segment
from .deadline import Deadline, bounded, bounded_map, loggers_listed_at_once

if TYPE_CHECKING:
    from ..settings import Settings

# The stores, and the deadlines every store operation runs under (:mod:`.deadline`): the rest of the package imports
# the family from here.
__all__ = [
    "ATTEMPTS", "Deadline", "LocalDirStore", "MemoryStore", "ObjectInfo", "S3Store", "Store", "Walk", "bounded", "bounded_map",
    "from_settings", "loggers_listed_at_once", "make_s3_client", "new_object_name", "validate_folder",
]


@dataclass(frozen=True)
class ObjectInfo:
    name: str  # the object's name inside its folder (no slashes)
    size: int
    modified: float  # POSIX seconds


_CHUNK = 1 << 20  # what a streamed GET reads at a time

Walk = list[tuple[str, ObjectInfo]]  # (folder, object) pairs; an alias because stores define list()


def new_object_name() -> str:
    """A unique, time-sortable object name."""
    now = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now % 1 * 1000):03d}"
    return f"{stamp}-{os.getpid()}-{secrets.token_hex(6)}{OBJECT_SUFFIX}"


def validate_folder(folder: str) -> str:
    """``folder`` without outer slashes, refused unless each part is a segment (:func:`.layout.valid_segment`):
    the layout's broadest rule, as a folder holds prefix parts (which may start with a dot) as well as a scope."""
    parts = folder.strip("/").split("/")
    if not all(valid_segment(p) for p in parts):
        raise StoreError(f"unsafe folder {folder[:120]!r}", "other")
    return "/".join(parts)


class Store(Protocol):
    """A flat namespace of folders (``prefix/scope/fingerprint``, see :mod:`.layout`) holding immutable objects."""

    label: str

    def list(self, folder: str) -> list[ObjectInfo]: ...

    def get(self, folder: str, name: str, max_bytes: int) -> bytes | None: ...

    def put(self, folder: str, name: str, data: bytes) -> None:
        """Store a new object; raises :class:`StoreError` (and keeps the object there) when the name is taken."""
        ...

    def fetch(self, folder: str, name: str, max_bytes: int, dest: BinaryIO) -> bool:
        """Write the object into ``dest`` a chunk at a time (refused over ``max_bytes``); False if it is gone."""
        ...

    def put_file(self, folder: str, name: str, path: str) -> None:
        """Store the file ``path`` as a new object, read a chunk at a time."""
        ...

    def delete(self, folder: str, name: str) -> None: ...

    def walk(self, prefix: str) -> Walk:
        """Every object below ``prefix`` at any depth, as (folder, info); invalid names are skipped."""
        ...

    def head(self, folder: str, name: str, nbytes: int) -> bytes | None:
        """The first ``nbytes`` of an object (a ranged GET on S3), or None if it is gone."""
        ...


def _split_key(prefix: str, key: str) -> tuple[str, str] | None:
    """``prefix/a/b/name.mcb`` -> (``prefix/a/b``, ``name.mcb``) when both parts are valid."""
    folder, _, name = key.rpartition("/")
    if not folder or not valid_object_name(name) or not (folder == prefix or folder.startswith(prefix + "/")):
        return None
    try:
        return validate_folder(folder), name
    except StoreError:
        return None


class MemoryStore:
    """In-process reference store for tests."""

    def __init__(self) -> None:
        self.label = "memory"
        self.objects: dict[tuple[str, str], tuple[bytes, float]] = {}
        self._lock = threading.Lock()

    def list(self, folder: str) -> list[ObjectInfo]:
        folder = validate_folder(folder)
        with self._lock:
            return sorted((ObjectInfo(n, len(d), t) for (f, n), (d, t) in self.objects.items() if f == folder),
                          key=lambda o: o.name)

    def get(self, folder: str, name: str, max_bytes: int) -> bytes | None:
        with self._lock:
            item = self.objects.get((validate_folder(folder), name))
        if item is None:
            return None
        if len(item[0]) > max_bytes:
            raise StoreError(f"object {name} is {len(item[0])} bytes, over the limit of {max_bytes}", "too-large")
        return item[0]

    def head(self, folder: str, name: str, nbytes: int) -> bytes | None:
        with self._lock:
            item = self.objects.get((validate_folder(folder), name))
        return None if item is None else item[0][:nbytes]

    def put(self, folder: str, name: str, data: bytes) -> None:
        if not valid_object_name(name):
            raise StoreError(f"bad object name {name!r}")
        where = (validate_folder(folder), name)
        with self._lock:
            if where in self.objects:
                raise StoreError(f"object {name} already exists", "other")
            self.objects[where] = (bytes(data), time.time())

    def fetch(self, folder: str, name: str, max_bytes: int, dest: BinaryIO) -> bool:
        data = self.get(folder, name, max_bytes)
        if data is None:
            return False
        dest.write(data)
        return True

    def put_file(self, folder: str, name: str, path: str) -> None:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror or exc}", "io") from exc
        self.put(folder, name, data)

    def delete(self, folder: str, name: str) -> None:
        with self._lock:
            self.objects.pop((validate_folder(folder), name), None)

    def walk(self, prefix: str) -> Walk:
        prefix = validate_folder(prefix)
        with self._lock:
            items = list(self.objects.items())
        out = []
        for (folder, name), (data, when) in items:
            split = _split_key(prefix, f"{folder}/{name}")
            if split is not None:
                out.append((split[0], ObjectInfo(name, len(data), when)))
        return sorted(out, key=lambda fo: (fo[0], fo[1].name))


class LocalDirStore:
    """Objects as files under ``root/folder/``, written atomically and never over one another
    (:func:`.fsutil.write_atomic`), read without following a link (:func:`.fsutil.read_regular`)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.label = f"dir:{self.root}"

    def _dir(self, folder: str) -> Path:
        return self.root.joinpath(*validate_folder(folder).split("/"))

    def list(self, folder: str) -> list[ObjectInfo]:
        path = self._dir(folder)
        out = []
        try:
            with os.scandir(path) as it:
                for item in it:
                    if not (valid_object_name(item.name) and item.is_file(follow_symlinks=False)):
                        continue
                    try:
                        st = item.stat(follow_symlinks=False)
                    except FileNotFoundError:  # deleted while the folder was read (another session's compaction)
                        continue
                    out.append(ObjectInfo(item.name, st.st_size, st.st_mtime))
        except FileNotFoundError:  # no folder: nothing stored there yet
            return []
        except OSError as exc:
            raise StoreError(f"cannot list {path}: {exc.strerror or exc}", "io") from exc
        return sorted(out, key=lambda o: o.name)

    def _object(self, folder: str, name: str) -> Path:
        if not valid_object_name(name):
            raise StoreError(f"bad object name {name[:80]!r}")
        return self._dir(folder) / name

    def get(self, folder: str, name: str, max_bytes: int) -> bytes | None:
        """The object, refused over ``max_bytes`` and when it is not a regular file (a link is not followed)."""
        out = io.BytesIO()
        return out.getvalue() if self.fetch(folder, name, max_bytes, out) else None

    def head(self, folder: str, name: str, nbytes: int) -> bytes | None:
        path = self._object(folder, name)
        try:
            with open(path, "rb") as fh:
                return fh.read(nbytes)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror or exc}", "io") from exc

    def fetch(self, folder: str, name: str, max_bytes: int, dest: BinaryIO) -> bool:
        path = self._object(folder, name)
        try:
            copy_regular(path, max_bytes, dest)
        except FileNotFoundError:
            return False
        except TooLarge as exc:
            raise StoreError(f"object {name} is {exc.size} bytes, over the limit of {max_bytes}", "too-large") from exc
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror or exc}", "io") from exc
        return True

    def put(self, folder: str, name: str, data: bytes) -> None:
        """Write a new object (flushed to disk, then renamed into place); one of that name already there stays."""
        self._write(folder, name, data)

    def put_file(self, folder: str, name: str, path: str) -> None:
        try:
            with open(path, "rb") as source:
                self._write(folder, name, source)
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror or exc}", "io") from exc

    def _write(self, folder: str, name: str, data: bytes | BinaryIO) -> None:
        path = self._object(folder, name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            written = write_atomic(path, data, mode=0o600, replace=False, fsync=True)
        except OSError as exc:
            raise StoreError(f"cannot write {path}: {exc.strerror or exc}", "io") from exc
        if not written:
            raise StoreError(f"object {name} already exists", "other")

    def delete(self, folder: str, name: str) -> None:
        if not valid_object_name(name):
            raise StoreError(f"bad object name {name!r}")
        try:
            (self._dir(folder) / name).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"cannot delete {name}: {exc.strerror or exc}", "io") from exc

    def walk(self, prefix: str) -> Walk:
        prefix = validate_folder(prefix)
        base = self._dir(prefix)
        out: Walk = []
        try:
            for dirpath, dirnames, filenames in os.walk(base, onerror=None, followlinks=False):
                rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                for fn in filenames:
                    split = _split_key(prefix, f"{rel}/{fn}")
                    path = os.path.join(dirpath, fn)
                    if split is None or os.path.islink(path):
                        continue
                    try:
                        st = os.lstat(path)
                    except FileNotFoundError:  # deleted while the tree was read
                        continue
                    out.append((split[0], ObjectInfo(fn, st.st_size, st.st_mtime)))
        except OSError as exc:
            raise StoreError(f"cannot walk {base}: {exc.strerror or exc}", "io") from exc
        return sorted(out, key=lambda fo: (fo[0], fo[1].name))


def _classify(exc: BaseException) -> str:
    from botocore import exceptions as bex

    if isinstance(exc, (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ReadTimeoutError,
                        bex.ConnectionClosedError)):
        return "unreachable"
    if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError)):
        return "credentials"
    if isinstance(exc, bex.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchBucket",):
            return "no-bucket"
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"):
            return "denied"
    return "other"


# What S3 answers a conditional PUT to a taken name (409: another conditional PUT to it is under way), and what an
# endpoint without conditional writes answers one.
_TAKEN = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})
_NO_CONDITIONS = frozenset({"NotImplemented", "501"})


def _describe(exc: BaseException) -> str:
    return redact_cut(str(exc) or type(exc).__name__)


class _Digest:
    """A sink that keeps only the digest of what is written to it."""

    def __init__(self) -> None:
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return len(data)


class S3Store:
    """Objects at ``s3://bucket/folder/name``, through a boto3 client passed in or built from settings."""

    def __init__(self, bucket: str, client: Any) -> None:
        self.bucket = bucket
        self.client = client
        self.label = f"s3://{bucket}"

    def _key(self, folder: str, name: str) -> str:
        if not valid_object_name(name):
            raise StoreError(f"bad object name {name[:80]!r}")
        return f"{validate_folder(folder)}/{name}"

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except (BotoCoreError, ClientError) as exc:
            raise StoreError(f"S3 {what} on bucket {self.bucket!r} failed: {_describe(exc)}", _classify(exc)) from exc

    def _listing(self, prefix: str) -> Iterator[dict[str, Any]]:
        """Every item of a ``list_objects_v2`` listing under ``prefix``, page by page.

        A non-conforming endpoint that says a page is truncated but gives no new continuation token (or the
        same one again) would make a naive loop ask forever: that is an error here."""
        token: str | None = None
        seen: set[str] = set()
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("list", self.client.list_objects_v2, **kwargs)
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")
            if not token or token in seen:
                raise StoreError(f"S3 list on bucket {self.bucket!r}: the endpoint said the listing was truncated "
                                 "but gave no new continuation token", "other")
            seen.add(token)

    def list(self, folder: str) -> list[ObjectInfo]:
        base = validate_folder(folder) + "/"
        out = []
        for item in self._listing(base):
            name = str(item["Key"])[len(base):]
            if valid_object_name(name):
                out.append(ObjectInfo(name, int(item.get("Size", 0)), item["LastModified"].timestamp()))
        return sorted(out, key=lambda o: o.name)

    def _get_object(self, folder: str, name: str) -> dict[str, Any] | None:
        """The GET's response (its body not read yet), or None if the object is gone."""
        from botocore.exceptions import BotoCoreError, ClientError

        key = self._key(folder, name)
        try:
            response: dict[str, Any] = self.client.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise StoreError(f"S3 get of {key} failed: {_describe(exc)}", _classify(exc)) from exc
        except BotoCoreError as exc:
            raise StoreError(f"S3 get of {key} failed: {_describe(exc)}", _classify(exc)) from exc
        return response

    def get(self, folder: str, name: str, max_bytes: int) -> bytes | None:
        out = io.BytesIO()
        return out.getvalue() if self.fetch(folder, name, max_bytes, out) else None

    def fetch(self, folder: str, name: str, max_bytes: int, dest: BinaryIO) -> bool:
        response = self._get_object(folder, name)
        if response is None:
            return False
        from botocore.exceptions import BotoCoreError

        key = self._key(folder, name)
        body = response["Body"]
        try:
            if int(response.get("ContentLength", 0)) > max_bytes:
                raise StoreError(f"object {name} is {response['ContentLength']} bytes, over the limit of {max_bytes}",
                                 "too-large")
            size = 0
            while chunk := body.read(_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise StoreError(f"object {name} is over the limit of {max_bytes} bytes", "too-large")
                dest.write(chunk)
        except (BotoCoreError, OSError) as exc:
            raise StoreError(f"S3 read of {key} failed: {_describe(exc)}", _classify(exc)) from exc
        finally:
            body.close()
        return True

    def put(self, folder: str, name: str, data: bytes) -> None:
        self._put_new(folder, name, io.BytesIO(data))

    def put_file(self, folder: str, name: str, path: str) -> None:
        """One PUT whose body is read from the file (botocore rewinds it for a retry)."""
        self._key(folder, name)  # a bad name is refused before the file is opened
        try:
            with open(path, "rb") as body:
                self._put_new(folder, name, body)
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror or exc}", "io") from exc

    def _conditional_puts(self) -> bool:
        """Whether the client knows ``IfNoneMatch`` for PutObject (botocore 1.35 and later; older ones refuse it)."""
        try:
            return "IfNoneMatch" in self.client.meta.service_model.operation_model("PutObject").input_shape.members
        except Exception:  # noqa: BLE001 - a client without botocore's model: no condition to send
            return False

    def _put_new(self, folder: str, name: str, body: BinaryIO) -> None:
        """PUT ``body`` at ``key`` unless an object is there: a conditional write (``If-None-Match: *``), which S3
        and most compatible endpoints honour. An endpoint that does not implement it (501) gets the plain PUT: the
        unique name is then the only guard, as it is with a botocore too old to send the condition. A name found
        taken by these very bytes is this PUT's own: botocore retried a PUT that had landed, its answer lost."""
        from botocore.exceptions import ClientError

        key = self._key(folder, name)
        for conditional in (True, False) if self._conditional_puts() else (False,):
            body.seek(0)
            condition = {"IfNoneMatch": "*"} if conditional else {}
            try:
                self._call("put", self.client.put_object, Key=key, Body=body, ContentType="application/octet-stream",
                           **condition)
                return
            except StoreError as exc:
                cause = exc.__cause__
                code = str(cause.response.get("Error", {}).get("Code", "")) if isinstance(cause, ClientError) else ""
                if code in _TAKEN:
                    if self._holds(folder, name, body):
                        return
                    raise StoreError(f"object {name} already exists", "other") from cause
                if not (conditional and code in _NO_CONDITIONS):
                    raise

    def _holds(self, folder: str, name: str, body: BinaryIO) -> bool:
        """Whether the object ``name`` holds ``body``'s bytes (read again from its start): digests of both, a chunk
        at a time, the object's through :meth:`fetch`. Any failure to read either is a no."""
        mine, theirs = hashlib.sha256(), _Digest()
        try:
            body.seek(0)
            while chunk := body.read(_CHUNK):
                mine.update(chunk)
            found = self.fetch(folder, name, 1 << 62, theirs)  # type: ignore[arg-type]
        except (StoreError, OSError):
            return False
        return found and mine.digest() == theirs.sha256.digest()

    def delete(self, folder: str, name: str) -> None:
        self._call("delete", self.client.delete_object, Key=self._key(folder, name))

    def walk(self, prefix: str) -> Walk:
        prefix = validate_folder(prefix)
        out = []
        for item in self._listing(prefix + "/"):
            split = _split_key(prefix, str(item["Key"]))
            if split is not None:
                out.append((split[0], ObjectInfo(split[1], int(item.get("Size", 0)), item["LastModified"].timestamp())))
        return sorted(out, key=lambda fo: (fo[0], fo[1].name))

    def head(self, folder: str, name: str, nbytes: int) -> bytes | None:
        from botocore.exceptions import ClientError

        key = self._key(folder, name)
        try:
            response = self._call("get", self.client.get_object, Key=key, Range=f"bytes=0-{max(0, nbytes - 1)}")
        except StoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, ClientError) and cause.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        body = response["Body"]
        try:
            data: bytes = body.read(nbytes)
        except Exception as exc:
            raise StoreError(f"S3 read of {key} failed: {_describe(exc)}", "unreachable") from exc
        finally:
            body.close()
        return data


# Requests per S3 call, the first one included (botocore's ``max_attempts`` would count retries only: 3 made 4).
ATTEMPTS = 3


def make_s3_client(endpoint_url: str | None = None, connect_timeout: float = 3.0, read_timeout: float = 30.0,
                   attempts: int = ATTEMPTS) -> Any:
    """A boto3 S3 client with bounded timeouts and ``attempts`` requests per call at most. boto3 resolves
    credentials, the region and ``AWS_ENDPOINT_URL_S3`` itself when ``endpoint_url`` is None. The timeouts are
    per connection and per socket read: the session's wall-clock budgets (:mod:`deadline`) bound the rest."""
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"total_max_attempts": attempts, "mode": "standard"},
        max_pool_connections=16,
    )
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config, region_name=region)


def from_settings(settings: Settings) -> Store:
    if settings.bucket:
        return S3Store(settings.bucket, make_s3_client(settings.endpoint_url))
    if settings.directory:
        return LocalDirStore(settings.directory)
    raise StoreError("no store configured (set --megacache-bucket or --megacache-dir)")
