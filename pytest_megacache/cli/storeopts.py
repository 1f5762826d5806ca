"""The store options of the ``pytest-megacache`` commands, for :mod:`.cli` (and :mod:`.storeobjects`, which resolves
them) and :mod:`.doctor` alike.

Each store setting of :mod:`.settings` (bucket, directory, prefix, endpoint URL) has a short flag here (``--bucket``,
``--dir``, ...) beside the plugin's own (``--megacache-bucket``, ...), both stored under the setting's name, so that
:func:`.settings.resolve` reads a command's arguments as it reads a pytest command line (then ``MEGACACHE_*``).
:func:`cli_flags` rewrites a settings error, which names the plugin's flags, with the short ones.

Imports only :mod:`.settings` and the standard library.
"""

from __future__ import annotations

import argparse
import re

from ..settings import OPTIONS, Settings

__all__ = ["CLI_FLAGS", "STORE_FIELDS", "add_store_options", "cli_flags"]

# The command's own flag for each store setting.
CLI_FLAGS = {"bucket": "--bucket", "directory": "--dir", "prefix": "--prefix", "endpoint_url": "--endpoint-url"}
STORE_FIELDS = tuple(CLI_FLAGS)


def add_store_options(parser: argparse.ArgumentParser) -> None:
    """The ``store`` group of options: the short flag and the plugin's flag for each store setting."""
    group = parser.add_argument_group("store", "each falls back to its MEGACACHE_* environment variable")
    group.add_argument(CLI_FLAGS["bucket"], "--megacache-bucket", dest="bucket", metavar="NAME",
                       help="S3 bucket (MEGACACHE_BUCKET); credentials come from boto3's usual chain")
    group.add_argument(CLI_FLAGS["directory"], "--megacache-dir", dest="directory", metavar="DIR",
                       help="local directory store (MEGACACHE_DIR)")
    group.add_argument(CLI_FLAGS["prefix"], "--megacache-prefix", dest="prefix", metavar="PREFIX",
                       help=f"key prefix (MEGACACHE_PREFIX; default: {Settings().prefix})")
    group.add_argument(CLI_FLAGS["endpoint_url"], "--megacache-endpoint-url", dest="endpoint_url", metavar="URL",
                       help="S3-compatible endpoint (MEGACACHE_ENDPOINT_URL; AWS_ENDPOINT_URL_S3 works too)")


def cli_flags(message: str) -> str:
    """``message`` (from the plugin's settings) with each store option's plugin flag replaced by the command's."""
    for opt in OPTIONS:
        if opt.name in CLI_FLAGS:
            message = re.sub(re.escape(opt.flag) + r"(?![\w-])", CLI_FLAGS[opt.name], message)
    return message
