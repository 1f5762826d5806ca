"""Child processes: what a child process of a session arms at its start, and the record it writes at exit.
This module, the family's front door, is the start; :mod:`.hook` writes the record and reads the spool.

The rest of the package takes :class:`Spool`, :class:`RestoreSignal` and :func:`disarm` from here: they are imported
when first asked for, so that a child's start imports nothing more.

The package installs ``pytest_megacache_children.pth`` into site-packages; its one line (:data:`PTH_LINE`) runs at
every interpreter start, looks up :data:`SPOOL_ENV` and does nothing else when it is absent. When the plugin has set
it, the line imports this package and calls :func:`start`, which

* registers an exit handler that, at a normal exit of a process that loaded ``torch._dynamo.utils``, imports
  :mod:`.hook` and calls its ``exit_handler`` (one record of torch's counters into the spool);
* when :data:`READY_ENV` or :data:`ISA_ENV` is set too and torch is not imported yet, puts
  :class:`MegacacheRestoreWait` at the front of ``sys.meta_path``. At the process's first ``import torch`` the
  finder removes itself first, then, with :data:`ISA_ENV`, arms the reuse of torch's CPU vector-ISA check
  (:func:`.isaprobe.arm_child`: a hook for torch's ``cpu_vec_isa``, gated on this process deciding the check as the
  session does), and, with :data:`READY_ENV`, asks the parent for the restore (a file named :data:`READY_ENV` +
  :data:`WANTED_SUFFIX`) and waits until the file :data:`READY_ENV` exists, at most :data:`WAIT_ENV` seconds and
  never more than :data:`MAX_CHILD_WAIT`. It finds nothing: torch is then imported as usual. A process that never
  imports torch never waits and imports nothing more.

This runs in every child process of a session, most of which never import torch: the module, and the package's
``__init__`` that importing it runs first, import only ``os``, ``sys`` and ``atexit`` (already loaded, or built in)
at start, ``time`` when the wait begins, and :mod:`.isaprobe` (with the standard library modules torch imports
anyway) when torch is being imported. No ``typing``, no ``__future__``. No exception leaves :func:`start`, the
exit handler or the finder (a traceback in someone else's stderr, or a SystemExit taken for theirs); the line
itself swallows a failed import of the package.
"""

import atexit
import os
import sys

TYPE_CHECKING = False  # typing is not imported at run time
if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType

    from .hook import RestoreSignal, Spool, disarm

__all__ = [
    "ISA_ENV", "MAX_CHILD_WAIT", "PTH_LINE", "READY_ENV", "SPOOL_ENV", "WAIT_ENV", "WANTED_SUFFIX", "MegacacheRestoreWait",
    "RestoreSignal", "Spool", "disarm", "start",
]

SPOOL_ENV = "MEGACACHE_CHILD_SPOOL"
# Set by a session whose restore writes compiled files into the cache directories its child processes inherit: a
# file that appears once the restore has settled (written, or given up), and how many seconds a child waits for it
# at most. A child that imports torch creates the file's name + WANTED_SUFFIX (the session starts its restore then,
# if nothing did before) and waits for the file: it then compiles on the restored files and after the session's
# snapshot of the directories, so what it compiles is carried.
READY_ENV = "MEGACACHE_RESTORE_READY"
WAIT_ENV = "MEGACACHE_RESTORE_WAIT"
WANTED_SUFFIX = ".wanted"
# Set by a session that reuses torch's CPU vector-ISA check (isaprobe.CHILD_ENV): the digest of what decides it there.
ISA_ENV = "MEGACACHE_ISA_REUSE"
MAX_CHILD_WAIT = 900  # seconds: the longest any child waits, whatever the variable says
POLL = 0.02  # seconds between looks at the ready file

# The one line of pytest_megacache_children.pth (tests/children/test_childhook.py checks the file and the installed copy).
# site runs lines that start with "import" and prints a traceback into the child's stderr for any Exception they
# raise: the import of the package (missing, another version of it first on the path) is inside a try. Python 3.11
# runs a venv's .pth files twice (site.venv() and site.main() both add site-packages): start() arms once.
_PTH_CODE = "try:\n import pytest_megacache.children as m\n m.start()\nexcept Exception:\n pass"
PTH_LINE = f"import os; os.environ.get({SPOOL_ENV!r}) and exec({_PTH_CODE!r}, {{}})\n"

_started = False


def __getattr__(name: str) -> object:
    """The family's names for the rest of the package, each imported when first asked for (a child's start imports
    only this module)."""
    if name in ("RestoreSignal", "Spool", "disarm"):
        from . import hook

        return getattr(hook, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def start() -> None:
    """Arm this process if :data:`SPOOL_ENV` is set: the exit handler, and the finder for the first ``import torch``
    when :data:`READY_ENV` or :data:`ISA_ENV` is set and torch is not imported yet. Once per process; never
    raises."""
    global _started
    try:
        spool = os.environ.get(SPOOL_ENV)
        if not spool or _started:
            return
        _started = True
        # pid, parent pid and spool as they are now: a forked child (another pid) writes nothing, and a process
        # that points the variable elsewhere for its own children still writes into its own spool.
        atexit.register(_at_exit, os.getpid(), os.getppid(), spool)
        if (os.environ.get(READY_ENV) or os.environ.get(ISA_ENV)) and "torch" not in sys.modules and not _waiting():
            sys.meta_path.insert(0, MegacacheRestoreWait)
    except Exception:  # noqa: BLE001 - arming must never fail the process
        pass


def _at_exit(start_pid: int, start_ppid: int, spool: str) -> None:
    # .hook (json, dataclasses, the spool's reader) is imported only by a process that loaded torch's counters.
    try:
        if "torch._dynamo.utils" in sys.modules:
            from .hook import exit_handler

            exit_handler(start_pid, start_ppid, spool)
    except BaseException:  # noqa: BLE001
        pass


def _is_wait(finder: object) -> bool:
    """Whether ``finder`` is a restore wait, this module's or another copy's (compared by name)."""
    return getattr(finder, "__name__", "") == MegacacheRestoreWait.__name__


def _waiting() -> bool:
    """Whether a restore wait is on ``sys.meta_path`` already (put there by another copy of this module)."""
    return any(map(_is_wait, sys.meta_path))


class MegacacheRestoreWait:
    """A meta-path finder that finds nothing: at the first ``import torch`` it takes itself off ``sys.meta_path``,
    arms the vector-ISA check's reuse (:data:`ISA_ENV`), asks the parent for the restore and waits until it has
    settled (bounded, :data:`READY_ENV`); then the usual finders find torch."""

    @staticmethod
    def find_spec(name: str, path: "Sequence[str] | None" = None, target: "ModuleType | None" = None) -> None:
        if name != "torch":
            return
        try:
            sys.meta_path[:] = [f for f in sys.meta_path if not _is_wait(f)]
        except BaseException:  # noqa: BLE001 - the import of torch goes on, whatever happens here
            pass
        try:
            offered = os.environ.get(ISA_ENV)
            if offered:
                from ..isaprobe import arm_child

                arm_child(offered)
        except BaseException:  # noqa: BLE001
            pass
        try:
            if os.environ.get(READY_ENV):
                _wait_for_restore()
        except BaseException:  # noqa: BLE001
            pass


def _wait_for_restore() -> None:
    import time

    ready = os.environ.get(READY_ENV, "")
    end = time.monotonic() + min(MAX_CHILD_WAIT, float(os.environ.get(WAIT_ENV) or 0))
    if ready and not os.path.exists(ready):
        with open(ready + WANTED_SUFFIX, "a"):  # the request: the name is all
            pass
        while not os.path.exists(ready) and time.monotonic() < end:
            time.sleep(POLL)
