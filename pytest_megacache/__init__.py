"""pytest-megacache: persist torch.compile caches across CI runs."""

from __future__ import annotations

from .errors import MegacacheError, MegacacheWarning

__version__ = "0.1.0"

__all__ = ["MegacacheError", "MegacacheWarning", "__version__"]
