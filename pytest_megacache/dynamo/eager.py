"""The stored forms of compiled graphs that torch's caching precompile has none of its own for
(:mod:`pytest_megacache.dynamo.backends`). It imports torch: only where such a graph is recorded, or by pickle where
one is loaded."""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.precompile_context import BackendCacheArtifact, EagerCacheArtifact


class GraphForward(EagerCacheArtifact):
    """A graph of torch's ``eager`` backend, installed as its ``forward`` (what the backend returned)."""

    def after_deserialization(self) -> Any:
        return self.content.forward


class DispatchOff(BackendCacheArtifact[Any]):
    """A compiled graph that torch runs with tensor-subclass dispatch off (Dynamo inlined a ``__torch_function__``):
    the artifact torch recorded for it, whose backend is installed so again."""

    def after_deserialization(self) -> Any:
        backend = self.content.after_deserialization()

        def dispatch_off(*args: Any, **kwargs: Any) -> Any:
            with torch._C.DisableTorchFunctionSubclass():
                return backend(*args, **kwargs)

        return dispatch_off
