"""What Dynamo reuse (:mod:`pytest_megacache.dynamo`) checks a stored entry against, without torch:

- **Code.** :func:`source_id` is a compiled function's entry id: its module, path relative to the rootdir,
  qualname, first line and code digest (:mod:`~pytest_megacache.dynamo.objects`).
- **Identity guards.** :func:`prove` builds the proof stored for a guard on the identity of an object reached by a
  path (:mod:`~pytest_megacache.dynamo.paths`) from the frame's globals
  (:mod:`~pytest_megacache.dynamo.proof_globals`) or locals (:mod:`~pytest_megacache.dynamo.proof_locals`): what
  that object was. :func:`pack_guards` stores the proofs with torch's guard state and :func:`unpack_guards` reads
  them back; :func:`check_proofs` checks them against the objects the paths name when the entry is loaded.

What cannot be proven, or no longer holds, raises :class:`Refused`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from .effects import Effects, read_effects
from .objects import Refused, code_digest, describe, describe_member, find, function_of
from .paths import parse_path, path_text, resolve, rooted_at
from .proof_globals import check_global, prove_global
from .proof_locals import check_local, prove_local

__all__ = ["Refused", "Stored", "check_proofs", "code_digest", "describe", "describe_member", "find", "function_of",
           "guards_digest", "pack_guards", "parse_path", "prove", "prove_class", "relative_file", "resolve", "source_id",
           "tag_of_test",
           "unpack_guards"]

# the stored guards' format; a variant stored in an earlier one is refused (5: the globals its trace installed are
# proven, without which a variant read a global it could not bind)
_MAGIC = b"megacache-guards-5\n"
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class created at run time (a class statement), not defined in C
_ID_PREFIX = b"pytest-megacache dynamo entry 4\0"
MAX_SECONDS = 86_400.0  # what a stored variant may say its trace took (an unverified input when read)
# pack_guards's last keys (the seconds, and those of them its trace took without its backend's compile), and the
# header's end
_SECONDS_TAIL = re.compile(rb',"seconds":[0-9.eE+\-]+(?:,"traced":[0-9.eE+\-]+)?}')


def relative_file(filename: str, rootdir: str) -> str:
    """``filename`` relative to the rootdir (symbolic links resolved), or "" where it lies outside it."""
    try:
        path = os.path.realpath(filename)
        root = os.path.realpath(rootdir)
        if rootdir and os.path.commonpath([path, root]) == root:
            return os.path.relpath(path, root)
    except ValueError:
        pass
    return ""  # outside the project: the module name stands for it (an absolute path differs between machines)


def source_id(fn: Any, rootdir: str) -> str:
    """The entry id of a compiled function (as torch's ``innermost_fn`` gives it): module, path relative to the
    rootdir, qualname, first line, code."""
    func = function_of(fn)
    code = func.__code__
    h = hashlib.sha256(_ID_PREFIX)
    for part in (getattr(func, "__module__", "") or "", relative_file(code.co_filename, rootdir),
                 getattr(func, "__qualname__", code.co_name), str(code.co_firstlineno), code_digest(code)):
        h.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


# --- proofs for identity guards ---------------------------------------------------------------------------------
def prove(name: str, obj: Any, scope: dict[str, Any], local_scope: dict[str, Any] | None = None) -> dict[str, Any]:
    """The proof stored for an identity guard on ``name`` (whose object is ``obj``), from the frame's globals
    (``scope``) or locals; raises :class:`Refused`."""
    steps = parse_path(name)
    if steps is None:
        raise Refused("unsupported_guard", f"an identity guard on {name}, a source no proof reads")
    local = rooted_at(steps) == "local"
    if local and local_scope is None:
        raise Refused("unsupported_guard", f"an identity guard on {name}, without the frame's locals")
    here = local_scope if local and local_scope is not None else scope
    try:
        reached = resolve(steps, here) is obj
    except Exception:  # noqa: BLE001 - a path that does not resolve the same way cannot be proven
        reached = False
    if not reached:
        raise Refused("unsupported_guard", f"an identity guard on {name} that its path does not reach")
    return prove_local(name, steps, obj) if local else prove_global(name, steps, obj, scope)


def prove_class(name: str, cls: type) -> dict[str, Any]:
    """The proof stored for a guard on the type of ``name`` (``TYPE_MATCH``): torch rebuilds it on the class its
    module and qualname name at load, which must have the same definition (an edited or ``monkeypatch``-ed method
    refuses it)."""
    if not cls.__flags__ & _HEAP_TYPE:
        return {}  # a class defined in C (``dict``, ``mappingproxy``): fixed by the build, which is in the key
    what = describe(cls)
    if what is None or find(what) is not cls:
        raise Refused("unsupported_guard", f"a guard on the type of {name}, {cls.__qualname__}, which has no name")
    return {"class": what}


def check_proofs(proofs: list[dict[str, Any]], scope: dict[str, Any], local_scope: dict[str, Any] | None = None,
                 bind: Callable[[str, Any], None] | None = None) -> None:
    """Raises :class:`Refused` unless every proof's path names an object described as stored: from the module's
    globals (``scope``; ``bind`` puts a global of the tracing process back) or the locals torch loaded."""
    for proof in proofs:
        if "class" in proof:
            if find([str(part) for part in proof["class"]]) is None:
                raise Refused("class_changed", f"{'.'.join(proof['class'][1:3])} is not the class traced")
            continue
        steps = [(str(kind), str(name)) for kind, name in proof["path"]]
        if rooted_at(steps) == "global":
            check_global(proof, steps, scope, bind)
        elif local_scope is None:
            raise Refused("local_changed", f"{path_text(steps)}: the locals were not loaded")
        else:
            check_local(proof, steps, local_scope)


class Stored(NamedTuple):
    """A variant's stored guards as :func:`unpack_guards` reads them."""

    proofs: list[dict[str, Any]]
    context: str
    guards_state: bytes  # torch's
    origin: tuple[str, bool]  # the tag of the test it was traced in, and whether it replaced one passed over there
    effects: Effects
    seconds: float  # what its trace and compile took where it was traced
    # the modules whose functions its trace inlined or imported (None: not recorded, so any of the entry's)
    modules: frozenset[str] | None = None
    traced: float = 0.0  # what its trace took without its backend's compile (0 where not recorded)


def pack_guards(proofs: list[dict[str, Any]], context: str, guards_state: bytes, test: str = "",
                retraced: bool = False, effects: dict[str, Any] | None = None, seconds: float | None = None,
                modules: list[str] | None = None, traced: float | None = None) -> bytes:
    """torch's guard state with the proofs of its identity guards, the digest of the context it was compiled in
    (:func:`pytest_megacache.dynamo.context.compile_context`), the tag of the test it was traced in
    (:func:`tag_of_test`; empty outside a test), whether it was traced in place of a stored variant of that test that
    was passed over (``retraced``: :func:`pytest_megacache.dynamo.offers.superseded`), what its trace did that a
    test can see (``effects``: :func:`pytest_megacache.dynamo.effects.effects_of`), the modules whose functions it
    inlined or imported (``modules``: a stored entry's variants are taken without those that need a module not there
    yet), the seconds its trace and compile took (``seconds``: what a later run that takes it is spared) and those of
    them that its backend's compile did not take (``traced``: what a run without reuse, whose backend hits torch's
    caches, spends again; neither is part of the variant's identity, :func:`guards_digest`)."""
    fields: dict[str, Any] = {"proofs": proofs, "context": context, **({"test": test} if test else {}),
                              **({"retraced": True} if retraced else {}), **({"effects": effects} if effects else {}),
                              **({"modules": sorted(modules)} if modules is not None else {})}
    if seconds is not None and math.isfinite(seconds) and seconds >= 0:
        fields["seconds"] = round(min(seconds, MAX_SECONDS), 3)  # last: guards_digest leaves it out
        if traced is not None and math.isfinite(traced) and 0 <= traced <= seconds:
            fields["traced"] = round(traced, 3)  # and this after it
    header = json.dumps(fields, separators=(",", ":")).encode()
    return _MAGIC + len(header).to_bytes(8, "big") + header + guards_state


def guards_digest(data: bytes) -> str:
    """The digest of a variant's stored guards as :func:`pack_guards` wrote them: proofs, context and torch's guard
    state, so one variant has one digest wherever it is named (an offer, the merge's variants to leave out, two
    packages' copies of it). The seconds its trace took are left out: the same variant traced in two runs is one."""
    return hashlib.sha256(_identity(bytes(data))).hexdigest()


def _identity(data: bytes) -> bytes:
    """``data`` as :func:`pack_guards` would have written it without the seconds: the header's last keys, cut from its
    text (a JSON key's quotes are never escaped, and a nested one is followed by more than one brace), not parsed,
    since every variant's digest is taken wherever one is named."""
    start = len(_MAGIC) + 8
    if not data.startswith(_MAGIC) or len(data) < start:
        return data
    end = start + int.from_bytes(data[len(_MAGIC):start], "big")
    at = data.rfind(b',"seconds":', start, end)
    if at < 0 or not _SECONDS_TAIL.fullmatch(data, at, end):
        return data
    header = data[start:at] + b"}"
    return _MAGIC + len(header).to_bytes(8, "big") + header + data[end:]


def tag_of_test(nodeid: str) -> str:
    """What a stored variant keeps of the test it was traced in: a digest of its id (an id may carry a parameter's
    value)."""
    return hashlib.sha256(nodeid.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def reason_of(exc: BaseException) -> str:
    """The refusal reason of what failed while a frame was stored or loaded."""
    if isinstance(exc, Refused):
        return exc.reason
    if isinstance(exc, ImportError):
        return "missing_module"
    if isinstance(exc, RuntimeError) and "Source code changes detected" in str(exc):
        return "code_changed"
    if isinstance(exc, (pickle.PickleError, AttributeError, EOFError)):
        return "unpicklable"
    return "torch_error"


def unpack_guards(data: bytes) -> Stored:
    """The proofs, the compile context, torch's guard state, where the variant was traced (the tag of its test, ""
    where none was recorded, and whether it was traced in place of a variant of that test passed over there), what
    its trace did that a test can see, the seconds it took (0 where none were recorded), the modules it needs
    (None where not recorded) and the seconds of its trace without its backend's compile (0 where not recorded);
    raises :class:`Refused` for guards stored without proofs, or a malformed record."""
    if not isinstance(data, (bytes, bytearray)) or not bytes(data[:len(_MAGIC)]) == _MAGIC:
        raise Refused("unsupported_guard", "guards stored without the plugin's proofs")
    start = len(_MAGIC) + 8
    size = int.from_bytes(data[len(_MAGIC):start], "big")
    header = json.loads(bytes(data[start:start + size]))
    proofs = header.get("proofs") if isinstance(header, dict) else None
    context = header.get("context") if isinstance(header, dict) else None
    if not isinstance(proofs, list) or not isinstance(context, str) or not all(
            isinstance(p, dict) and (("path" in p and "is" in p) or "class" in p) for p in proofs):
        raise Refused("unsupported_guard", "malformed proofs")
    test = header.get("test", "")
    origin = (test if isinstance(test, str) else "", header.get("retraced") is True)
    seconds = header.get("seconds")
    ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds <= MAX_SECONDS
    traced = header.get("traced")
    traced_ok = ok and isinstance(traced, (int, float)) and not isinstance(traced, bool) and 0 <= traced <= seconds
    modules = header.get("modules")
    needs = frozenset(modules) if isinstance(modules, list) and all(isinstance(m, str) for m in modules) else None
    return Stored(proofs, context, bytes(data[start + size:]), origin, read_effects(header.get("effects")),
                  float(seconds) if ok else 0.0, needs, float(traced) if traced_ok else 0.0)
