"""Tokenization of fleet texts: the word cache (``FastTokenizer.ids``, what a worker runs on its
misses) against the model's tokenizer (``encode_batch``) on one core and on every core.

Texts: ``features.synthetic.fleet_texts`` (driver, vehicle and order texts, every city,
accented and CJK place names included), new to the word cache at the start of each run (a fresh
``FastTokenizer``: the first texts pay for filling it). Each run tokenizes all of them in
batches of ``--batch``; the table shows texts/s (median and worst of the runs) and the ratio
to ``encode_batch`` on one core, and checks that every id equals ``encode_batch``'s.

    .venv/bin/python -m bench.tokenize_bench --drivers 20000 --runs 5

Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC

from bench.serve_bench import print_table
from engines.tokenization import FastTokenizer
from engines.torch_engine import default_model_path
from features.synthetic import fleet_texts


def rate(run: Callable[[list[str]], object], texts: list[str], batch: int) -> float:
    started = time.perf_counter()
    for start in range(0, len(texts), batch):
        run(texts[start : start + batch])
    return len(texts) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drivers", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=32, help="texts per call (a request)")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    texts = fleet_texts(args.drivers, seed=5)
    path, cores = default_model_path(), os.cpu_count() or 1

    def word_cache() -> Callable[[list[str]], object]:
        return FastTokenizer(path, 256).ids  # a fresh cache each run

    def tokenizer(parallel: bool) -> Callable[[], Callable[[list[str]], object]]:
        def make() -> Callable[[list[str]], object]:
            os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"  # each call
            fast = FastTokenizer(path, 256)
            return lambda batch: fast.ids(batch, cached=False)

        return make

    reference = [list(ids) for ids in FastTokenizer(path, 256).ids(texts, cached=False)]
    assert [list(ids) for ids in FastTokenizer(path, 256).ids(texts)] == reference, "ids differ"
    variants = [
        ("encode_batch, one core", tokenizer(False)),
        (f"encode_batch, {cores} cores", tokenizer(True)),
        ("word cache, one core", word_cache),
    ]
    now = datetime.datetime.now(UTC)
    print(
        f"# tokenize_bench {now:%Y-%m-%d %H:%M} UTC, {platform.node()} ({cores} cores), "
        f"{len(texts):,} fleet texts, batches of {args.batch}, {args.runs} runs; "
        "ids equal to encode_batch's: yes"
    )
    table, base = [], 0.0
    for name, make in variants:
        rates = [rate(make(), texts, args.batch) for _ in range(args.runs)]
        median = statistics.median(rates)
        base = base or median
        table.append([name, f"{median:,.0f}", f"{min(rates):,.0f}", f"{median / base:.2f}x"])
    print()
    print_table(["variant", "texts/s median", "worst run", "x encode_batch one core"], table)


if __name__ == "__main__":
    main()
