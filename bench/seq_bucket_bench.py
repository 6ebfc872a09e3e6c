"""What the sequence buckets cost the GPU's forward on fleet texts: ``TorchEngine`` with the
default buckets against the same with more of them, on the same driver texts.

A fleet's driver texts are 31-86 tokens (median 60, the model's tokenizer); with the default
buckets (16, 32, 64, 128, 256) a batch of them runs at 128 columns. This times the forward
alone (``tokenize`` done first, then ``forward`` + ``postprocess``, synchronised) of batches
of ``--batch`` texts, each engine in turn, ``--runs`` times ``--repeats`` batches, and checks
that both give the same vectors (cosine).

    python -m bench.seq_bucket_bench --model M --device cuda [--batch 256] [--runs 5]

Prints per engine: the bucket the batches ran at, ms a batch (median of runs, worst run),
texts/s, and the ratio to the default. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import numpy as np

from engines.tokenization import DEFAULT_SEQ_BUCKETS
from engines.torch_engine import TorchEngine
from features.synthetic import iter_fleet
from features.text import driver_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--buckets", type=int, nargs="+", default=[16, 32, 48, 64, 96, 128, 192])
    args = parser.parse_args()
    texts = [driver_text(r) for r in iter_fleet(args.batch * 8, seed=11)]
    batches = [texts[i : i + args.batch] for i in range(0, len(texts), args.batch)]
    variants = {
        f"default {DEFAULT_SEQ_BUCKETS}": TorchEngine(args.model, args.device),
        f"buckets {tuple(args.buckets)}": TorchEngine(
            args.model, args.device, seq_buckets=args.buckets
        ),
    }
    for engine in variants.values():
        engine.load()
        engine.warmup()
    import torch

    tokenized = {name: [e.tokenize(b) for b in batches] for name, e in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.runs):
        for name, engine in variants.items():  # in turns
            torch.cuda.synchronize()
            started = time.perf_counter()
            for i in range(args.repeats):
                batch = tokenized[name][i % len(batches)]
                engine.postprocess(engine.forward(batch), batch)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - started) / args.repeats * 1e3)
    vectors = [np.concatenate([e.embed(b) for b in batches]) for e in variants.values()]
    cosine = float(np.min(np.sum(vectors[0] * vectors[1], axis=1)))
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# seq_bucket_bench {now}, {platform.node()}, {torch.cuda.get_device_name()}")
    print(f"{len(texts)} driver texts in batches of {args.batch}; lowest cosine {cosine:.6f}")
    print("| buckets | columns a batch | ms a batch (worst run) | texts/s | x default |")
    print("|---|---|---|---|---|")
    base = statistics.median(next(iter(times.values())))
    for name, runs in times.items():
        ms = statistics.median(runs)
        columns = sorted({int(b.seq_lengths.max()) for b in tokenized[name]})  # type: ignore[union-attr]
        print(
            f"| {name} | {columns} | {ms:.2f} ({max(runs):.2f}) | {args.batch / ms * 1e3:,.0f} "
            f"| {base / ms:.2f}x |"
        )


if __name__ == "__main__":
    main()
