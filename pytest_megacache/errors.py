"""Exception and warning types shared by every module."""

from __future__ import annotations


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
