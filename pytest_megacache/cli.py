"""``pytest-megacache`` / ``python -m pytest_megacache``: cache chores without a pytest session."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import bundle as bundlemod
from .errors import BundleError
from .fingerprint import TorchUnavailable, compute
from .report import human_bytes


def _cmd_key(args: argparse.Namespace) -> int:
    try:
        fp = compute()
    except TorchUnavailable as exc:
        print(f"pytest-megacache: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"key": fp.key, "digest": fp.digest, **fp.parts}, indent=2, sort_keys=True))
    else:
        # Usable as an actions/cache key: no spaces, '/' replaced by '-'.
        print(fp.key.replace("/", "-") if args.flat else fp.key)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    status = 0
    for path in args.paths:
        try:
            with open(path, "rb") as fh:
                header, entries = bundlemod.decode(fh.read())
        except (OSError, BundleError) as exc:
            print(f"{path}: refused: {exc}")
            status = 1
            continue
        print(f"{path}: fingerprint {header.fingerprint}, {header.entries} entries, "
              f"{human_bytes(header.payload_size)} compressed, {human_bytes(header.raw_size)} raw")
        for kind, count in entries.counts().items():
            print(f"  {kind}: {count}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pytest-megacache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    key = sub.add_parser("key", help="print this environment's fingerprint (an actions/cache key)")
    key.add_argument("--json", action="store_true", help="print every part of the fingerprint")
    key.add_argument("--flat", action="store_true", help="replace '/' with '-'")
    key.set_defaults(func=_cmd_key)
    inspect = sub.add_parser("inspect", help="validate bundle files and list what they hold (loads nothing)")
    inspect.add_argument("paths", nargs="+")
    inspect.set_defaults(func=_cmd_inspect)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
