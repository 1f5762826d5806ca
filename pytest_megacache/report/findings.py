"""What a session finds to say about its cache once its tests ran: notes drawn from its figures, never problems."""

from __future__ import annotations

from ..torch_adapter import HIT_COUNTERS, MISS_COUNTERS, counter_sum  # a light module: it imports no torch
from .stats import LoadStats, RestoreStats, TorchStats

__all__ = ["unstorable_note", "unused_note"]


def unused_note(r: RestoreStats, t: TorchStats, load: LoadStats, full_coverage: bool) -> str | None:
    """Restored objects that torch hit none of (None where that is not so). The environment settings that change
    keys are in the fingerprint (another folder), so what is left is a session that compiled only graphs the store
    lacks (new or changed code or config, another shard): healthy, and said so, with the likely causes where the
    objects came from a run of these very tests (``full_coverage``). After a failed load, that failure was the
    problem already."""
    hits, misses = counter_sum(t.counters, HIT_COUNTERS), counter_sum(t.counters, MISS_COUNTERS)
    if not (r.objects_used and t.compiled and hits == 0 and misses > 0) or (load.called and not load.ok):
        return None
    note = f"restored {r.objects_used} object(s); this session compiled only graphs they do not hold ({misses} misses)"
    if full_coverage:
        return note + (": they were stored by a run of these same tests, so the code or an Inductor/Dynamo setting "
                       "changed since (config patches in code, OMP_NUM_THREADS, model code)")
    return note + ": new or changed code, or other tests than the runs that stored them"


def unstorable_note(t: TorchStats, eager_backward: bool = False) -> str | None:
    """AOTAutograd graphs compiled but never stored, counted from torch's own counters (misses minus entries saved);
    None where there are none. torch stores an AOTAutograd entry only once the graph's backward is compiled, which is
    lazy (a forward whose inputs require grad, in tests that never call ``.backward()``, is never stored unless
    ``eager_backward``: ``--megacache-eager-backward``), and only when Inductor compiled every part through its
    FX-graph cache (``_should_save_cache``: a part with nothing for Inductor to compile, or one that bypassed the FX
    cache, has no key). The counters cannot tell the two apart, so the note names both, or only the second when
    backwards are compiled eagerly. With Dynamo reuse, the backwards of such graphs are compiled with their forwards as
    far as what reuse spared pays for them (:mod:`..dynamo.backwards`): those are counted as stored."""
    # the backwards Dynamo reuse compiled with their forwards saved entries that torch's counters, put back, do not show
    unsaved = (t.counters.get("autograd_cache_miss", 0) - t.counters.get("autograd_cache_saved", 0)
               - t.counters.get("dynamo_backwards_compiled", 0))
    if "autograd_cache_saved" not in t.counters or unsaved <= 0:
        return None
    tests = [nodeid for nodeid, rec in t.per_test.items()
             if rec["counters"].get("autograd_cache_miss", 0) > rec["counters"].get("autograd_cache_saved", 0)]
    named = f" (in {', '.join(tests[:3])}{f' and {len(tests) - 3} more' if len(tests) > 3 else ''})" if tests else ""
    no_key = ("a part that Inductor did not compile through its FX-graph cache (nothing for it to compile, or a cache "
              "bypass) has no key")
    why = (f"with backwards compiled eagerly, the reason left is that {no_key}" if eager_backward else
           "torch stores an entry only once its backward is compiled (a forward whose inputs require grad in a test "
           "that never calls backward(): run inference-only tests under torch.no_grad() or torch.inference_mode(), "
           f"or opt in to --megacache-eager-backward), and never when {no_key}")
    reuse = any(t.counters.get(name, 0) for name in ("dynamo_stored", "dynamo_frames_reused"))
    later = (" until Dynamo reuse has spared the time to compile their backwards with their forwards"
             if reuse and not eager_backward else "")
    return f"{unsaved} AOTAutograd graph(s) compiled but not stored{named}, so they miss in every run{later}: " + why
