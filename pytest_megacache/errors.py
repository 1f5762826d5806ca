"""Exception and warning types shared by every module."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Mapping

from .envpolicy import SECRET_ENV, secret_values

__all__ = ["SECRET_ENV", "BundleError", "LocalDiskError", "MegacacheError", "MegacacheWarning", "StoreError", "disk_of",
           "free_bytes", "redact", "redact_cut"]

# scheme://userinfo@ : the userinfo runs to the authority's last '@', so a password holding '@' is masked whole.
_URL_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^\s/]*@")


def redact(text: str, env: Mapping[str, str] | None = None) -> str:
    """``text`` without credentials: the values of variables not known to be harmless (as ``<NAME>``; see
    :func:`envpolicy.masked`) and a URL's user:password part (as ``***``).

    Cheap enough per message (one pass over the environment's names), not meant per byte. Mask before cutting
    a message short (:func:`redact_cut`): a cut secret is no longer recognised."""
    env = os.environ if env is None else env
    for name, secret in sorted(secret_values(env), key=lambda pair: -len(pair[1])):
        if secret in text:
            text = text.replace(secret, f"<{name}>")
    return _URL_USERINFO.sub(r"\1***@", text)


def redact_cut(text: str, limit: int = 300, env: Mapping[str, str] | None = None) -> str:
    """:func:`redact`, then at most ``limit`` characters."""
    return redact(text, env)[:limit]


class MegacacheWarning(UserWarning):
    """A cache problem: the session goes on cold (or without uploading)."""


class MegacacheError(Exception):
    """Base of the plugin's own exceptions that other code may catch (a failed profile merge, say). Never
    raised into pytest: a cache problem is a warning, and under ``--megacache-strict`` a ``pytest.UsageError``
    (at session start) or a failing exit status (later)."""


class BundleError(ValueError):
    """A bundle or one of its parts failed validation; nothing of it may reach torch."""


class StoreError(Exception):
    """A store operation failed.

    ``kind`` classifies the failure for the report: ``unreachable``, ``no-bucket``, ``denied``,
    ``credentials``, ``io`` (local disk, including a full disk) or ``other``.
    """

    def __init__(self, message: str, kind: str = "other") -> None:
        super().__init__(message)
        self.kind = kind


_DISK_STATE = {errno.ENOSPC: "full", errno.EDQUOT: "over quota", errno.EROFS: "read-only",
               errno.EFBIG: "over the file size limit"}


def free_bytes(path: str) -> int | None:
    """The bytes free to this user on the file system of ``path`` (or of its nearest existing parent); None if
    unknown."""
    probe = os.path.abspath(path)
    for _ in range(64):
        try:
            st = os.statvfs(probe)
        except FileNotFoundError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return None
            probe = parent
            continue
        except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
            return None
        return st.f_bavail * st.f_frsize
    return None


def note_free(exc: BaseException, path: str) -> None:
    """Read the free space of ``path``'s disk now, at the failure ``exc``, before the partial file that filled it is
    removed: :meth:`LocalDiskError.of` then says it (not what is free once the file has gone)."""
    if isinstance(exc, OSError) and not hasattr(exc, _FREE_AT_FAILURE):
        setattr(exc, _FREE_AT_FAILURE, free_bytes(path))


_FREE_AT_FAILURE = "megacache_free_at_failure"


def disk_of(path: str, code: int | None, free: int | None = None) -> str:
    """``TMPDIR full (12 MB free)``, ``the disk of /cache read-only (0 MB free)``: which local disk refused a write
    to ``path``, in what state (``free``: as read at the failure, else now)."""
    import tempfile

    tmp = os.path.realpath(tempfile.gettempdir())
    real = os.path.realpath(path)
    where = "TMPDIR" if real == tmp or real.startswith(tmp.rstrip(os.sep) + os.sep) else f"the disk of {os.path.dirname(path)}"
    free = free if free is not None else free_bytes(path)
    room = f" ({free / 1e6:.0f} MB free)" if free is not None else ""
    return f"{where} {_DISK_STATE.get(code or 0, 'refused a write')}{room}"


class LocalDiskError(OSError):
    """A local disk refused a write (full, over quota, read-only, a size limit): this machine's fault, never the
    store's. ``str()``: ``TMPDIR full (12 MB free): <what> at <path>: <reason>``; ``disk``: its first part."""

    def __init__(self, message: str, code: int | None, disk: str, reason: str = "") -> None:
        super().__init__(code, message)
        self.message = message
        self.disk = disk
        self.reason = reason or message  # what the system said ("No space left on device")

    def __str__(self) -> str:
        return self.message

    @classmethod
    def of(cls, exc: OSError, path: str, what: str) -> LocalDiskError:
        if isinstance(exc, LocalDiskError):
            return exc
        disk = disk_of(path, exc.errno, getattr(exc, _FREE_AT_FAILURE, None))
        reason = str(exc.strerror or exc)
        return cls(f"{disk}: {what} at {path}: {reason}", exc.errno, disk, reason)
