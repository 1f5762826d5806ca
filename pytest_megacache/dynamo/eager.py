"""The stored forms of compiled graphs that torch's caching precompile has none of its own for
(:mod:`pytest_megacache.dynamo.backends`). It imports torch: only where such a graph is recorded, or by pickle where
one is loaded.

A graph is stored node by node (torch's ``GraphPickler``), not as pickle stores a ``GraphModule``: that keeps only
the module's Python code and traces it again where it is loaded, and a trace drops every call made for its effect
alone (``torch._C._set_grad_enabled(False)`` of a ``torch.no_grad()`` block, say), so a graph taken from the store
ran that block with grad on. A graph whose code is not the same once loaded is not stored (:func:`graph_bytes`).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

import torch
from torch._dynamo.precompile_context import BackendCacheArtifact, EagerCacheArtifact

# Node metadata kept with a stored graph: where the user's code made each node. The rest holds the trace's own objects
# (example inputs, real ones among them: a model's parameters, by weak reference), which a stored graph must not hold.
KEPT_METADATA = frozenset({"stack_trace"})


def graph_loaded(data: bytes) -> Any:
    """A graph stored by :func:`graph_bytes`, with its code."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gm: Any = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    gm.recompile()
    return gm


def graph_bytes(gm: Any) -> bytes:
    """``gm`` stored node by node (see above); raises where it cannot be, or where what loads is not the same code."""
    from torch.fx._graph_pickler import GraphPickler, Options

    # every operation stored by name (torch's default keeps only aten's); the metadata kept stripped here, as torch's
    # releases that have no option for it store all of it
    names = {field.name for field in dataclasses.fields(Options)}
    unset: dict[str, Any] = {name: None for name in ("ops_filter", "node_metadata_key_filter") if name in names}
    options = Options(**unset)
    metas = [(node, node.meta) for node in gm.graph.nodes]
    try:
        for node, meta in metas:
            node.meta = {key: value for key, value in meta.items() if key in KEPT_METADATA}
        data = GraphPickler.dumps(gm, options)
    finally:
        for node, meta in metas:
            node.meta = meta
    if graph_loaded(data).code != gm.code:
        raise ValueError("the graph's code is not the same once loaded")
    return data


def _stored_graph(content: Any) -> Any:
    if not isinstance(content, (bytes, bytearray)):
        # a GraphModule as pickle stores it (an earlier form): loaded, it would lack the calls made for their effect
        raise ValueError("a graph stored in a form that drops calls made for their effect")
    return graph_loaded(bytes(content))


class GraphForward(EagerCacheArtifact):
    """A graph of torch's ``eager`` backend, installed as its ``forward`` (what the backend returned)."""

    def after_deserialization(self) -> Any:
        return _stored_graph(self.content).forward


class Explained:
    """A graph of ``torch._dynamo.explain``'s recorder, as installed: handed to the recorder of the explanation that
    takes its frame (:meth:`handed`), as explain's trace hands it, and run as what the recorder returned."""

    __slots__ = ("fn", "gm", "handed_once")

    def __init__(self, gm: Any) -> None:
        self.gm, self.fn, self.handed_once = gm, gm.forward, False

    def handed(self, recorder: Any) -> None:
        """Hand the graph to ``recorder`` (explain's backend), a copy of it after the first time: each trace gives
        an explanation a graph of its own."""
        gm = copy.deepcopy(self.gm) if self.handed_once else self.gm
        self.handed_once = True
        self.fn = recorder(gm, [])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _user_stack(gm: Any) -> list[Any]:
    return list(getattr(getattr(gm, "compile_subgraph_reason", None), "user_stack", None) or [])


def explained_content(gm: Any) -> tuple[bytes, list[str | None]]:
    """What is stored of a graph of explain's recorder: the graph (:func:`graph_bytes`), and for each frame of the
    user's stack its reason for the graph names (where its break is), the module of that frame's file, where one is
    loaded from it: the file is named where it is loaded (a checkout or a virtual environment in another folder)."""
    stack = _user_stack(gm)
    if stack and len(sys.modules) != _FILES[0]:  # made again where modules were loaded since
        _FILES[:] = [len(sys.modules), {path: name for name, module in reversed(list(sys.modules.items()))
                                        if isinstance(path := getattr(module, "__file__", None), str)}]
    return graph_bytes(gm), [_FILES[1].get(str(frame.filename)) for frame in stack]


_FILES: list[Any] = [-1, {}]  # the number of modules loaded, and the module of each file (a code's co_filename)


def _files_named_here(gm: Any, modules: list[str | None]) -> Any:
    for frame, name in zip(_user_stack(gm), modules, strict=True):
        path = getattr(sys.modules.get(name), "__file__", None) if name else None
        if isinstance(path, str):
            frame.filename = path
    return gm


class ExplainedGraph(EagerCacheArtifact):
    """A graph of ``torch._dynamo.explain``'s recorder (it returns the graph's ``forward``), with the modules of its
    reason's user stack (:func:`explained_content`)."""

    def after_deserialization(self) -> Any:
        data, modules = self.content
        return Explained(_files_named_here(_stored_graph(data), list(modules)))


class DispatchOff(BackendCacheArtifact[Any]):
    """A compiled graph that torch runs with tensor-subclass dispatch off (Dynamo inlined a ``__torch_function__``):
    the artifact torch recorded for it, whose backend is installed so again."""

    def after_deserialization(self) -> Any:
        backend = self.content.after_deserialization()

        def dispatch_off(*args: Any, **kwargs: Any) -> Any:
            with torch._C.DisableTorchFunctionSubclass():
                return backend(*args, **kwargs)

        dispatch_off.explained = backend if isinstance(backend, Explained) else None  # type: ignore[attr-defined]
        return dispatch_off
