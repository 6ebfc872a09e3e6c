"""A warm-up reader's own work a feature, with the garbage collector as a reader had it and as
it has it now (``proxy.jobs.READER_GC_THRESHOLDS`` with the heap frozen, ``frozen_heap``).

One reader of ``--readers`` over a JSONL file of ``--drivers`` synthetic drivers does what a
job's reader does with its rows before it calls the cache and the index: read every line and
keep its own (``Shard.keeps_raw``), validate them, render their texts, tokenize them through
the cache (``FastTokenizer.ids``, ``TokenizedTexts``) and build the index's columns
(``Prepared.of``), chunk after chunk, keeping the last ``--alive`` chunks' objects alive as a
reader's slices in flight keep them. No engine, no store, no index calls: what those cost is
in ``bench/serve_bench.py``'s per-role table. Each variant runs in a process of its own (the
collector's state is per process), its runs in turns with the other's.

    .venv/bin/python -m bench.reader_bench --drivers 30000 --readers 3 --runs 3

Prints microseconds of wall time a feature of the reader's own rows (one thread, nothing
else running in it): medians of the runs, the worst run beside. Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC
from pathlib import Path

VARIANTS = ("collector at its default", "heap frozen, READER_GC_THRESHOLDS")


def one_run(path: Path, readers: int, alive: int, tuned: bool) -> float:
    """Microseconds a feature of one reader's pass over ``path``."""
    from engines.tokenization import FastTokenizer, TokenizedTexts
    from engines.torch_engine import default_model_path
    from features.readers import iter_rows
    from features.text import driver_text
    from indexes.table import Prepared
    from proxy.jobs import READER_GC_THRESHOLDS
    from proxy.processes import frozen_heap
    from proxy.warmup import Shard, read_chunks

    shard = Shard(0, readers)
    tokenizer = FastTokenizer(default_model_path(), 256)
    kept: list[object] = []
    features = 0
    with frozen_heap(READER_GC_THRESHOLDS) if tuned else contextlib.nullcontext():
        started = time.perf_counter()
        rows = iter_rows(path, keep=shard.keeps, keep_raw=shard.keeps_raw)
        for chunk in read_chunks(rows, 500 * readers):
            records = [row.record for row in chunk if row.record is not None]
            texts = [driver_text(r) for r in records]
            ids = TokenizedTexts.of(texts, tokenizer.ids(texts))
            kept = [*kept[-(alive - 1) :], (records, ids, Prepared.of(records))]
            features += len(records)
        elapsed = time.perf_counter() - started
    return elapsed / features * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drivers", type=int, default=30_000)
    parser.add_argument("--readers", type=int, default=3, help="the job's readers: 1 is this")
    parser.add_argument("--alive", type=int, default=12, help="chunks kept alive")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: FILE,TUNED
    args = parser.parse_args()
    if args.one:
        file, tuned = args.one.rsplit(",", 1)
        print(one_run(Path(file), args.readers, args.alive, tuned == "1"))
        return
    from features.readers import write_records
    from features.synthetic import generate_fleet

    with tempfile.TemporaryDirectory() as tmp:
        fleet = Path(tmp) / "fleet.jsonl"
        write_records(generate_fleet(args.drivers, seed=3), fleet)
        runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.runs):
            for tuned, name in enumerate(VARIANTS):
                command = [sys.executable, "-m", "bench.reader_bench", "--readers"]
                command += [str(args.readers), "--alive", str(args.alive)]
                command += ["--one", f"{fleet},{tuned}"]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                runs[name].append(float(done.stdout.strip().splitlines()[-1]))
    now = datetime.datetime.now(UTC)
    print(
        f"# reader_bench {now:%Y-%m-%d %H:%M} UTC, {platform.node()} ({os.cpu_count()} cores), "
        f"{args.drivers:,} drivers, reader 1 of {args.readers}, {args.alive} chunks alive, "
        f"{args.runs} runs each, in turns\n"
    )
    from bench.serve_bench import print_table

    base = statistics.median(runs[VARIANTS[0]])
    table = [
        [
            name,
            f"{statistics.median(v):.1f}",
            f"{max(v):.1f}",
            f"{statistics.median(v) / base:.2f}x",
        ]
        for name, v in runs.items()
    ]
    print_table(["variant", "us a feature, median", "worst run", "x default"], table)


if __name__ == "__main__":
    main()
