"""Exception and warning types shared by every module."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

_URL_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/\s@]+@")
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "MEGACACHE_SIGNING_KEY")


def redact(text: str, env: Mapping[str, str] | None = None) -> str:
    """``text`` without credentials: a URL's user:password part, and the values of secret variables."""
    text = _URL_USERINFO.sub(r"\1***@", text)
    env = os.environ if env is None else env
    for name in SECRET_ENV:
        for secret in re.split(r"[\s,]+", env.get(name) or ""):
            if len(secret) >= 8:
                text = text.replace(secret, f"<{name}>")
    return text


class MegacacheWarning(UserWarning):
    """A cache problem: the session goes on cold (or without uploading)."""


class MegacacheError(Exception):
    """A cache problem raised instead of warned about (``--megacache-strict``)."""


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
