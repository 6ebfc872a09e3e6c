"""GPU benchmark of the torch engine and the batcher: one run, one table.

    python3 bench/gpu_bench.py --model PATH [--texts 1000] [--out DIR] [--quick] [--http]

Measures, all on the same synthetic fleet texts:

1. parity: every engine variant vs sentence-transformers fp32 on the same device
   (cosine per text; targets >= 0.999 fp16, >= 0.9999 fp32);
2. raw engine: per batch size, the p50 latency of ``forward`` alone (pre-tokenized, host to
   device copy, forward, device to host copy) and of ``embed`` (tokenization included),
   eager at bucket shapes vs CUDA graphs, plus the plain sentence-transformers path;
3. the batcher under 64 concurrent submitters of 1-32 texts each, against the raw engine
   at the batch size the batcher formed, and against one forward per text;
4. with ``--http``: the full proxy (``fleetcache serve`` on loopback, this process as the
   load generator) on the same GPU: requests of 32 new texts (all misses) and of 32 cached
   texts at 64 concurrent connections from 4 client processes, against one forward per text.

Writes ``gpu_bench.md`` and ``gpu_bench.json`` under ``--out``. Runs on the CPU with
``--quick`` (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.batcher import Batcher
from engines.torch_engine import TorchEngine

ROLES = ["van", "box truck", "reefer", "flatbed", "cargo bike", "minibus", "tanker"]
SKILLS = ["hazmat", "liftgate", "pallet jack", "cold chain", "wheelchair ramp", "night shift"]
CITIES = ["Berlin", "Hamburg", "München", "Köln", "Leipzig", "Madrid", "Lyon", "Gdańsk"]


def make_texts(count: int, seed: int = 7) -> list[str]:
    """Deterministic fleet records of 20-70 tokens."""
    rng = random.Random(seed)
    texts = []
    for i in range(count):
        skills = ", ".join(rng.sample(SKILLS, rng.randint(1, 4)))
        note = " ".join(rng.choice(["urgent", "fragile", "returns", "weekend"]) for _ in range(6))
        texts.append(
            f"driver {i} | {rng.choice(ROLES)} | {rng.choice(CITIES)} zone {rng.randint(1, 40)}"
            f" | skills: {skills} | capacity {rng.randint(50, 24000)} kg"
            + (f" | notes: {note}" if rng.random() < 0.5 else "")
        )
    return texts


def p50_ms(fn: Callable[[], object], min_iters: int, budget_s: float) -> tuple[float, float]:
    """(p50, p99) of fn() in ms after 3 warm calls; at least min_iters, up to budget_s."""
    for _ in range(3):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < min_iters or time.perf_counter() < deadline:
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
        if len(times) >= 10_000:
            break
    p50, p99 = np.percentile(times, [50, 99])
    return float(p50), float(p99)


def cosines(vectors: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    ref = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    cos = np.sum(vectors * ref, axis=1) / np.linalg.norm(vectors, axis=1)
    return float(cos.min()), float(cos.mean())


async def batcher_run(
    engine: TorchEngine, texts: Sequence[str], clients: int, total: int, max_batch: int
) -> dict[str, Any]:
    latencies: list[float] = []
    done = 0
    rng = random.Random(11)

    async def client(limit: int) -> None:
        nonlocal done
        while done < limit:
            n = rng.randint(1, 32)
            start = rng.randrange(len(texts) - n)
            done += n
            started = time.perf_counter()
            await batcher.submit(texts[start : start + n])
            latencies.append((time.perf_counter() - started) * 1000)

    async with Batcher(engine, max_batch_size=max_batch, max_delay_ms=2.0) as batcher:
        await asyncio.gather(*(client(min(total, 2000)) for _ in range(clients)))  # warm
        done, latencies = 0, []
        started = time.perf_counter()
        await asyncio.gather(*(client(total) for _ in range(clients)))
        elapsed = time.perf_counter() - started
        stats = batcher.stats()
    p50, p99 = np.percentile(latencies, [50, 99])
    return {
        "max_batch": max_batch,
        "texts": done,
        "texts_per_s": done / elapsed,
        "mean_batch": stats.mean_batch,
        "batch_p50_ms": stats.p50_batch_ms,
        "request_p50_ms": float(p50),
        "request_p99_ms": float(p99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="sentence-transformers model directory")
    parser.add_argument("--texts", type=int, default=1000, help="parity texts")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke test)")
    parser.add_argument("--http", action="store_true", help="also the full proxy over HTTP")
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    cuda = torch.cuda.is_available() and not args.quick
    device = "cuda" if cuda else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = make_texts(max(args.texts, 4096))
    batch_sizes = [1, 8, 32, 64, 128, 256, 1024] if not args.quick else [1, 8]
    buckets = {} if not args.quick else {"batch_buckets": (1, 8), "seq_buckets": (64,)}
    budget = 0.6 if not args.quick else 0.05
    lines: list[str] = []
    results: dict[str, Any] = {}

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    gpu = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
    say(f"# gpu_bench {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}")
    say(f"device {device} ({gpu}); torch {torch.__version__}; python {platform.python_version()}")
    say(f"command: {' '.join(sys.argv)}")

    # -- engines ------------------------------------------------------------------------------
    started = time.perf_counter()
    engines: dict[str, TorchEngine] = {
        "graphs-fp16": TorchEngine(args.model, device=device, fp16=cuda, **buckets),
        "eager-fp16": TorchEngine(args.model, device=device, fp16=cuda, cuda_graphs=False),
        "graphs-fp32": TorchEngine(args.model, device=device, fp16=False, **buckets),
        "st-fp16": TorchEngine(args.model, device=device, fp16=cuda, static_shapes=False),
    }
    if args.quick:
        engines["eager-fp16"] = TorchEngine(
            args.model, device=device, static_shapes=True, cuda_graphs=False, **buckets
        )
        engines["graphs-fp16"] = TorchEngine(
            args.model, device=device, static_shapes=True, **buckets
        )
    warm_s = {}
    for name, engine in engines.items():
        t0 = time.perf_counter()
        engine.load()
        engine.warmup()
        warm_s[name] = time.perf_counter() - t0
        say(f"loaded+warmed {name}: {warm_s[name]:.1f} s; health {engine.health()}")
    say(f"all engines ready in {time.perf_counter() - started:.1f} s")
    results["warmup_s"] = warm_s

    # -- parity ---------------------------------------------------------------------------------
    reference_model = SentenceTransformer(args.model, device=device).float()
    parity_texts = texts[: args.texts]
    reference = reference_model.encode(parity_texts, batch_size=64, normalize_embeddings=True)
    say()
    say(f"## parity vs sentence-transformers fp32 on {device}, {len(parity_texts)} texts")
    say("| engine | cos min | cos mean | target |")
    say("|---|---|---|---|")
    results["parity"] = {}
    for name, engine in engines.items():
        vectors = np.concatenate(
            [engine.embed(parity_texts[i : i + 256]) for i in range(0, len(parity_texts), 256)]
        )
        low, mean = cosines(vectors, reference)
        target = 0.999 if engine.info.precision == "fp16" else 0.9999
        verdict = "ok" if low >= target else "MISS"
        say(f"| {name} | {low:.6f} | {mean:.6f} | >= {target} {verdict} |")
        results["parity"][name] = {"min": low, "mean": mean, "target": target}
    del reference_model

    # -- raw engine -----------------------------------------------------------------------------
    say()
    say("## raw engine, p50 ms per call (texts/s at p50); forward = pre-tokenized batch")
    names = list(engines)
    say(
        "| batch | "
        + " | ".join(f"{n} fwd" for n in names)
        + " | "
        + " | ".join(f"{n} embed" for n in names)
        + " |"
    )
    say("|---" * (1 + 2 * len(names)) + "|")
    results["raw"] = {}
    for size in batch_sizes:
        batch_texts = texts[:size]
        row: dict[str, Any] = {}
        cells_fwd, cells_embed = [], []
        for name, engine in engines.items():
            tokens = engine.tokenize(batch_texts)
            fwd, fwd99 = p50_ms(lambda e=engine, t=tokens: e.forward(t), 20, budget)
            emb, _ = p50_ms(lambda e=engine, b=batch_texts: e.embed(b), 20, budget)
            row[name] = {"forward_p50_ms": fwd, "forward_p99_ms": fwd99, "embed_p50_ms": emb}
            cells_fwd.append(f"{fwd:.3f} ({size / fwd * 1000:,.0f}/s)")
            cells_embed.append(f"{emb:.3f} ({size / emb * 1000:,.0f}/s)")
        results["raw"][size] = row
        say(f"| {size} | " + " | ".join(cells_fwd + cells_embed) + " |")

    # -- batcher ---------------------------------------------------------------------------------
    say()
    say("## batcher: 64 concurrent submitters of 1-32 texts (graphs-fp16 engine)")
    engine = engines["graphs-fp16"]
    total = 40_000 if not args.quick else 400
    runs = []
    for max_batch in (64, 256) if not args.quick else (8,):
        runs.append(asyncio.run(batcher_run(engine, texts, 64, total, max_batch)))
    say(
        "| max_batch | texts | texts/s | mean batch | batch p50 ms | req p50 ms | req p99 ms"
        " | raw embed at that batch, texts/s | batcher / raw |"
    )
    say("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        size = max(1, round(run["mean_batch"]))
        raw, _ = p50_ms(lambda s=size: engine.embed(texts[:s]), 20, budget)
        run["raw_texts_per_s"] = size / raw * 1000
        run["ratio"] = run["texts_per_s"] / run["raw_texts_per_s"]
        say(
            f"| {run['max_batch']} | {run['texts']} | {run['texts_per_s']:,.0f} "
            f"| {run['mean_batch']:.1f} | {run['batch_p50_ms']:.3f} | {run['request_p50_ms']:.2f} "
            f"| {run['request_p99_ms']:.2f} | {run['raw_texts_per_s']:,.0f} | {run['ratio']:.2f} |"
        )
    results["batcher"] = runs

    # -- one forward per text ------------------------------------------------------------------
    say()
    say("## one text per forward (the baseline batching must beat)")
    per_text = {}
    for name in ("st-fp16", "graphs-fp16"):
        one, one99 = p50_ms(lambda n=name: engines[n].embed(texts[:1]), 50, budget)
        per_text[name] = {"p50_ms": one, "p99_ms": one99, "texts_per_s": 1000 / one}
        say(f"{name}: p50 {one:.3f} ms, p99 {one99:.3f} ms -> {1000 / one:,.0f} texts/s")
    best = max(run["texts_per_s"] for run in runs)
    say(
        f"batcher best {best:,.0f} texts/s = {best / per_text['st-fp16']['texts_per_s']:.1f}x "
        f"one-text-per-forward (st-fp16)"
    )
    results["per_text"] = per_text
    for engine in engines.values():
        engine.close()
    if args.http:
        say()
        say(
            "## full proxy over HTTP (fleetcache serve, torch engine, max_batch_size 256; "
            "64 connections from 4 load processes)"
        )
        rows = http_run(args.model, device, texts, concurrency=64, requests=200 if cuda else 8)
        say("| requests of 32 texts | p50 ms | p99 ms | texts/s | vs one text per forward |")
        say("|---|---|---|---|---|")
        for kind, row in rows.items():
            ratio = row["texts_per_s"] / per_text["st-fp16"]["texts_per_s"]
            say(
                f"| {kind} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} "
                f"| {row['texts_per_s']:,.0f} | {ratio:.1f}x |"
            )
        say(f"server: {rows['all new (misses)']['server']}")
        results["http"] = rows
    results["meta"] = {"device": device, "gpu": gpu, "torch": torch.__version__, "argv": sys.argv}
    (out / "gpu_bench.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_bench.json").write_text(json.dumps(results, indent=1, default=str))
    print(
        f"wrote {out / 'gpu_bench.md'}; median warm-up {statistics.median(warm_s.values()):.1f} s"
    )


def http_run(
    model: str, device: str, texts: list[str], concurrency: int, requests: int
) -> dict[str, dict[str, Any]]:
    """All-miss then all-hit requests of 32 texts against a real server on this machine."""
    import tempfile

    import httpx

    from bench.http_bench import load_processes, start_server

    size = 32
    fresh = [f"{t} #{i}" for i, t in enumerate(texts * (requests * size // len(texts) + 1))]
    new = [fresh[i : i + size] for i in range(0, requests * size, size)]
    rng = random.Random(3)
    cached = [rng.sample(fresh[: requests * size], size) for _ in range(requests)]
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(
            "torch", Path(tmp) / "data", device=device, model_path=model, max_batch_size="256"
        )
        try:
            for kind, batches in (("all new (misses)", new), ("all cached (hits)", cached)):
                latencies, rps = load_processes(url, batches, concurrency, processes=4)
                rows[kind] = {
                    "p50_ms": float(np.percentile(latencies, 50)),
                    "p99_ms": float(np.percentile(latencies, 99)),
                    "texts_per_s": rps * size,
                }
            stats = httpx.get(f"{url}/v1/stats").json()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    inference = stats["inference"]
    rows["all new (misses)"]["server"] = (
        f"hits={stats['cache']['hits']} misses={stats['cache']['misses']} "
        f"items={inference['items']} mean_batch={inference['mean_batch']:.1f} "
        f"p99_batch_ms={inference['p99_batch_ms']:.2f}"
    )
    return rows


if __name__ == "__main__":
    main()
