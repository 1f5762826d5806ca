"""One workload in every mode, repeat by repeat (plain, cold, warm, the warm variants, hot, naive and the xdist
pair), and the naive baseline's tar + zstd of the cache directories."""

from __future__ import annotations

import os
import tarfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .console import human_bytes, say
from .records import Run
from .runner import S3, THREADS_FLAG, Dirs, Runner
from .workloads import Workload

ISA_FLAG = "--megacache-reuse-isa-check"
NAIVE_ZSTD_LEVEL = 3


# --- naive: tar + zstd of the cache directories ----------------------------------------------------
class _Counting:
    """A write-only file object that counts what goes through it (the tar stream's raw size)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.count = inner, 0

    def write(self, data: bytes) -> int:
        self.count += len(data)
        self.inner.write(data)
        return len(data)

    def flush(self) -> None:
        pass


def naive_pack(dirs: Dirs, archive: Path) -> dict[str, Any]:
    import zstandard

    start = time.perf_counter()
    with open(archive, "wb") as fh:
        with zstandard.ZstdCompressor(level=NAIVE_ZSTD_LEVEL).stream_writer(fh, closefd=False) as zw:
            counting = _Counting(zw)
            with tarfile.open(fileobj=counting, mode="w|") as tar:  # type: ignore[call-overload]
                tar.add(dirs.inductor, arcname="inductor")
                tar.add(dirs.triton, arcname="triton")
    seconds = time.perf_counter() - start
    return {"pack_seconds": seconds, "tar_bytes": counting.count, "tar_zst_bytes": archive.stat().st_size}


def naive_unpack(archive: Path, dest: Path) -> tuple[Dirs, float]:
    import zstandard

    dest.mkdir(parents=True)
    start = time.perf_counter()
    with open(archive, "rb") as fh, zstandard.ZstdDecompressor().stream_reader(fh) as zr:
        with tarfile.open(fileobj=zr, mode="r|") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:  # pragma: no cover - Python without the extraction filters
                tar.extractall(dest)
    seconds = time.perf_counter() - start
    dirs = Dirs(dest / "inductor", dest / "triton", dest / "tmp")
    dirs.tmp.mkdir()
    return dirs, seconds


# --- one workload, every mode ----------------------------------------------------------------------
def bucket_bytes(s3: S3, bucket: str) -> tuple[int, int]:
    """(objects, bytes) of the cache objects a bucket holds."""
    sizes = [size for key, size in s3.objects(bucket) if key.endswith(".mcb")]
    return len(sizes), sum(sizes)


def bench_xdist(runner: Runner, wl: Workload, rep: int, base: Path, workers: int,
                serial_bucket: str | None = None) -> list[Run]:
    """cold then warm with ``-n workers``, into and from a bucket of their own; with ``serial_bucket`` (cold-xdist
    skipped), only warm, from the bucket the serial cold and warm runs filled."""
    args = ["-n", str(workers)]
    runs: list[Run] = []
    if serial_bucket is None:
        bucket = runner.s3.create_bucket(f"bench-{wl.name.lower()}-r{rep}-x{workers}-{os.getpid()}")
        cold = runner.run(wl, "cold-xdist", rep, base / "cold-xdist", bucket=bucket, extra=args)
        if not cold.ok:
            return [cold, Run(wl.name, "warm-xdist", rep, error="not run: the cold-xdist run failed")]
        runs.append(cold)
    else:
        bucket = serial_bucket
    objects, stored = bucket_bytes(runner.s3, bucket)
    if runs:
        runs[0].extra = {"bucket_objects": objects, "bucket_bytes": stored}
    warm = runner.run(wl, "warm-xdist", rep, base / "warm-xdist", bucket=bucket, extra=args)
    # Bytes fetched over bytes stored: 1.0 when the controller downloaded each object once for all workers.
    warm.extra = {"bucket_objects": objects, "bucket_bytes": stored,
                  "downloads": warm.bytes_moved / stored if warm.bytes_moved is not None and stored else None}
    return [*runs, warm]


# Modes a time-limited run may leave out (plain, cold and warm make the main ratios). Without cold-xdist, warm-xdist
# restores from the serial runs' bucket (what the serial cold run uploaded, and anything the serial warm run added).
SKIPPABLE = ("hot", "naive", "cold-xdist")


def bench_workload(runner: Runner, wl: Workload, repeats: int, work: Path, threads: bool,
                   xdist: int = 0, skip: Iterable[str] = (), isa_pair: bool = False) -> tuple[list[Run], str | None]:
    """Every mode (less those in ``skip``: SKIPPABLE), repeat by repeat; returns the runs and a bucket the cold
    run filled (for idle and objects)."""
    runs: list[Run] = []
    populated: str | None = None
    skipped = frozenset(skip)
    modes = ["cold", "warm", *(["warm-auto", "warm-keep"] if threads else []), *(["warm-isa-off"] if isa_pair else []),
             *(m for m in ("hot", "naive") if m not in skipped),
             *(m for m in ("cold-xdist", "warm-xdist") if xdist and m not in skipped)]

    def record(r: Run) -> Run:
        runs.append(r)
        runner.progress(r)
        if r.ok:
            say(f"  {r.mode}: wall {r.wall:.1f} s, compile {r.compile_seconds:.2f} s, FX {r.fx_hit}/{r.fx_miss} "
                f"hit/miss, AOT {r.aot_hit}/{r.aot_miss}, moved {human_bytes(r.bytes_moved)}"
                + (f", Triton built {r.triton_built} / cached {r.triton_hits}" if r.triton_built is not None else ""))
        return r

    for rep in range(repeats):
        base = work / wl.name / f"r{rep}"
        bucket = runner.s3.create_bucket(f"bench-{wl.name.lower()}-r{rep}-{os.getpid()}")
        say(f"{wl.name}: repeat {rep + 1}/{repeats}: plain, {', '.join(modes)}")
        plain = runner.plain(wl, rep, base / "plain")
        runs.append(plain)
        runner.progress(plain)
        if plain.ok:
            say(f"  plain (no plugin): wall {plain.wall:.1f} s")
        cold = record(runner.run(wl, "cold", rep, base / "cold", bucket=bucket))
        if not cold.ok:
            runs.extend(Run(wl.name, mode, rep, error="not run: the cold run failed") for mode in modes[1:])
            continue
        populated = populated or bucket
        cold_dirs = Dirs(base / "cold" / "inductor-cache", base / "cold" / "triton-cache", base / "cold" / "tmp")
        archive = base / "naive-cache.tar.zst"
        if "naive" not in skipped:
            pack = naive_pack(cold_dirs, archive)  # before anything else runs in the cold run's directories
        record(runner.run(wl, "warm", rep, base / "warm", bucket=bucket))
        if threads:
            for value in ("auto", "keep"):
                record(runner.run(wl, f"warm-{value}", rep, base / f"warm-{value}", bucket=bucket,
                                  extra=[THREADS_FLAG, value]))
        if isa_pair:  # the same restore, every process running torch's vector-ISA load checks itself
            record(runner.run(wl, "warm-isa-off", rep, base / "warm-isa-off", bucket=bucket, extra=[ISA_FLAG, "no"]))
        if "hot" not in skipped:
            record(runner.run(wl, "hot", rep, base / "hot", dirs=cold_dirs, store_dir=base / "empty-store-hot",
                              read_only=True))
        if "naive" not in skipped:
            naive_dirs, unpack_seconds = naive_unpack(archive, base / "naive")
            naive = runner.run(wl, "naive", rep, base / "naive-run", dirs=naive_dirs,
                               store_dir=base / "empty-store-naive", read_only=True)
            naive.extra = {**pack, "unpack_seconds": unpack_seconds}
            naive.bytes_moved = pack["tar_zst_bytes"]
            naive.restore_seconds = pack["pack_seconds"] + unpack_seconds
            record(naive)
        if xdist:
            for r in bench_xdist(runner, wl, rep, base, xdist, bucket if "cold-xdist" in skipped else None):
                record(r)
    return runs, populated
