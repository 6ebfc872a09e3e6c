"""What grouping warm-up texts by length saves the device: the real ``Batcher`` over a
``TorchEngine`` (fixed shapes), fed as a warm-up job feeds it, with its batches formed in
submission order (``Batcher(by_length=False)``) against the shortest first, in turns.

A job's shards send calls of up to 256 driver texts with their token ids on the warm-up lane,
several in flight each, so the lane holds more than a batch. A forward costs its size x its
longest padded text: driver texts are 31-84 tokens, padded to 64 or 96, and in submission
order nearly every batch of 256 holds one over 64. This runs ``--shards`` clients each keeping
``--depth`` calls of ``--call`` texts in flight over ``--texts`` driver texts, ``--runs``
times each way (each going first in turn), and stops with an error unless both ways give
each text the same vector (lowest cosine of the unit vectors at least 0.9999).

    python -m bench.warmup_batch_bench --model M --device cuda [--texts 100000] [--runs 3]

Prints per way (medians of the runs): texts/s (and the worst run's), batches and their mean
padded columns, the engine's ms a batch (tokenize, forward and postprocess: the batcher's
``engine_ms``), the p99 of a call's time from submit to rows, and the ratio to submission
order. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import time
from typing import Any

import numpy as np

from engines.base import Batch, Vectors
from engines.batcher import Batcher
from engines.tokenization import TokenizedTexts
from engines.torch_engine import TorchEngine
from features.synthetic import iter_fleet
from features.text import driver_text

WAYS = {"submission order": False, "shortest first": True}  # Batcher(by_length=...)
KEYS = ("s", "p99", "ms", "batches", "columns")


class Columns(TorchEngine):
    """Records each forward's padded columns."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.columns: list[int] = []

    def forward(self, batch: Batch) -> Vectors:
        assert batch.seq_lengths is not None
        self.columns.append(int(batch.seq_lengths.max()))
        return super().forward(batch)


async def job(
    engine: Columns, calls: list[list[str]], in_flight: int, size: int, by_length: bool
) -> tuple[dict[str, float], Vectors]:
    """Every call on the warm-up lane, ``in_flight`` at once: the run's figures (``KEYS``)
    and the rows in call order."""
    rows: list[Vectors | None] = [None] * len(calls)
    latencies: list[float] = []
    engine.columns = []
    async with Batcher(
        engine, max_batch_size=size, max_batch_tokens=32_768, by_length=by_length
    ) as batcher:
        pending = iter(range(len(calls)))

        async def client() -> None:
            for index in pending:
                began = time.perf_counter()
                rows[index] = await batcher.submit(calls[index], "warmup")
                latencies.append(time.perf_counter() - began)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(in_flight)))
        seconds = time.perf_counter() - started
        stats = batcher.stats()
    figures = {
        "s": seconds,
        "p99": float(np.percentile(latencies, 99)) * 1e3,
        "ms": stats.engine_ms / stats.batches,
        "batches": stats.batches,
        "columns": statistics.mean(engine.columns),
    }
    return figures, np.concatenate([r for r in rows if r is not None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--texts", type=int, default=100_000)
    parser.add_argument("--call", type=int, default=256, help="texts a call (a shard's merge)")
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--depth", type=int, default=2, help="calls in flight a shard")
    parser.add_argument("--batch", type=int, default=256, help="max_batch_size")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    engine = Columns(args.model, args.device, static_shapes=True)
    engine.load()
    engine.warmup()
    fast = engine.tokenizer()
    assert fast is not None
    texts = [driver_text(r) for r in iter_fleet(args.texts, seed=23)]
    calls = [
        TokenizedTexts.of(part, fast.ids(part))
        for part in (texts[i : i + args.call] for i in range(0, len(texts), args.call))
    ]
    results: dict[str, dict[str, list[float]]] = {w: {k: [] for k in KEYS} for w in WAYS}
    vectors: dict[str, Vectors] = {}
    for run in range(args.runs):
        for way in list(WAYS)[:: -1 if run % 2 else 1]:  # in turns, each going first in turn
            figures, vectors[way] = asyncio.run(
                job(engine, list(calls), args.shards * args.depth, args.batch, WAYS[way])
            )
            for key in KEYS:
                results[way][key].append(figures[key])
    first, second = vectors.values()
    cosine = float(np.min(np.sum(first * second, axis=1)))
    if cosine < 0.9999:
        raise SystemExit(f"the two ways gave different vectors: lowest cosine {cosine:.6f}")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    device = args.device
    if device.startswith("cuda"):
        import torch

        device = torch.cuda.get_device_name()
    print(f"# warmup_batch_bench {now}, {platform.node()}, {device}")
    print(
        f"{len(texts):,} driver texts in calls of {args.call}, {args.shards} shards x "
        f"{args.depth} in flight, batches of {args.batch}, {args.runs} runs; lowest cosine "
        f"between the ways {cosine:.6f}"
    )
    print("| way | texts/s (worst) | batches | columns | engine ms a batch | call p99 ms | x |")
    print("|---|---|---|---|---|---|---|")
    base = statistics.median(results["submission order"]["s"])
    for way, runs in results.items():
        med = {key: statistics.median(values) for key, values in runs.items()}
        print(
            f"| {way} | {len(texts) / med['s']:,.0f} ({len(texts) / max(runs['s']):,.0f}) | "
            f"{med['batches']:,.0f} | {med['columns']:.1f} | {med['ms']:.2f} | "
            f"{med['p99']:.1f} | {base / med['s']:.2f}x |"
        )


if __name__ == "__main__":
    main()
