"""Diagnostics for the GPU proofs (not part of the plugin): with ``-p autotune_events`` (scripts/ on PYTHONPATH)
and AUTOTUNE_EVENTS=PATH set, log as JSON lines every Triton compile (kernel name, cache hit), every Inductor
autotune-cache lookup (its key, found or not, whether the stored best config was usable) and every save, so a
warm run's recompiled kernels can be traced to the artifact that was missing.

Caution: the autotune-cache part changes what it measures. With it on (H100, torch 2.11, 2026-11-23), the
max-autotune graph missed torch's FX-graph cache even hot with the plugin off: the hot lookup found no entry, so
the wrapped hooks apparently kept torch from saving the graph. Never take cache hits or misses from a run with
AUTOTUNE_EVENTS set; FX_EVENTS alone (the lookup log) and the example's own Triton listener left them unchanged.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest


def _log(event: dict[str, Any]) -> None:
    with open(os.environ["AUTOTUNE_EVENTS"], "a") as fh:
        fh.write(json.dumps(event, default=str) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("FX_EVENTS"):
        install_fx_probe()
    if not os.environ.get("AUTOTUNE_EVENTS"):
        return
    try:
        import triton.knobs

        def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
            _log({"ev": "triton", "name": metadata.get("name"), "hit": cache_hit,
                  "s": getattr(times, "total_us", 0) / 1e6 if times else None})

        triton.knobs.compilation.listener = listener
    except Exception as exc:  # noqa: BLE001
        _log({"ev": "error", "what": f"triton listener: {exc}"})
    try:
        from torch._inductor.runtime import autotune_cache as ac

        read_best, save = ac.AutotuneCache.read_best, ac.AutotuneCache.save

        def key(self: Any) -> str | None:
            local = getattr(self, "local_cache", None)
            return os.path.relpath(local[1], os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/")) if local else None

        def logged_read(self: Any, inductor_meta: Any, configs: Any) -> Any:
            raw = self._read()
            best = read_best(self, inductor_meta, configs)
            _log({"ev": "autotune-read", "key": key(self), "stored": raw is not None, "used": best is not None,
                  "configs": len(configs), "configs_hash": self.configs_hash,
                  "stored_hash": (raw or {}).get("configs_hash"),
                  "kernel": inductor_meta.get("kernel_name")})
            return best

        def logged_save(self: Any, config: Any, time_taken_ns: int, found_by_coordesc: bool = False,
                        triton_cache_hash: str | None = None) -> None:
            _log({"ev": "autotune-save", "key": key(self), "coordesc": found_by_coordesc})
            save(self, config, time_taken_ns, found_by_coordesc, triton_cache_hash)

        ac.AutotuneCache.read_best = logged_read  # type: ignore[method-assign]
        ac.AutotuneCache.save = logged_save  # type: ignore[method-assign]
    except Exception as exc:  # noqa: BLE001
        _log({"ev": "error", "what": f"autotune cache: {exc}"})


def summarize(path: str) -> str:
    """One paragraph per log: Triton compiles that missed (by name), autotune lookups stored/used, saves."""
    events = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    missed: dict[str, int] = {}
    for e in events:
        if e["ev"] == "triton" and not e["hit"]:
            missed[e["name"]] = missed.get(e["name"], 0) + 1
    reads = [e for e in events if e["ev"] == "autotune-read"]
    lines = [f"triton compiles: {sum(e['ev'] == 'triton' for e in events)}, cache misses {sum(missed.values())}: "
             + ", ".join(f"{n} x{c}" for n, c in sorted(missed.items())),
             f"autotune reads {len(reads)}: stored {sum(e['stored'] for e in reads)}, used {sum(e['used'] for e in reads)}; "
             f"saves {sum(e['ev'] == 'autotune-save' for e in events)}"]
    lines += [f"  not used: {e['kernel']} key={e['key']} stored={e['stored']} configs={e['configs']} "
              f"hash={e['configs_hash']} stored_hash={e['stored_hash']}" for e in reads if not e["used"]][:40]
    lines += [f"  error: {e['what']}" for e in events if e["ev"] == "error"]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(summarize(sys.argv[1]))


def install_fx_probe() -> None:
    """With FX_EVENTS=PATH: log each FX-graph cache lookup (key, found, torch's cache_info) and AOTAutograd's."""
    import torch._inductor.codecache as cc

    original = cc.FxGraphCache._lookup_graph

    def lookup(*args: Any, **kwargs: Any) -> Any:
        graph, info = original(*args, **kwargs)
        key = args[0] if args else kwargs.get("key")
        with open(os.environ["FX_EVENTS"], "a") as fh:
            fh.write(json.dumps({"ev": "fx-lookup", "key": key, "found": graph is not None, "info": info},
                                default=str) + "\n")
        return graph, info

    cc.FxGraphCache._lookup_graph = staticmethod(lookup)  # type: ignore[assignment]
