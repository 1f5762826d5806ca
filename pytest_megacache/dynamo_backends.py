"""What a stored frame's compiled graphs are, where torch's caching precompile stores none of its own (no torch
imported until :func:`eager_graphs_stored` runs).

- **Graphs of torch's ``eager`` backend.** torch stores a frame's compiled graph as the AOTAutograd entry that
  Inductor's compile bundled; ``backend="eager"`` (common in test suites: it checks what Dynamo traces without paying
  Inductor) compiles nothing, so no variant of such a frame had a backend to store and every one was traced again in
  every run. That backend's compiled graph *is* Dynamo's FX graph, run by its generated ``forward``: the graph is
  stored as torch's own ``EagerCacheArtifact`` holds one, and installed as its ``forward``, the callable the backend
  returned (calling the module would run global module hooks that the traced frame did not). Only where the compile
  asked for torch's ``eager`` function itself (a backend of a test's own that returns the graph may count or record
  what it is given: it must run), the graph was not wrapped after the backend returned it (below), and it pickles.
- **A graph torch wraps after its backend returned it** (:func:`wrapped_after_backend`): where Dynamo inlined a
  tensor subclass's ``__torch_function__`` it runs the compiled graph with subclass dispatch disabled (else the
  subclass would handle each operation twice), and where a shape was specialized it dispatches between specialized
  graphs. torch records the backend before either wrapper, and its install puts the bare backend in place: such a
  frame is not stored (``unsupported backend``), whatever its backend.
"""

from __future__ import annotations

import functools
import pickle
import weakref
from typing import Any

__all__ = ["eager_graphs_stored", "wrapped_after_backend"]

_EAGER_GRAPHS: weakref.WeakSet[Any] = weakref.WeakSet()  # graphs torch's eager backend returned as they were


def wrapped_after_backend(output_graph: Any) -> bool:
    """Whether torch wraps the frame's compiled graphs after their backend returned them (see above)."""
    if getattr(output_graph, "torch_function_subclass_inlined", False):
        return True
    shape_env = getattr(getattr(getattr(output_graph, "tracing_context", None), "fake_mode", None), "shape_env", None)
    return bool(getattr(shape_env, "specializations", None))


def _torch_eager(compiler_fn: Any, innermost_backend: Any) -> bool:
    from torch._dynamo.backends.debugging import eager

    backend = innermost_backend(compiler_fn)
    if type(backend).__name__ == "_TorchCompileWrapper":
        backend = getattr(backend, "compiler_fn", None)
    return backend is eager


def eager_graphs_stored(output_graph: Any, package: Any, innermost_backend: Any) -> None:
    """Records the graph of each compile by torch's ``eager`` backend as the backend torch stores with the frame
    (``package.CompilePackage.add_backend_id`` is where torch names a frame's compiled graph; it is called only under
    caching precompile)."""
    from torch._dynamo.precompile_context import PrecompileContext

    from .dynamo_eager import GraphForward

    call_user_compiler = getattr(output_graph, "call_user_compiler", None)
    add_backend_id = getattr(getattr(package, "CompilePackage", None), "add_backend_id", None)
    if call_user_compiler is None or add_backend_id is None or getattr(add_backend_id, "_megacache_eager", False):
        return

    @functools.wraps(call_user_compiler)
    def compiled_by(self: Any, gm: Any, *args: Any, **kwargs: Any) -> Any:
        compiled = call_user_compiler(self, gm, *args, **kwargs)
        try:
            if (getattr(compiled, "__self__", None) is gm and _torch_eager(self.compiler_fn, innermost_backend)
                    and not getattr(self, "export", False)):
                _EAGER_GRAPHS.add(gm)
        except Exception:  # noqa: BLE001 - a graph not recorded is a variant not stored
            pass
        return compiled

    @functools.wraps(add_backend_id)
    def named(self: Any, backend_id: str, backend: Any = None) -> None:
        add_backend_id(self, backend_id, backend)
        gm = getattr(backend, "__self__", None)
        try:
            if gm is not None and gm in _EAGER_GRAPHS:
                pickle.dumps(gm)  # one that does not pickle is not recorded: only its variant is not stored
                PrecompileContext.record_artifact(GraphForward(key=backend_id, content=gm))
        except Exception:  # noqa: BLE001
            pass

    named._megacache_eager = True  # type: ignore[attr-defined]
    output_graph.call_user_compiler = compiled_by
    package.CompilePackage.add_backend_id = named
