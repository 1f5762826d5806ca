"""Exception and warning types shared by every module."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from .envpolicy import SECRET_ENV, secret_values

__all__ = ["SECRET_ENV", "BundleError", "MegacacheError", "MegacacheWarning", "StoreError", "redact", "redact_cut"]

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
