"""torch's CPU vector-ISA load check, run once per library and loader instead of once per process.

Each process that compiles for the CPU asks torch which vector ISAs work (``cpu_vec_isa.valid_vec_isa_list()``).
For each candidate the CPU's flags allow, torch builds a small library into ``TORCHINDUCTOR_CACHE_DIR`` (skipped
when it is there: torch keys it by its code, the ISA flags, the compiler's version and torch's version) and then
checks that it *loads*: a new Python process runs ``VecISA._avx_py_load``, ``cdll.LoadLibrary`` on it (torch
<= 2.12 imports torch in that process first, measured at 32-41 s per pytest process on an H200 host with torch 2.11;
torch 2.13 does not, 0.5 s here). Only that check is repeated by every process, xdist worker and warm run.

What this module does, when the session armed it: it replaces the ``subprocess`` name in torch's
``cpu_vec_isa`` module (only there) by a proxy that recognises exactly that check (``[sys.executable, "-c",
<torch's own template with one library path>]``) and lets every other call through. When the check succeeds, it
writes a marker next to the library (``<library>.<identity prefix>`` + :data:`MARKER_SUFFIX`) holding the library's SHA-256 and a
hash of what the load depends on (:func:`loader_identity`). A later process whose library has the same bytes and
whose identity is the same takes the marker for the check's result instead of running it again. Anything else (no
marker, a different library, torch, interpreter, C library, CPU flags or loader variables, a marker that is not
exactly what this module writes) runs torch's check as before; a failed check writes nothing, so a failure is
never remembered and never skipped. torch's config is not touched (``cpp.vec_isa_ok`` is part of every FX graph's
key): torch decides the same ISAs, flags and keys (tests/test_isaprobe.py compares them in fresh processes).

The markers live in the cache directory, so they travel with the libraries (``file/inductor`` entries) and a
warm run on a fresh runner of the same kind skips the checks too. No exception of this module's own reaches
torch: any doubt runs the check.

Child processes of a session (``subprocess``, ``multiprocessing`` spawn, torchrun's ranks, a DataLoader worker that
compiles) run the same check. :func:`arm` names, in :data:`CHILD_ENV`, a digest of what decides the check and its
answer in the session's process (:func:`decision_digest`: the ISA torch picks, the CPU's code-generation flags, the
C++ compiler and the build and loader variables, the compiler settings, the interpreter). A child inherits it;
at its first ``import torch`` (:mod:`.children`) it puts the same proxy into torch's ``cpu_vec_isa`` with a gate
(:func:`arm_child`): at the child's first check the child computes the digest from its own environment, and only
an equal digest lets it take a record; any other child runs torch's check as before and writes no record (its
checks are still counted, for its record in the session's report). The record itself is checked in the child as in
the session's process (library bytes and the child's own loader identity).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from .fsutil import read_regular, write_atomic
from .patches import PATCHES

__all__ = ["CHILD_ENV", "MARKER_SUFFIX", "MODULE", "TORCH_RECORDS_NOTE", "TORCH_RECORD_SUFFIX", "ProbeProxy", "arm",
           "arm_child", "check_seconds", "counts", "decision_digest", "disarm", "install", "loader_identity",
           "marker_path", "record", "reset_counts", "reusable", "torch_records_itself", "uninstall"]

MODULE = "torch._inductor.cpu_vec_isa"
PLACEHOLDER = "__lib_path__"  # where torch's template takes the library's path
MARKER_SUFFIX = ".megacache-loads.json"
# torch 2.14 and later record a check that succeeded themselves: an empty <library>.load_ok beside the library
# (see torch_records_itself). Which ISAs are checked at all is still decided by the CPU's own flags first
# (cpu_vec_isa.valid_vec_isa_list: a candidate the CPU lacks is never checked, so its record is never read).
TORCH_RECORD_SUFFIX = ".load_ok"
RUNS_EVERYWHERE = "torch's vector-ISA check runs in every process: "
TORCH_RECORDS_NOTE = ("torch's vector-ISA check records its own successes (a .load_ok file beside each check's library "
                      "in the Inductor cache directory): those records travel with the cache, and a check runs only "
                      "for an ISA this CPU has and no record covers")
# Set by a session that reuses the check, for the processes it starts: the digest of what decides the check there.
CHILD_ENV = "MEGACACHE_ISA_REUSE"
# Variables of the C++ build besides CXX (torch's cpp_builder and the compiler read them) and of the loader.
BUILD_ENV = ("CXX", "CC", "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "CFLAGS", "CXXFLAGS",
             "CPPFLAGS", "LDFLAGS", "CONDA_PREFIX", "TORCH_CUDA_ARCH_LIST")
MARKER_VERSION = 1
MAX_MARKER_BYTES = 4096
MAX_LIBRARY_BYTES = 64 << 20  # the probe libraries are tens of KB
# The loader's environment variables that change what a dlopen resolves (their values enter a hash, never a file).
LOADER_ENV = ("LD_LIBRARY_PATH", "LD_PRELOAD", "LD_BIND_NOW", "PYTHONHOME", "PYTHONPATH")

_lock = threading.Lock()
_counts = {"reused": 0, "run": 0, "recorded": 0}
_seconds = [0.0]  # wall seconds spent in the load checks seen: torch's own runs, and taking a record instead
_identities: dict[str, str] = {}  # template -> loader_identity(template), once per process


def counts() -> dict[str, int]:
    """This process's checks: taken from a marker (``reused``), run by torch (``run``), markers written."""
    with _lock:
        return dict(_counts)


def check_seconds() -> float:
    """Wall seconds this process spent in torch's load checks (run by torch, or taken from a record), on every
    thread together: the per-process table shows them as their own phase (stats.ProcessTimes.isa_check)."""
    with _lock:
        return _seconds[0]


def reset_counts() -> None:
    """Zero the counts and seconds and forget the loader identity (a new session may run in the same process)."""
    with _lock:
        for name in _counts:
            _counts[name] = 0
        _seconds[0] = 0.0
        _identities.clear()


def _count(name: str, seconds: float = 0.0) -> None:
    with _lock:
        _counts[name] += 1
        _seconds[0] += seconds


# --- what the check's result depends on ---------------------------------------------------------------------
def _cpu_flags() -> str:
    """The CPU's feature flags (Linux: the first ``flags`` line of /proc/cpuinfo, sorted); "" elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(set(line.partition(":")[2].split())))
    except OSError:
        pass
    return ""


def _torch_libraries(torch_dir: str) -> list[tuple[str, int]]:
    """``(name, size)`` of the shared libraries torch ships (what the probe library links against)."""
    lib = os.path.join(torch_dir, "lib")
    try:
        names = sorted(os.listdir(lib))
    except OSError:
        return []
    out = []
    for name in names:
        if ".so" in name or name.endswith((".dylib", ".dll")):
            try:
                out.append((name, os.stat(os.path.join(lib, name)).st_size))
            except OSError:
                out.append((name, -1))
    return out


def _torch_build() -> list[Any]:
    """The torch build the check loads against: version, git revision, install path, its libraries."""
    import torch  # only called from torch's own cpu_vec_isa: torch is imported

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    return [str(torch.__version__), str(getattr(torch.version, "git_version", "")), _where(torch_dir),
            _torch_libraries(torch_dir)]


def _where(path: str, cwd: str | None = None) -> str:
    """``path`` as the check's process finds it: relative where it is below the current directory (a checkout, and a
    virtual environment inside it, in another runner's work folder is the same files there), else as it is."""
    cwd = os.getcwd() if cwd is None else cwd
    if os.path.isabs(path) and (rel := os.path.relpath(path, cwd)) != os.pardir and not rel.startswith(
            os.pardir + os.sep):
        return os.path.join(".", rel)
    return path


def _search_path(value: str | None, cwd: str | None = None) -> str | None:
    """A search path variable's value, each of its folders as :func:`_where` gives it."""
    return None if value is None else os.pathsep.join(_where(part, cwd) for part in value.split(os.pathsep))


def loader_identity(template: str, env: dict[str, str] | None = None) -> str:
    """A hash of everything a successful load check depends on besides the library's own bytes: torch's check
    (its template), the torch build it loads against (version, git revision, install path, its libraries' names
    and sizes), the interpreter, the C library, the machine and its CPU flags, and the loader's variables. A path
    below the current directory counts relative to it (:func:`_where`): the same checkout in another folder takes
    the records made in the first."""
    env = dict(os.environ if env is None else env)
    parts: dict[str, Any] = {
        "template": template,
        "torch": _torch_build(),
        "python": [_where(sys.executable), sys.version, sys.implementation.cache_tag],
        "libc": list(platform.libc_ver()),
        "machine": [sys.platform, platform.machine()],
        "cpu": _cpu_flags(),
        "env": {name: _search_path(env.get(name)) for name in LOADER_ENV},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _identity_for(template: str) -> str:
    with _lock:
        if template not in _identities:
            _identities[template] = loader_identity(template)
        return _identities[template]


def _library_digest(path: str) -> tuple[str, int] | None:
    """SHA-256 and size of a regular file (no link) of at most MAX_LIBRARY_BYTES, or None."""
    try:
        data = read_regular(path, MAX_LIBRARY_BYTES)
    except OSError:  # missing, a link, not a regular file, too large
        return None
    return hashlib.sha256(data).hexdigest(), len(data)


def _read_marker(path: str) -> dict[str, Any] | None:
    try:
        data = read_regular(path, MAX_MARKER_BYTES)
    except OSError:
        return None
    try:
        marker = json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _expected(library: str, template: str) -> dict[str, Any] | None:
    digest = _library_digest(library)
    if digest is None:
        return None
    return {"v": MARKER_VERSION, "library_sha256": digest[0], "library_bytes": digest[1],
            "loader": _identity_for(template)}


def marker_path(library: str, template: str) -> str:
    """Where the record for ``library`` on this loader lives: its name holds the identity's first 16 hex digits,
    so the records of several kinds of machine sharing one store live side by side (each is new where made)."""
    return f"{library}.{_identity_for(template)[:16]}{MARKER_SUFFIX}"


def reusable(library: str, template: str) -> bool:
    """Whether a marker says torch's load check succeeded for these exact library bytes and loader."""
    marker = _read_marker(marker_path(library, template))
    return marker is not None and marker == _expected(library, template)


def record(library: str, template: str) -> bool:
    """Write the marker for a check that just succeeded (atomically; an existing marker is replaced only by
    a rename, never written into)."""
    expected = _expected(library, template)
    if expected is None:
        return False
    data = json.dumps(expected, sort_keys=True).encode("ascii")
    try:
        write_atomic(marker_path(library, template), data)
    except OSError:
        return False
    return True


# --- the proxy ----------------------------------------------------------------------------------------------
class ProbeProxy:
    """Stands for the ``subprocess`` module inside torch's ``cpu_vec_isa``: ``run`` and ``check_call`` of torch's
    load check consult the markers; everything else is the real module's."""

    def __init__(self, real: ModuleType, template: str, gate: Callable[[], bool] | None = None) -> None:
        self._real = real
        self._template = template
        self._prefix, _, self._suffix = template.partition(PLACEHOLDER)
        self._gate = gate  # None: records are taken and written; else asked once, at the first check
        self._allowed: bool | None = None if gate is not None else True

    def _records_allowed(self) -> bool:
        """Whether this process may take and write records (a child: its decision digest is the session's)."""
        if self._allowed is None:
            try:
                self._allowed = bool(self._gate()) if self._gate is not None else True
            except Exception:  # noqa: BLE001 - any doubt: torch runs its check, nothing is recorded
                self._allowed = False
        return self._allowed

    def ungate(self) -> None:
        """Take and write records without asking the gate (a session's own pytest process)."""
        self._gate, self._allowed = None, True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _library(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The library path when this call is torch's load check (its exact command), else None."""
        argv = args[0] if args else kwargs.get("args")
        if not isinstance(argv, (list, tuple)) or len(argv) != 3 or argv[0] != sys.executable or argv[1] != "-c":
            return None
        code = argv[2]
        if not (isinstance(code, str) and code.startswith(self._prefix) and code.endswith(self._suffix)):
            return None
        path = code[len(self._prefix):len(code) - len(self._suffix)]
        if not path or not os.path.isabs(path) or any(c in path for c in "\"\\\n\r\0"):
            return None
        return path

    def _call(self, real: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              on_hit: Callable[[list[Any]], Any], succeeded: Callable[[Any], bool]) -> Any:
        start = time.perf_counter()
        allowed = False
        try:
            library = self._library(args, kwargs)
            allowed = library is not None and self._records_allowed()
            if allowed and library is not None and reusable(library, self._template):
                _count("reused", time.perf_counter() - start)
                return on_hit(list(args[0] if args else kwargs["args"]))
        except Exception:  # noqa: BLE001 - any doubt: torch runs its check
            library, allowed = None, False
        try:
            result = real(*args, **kwargs)  # torch's own check; its exceptions are torch's
            if library is not None and allowed:
                try:
                    if succeeded(result) and record(library, self._template):
                        _count("recorded")
                except Exception:  # noqa: BLE001
                    pass
            return result
        finally:
            if library is not None:
                _count("run", time.perf_counter() - start)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(self._real.run, args, kwargs, lambda argv: self._real.CompletedProcess(argv, 0),
                          lambda result: getattr(result, "returncode", None) == 0)

    def check_call(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(self._real.check_call, args, kwargs, lambda argv: 0, lambda result: result == 0)


def torch_records_itself(module: ModuleType) -> bool:
    """Whether this torch keeps its own record of a check that succeeded (torch 2.14 and later: ``check_build``
    writes an empty ``<library>.load_ok`` beside the library in the Inductor cache directory once the load
    succeeded, and a later check of the same library takes it instead of loading the library again). Read from
    the code of ``VecISA.check_build``, never by calling it."""
    code = getattr(getattr(getattr(module, "VecISA", None), "check_build", None), "__code__", None)
    consts = getattr(code, "co_consts", ())
    return isinstance(consts, tuple) and TORCH_RECORD_SUFFIX in consts


def install(module: ModuleType, gate: Callable[[], bool] | None = None) -> str | None:
    """Put the proxy in ``module`` (torch's ``cpu_vec_isa``); None when done, else a note for the session's
    summary saying what happens instead. With ``gate``, records are taken and written only if it says so at the
    first check (a child process); otherwise the proxy only counts torch's checks."""
    current = getattr(module, "subprocess", None)
    if isinstance(current, ProbeProxy):
        if gate is None:
            current.ungate()  # a pytest process started by another session: its own records, no outer gate
        return None
    if torch_records_itself(module):
        return TORCH_RECORDS_NOTE
    template = getattr(getattr(module, "VecISA", None), "_avx_py_load", None)
    if not isinstance(template, str) or template.count(PLACEHOLDER) != 1:
        return RUNS_EVERYWHERE + "this torch's vector-ISA check has another form"
    if not isinstance(current, ModuleType) or current.__name__ != "subprocess":
        return RUNS_EVERYWHERE + "this torch's vector-ISA check does not go through subprocess"
    PATCHES.replace(module, "subprocess", ProbeProxy(current, template, gate),
                    "torch's vector-ISA load check is taken from a record of the same library's check where there is one")
    return None


def uninstall(module: ModuleType | None = None) -> None:
    """torch's own ``subprocess`` in ``module`` again (torch's ``cpu_vec_isa`` where None)."""
    module = module if module is not None else sys.modules.get(MODULE)
    if module is not None:
        PATCHES.remove(module, "subprocess")


def arm(on_problem: Callable[[str], None]) -> Any:
    """Install now if torch's ``cpu_vec_isa`` is imported, else when it is. Returns the import hook to remove
    (or None). ``on_problem`` hears, as a whole sentence, why it was not installed and what happens instead."""
    def after(module: ModuleType) -> None:
        try:
            why = install(module)
        except Exception as exc:  # noqa: BLE001 - never into torch's import
            why = f"{RUNS_EVERYWHERE}{type(exc).__name__}: {exc}"
        if why:
            on_problem(why)

    _offer_to_children()
    return _when_imported(after)


def _when_imported(after: Any) -> Any:
    """Runs ``after`` on torch's vector-ISA module now if it is imported, else once it is (the hook, to remove)."""
    from .importhook import PostImportHook

    if MODULE in sys.modules:
        after(sys.modules[MODULE])
        return None
    hook = PostImportHook(MODULE, after)
    sys.meta_path.insert(0, hook)
    return hook


def disarm(hook: Any) -> None:
    if hook is not None:
        hook.remove()
    uninstall()
    _withdraw_from_children()


# --- child processes ------------------------------------------------------------------------------------------
_offered: list[tuple[str, str | None]] = []  # (the value set, the variable's value before), while armed


def decision_digest(env: Mapping[str, str] | None = None) -> str:
    """A digest of what decides torch's vector-ISA check and its answer in a process with ``env``, besides the
    library's bytes and the loader identity a record holds: the ISA torch picks (the CPU's flags, the SVE length,
    ``ATEN_CPU_CAPABILITY``), the CPU's code-generation flags, the C++ compiler (``$CXX`` or ``g++`` resolved on
    ``PATH``, to its real path), the build and loader variables, every compiler setting the fingerprint keys on
    (``TORCHINDUCTOR_*``, ``TORCH_COMPILE_*``, ``TORCHDYNAMO_*``, ``TRITON_*``; a value that may be a secret by its
    slow digest, as in the fingerprint) and the interpreter. Thread counts and cache directories are left out:
    they decide neither the check nor the ISA. Reads no torch; a few milliseconds."""
    import shutil

    from . import fingerprint
    from .envpolicy import fingerprint_value, keyed

    env = dict(os.environ if env is None else env)
    flags, _cores = fingerprint._cpu_flags()
    machine = platform.machine()
    sve = fingerprint.sve_bits(machine)
    cxx = env.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    found = shutil.which(cxx, path=env.get("PATH"))
    parts = {
        "isa": fingerprint.picked_isa(flags, machine, env.get("ATEN_CPU_CAPABILITY"), sve=sve),
        "cpu": sorted(flags & fingerprint.CODEGEN_FLAGS), "sve": sve, "machine": [sys.platform, machine],
        "cxx": os.path.realpath(found) if found else None,
        "build": {name: env.get(name) for name in (*BUILD_ENV, *LOADER_ENV)},
        "settings": {name: fingerprint_value(name, value) for name, value in sorted(env.items()) if keyed(name)},
        "python": [sys.executable, sys.version],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _offer_to_children() -> None:
    """Name this process's decision digest in :data:`CHILD_ENV` for the processes it starts (undone by
    :func:`disarm`). Contained: a failure leaves the children running their checks."""
    try:
        digest = decision_digest()
    except Exception:  # noqa: BLE001
        return
    _offered.append((digest, os.environ.get(CHILD_ENV)))
    os.environ[CHILD_ENV] = digest


def _withdraw_from_children() -> None:
    while _offered:
        digest, before = _offered.pop()
        if os.environ.get(CHILD_ENV) == digest:  # not changed since by someone else
            if before is None:
                os.environ.pop(CHILD_ENV, None)
            else:
                os.environ[CHILD_ENV] = before


def arm_child(offered: str) -> Any:
    """In a child process at its first ``import torch`` (:mod:`.children`): put the proxy into torch's
    ``cpu_vec_isa`` once it is imported, gated on :func:`decision_digest` of this process's environment at its
    first check being ``offered`` (the session's). Returns the import hook (or None); never raises."""
    try:
        def gate() -> bool:
            return len(offered) == 64 and decision_digest() == offered

        def after(module: ModuleType) -> None:
            try:
                install(module, gate)
            except Exception:  # noqa: BLE001 - never into torch's import
                pass

        return _when_imported(after)
    except Exception:  # noqa: BLE001
        return None
