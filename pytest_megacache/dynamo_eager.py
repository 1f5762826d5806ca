"""The stored form of a graph of torch's ``eager`` backend (:mod:`pytest_megacache.dynamo_backends`). It imports
torch: only where such a graph is recorded, or by pickle where one is loaded."""

from __future__ import annotations

from typing import Any

from torch._dynamo.precompile_context import EagerCacheArtifact


class GraphForward(EagerCacheArtifact):
    """A graph of torch's ``eager`` backend, installed as its ``forward`` (what the backend returned)."""

    def after_deserialization(self) -> Any:
        return self.content.forward
