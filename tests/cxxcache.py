"""A compiler-output cache for the test suite's torch sessions: run as ``g++`` (first on PATH), it serves a C++
build whose inputs it has seen before in this test run from its store, and runs the real compiler otherwise.

Why: every cold torch session of the suite starts from empty cache directories (that is what the tests assert
on), so each one builds the same vector-ISA checks (about 15 s on 2 cores) and the same precompiled header
(about 7 s) again, and most build the same kernels. torch still does everything it does without this
(it writes the same sources, calls the compiler with the same arguments, finds the outputs, loads them); only
the compiler's work is shared, within one run of the suite.

The key of a build is every argument, with each existing file replaced by its name and a digest of its bytes,
and the output path by its name (a session's cache directory is another path each time), plus the real
compiler's identity. Headers are not read: those a build includes (torch's, Python's, the system's) do not
change during one run, which is why the store lives only as long as that run. Anything unusual (no single
``-o``, preprocessing, dependency files) goes straight to the real compiler, as does every failure.

A build is served as a hard link to the store's copy where the file system allows (one precompiled header of
about 150 MB for every session, not a copy each), else copied. A file written in place through any of its links
changes its modification time: the store records each build's size and time (``stat-<key>``) and serves a build
whose file no longer matches them as a miss, so a session that rewrites its output never hands that to another.

Environment: ``TESTS_CXX_REAL`` the real compiler, ``TESTS_CXX_STORE`` the store (a directory). Standard
library only: it runs as ``python -S``, outside the package (so its atomic copy is its own, not
``pytest_megacache.fsutil``'s).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile

PASS_THROUGH = ("-E", "-M", "-MM", "-MD", "-MMD", "-MF", "-save-temps", "--version", "-v", "-dumpversion",
                "-dumpmachine", "-print-search-dirs")
HITS = "hits"  # beside the builds, which are named by their keys (hexadecimal digests)


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_key(argv: list[str], real: str) -> tuple[str, str] | None:
    """The build's key and its output path, or None when the build is not one to share."""
    if any(arg in PASS_THROUGH or arg.startswith(("-M", "-fprofile")) for arg in argv) or argv.count("-o") != 1:
        return None
    at = argv.index("-o") + 1  # the output's place
    if at == len(argv):
        return None
    stat = os.stat(real)
    h = hashlib.sha256(f"cxxcache 1\0{os.path.realpath(real)}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    for i, arg in enumerate(argv):
        if i == at:
            h.update(f"out\0{os.path.basename(arg)}\0".encode())
        elif os.path.isfile(arg):
            h.update(f"file\0{os.path.basename(arg)}\0{_digest(arg)}\0".encode())
        else:
            h.update(f"arg\0{arg}\0".encode())
    return h.hexdigest(), argv[at]


def _place(source: str, target: str) -> None:
    """Link, else copy, ``source`` to ``target`` through a temporary name beside it: a reader never sees half a
    file."""
    folder = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".cxxcache-")
    try:
        os.close(fd)
        os.unlink(tmp)  # the name, for the link (mkstemp's names are unique, the race is with a stranger's name)
        try:
            os.link(source, tmp)
        except OSError:  # another file system, or links not allowed
            with open(tmp, "xb") as out, open(source, "rb") as src:
                while block := src.read(1 << 20):
                    out.write(block)
            os.chmod(tmp, os.stat(source).st_mode & 0o777)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _stamp(path: str) -> str:
    st = os.stat(path)
    return f"{st.st_size} {st.st_mtime_ns}"


def _kept(store: str, key: str) -> str | None:
    """The store's build of ``key`` if its file is as it was stored, else None (and the build is dropped)."""
    kept, stamp = os.path.join(store, key), os.path.join(store, f"stat-{key}")
    try:
        with open(stamp, encoding="ascii") as fh:
            if fh.read() == _stamp(kept):
                return kept
    except OSError:
        pass
    for path in (kept, stamp):
        try:
            os.unlink(path)
        except OSError:
            pass
    return None


def _keep(store: str, key: str, output: str) -> None:
    """``output`` into the store as ``key``, with the stamp that tells its file unchanged."""
    kept = os.path.join(store, key)
    _place(output, kept)
    fd, tmp = tempfile.mkstemp(dir=store, prefix=".stamp-")
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(_stamp(kept))
    os.replace(tmp, os.path.join(store, f"stat-{key}"))


def _count_hit(store: str) -> None:
    """One byte more in the store's ``hits`` file (the builds are the store's keys)."""
    with open(os.path.join(store, HITS), "ab") as fh:
        fh.write(b".")


def main(argv: list[str]) -> int:
    real, store = os.environ["TESTS_CXX_REAL"], os.environ.get("TESTS_CXX_STORE", "")
    found = build_key(argv, real) if store and os.path.isdir(store) else None
    if found is None:
        return subprocess.call([real, *argv])
    key, output = found
    kept = _kept(store, key)
    if kept is not None:
        _place(kept, output)
        _count_hit(store)
        return 0
    rc = subprocess.call([real, *argv])
    if rc == 0 and os.path.isfile(output):
        _keep(store, key, output)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
