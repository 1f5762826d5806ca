"""The registry of Dynamo reuse's patches of torch (:mod:`..patches`: each a named :class:`Patch`, undone last first):
:func:`.uninstall` removes them all, and only them, so that torch's functions are torch's own again (a session that
turns reuse off, a test). No torch imported here.
"""

from __future__ import annotations

from ..patches import Patch, Patches

__all__ = ["PATCHES", "Patch", "Patches"]

PATCHES = Patches()
