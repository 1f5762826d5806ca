"""Signing keys from ``MEGACACHE_SIGNING_KEY`` (kept apart from :mod:`bundle` so that reading them costs no
zstandard import: :func:`.settings.resolve` reads them at configure time, in sessions that may never touch the
cache)."""

from __future__ import annotations

import re

MIN_KEY_CHARS = 16
SIGNING_KEY_ENV = "MEGACACHE_SIGNING_KEY"


def parse_signing_keys(text: str | None) -> list[bytes]:
    """Keys from ``MEGACACHE_SIGNING_KEY``: separated by commas or whitespace; the first one signs.

    Every key verifies (so a rotation lists the new key first and the old one after it until old objects are
    gone). Each key must be at least 16 characters; a key is the UTF-8 bytes of its text. Error messages name a
    key by its position only, never by its text.
    """
    if text is None:
        return []
    keys: list[bytes] = []
    for i, part in enumerate((p for p in re.split(r"[\s,]+", text) if p), start=1):
        if len(part) < MIN_KEY_CHARS:
            raise ValueError(f"{SIGNING_KEY_ENV}: key {i} is shorter than {MIN_KEY_CHARS} characters")
        try:
            key = part.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes in the environment: the codec's message quotes them
            raise ValueError(f"{SIGNING_KEY_ENV}: key {i} is not valid UTF-8 text") from None
        if key not in keys:
            keys.append(key)
    return keys
