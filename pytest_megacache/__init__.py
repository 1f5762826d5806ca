"""pytest-megacache: persist torch.compile caches across CI runs.

Importing the package imports nothing else: child processes of a session import :mod:`.children` at their start
(the package's ``.pth`` line), which runs this first. The exception types come from :mod:`.errors` when first used.
"""

TYPE_CHECKING = False  # typing is not imported at run time
if TYPE_CHECKING:
    from .errors import MegacacheError, MegacacheWarning

__version__ = "0.1.0"

__all__ = ["MegacacheError", "MegacacheWarning", "__version__"]


def __getattr__(name: str) -> object:
    if name in ("MegacacheError", "MegacacheWarning"):
        from . import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
