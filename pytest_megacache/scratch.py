"""The session's scratch directory: the objects it fetches and the compiled files it restores or collects, each in a
file of its own, so that they are never all in memory. Made on first use, removed when the session ends (or at
interpreter exit)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref

from .layout import OBJECT_SUFFIX
from .stores import Store


def unlink(path: str) -> None:
    """Remove a file, if it is there."""
    try:
        os.unlink(path)
    except OSError:
        pass


class Scratch:
    """A temporary directory, ``pytest-megacache-scratch-*``; thread-safe."""

    def __init__(self) -> None:
        self._path: str | None = None
        self._lock = threading.Lock()

    def path(self) -> str:
        with self._lock:
            if self._path is None:
                self._path = tempfile.mkdtemp(prefix="pytest-megacache-scratch-")
                weakref.finalize(self, shutil.rmtree, self._path, True)
            return self._path

    def close(self) -> None:
        with self._lock:
            path, self._path = self._path, None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    def fetch(self, store: Store, folder: str, name: str, max_bytes: int) -> str | None:
        """The object in a new scratch file (its path), fetched a chunk at a time; None when it is gone."""
        fd, path = tempfile.mkstemp(dir=self.path(), suffix=OBJECT_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as dest:
                found = store.fetch(folder, name, max_bytes, dest)
        except BaseException:
            unlink(path)
            raise
        if not found:
            unlink(path)
            return None
        return path
