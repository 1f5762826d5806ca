"""The store at scale, without torch: a session whose cache directory holds N bytes of compiled files uploads them
(cold), and a fresh session restores them (warm), on a directory store and on S3 (moto's server on loopback); then
four shards of one suite before and after the first warm session merges their objects.

    python benchmarks/store_scale.py                       # 100MB and 1GB, both stores
    python benchmarks/store_scale.py --sizes 100MB 1GB 3GB --stores dir s3 --json out.json

Each cold and warm session is a process of its own, and so is its baseline: the same process, the same imports
and the same files moved into the cache directory, with the plugin's work left out (plugin off). Peak memory is
the process's peak resident set (``ru_maxrss``); "added" is the session's less its baseline's. Each session has a
TMPDIR of its own holding its cache directory (where torch puts it by default): the peak of what the session holds
there, sampled every 20 ms (the cache directory's files and the plugin's scratch files, apart), is printed for the
warm sessions. The synthetic kernel files compress about 2:1 and are 8 MB each (the precompiled header of a CPU run
is 156 MB, Inductor's kernels are KBs to MBs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FP = "torch-2.13.0+cpu/cpu-bench-t2/py3.11-linux-x86_64/0123456789ab"
FOLDER = f"pytest-megacache/main/{FP}"
FILE_BYTES = 8 << 20


def parse_size(text: str) -> int:
    units = {"MB": 10**6, "GB": 10**9}
    return int(float(text[:-2]) * units[text[-2:].upper()])


def generate(folder: Path, total: int, tag: str) -> None:
    """``total`` bytes of whole ELF-looking kernel files under ``folder``, half random, half zeros (about 2:1)."""
    folder.mkdir(parents=True, exist_ok=True)
    header = b"\x7fELF\x02\x01\x01" + bytes(57)
    for i in range(max(1, total // FILE_BYTES)):
        size = min(FILE_BYTES, total)
        (folder / f"{tag}{i:05d}").mkdir(exist_ok=True)
        (folder / f"{tag}{i:05d}" / f"k{i}.so").write_bytes(header + os.urandom(size // 2) + bytes(size - size // 2 - 64))


def store_for(kind: str, where: str) -> Any:
    from pytest_megacache.stores import LocalDirStore, S3Store, make_s3_client

    if kind == "dir":
        return LocalDirStore(where)
    bucket, url = where.split("@", 1)
    return S3Store(bucket, make_s3_client(url, read_timeout=300))


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One session in this process: ``cold`` (links ``--src``'s files into an empty cache directory after the
    restore and uploads them) or ``warm`` (restores into an empty cache directory); with ``--off``, the same
    process without the plugin's work."""
    from pytest_megacache.bundle import DEFAULT_LIMITS, Limits
    from pytest_megacache.core import CacheSession
    from pytest_megacache.files import FileRoot

    cache = Path(args.cache)
    tmp = cache.parent / f"{cache.name}-tmp"  # the session's TMPDIR: its scratch files, and its cache directory
    tmp.mkdir(parents=True, exist_ok=True)
    tempfile.tempdir = str(tmp)
    cache = tmp / "inductor"
    sampler = DiskPeak(tmp, cache)
    store = store_for(args.store, args.where)
    limits = Limits(max_object_bytes=args.max_object) if args.max_object else DEFAULT_LIMITS
    session = CacheSession(store_factory=lambda: store, folder=FOLDER, fingerprint=FP,
                           roots=[FileRoot("inductor", cache)], reads=args.mode != "cold-blind", writes=args.mode != "warm-read",
                           restore_timeout=600, upload_timeout=600, compact_after=args.compact_after, limits=limits)
    start = time.perf_counter()
    if not args.off:
        session.start_restore(background=False)
    restored = time.perf_counter() - start
    if args.mode.startswith("cold"):
        for path in Path(args.src).rglob("*.so"):
            target = cache / path.relative_to(args.src)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():  # restored: a shard that finds a kernel does not build it
                os.link(path, target)
    start = time.perf_counter()
    if not args.off and args.mode != "warm-read":
        session.finish(None)  # collects what the cache directory gained, and uploads it
    session.close()
    finished = time.perf_counter() - start
    sampler.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    r, up = session.restore_stats, session.upload_stats
    return {"restore_s": round(restored, 2), "finish_s": round(finished, 2), "fetched": r.bytes_fetched,
            "raw_fetched": r.raw_fetched, "raw_unique": r.raw_unique, "raw_decompressed": r.raw_decompressed,
            "objects_used": r.objects_used,
            "files_written": r.files_written, "uploaded": up.bytes + up.merged_bytes, "objects_up":
            up.objects + up.merged_objects, "problems": session.problems,
            "peak_mb": peak_mb(), "tmp_peak": sampler.peak, "scratch_peak": sampler.scratch_peak,
            "cache_bytes": sampler.cache_last}


def tree_bytes(path: Path) -> int:
    """The disk space the files below ``path`` take (allocated blocks), 0 where it is gone."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


class DiskPeak:
    """The most a TMPDIR held while this process ran, sampled every 20 ms: in all, and outside its cache
    directory (the plugin's scratch files)."""

    def __init__(self, tmp: Path, cache: Path) -> None:
        self.tmp, self.cache = tmp, cache
        self.peak = self.scratch_peak = self.cache_last = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        cache = tree_bytes(self.cache)
        total = tree_bytes(self.tmp)
        self.peak, self.cache_last = max(self.peak, total), cache
        self.scratch_peak = max(self.scratch_peak, total - cache)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def peak_mb() -> float:
    """This process's peak resident set, MB: VmHWM (``ru_maxrss`` would also count what the parent held when it
    forked this process, as Linux keeps it across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def run_child(**kw: Any) -> dict[str, Any]:
    [result] = run_children([kw])
    return result


def run_children(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each call a process of its own, all at once; their results in order."""
    procs = []
    for kw in calls:
        argv = [sys.executable, __file__, "--child"]
        for key, value in kw.items():
            if value is True:
                argv.append(f"--{key.replace('_', '-')}")
            elif value not in (None, False):
                argv += [f"--{key.replace('_', '-')}", str(value)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CHILD_ENV))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"benchmark child failed: {err[-2000:]}")
        results.append(json.loads(out.splitlines()[-1]))
    return results


CHILD_ENV = dict(os.environ)


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def size_rows(store: str, where: str, total: int, work: Path) -> dict[str, Any]:
    src = work / f"src-{total}"
    if not src.exists():
        generate(src, total, "k")
    cold_off = run_child(mode="cold", store=store, where=where, cache=work / "c-off", src=src, off=True)
    cold = run_child(mode="cold", store=store, where=where, cache=work / "c-on", src=src)
    warm_off = run_child(mode="warm", store=store, where=where, cache=work / "w-off", off=True)
    warm = run_child(mode="warm", store=store, where=where, cache=work / "w-on")
    for folder in ("c-off", "c-on", "w-off", "w-on"):
        shutil.rmtree(work / folder, ignore_errors=True)
    return {"store": store, "raw": total, "cold": cold, "cold_off": cold_off, "warm": warm, "warm_off": warm_off}


def shard_rows(store: str, where: str, total: int, work: Path) -> dict[str, Any]:
    """Four shards: each the same shared files (``total`` / 2) plus its own (``total`` / 8); cold at once on an
    empty store; a warm restore; the first read-write warm session (it merges); a warm restore again."""
    work = work / f"shards-{store}"
    shared = work / "shared"
    generate(shared, total // 2, "s")
    for i in range(4):
        src = work / f"shard{i}"
        shutil.copytree(shared, src, copy_function=os.link)
        generate(src, total // 8, f"own{i}-")
    # All four at once on an empty store: none restores what another stores.
    run_children([{"mode": "cold-blind", "store": store, "where": where, "cache": work / f"shard-c{i}",
                   "src": work / f"shard{i}"} for i in range(4)])
    before = run_child(mode="warm-read", store=store, where=where, cache=work / "shard-before")
    merging = run_child(mode="warm", store=store, where=where, cache=work / "shard-merge")
    after = run_child(mode="warm-read", store=store, where=where, cache=work / "shard-after")
    return {"store": store, "raw": total, "before": before, "merging": merging, "after": after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["100MB", "1GB"])
    parser.add_argument("--stores", nargs="+", default=["dir", "s3"], choices=["dir", "s3"])
    parser.add_argument("--shards", default="200MB", help="raw size of the four-shard run (0 to skip)")
    parser.add_argument("--json", help="write the records here too")
    parser.add_argument("--work", help="scratch folder (default: a temporary one, removed)")
    # the child's arguments
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--where", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--off", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compact-after", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--max-object", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="megacache-scale-"))
    records: dict[str, Any] = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                                          f"Python {platform.python_version()}", "sizes": [], "shards": []}
    server = None
    try:
        for store in args.stores:
            where = str(work / "store")
            if store == "s3":
                from demo.local_s3 import LocalS3

                server = LocalS3().start()
                CHILD_ENV.update(server.env())
                where = f"{server.create_bucket()}@{server.url}"
            for text in args.sizes:
                shutil.rmtree(work / "store", ignore_errors=True)
                if server is not None:
                    where = f"{server.create_bucket()}@{server.url}"
                records["sizes"].append(size_rows(store, where, parse_size(text), work))
                print_size(records["sizes"][-1])
            if parse_size(args.shards) if args.shards != "0" else 0:
                shutil.rmtree(work / "store", ignore_errors=True)
                if server is not None:
                    where = f"{server.create_bucket()}@{server.url}"
                records["shards"].append(shard_rows(store, where, parse_size(args.shards), work))
                print_shards(records["shards"][-1])
            if server is not None:
                server.stop()
                server = None
    finally:
        if server is not None:
            server.stop()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nmachine: {records['machine']}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n")


def print_size(row: dict[str, Any]) -> None:
    c, co, w, wo = row["cold"], row["cold_off"], row["warm"], row["warm_off"]
    print(f"\n{row['store']:>3} {mb(row['raw'])} raw")
    print("  session  seconds  objects  stored/fetched  peak RSS  plugin off  added  TMPDIR peak  of it scratch"
          "  cache files")
    print(f"  cold     {c['finish_s']:7.1f}  {c['objects_up']:7d}  {mb(c['uploaded']):>14}  {c['peak_mb']:6.0f} MB"
          f"  {co['peak_mb']:7.0f} MB  {c['peak_mb'] - co['peak_mb']:5.0f} MB")
    print(f"  warm     {w['restore_s']:7.1f}  {w['objects_used']:7d}  {mb(w['fetched']):>14}  {w['peak_mb']:6.0f} MB"
          f"  {wo['peak_mb']:7.0f} MB  {w['peak_mb'] - wo['peak_mb']:5.0f} MB  {mb(w['tmp_peak']):>11}"
          f"  {mb(w['scratch_peak']):>13}  {mb(w['cache_bytes']):>11}")
    for rec in (c, w):
        if rec["problems"]:
            print("  problems:", "; ".join(rec["problems"])[:500])


def print_shards(row: dict[str, Any]) -> None:
    print(f"\n{row['store']:>3} four shards, {mb(row['raw'])} raw in all (half of it in every shard)")
    print("  warm restore        seconds  objects  fetched  raw fetched  raw distinct  decompressed")
    for label, key in (("before merging", "before"), ("merging session", "merging"), ("after merging", "after")):
        r = row[key]
        print(f"  {label:<18} {r['restore_s']:7.1f}  {r['objects_used']:7d}  {mb(r['fetched']):>7}  "
              f"{mb(r['raw_fetched']):>11}  {mb(r['raw_unique']):>12}  {mb(r['raw_decompressed']):>12}")
    print(f"  the merging session stored {row['merging']['objects_up']} object(s), {mb(row['merging']['uploaded'])}, "
          f"in {row['merging']['finish_s']:.1f} s")


if __name__ == "__main__":
    main()
