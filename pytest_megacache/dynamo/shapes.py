"""What a frame's trace noted of the shapes it saw (automatic dynamic shapes), noted again where a stored variant of
it is taken instead.

Dynamo notes, per code object, the sizes, strides and integer values of the inputs of every frame it traces
(``torch._dynamo.pgo.update_automatic_dynamic``, into the process's code state, which torch's dynamic-shape profiles
also write): a later trace of that code whose inputs differ marks what differs dynamic. A frame taken from the store
is not traced, so without this a later trace of the same code would find nothing noted and compile a static graph
where, without the plugin, torch compiles a dynamic one (and recompiles once more on the next new size).
:func:`watch_shapes` records each note a trace makes (in its :class:`~.effects.Trace`); the records are stored with
the variant (:func:`~.effects.effects_of`), checked when read back (:func:`read_shapes`), rebuilt as torch's objects
where the variant is about to be taken (:func:`notes_of`, which refuses the variant where one cannot be) and noted
again as torch notes them (:func:`note_again`). A note about the traced frame's own code is keyed by the code that
takes the variant; one about a function the trace inlined, by that function's code id (file content, first line,
name) and, where torch keys a closure by the code of the functions its cells hold (torch 2.12 on), by those
functions' names and code digests, found again where the variant is taken: a trace that noted one whose cells hold
a function no name finds (one made in a function) is not stored.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from .objects import Refused, describe, find
from .patches import PATCHES

FRAME = "frame"  # a note about the traced frame's own code
MAX_NOTES = 256  # per frame traced; a trace that made more is not stored
MAX_DIMS = 64
_SENTINELS = ("auto_dynamic", "auto_unset")  # torch's markers in a note's values, stored by name


_PLAIN = (int, float, bool)  # a noted integer or float input's value (JSON keeps the three apart)


def _encode(value: Any, pgo: Any) -> Any:
    if type(value) in _PLAIN or value is None:
        return value
    for name in _SENTINELS:
        if value is getattr(pgo, name, _SENTINELS):
            return name
    if type(value) is getattr(pgo, "InferStride", None):
        return {"infer": _encode(value.dim, pgo)}
    if type(value) is tuple and len(value) <= MAX_DIMS:
        return [_encode(v, pgo) for v in value]
    raise ValueError(f"a value of type {type(value).__name__} in a shape note")


def _decode(value: Any, pgo: Any, depth: int = 0) -> Any:
    if type(value) in _PLAIN or value is None:
        return value
    if isinstance(value, str) and value in _SENTINELS:
        return getattr(pgo, value)
    if isinstance(value, dict) and set(value) == {"infer"} and type(value["infer"]) is int:
        return pgo.InferStride(value["infer"])
    if isinstance(value, list) and len(value) <= MAX_DIMS and depth == 0:
        return tuple(_decode(v, pgo, 1) for v in value)
    raise Refused("side_effect", "malformed record of the shapes the trace saw")


def encode_entry(entry: Any, pgo: Any) -> dict[str, Any] | None:
    """torch's ``FrameStateSizeEntry`` (or None) as plain data."""
    if entry is None:
        return None
    return {f.name: _encode(getattr(entry, f.name), pgo) for f in dataclasses.fields(entry)}


def _keyed_by_closure(pgo: Any) -> bool:
    """Whether this torch keys a code's record by what its closure's cells hold (2.12 on; 2.11 by the code alone)."""
    return any(f.name == "closure_hash" for f in dataclasses.fields(pgo.CodeId))


def _code_id(pgo: Any, code: Any, closure: Any) -> Any:
    return pgo.CodeId.make(code, closure) if _keyed_by_closure(pgo) else pgo.CodeId.make(code)


def _cells(closure: Any) -> list[Any] | None:
    """What torch's key of a closure hashes (the code of each function a cell holds), as descriptions found again in
    another process (None: no closure); raises where a function has no name to be found by."""
    if not closure:
        return None
    cells: list[Any] = []
    for cell in closure:
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell: torch hashes None for it
            content = None
        if not (callable(content) and hasattr(content, "__code__")):
            cells.append(None)
            continue
        what = describe(content)
        if what is None or what[0] != "function" or find(what) is not content:
            raise ValueError("a closure holding a function no name finds")
        cells.append(what)
    return cells


def _closure_hash(cells: list[Any]) -> int:
    """torch's hash of a closure whose cells :func:`_cells` described, in this process."""
    codes: list[Any] = []
    for what in cells:
        if what is None:
            codes.append(None)
            continue
        found = find(what)
        if found is None:
            raise Refused("side_effect", "a function a closure held when the trace noted its shapes is not there")
        codes.append(found.__code__)
    return hash(tuple(codes))


def _recorded(pgo: Any, code_id: Any) -> Any:
    """What the process's code state holds for ``code_id``, without adding it (the state is a defaultdict)."""
    return pgo.get_code_state().get(code_id)


def _before(state: Any, name: str) -> Any:
    return None if state is None else state.automatic_dynamic.get(name)


def watch_shapes(state: Any, compile_id: Any, pgo: Any) -> None:
    """Records each note the frame being traced makes (``state.traces`` by compile id, as :func:`.effects.watch_warnings`
    records its warnings): torch's ``update_automatic_dynamic`` in ``pgo`` (its module), wrapped once per process."""
    update = getattr(pgo, "update_automatic_dynamic", None)
    code_id = getattr(pgo, "CodeId", None)
    if update is None or code_id is None or getattr(update, "_megacache_watch", False):
        return

    def before(tx: Any, name: str) -> Any:
        """The trace being noted, and what the code state held for ``name`` before this note (encoded)."""
        trace = None
        try:
            current = compile_id()
            trace = state.traces.get(str(current)) if current is not None else None
            if trace is None or trace.shapes is None:
                return None, None
            made = _code_id(pgo, tx.f_code, getattr(tx, "closure", None))
            return trace, encode_entry(_before(_recorded(pgo, made), name), pgo)
        except Exception:  # noqa: BLE001 - watching never changes a trace; a note not recorded leaves it unstored
            if trace is not None:
                trace.shapes = None
            return None, None

    def note(trace: Any, tx: Any, name: str, entry: Any, held: Any) -> None:
        try:
            code = tx.f_code
            if code is trace.code:
                where: Any = FRAME
            else:
                made = _code_id(pgo, code, None)
                where = [str(made.filename), int(made.firstlineno), str(made.name), str(made.file_hash)]
                if _keyed_by_closure(pgo) and (cells := _cells(getattr(tx, "closure", None))) is not None:
                    where.append(cells)
            noted = [where, str(name), encode_entry(entry, pgo), held]
            trace.shapes = [*trace.shapes, noted] if len(trace.shapes) < MAX_NOTES else None
        except Exception:  # noqa: BLE001
            trace.shapes = None

    @functools.wraps(update)
    def update_noted(tx: Any, name: str, entry: Any, *args: Any, **kwargs: Any) -> Any:
        trace, held = before(tx, name)
        result = update(tx, name, entry, *args, **kwargs)
        if trace is not None and trace.shapes is not None:
            note(trace, tx, name, entry, held)
        return result

    update_noted._megacache_watch = True  # type: ignore[attr-defined]
    PATCHES.replace(pgo, "update_automatic_dynamic", update_noted,
                    "what a trace notes of its inputs' shapes is stored with the variant and noted again where taken")


Note = tuple[Any, str, dict[str, Any], "dict[str, Any] | None"]  # where, input name, the note, what was held before


def read_shapes(raw: Any) -> tuple[Note, ...]:
    """The stored notes, checked for their form (plain data of the expected types and sizes); raises
    :class:`Refused` for anything else. Their values are checked where they are rebuilt (:func:`notes_of`)."""
    if not isinstance(raw, list) or len(raw) > MAX_NOTES:
        raise Refused("side_effect", "malformed record of the shapes the trace saw")
    notes: list[Note] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[1], str) and isinstance(item[2], dict)
                and (item[3] is None or isinstance(item[3], dict)) and (item[0] == FRAME or _is_code_id(item[0]))):
            raise Refused("side_effect", "malformed record of the shapes the trace saw")
        notes.append((item[0] if item[0] == FRAME else tuple(item[0]), item[1], item[2], item[3]))
    return tuple(notes)


def _is_code_id(where: Any) -> bool:
    return (isinstance(where, list) and len(where) in (4, 5) and isinstance(where[0], str) and type(where[1]) is int
            and isinstance(where[2], str) and isinstance(where[3], str)
            and (len(where) == 4 or (isinstance(where[4], list) and all(_is_description(c) for c in where[4]))))


def _is_description(cell: Any) -> bool:
    return cell is None or (isinstance(cell, list) and 0 < len(cell) <= 8 and cell[0] == "function"
                            and all(isinstance(part, str) for part in cell[:4]))


def _key(where: Any, code: Any, closure: Any, pgo: Any) -> Any:
    if where == FRAME:
        return _code_id(pgo, code, closure)
    if len(where) == 5:
        return pgo.CodeId(*where[:4], _closure_hash(where[4]))
    return pgo.CodeId(*where)


def fits(notes: tuple[Note, ...], code: Any, closure: Any, pgo: Any) -> bool:
    """Whether the process's code state holds, for every input the trace noted, what it held where the trace began
    (``code`` and ``closure``: the frame about to take the variant). What Dynamo makes static or dynamic is decided by
    that record: where it holds something else (a size seen since, or not yet seen), Dynamo would trace another
    variant than the stored one, and the frame is traced. The first note of each input decides; the later ones of the
    same trace follow from it."""
    seen: set[tuple[Any, str]] = set()
    for where, name, _entry, held in notes:
        key = _key(where, code, closure, pgo)
        if (key, name) in seen:
            continue
        seen.add((key, name))
        if encode_entry(_before(_recorded(pgo, key), name), pgo) != held:
            return False
    return True


def notes_of(notes: tuple[Note, ...], code: Any, closure: Any, pgo: Any) -> list[Any]:
    """The stored notes as torch's (code id, input name, ``FrameStateSizeEntry``), the frame's own keyed by ``code``
    and ``closure`` (the frame about to take the variant); raises :class:`Refused` where one cannot be rebuilt."""
    entry_class = pgo.FrameStateSizeEntry
    names = {f.name for f in dataclasses.fields(entry_class)}
    rebuilt = []
    for where, name, fields, _held in notes:
        if set(fields) != names:
            raise Refused("side_effect", "a record of the shapes the trace saw of another form")
        entry = entry_class(**{k: _decode(v, pgo) for k, v in fields.items()})
        rebuilt.append((_key(where, code, closure, pgo), name, entry))
    return rebuilt


def note_again(notes: list[Any], pgo: Any, config: Any) -> None:
    """What the trace noted, noted again into the process's code state, as torch's ``update_automatic_dynamic``
    notes it (where automatic dynamic shapes are on: the compile context, in the variant's identity, says they
    were so where it was traced)."""
    if not notes or not getattr(config, "automatic_dynamic_shapes", False):
        return
    state = pgo.get_code_state()
    for key, name, entry in notes:
        state[key].automatic_dynamic[name] |= entry
