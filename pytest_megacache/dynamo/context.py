"""What a compiled variant was compiled *under*, besides its code and guards: the compile context.

Dynamo's guards check the frame's inputs and the global state it reads (grad mode, autocast, ...), not the
``torch.compile`` call that traced the frame: its backend and mode, ``fullgraph``, and the Dynamo, Inductor and
AOTAutograd configuration of the moment. In one process torch keeps each wrapper's compiled frames apart by backend
(a cache entry is used only under an equal backend), and a change of configuration after a reset is traced again.
A stored variant must be kept apart the same way: :func:`compile_context` digests all of it where Dynamo is about to
trace a frame, the digest is stored with the variant, and a variant is offered only where Dynamo is about to trace
under an equal digest. A backend that cannot be named in another process (a function of a test's own, an object) has
no context: its frames are never stored. Nor, where reuse is on by default rather than asked for, has a backend that
is not torch's own (:func:`torch_own`).
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

from .objects import describe

# Where torch keeps the configuration that decides what Dynamo, AOTAutograd and Inductor build.
CONFIG_MODULES = ("torch._dynamo.config", "torch._functorch.config", "torch._inductor.config")
# Settings that decide how many processes compile, not what is compiled: the plugin itself compiles with one thread
# where the restored cache covers the selection. And settings that hold where something is, which torch keeps out of
# its own FX-graph key for that reason ("uses absolute path", Inductor's ``_cache_config_ignore_prefix``): CUTLASS's
# folder below torch's install (another virtual environment's folder), or the current directory where its variable is
# unset (``xpu.cutlass_dir`` is the real path of ""); in the key, a checkout in another folder, or a virtual
# environment inside it, took nothing from the store. What the folder holds is torch's own, in the fingerprint.
NOT_COMPILED = frozenset({"compile_threads", "worker_start_method", "cuda.cutlass_dir", "cutlass.cutlass_dir",
                          "xpu.cutlass_dir"})


def innermost_backend(compiler_fn: Any) -> Any:
    """The backend a compile was asked for, below torch's wrappers (``_torchdynamo_orig_backend``)."""
    seen = 0
    while hasattr(compiler_fn, "_torchdynamo_orig_backend") and seen < 32:
        compiler_fn = compiler_fn._torchdynamo_orig_backend
        seen += 1
    return compiler_fn


# torch._dynamo.explain's recorder of graphs: a function it makes for each explanation, in torch's module
EXPLAIN_RECORDER = ("torch._dynamo.eval_frame", "explain.<locals>.inner.<locals>.dynamo_graph_accumulating_compiler")


def explain_recorder(backend: Any) -> bool:
    """Whether ``backend`` is ``torch._dynamo.explain``'s recorder of graphs: torch's own, though made anew for each
    explanation; what it records is given to it again where an explanation takes a stored frame (:mod:`.backends`)."""
    return (getattr(backend, "__module__", None), getattr(backend, "__qualname__", None)) == EXPLAIN_RECORDER


def describe_backend(backend: Any) -> list[Any] | None:
    """The backend as a description that means the same backend in another process, or None. torch.compile's own
    wrappers are described by what their equality compares (the compiler, mode and options, ``dynamic``), explain's
    recorder as itself."""
    if explain_recorder(backend):
        return ["explain"]
    kind = type(backend).__name__
    if kind == "_TorchCompileInductorWrapper":
        return ["inductor", repr(getattr(backend, "name", "inductor")), repr(sorted(backend.config.items())),
                repr(backend.dynamic)]
    if kind == "_TorchCompileWrapper":
        inner = describe(backend.compiler_fn)
        if inner is None:
            return None
        return ["wrapper", repr(backend.compiler_name), inner, repr(sorted(backend.kwargs.items()))]
    if callable(backend) and getattr(backend, "__closure__", None) is None:
        what = describe(backend)
        # a plain function found by name (torch's registered backends); a function made in a test is not
        return what if what is not None and "<locals>" not in str(what[2:3]) else None
    return None


def canonical(value: Any) -> str:
    """A text of a configuration value that is the same in every process for the same value: sets and dicts in a
    sorted order (their order follows string hashing, which differs between processes). A value whose text names an
    address differs between processes: a miss, never a wrong hit."""
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(canonical(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(sorted(f"{canonical(k)}:{canonical(v)}" for k, v in value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "[" + ",".join(canonical(v) for v in value) + "]"
    return repr(value)


_DIGESTS: dict[str, tuple[Any, str]] = {}  # per configuration module: torch's own hash then, the digest


def config_digests() -> list[str]:
    """A digest of each configuration module's settings that compiles do not ignore (torch's own ``get_hash`` differs
    between processes: it hashes the text of sets)."""
    digests = []
    for name in CONFIG_MODULES:
        module = sys.modules.get(name)
        if module is None:
            digests.append("none")
            continue
        current = module.get_hash()  # cached by torch until a setting changes
        cached = _DIGESTS.get(name)
        if cached is None or cached[0] != current:
            values = module._get_dict(ignored_keys=[*module._compile_ignored_keys, *NOT_COMPILED])
            text = canonical(values).encode("utf-8", "surrogatepass")
            cached = _DIGESTS[name] = (current, hashlib.sha256(text).hexdigest())
        digests.append(cached[1])
    return digests


def torch_own(backend: list[Any]) -> bool:
    """Whether a backend described by :func:`describe_backend` is torch's own: Inductor, explain's recorder (what it
    records is given to it again), or a function of torch's modules (its registered backends, ``eager`` among them),
    which compile what they are given and record nothing a test could read. A function of a suite's own may count or
    record what it is given: a frame taken from the store never calls it."""
    kind = backend[0]
    if kind in ("inductor", "explain"):
        return True
    what = backend[2] if kind == "wrapper" else backend
    module = str(what[1]) if isinstance(what, list) and len(what) > 1 and what[0] == "function" else ""
    return module == "torch" or module.startswith("torch.")


def compile_context(compiler_fn: Any, one_graph: bool, export: bool, any_backend: bool = True) -> str | None:
    """The digest of what a frame is compiled under, or None where its backend cannot be named (or, unless
    ``any_backend``, is not torch's own: :func:`torch_own`)."""
    try:
        backend = describe_backend(innermost_backend(compiler_fn))
    except Exception:  # noqa: BLE001 - a backend that does not describe itself: no context
        return None
    if backend is None or not (any_backend or torch_own(backend)):
        return None
    text = repr([backend, bool(one_graph), bool(export), *config_digests()])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
