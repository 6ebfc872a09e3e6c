"""What one cached vector costs to write to LMDB on this machine's disk, and from how many writers.

Every new text the server computes is written back to the shared tier (LMDB by default) as one
entry of a 32-byte-hash key and a float32 row (384 dims: 1,546 bytes with the codec's header).
Keys are hashes, so each new entry lands on a random leaf page: about one 4 KiB page written
per text, whatever the group size. This bench writes such entries into a store already holding
``--prefill`` of them, through ``LmdbByteStore.mset`` (one transaction per group), and prints
per text: wall microseconds, CPU (user + system) microseconds, and texts/s:

- ``sync`` (the server's setting: one fdatasync per commit, integrity kept on an OS crash)
  and ``nosync`` (no fsync: what the disk's fsync costs);
- groups of 256 and 2,048 entries (the group commit's sizes under load);
- 1, 2 and 4 writer processes on one environment (LMDB serialises writers: do they add up?),
  and (``own``) each writer on an environment of its own holding its share of the entries (a
  store partitioned by key: one write lock and one fsync per partition);
- (``partitioned``) one writer process through ``LmdbByteStore(partitions=N)``, which
  writes the partitions of each group in parallel threads (the server's form).

    .venv/bin/python -m bench.lmdb_write_bench                  # this box
    python -m bench.lmdb_write_bench --dir /path/on/another/disk

Medians of ``--runs`` runs, the worst run beside. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

VALUE = 1546  # codec header + 384 float32
LAYOUTS = {  # the table's "environments" column
    "shared": "one",
    "own": "one a writer process",
    "partitioned": "partitions of one store, one process",
}


def keys(start: int, count: int) -> list[str]:
    return [
        "t1-bench:" + hashlib.blake2b(str(i).encode(), digest_size=32).hexdigest()
        for i in range(start, start + count)
    ]


def prefill(path: Path, count: int, partitions: int = 1) -> None:
    from cache.stores import LmdbByteStore

    store = LmdbByteStore(path, 16 << 30, sync=False, partitions=partitions)
    value = os.urandom(VALUE)
    for start in range(0, count, 10_000):
        store.mset([(k, value) for k in keys(start, min(10_000, count - start))])
    store.close()


Results = Any  # a multiprocessing queue of (wall s, CPU s), one per writer


def writer(path: str, sync: bool, group: int, start: int, count: int, out: Results) -> None:
    from cache.stores import LmdbByteStore

    store = LmdbByteStore(path, 16 << 30, sync=sync)  # a partitioned one opens as it was made
    value = os.urandom(VALUE)
    entries = [(k, value) for k in keys(start, count)]
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    for i in range(0, count, group):
        store.mset(entries[i : i + group])
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    store.close()
    out.put((wall, cpu))


def run(
    paths: list[Path], sync: bool, group: int, writers: int, count: int, start: int
) -> dict[str, float]:
    """``count`` new entries split among ``writers`` processes (writer ``w`` on
    ``paths[w % len(paths)]``): texts/s over the slowest, CPU microseconds per text summed
    over all."""
    context = multiprocessing.get_context("spawn")
    out: Results = context.Queue()
    share = count // writers
    processes = [
        context.Process(
            target=writer,
            args=(str(paths[w % len(paths)]), sync, group, start + w * share, share, out),
        )
        for w in range(writers)
    ]
    for process in processes:
        process.start()
    results = [out.get() for _ in processes]
    for process in processes:
        process.join()
    wall = max(r[0] for r in results)
    return {
        "texts_s": share * writers / wall,
        "wall_us": wall / (share * writers) * 1e6,
        "cpu_us": sum(r[1] for r in results) / (share * writers) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="where the environment goes (default: tmp)")
    parser.add_argument("--prefill", type=int, default=200_000)
    parser.add_argument("--count", type=int, default=40_000, help="new entries per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--writers", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument(
        "--layouts", nargs="*", default=["shared", "own", "partitioned"], help="see above"
    )
    parser.add_argument("--syncs", nargs="*", default=["sync", "nosync"], help="sync | nosync")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fleetcache-lmdb-bench-", dir=args.dir))
    try:
        most = max(args.writers)
        own = [root / f"own{w}.lmdb" for w in range(most)]  # the same entries, partitioned
        if "own" in args.layouts:
            for path in own:
                prefill(path, args.prefill // most)
        shared = [root / "cache.lmdb"]
        if "shared" in args.layouts:
            prefill(shared[0], args.prefill)
        partitioned = {n: root / f"partitioned{n}.lmdb" for n in args.writers if n > 1}
        if "partitioned" in args.layouts:
            for n, path in partitioned.items():
                prefill(path, args.prefill, partitions=n)
        start, rows = args.prefill, []
        for sync in (s == "sync" for s in args.syncs):
            for group in (256, 2048):
                for layout in args.layouts:
                    for writers in args.writers:
                        if layout != "shared" and writers == 1:
                            continue  # the shared layout's row
                        paths = {"shared": shared, "own": own[:writers]}.get(layout)
                        processes = writers
                        if paths is None:  # one process writing ``writers`` partitions
                            paths, processes = [partitioned[writers]], 1
                        results = []
                        for _ in range(args.runs):
                            results.append(run(paths, sync, group, processes, args.count, start))
                            start += args.count
                        rows.append((sync, group, layout, writers, results))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# lmdb_write_bench {now}, {platform.node()} ({os.cpu_count()} cores), dir "
        f"{args.dir or tempfile.gettempdir()}: {VALUE}-byte values, {args.prefill:,} entries "
        f"first, {args.count:,} new entries a run, {args.runs} runs"
    )
    print(
        "| sync | group | environments | writers (partitions) | texts/s (worst) | wall us per text "
        "| CPU us per text |"
    )
    print("|---|---|---|---|---|---|---|")
    for sync, group, layout, writers, results in rows:

        def med(key: str, rs: list[dict[str, float]] = results) -> float:
            return statistics.median(r[key] for r in rs)

        worst = min(r["texts_s"] for r in results)
        print(
            f"| {'sync' if sync else 'nosync'} | {group} "
            f"| {LAYOUTS[layout]} | {writers} | {med('texts_s'):,.0f} "
            f"({worst:,.0f}) | {med('wall_us'):.1f} | {med('cpu_us'):.1f} |"
        )


if __name__ == "__main__":
    main()
