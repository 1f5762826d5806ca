"""torch 2.14 and later: the vector-ISA check's own records (``<library>.load_ok``) travel with the cache, and a
carried record cannot make torch use an ISA the warm machine's CPU lacks.

What torch does (``torch/_inductor/cpu_vec_isa.py``): ``valid_vec_isa_list()`` keeps a candidate ISA only if
``all(flag in x86_isa_checker() ...) and isa``; ``x86_isa_checker()`` asks the CPU (``torch.cpu._is_avx512_supported``,
``_is_amx_tile_supported``, ...), and only ``bool(isa)`` reaches ``check_build``, the one place that reads a
``.load_ok`` record (AMX also needs ``torch.cpu._init_amx()``). So a record is consulted only for an ISA the CPU has.

Shown with real sessions: a donor session whose torch is told the CPU has AMX tiles (as an AMX machine's torch would
find) runs the checks, writes the records and uploads them; a warm session on this CPU (no AMX) restores them and
decides exactly as torch does with the plugin off; a control session told about AMX again takes the carried AMX
records without running a check, so the records are valid: only the CPU gate keeps AMX out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .conftest import Matrix, Results
from .sessions import Session, isa_decision


def torch_records_its_checks() -> bool:
    """Whether the installed torch's check keeps .load_ok records (read from its source; torch is not imported)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    source = Path(next(iter(spec.submodule_search_locations)), "_inductor", "cpu_vec_isa.py")
    return source.is_file() and '".load_ok"' in source.read_text()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


pytestmark = pytest.mark.skipif(not torch_records_its_checks(), reason="this torch's check keeps no .load_ok records")

AMX = "amx_tile"


def ran(session: Session) -> None:
    assert session.returncode == 0 and session.outcomes == {"test_isa_decision": "passed"}, session.describe()
    assert len(session.megacache_warnings()) <= 1, session.describe()


@pytest.mark.tier("isa_records_gated_by_cpu")
def test_a_carried_record_cannot_enable_an_isa_this_cpu_lacks(matrix: Matrix, results: Results) -> None:
    if AMX in cpu_flags():
        pytest.skip("this CPU has AMX tiles: no ISA here that the CPU lacks")
    plain = matrix.isa("plain", plugin=False)
    donor = matrix.isa("donor", pretend_amx=True)
    warm = matrix.isa("warm")
    control = matrix.isa("control", pretend_amx=True)
    for session in (plain, donor, warm, control):
        ran(session)
    off, given, taken, again = (isa_decision(s) for s in (plain, donor, warm, control))

    # The donor (torch told about AMX) checked the AMX candidates and recorded them.
    amx_libraries = sorted({Path(lib).relative_to(given["cache_dir"]).as_posix()
                            for isa, lib in given["probes"] if AMX in isa.split()})
    assert any(AMX in isa.split() for isa in given["valid"]) and amx_libraries, given
    assert all(Path(given["cache_dir"], lib + ".load_ok").is_file() for lib in amx_libraries), given

    # The warm session restored those records, and torch on this CPU decided as with the plugin off, never
    # looking at an AMX library: every check it needed was covered by a carried record (none ran).
    assert all((warm.cache_dir / (lib + ".load_ok")).is_file() for lib in amx_libraries), amx_libraries
    assert (taken["valid"], taken["picked"]) == (off["valid"], off["picked"]), (taken, off)
    assert not any(AMX in isa for isa in taken["valid"]) and taken["probes"] == [], taken
    assert off["probes"], "plugin off on fresh directories, torch ran its checks"

    # Control: told about AMX again, torch takes the carried AMX records without a check.
    assert again["valid"] == given["valid"] and again["probes"] == [], again
    results.record("isa_records_gated_by_cpu", "holds",
                   f"{len(amx_libraries)} AMX records carried to a CPU without AMX: valid {taken['valid']}, picked "
                   f"{taken['picked']} (plugin off: {off['valid']}, {off['picked']}); 0 checks run warm, "
                   f"{len(off['probes'])} plugin off")
