"""The command line: ``pytest-megacache`` / ``python -m pytest_megacache``, cache chores without a pytest session.
This module, the family's front door, is the parser and the dispatch; the commands are the family's other modules.

Commands: ``key`` (this environment's fingerprint), ``inspect`` (validate bundles, from files or from the
store), ``ls`` (what the store holds, per scope and fingerprint), ``prune`` (delete by age and/or a size
budget), ``pull`` and ``push`` (copy objects between the store and a local directory store), ``doctor`` (check
a CI setup, one line per check: :mod:`.doctor`).

This module is the parser and the dispatch: the arguments, the help texts, and the exit statuses. The commands
live in :mod:`.commands` (key, inspect, ls, prune), :mod:`.transfer` (pull, push) and :mod:`.doctor`; what they
share, the store the options name and the objects laid out in it (``<prefix>/<scope>/<fingerprint key>/<object
name>.mcb``, :class:`.layout.Layout`), in :mod:`.storeobjects`; the store options themselves in
:mod:`.storeopts` (shared with :mod:`.doctor`).

Errors are one line on stderr, never a traceback: a bad argument or setting exits with 2, a store failure or
anything unexpected with 1. An object that fails validation is refused on a line naming it, and the others are
still processed. A reader that goes away (``pytest-megacache ls --json | head -1``) ends the command quietly
with status 141 (128 + SIGPIPE, as a process the signal killed reports it).

What ``--help`` prints is plain text written for users (:data:`DESCRIPTION`, :data:`EPILOG`, one ``*_HELP`` per
command), not these docstrings.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import StoreError, redact
from . import commands, transfer
from . import doctor as doctormod
from .storeobjects import PROG, UsageProblem
from .storeopts import add_store_options

__all__ = ["main"]

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b?|b)?", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


# --- errors and argument types -----------------------------------------------------------------------


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
    key.set_defaults(func=commands.cmd_key)

    inspect = _command(sub, "inspect", "validate bundles (files or store objects) and list what they hold",
                       INSPECT_HELP)
    inspect.add_argument("paths", nargs="*", metavar="FILE", help="bundle files")
    inspect.add_argument("--store-object", dest="store_objects", action="append", default=[],
                         metavar="SCOPE/FINGERPRINT/NAME", help="fetch this object from the store (repeatable)")
    inspect.add_argument("-v", "--verbose", action="store_true", help="list every entry's name")
    add_store_options(inspect)
    inspect.set_defaults(func=commands.cmd_inspect)

    ls = _command(sub, "ls", "fingerprints per scope: objects, size, ages", LS_HELP)
    _add_filter(ls)
    ls.add_argument("--json", action="store_true", help="a machine-readable list")
    ls.add_argument("-v", "--verbose", action="store_true", help="list every object under its fingerprint")
    ls.add_argument("--duplicates", action="store_true",
                    help="read the objects of each fingerprint and show the bytes its objects hold more than once")
    add_store_options(ls)
    ls.set_defaults(func=commands.cmd_ls)

    prune = _command(sub, "prune", "delete old objects and/or the oldest beyond a size budget (dry run by default)",
                     PRUNE_HELP)
    prune.add_argument("--older-than", type=_days, metavar="DAYS", help="objects last modified more than DAYS ago")
    prune.add_argument("--max-bytes", type=parse_size, metavar="SIZE",
                       help="keep the newest objects within SIZE (500MB, 2GB, bytes) in total; delete the older rest")
    _add_filter(prune, fingerprint=False)
    prune.add_argument("--yes", action="store_true", help="delete (without it: print what would be deleted)")
    add_store_options(prune)
    prune.set_defaults(func=commands.cmd_prune)

    pull = _command(sub, "pull", "copy objects from the store into a local directory store", PULL_HELP)
    pull.add_argument("--to", required=True, metavar="DIR", help="local directory store (created if needed)")
    _add_filter(pull)
    pull.add_argument("-v", "--verbose", action="store_true", help="a line per object copied")
    add_store_options(pull)
    pull.set_defaults(func=transfer.cmd_pull)

    push = _command(sub, "push", "copy objects from a local directory store into the store", PUSH_HELP)
    push.add_argument("--from", dest="from_", required=True, metavar="DIR", help="local directory store")
    _add_filter(push)
    push.add_argument("-v", "--verbose", action="store_true", help="a line per object copied")
    add_store_options(push)
    push.set_defaults(func=transfer.cmd_push)

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
