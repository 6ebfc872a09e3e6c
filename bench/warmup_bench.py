"""Warm-up jobs: throughput against the raw engine, and dispatch latency while one runs.

    .venv/bin/python bench/warmup_bench.py [--engine torch|fake] [--device cpu|cuda|auto]
        [--model PATH] [--records 3000] [--runs 3] [--out DIR] [--max-batch-size 64]
        [--chunk-size 500] [--window 20] [--rate 40] [--parts throughput,dispatch]

1. Throughput, on the same ``--records`` synthetic drivers (``features.synthetic``), in
   features (records) per second, median and slowest of ``--runs`` runs:
   - raw engine: ``engine.embed`` of their ``driver_text`` in chunks of max_batch_size
     (tokenize + forward, what the batcher does per batch);
   - warm-up, all misses: ``proxy.warmup.run_warmup`` through ``open_local_services`` on a fresh
     LMDB data dir, the file written by ``features.readers.write_records`` (what
     ``fleetcache warmup FILE`` runs, without the progress bar); then a second pass over
     the same file (all hits, memory tier empty as in a new process);
   - what bounds it: ``engine.tokenize`` alone and ``forward`` on pre-tokenized batches
     (texts/s), and the non-engine stages of the warm-up alone (read + validate, text,
     cache keys + LMDB write-back, index upsert, snapshot) in microseconds per record.
2. Dispatch latency of cached lookups: a ``fleetcache serve`` process (uvicorn) on a fresh
   data dir; this process sends, open loop at ``--rate`` requests/s, alternately
   ``POST /v1/embeddings`` of 8 cached texts and ``POST /v1/dispatch/recommend`` of a
   cached order; ``--window`` seconds idle, then the same while ``POST /v1/warmup`` (a file
   in the data dir, caller ``warmup``, warmup lane) embeds uncached drivers. p50/p99 per
   kind, p99 busy/idle, and whether the job ran for the whole window.

Everything printed is also written to ``--out``/warmup_bench.txt (and .json). Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # also runs as ``python3 bench/warmup_bench.py`` (GPU machine)

from bench.cache_bench import summarize  # noqa: E402
from bench.http_bench import start_server  # noqa: E402
from cache.embedder import CachedEmbedder  # noqa: E402
from engines.base import Engine  # noqa: E402
from engines.registry import create_engine  # noqa: E402
from features.models import DriverRecord  # noqa: E402
from features.readers import iter_rows, write_records  # noqa: E402
from features.synthetic import generate_fleet, iter_fleet  # noqa: E402
from features.text import driver_text  # noqa: E402
from indexes.table import FleetTable  # noqa: E402
from proxy.engine_host import engine_options  # noqa: E402
from proxy.services import build_tiers, open_local_services  # noqa: E402
from proxy.settings import Settings  # noqa: E402
from proxy.warmup import LocalSink, WarmupProgress, checkpoint_for, run_warmup  # noqa: E402

LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def settings_for(args: argparse.Namespace, data_dir: Path) -> Settings:
    return Settings(
        engine=args.engine,
        device=args.device,
        model_path=args.model,
        data_dir=data_dir,
        store="lmdb",
        max_batch_size=args.max_batch_size,
    )


def per_second(count: int, fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return count / (time.perf_counter() - started)


def chunked(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# -- 1. throughput ------------------------------------------------------------------------


def engine_rates(engine: Engine, texts: list[str], batch: int) -> dict[str, float]:
    """Texts/s of embed (tokenize + forward), tokenize alone, forward alone (pre-tokenized)."""
    chunks = chunked(texts, batch)
    rates = {"raw": per_second(len(texts), lambda: [engine.embed(c) for c in chunks])}
    rates["tokenize"] = per_second(len(texts), lambda: [engine.tokenize(c) for c in chunks])
    batches = [engine.tokenize(c) for c in chunks]
    rates["forward"] = per_second(
        len(texts), lambda: [engine.postprocess(engine.forward(b), b) for b in batches]
    )
    return rates


async def warmup_pass(settings: Settings, path: Path, chunk_size: int) -> dict[str, float]:
    """One ``fleetcache warmup FILE`` on ``settings``' data dir, timed from the first row."""
    started = time.perf_counter()
    async with open_local_services(settings) as services:
        opened = time.perf_counter()
        progress = WarmupProgress(source=str(path))
        await run_warmup(
            path,
            LocalSink(services),
            progress,
            chunk_size=chunk_size,
            checkpoint=checkpoint_for(settings.data_dir, path),
        )
        elapsed = time.perf_counter() - opened
        stats = services.engine.batcher.stats()  # type: ignore[attr-defined]
    assert progress.state == "done" and progress.rejected == 0, progress
    engine_s = stats.per_item_ms * stats.items / 1000
    return {
        "rate": progress.indexed / elapsed,
        "embedded": progress.embedded,
        "cached": progress.cached,
        "engine_busy": engine_s / elapsed,
        "mean_batch": stats.mean_batch,
        "open_s": opened - started,
        "close_s": time.perf_counter() - opened - elapsed,
    }


async def stage_costs(
    records: list[DriverRecord], path: Path, settings: Settings, dim: int, chunk: int
) -> dict[str, float]:
    """Microseconds per record of each non-engine stage of a warm-up, alone, one thread."""
    n = len(records)
    vectors = np.random.default_rng(0).standard_normal((chunk, dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)

    async def compute(texts: Sequence[str], lane: str) -> np.ndarray:
        return vectors[: len(texts)]

    us: dict[str, float] = {}
    us["read + validate (iter_rows)"] = 1e6 / per_second(n, lambda: sum(1 for _ in iter_rows(path)))
    texts: list[str] = []
    us["driver_text"] = 1e6 / per_second(n, lambda: texts.extend(map(driver_text, records)))
    embedder = CachedEmbedder(compute, build_tiers(settings), namespace="bench", dim=dim)
    started = time.perf_counter()
    for part in chunked(texts, chunk):
        await embedder.aembed(part, caller="warmup")
    us["cache: keys, LMDB lookup + write"] = (time.perf_counter() - started) * 1e6 / n
    await embedder.aclose()
    index = FleetTable(dim)

    def upsert_all() -> None:
        for part in chunked(records, chunk):
            index.upsert_drivers(part, vectors[: len(part)])

    us["index upsert"] = 1e6 / per_second(n, upsert_all)
    us[f"index snapshot at {n:,} drivers (once)"] = 1e6 / per_second(
        n, lambda: index.save(settings.data_dir / "stage-index")
    )
    return us


def throughput(args: argparse.Namespace, tmp: Path) -> float:
    n, batch = args.records, args.max_batch_size
    records = generate_fleet(n, seed=0)
    texts = [driver_text(r) for r in records]
    path = tmp / "fleet.jsonl"
    write_records(records, path)
    base = settings_for(args, tmp / "raw")
    engine = create_engine(base.engine, **engine_options(base))
    engine.load()
    engine.warmup()
    say(f"engine: {engine.info.kind} on {engine.info.device} ({engine.info.precision})")
    rows: dict[str, list[float]] = {}
    busy: list[dict[str, float]] = []
    stages: list[dict[str, float]] = []
    for run in range(args.runs):
        for name, value in engine_rates(engine, texts, batch).items():
            rows.setdefault(name, []).append(value)
        settings = settings_for(args, tmp / f"run{run}")
        miss = asyncio.run(warmup_pass(settings, path, args.chunk_size))
        hit = asyncio.run(warmup_pass(settings, path, args.chunk_size))
        rows.setdefault("warm-up, all misses", []).append(miss["rate"])
        rows.setdefault("warm-up, all hits (2nd pass)", []).append(hit["rate"])
        busy.append(miss)
        stage_settings = settings_for(args, tmp / f"stages{run}")
        stages.append(
            asyncio.run(stage_costs(records, path, stage_settings, engine.dim, args.chunk_size))
        )
        shutil.rmtree(settings.data_dir)
        shutil.rmtree(stage_settings.data_dir)
        say(
            f"run {run + 1}: raw {rows['raw'][-1]:,.0f}/s, warm-up {miss['rate']:,.0f}/s "
            f"({miss['embedded']:.0f} embedded, {miss['cached']:.0f} cached), "
            f"hits {hit['rate']:,.0f}/s ({hit['cached']:.0f} cached)"
        )
    engine.close()

    med = {name: statistics.median(values) for name, values in rows.items()}
    raw = med["raw"]
    distinct = len(set(texts))
    say()
    say(
        f"## 1. throughput: {n:,} drivers ({distinct:,} distinct texts), max_batch_size {batch}, "
        f"chunk {args.chunk_size}, {args.runs} runs"
    )
    say(f"{'path':<34}{'median /s':>12}{'slowest /s':>12}{'x raw':>8}")
    labels = {
        "raw": "raw engine.embed per batch",
        "warm-up, all misses": "warm-up, all misses",
        "warm-up, all hits (2nd pass)": "warm-up, all hits (2nd pass)",
    }
    for key, label in labels.items():
        say(f"{label:<34}{med[key]:>12,.0f}{min(rows[key]):>12,.0f}{med[key] / raw:>7.2f}x")
    ratio = med["warm-up, all misses"] / raw
    verdict = "met" if ratio >= 0.9 else "MISSED"
    say(f"warm-up / raw engine = {ratio:.1%} (target >= 90%: {verdict})")

    def each(key: str, fmt: str) -> str:
        return ", ".join(format(b[key], fmt) for b in busy)

    say(
        f"warm-up, all misses: engine busy {each('engine_busy', '.0%')} of the job; mean batch "
        f"{each('mean_batch', '.1f')}; open_local_services {each('open_s', '.1f')} s, close "
        f"(snapshot) {each('close_s', '.2f')} s (not in the rate)"
    )

    tok, fwd = med["tokenize"], med["forward"]
    say()
    say(f"## what bounds it (texts/s, batches of {batch}, one thread calling the engine)")
    say(f"{'tokenize alone (engine.tokenize)':<44}{tok:>12,.0f}")
    say(f"{'forward alone (pre-tokenized batches)':<44}{fwd:>12,.0f}")
    say(f"{'serial tokenize + forward (raw)':<44}{raw:>12,.0f}")
    say(f"{'ceiling with tokenization overlapped':<44}{min(tok, fwd):>12,.0f}")
    say(f"bound: {'tokenizer' if tok < fwd else 'forward (device)'}")

    say()
    say("## non-engine stages of the warm-up, alone (median us per record; one thread)")
    total = 0.0
    for name in stages[0]:
        value = statistics.median(s[name] for s in stages)
        total += value if "snapshot" not in name else 0.0
        say(f"{name:<44}{value:>10.1f} us")
    engine_us = 1e6 / raw
    say(f"{'sum per record (snapshot excluded)':<44}{total:>10.1f} us  -> {1e6 / total:,.0f}/s")
    say(f"{'raw engine per record':<44}{engine_us:>10.1f} us")
    serial = 1e6 / (total + engine_us)
    say(f"if not overlapped with the engine: {serial:,.0f}/s ({serial / raw:.1%} of raw)")
    return med["warm-up, all misses"]


# -- 2. dispatch latency while a warm-up runs ---------------------------------------------


def orders(drivers: list[DriverRecord], count: int) -> list[dict[str, Any]]:
    """Orders at drivers' positions (so candidates exist), with varied texts."""
    rng = random.Random(3)
    constraints = ["electric_only", "refrigerated", "tail_lift", "english_speaking"]
    out = []
    for i in range(count):
        d = drivers[rng.randrange(len(drivers))]
        out.append(
            {
                "order_id": f"O{i}",
                "pickup": {"lat": d.position.lat, "lng": d.position.lng},
                "cargo": {"weight_kg": rng.choice([5, 50, 300]), "volume_m3": 0.1},
                "constraints": rng.sample(constraints, rng.randint(0, 1)),
                "requirements": f"bench order {i}",
                "radius_km": 10.0,
            }
        )
    return out


async def open_loop(
    client: httpx.AsyncClient,
    texts: list[str],
    order_bodies: list[dict[str, Any]],
    rate: float,
    seconds: float,
) -> dict[str, list[float]]:
    """Requests sent on a fixed schedule whatever the answers (no coordinated omission)."""
    rng = random.Random(5)
    latencies: dict[str, list[float]] = {"embeddings": [], "recommend": [], "missed": []}

    async def one(kind: str) -> None:
        started = time.perf_counter()
        if kind == "embeddings":
            r = await client.post("/v1/embeddings", json={"input": rng.sample(texts, 8)})
        else:
            r = await client.post("/v1/dispatch/recommend", json=rng.choice(order_bodies))
        r.raise_for_status()
        latencies[kind].append((time.perf_counter() - started) * 1000)
        if r.headers.get("X-Cache-Misses", "0") != "0":  # should never happen: all cached
            latencies["missed"].append(latencies[kind][-1])

    tasks = []
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one("embeddings" if i % 2 == 0 else "recommend")))
    await asyncio.gather(*tasks)
    return latencies


async def poll_job(
    client: httpx.AsyncClient, job_id: str, until: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """``GET /v1/warmup/{id}`` every 50 ms until ``until(progress)``; the last progress."""
    while True:
        response = await client.get(f"/v1/warmup/{job_id}")
        response.raise_for_status()
        progress: dict[str, Any] = response.json()
        if until(progress):
            return progress
        await asyncio.sleep(0.05)


async def dispatch_runs(
    args: argparse.Namespace, url: str, drivers: list[DriverRecord], source: str
) -> tuple[dict[str, list[list[float]]], list[str]]:
    texts = [driver_text(d) for d in drivers]
    order_bodies = orders(drivers, 64)
    phases: dict[str, list[list[float]]] = {}
    notes = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for part in chunked(drivers, 1000):  # the fleet and its texts: cached
            body = {"drivers": [d.model_dump(mode="json") for d in part]}
            (await client.put("/v1/fleet/drivers", json=body)).raise_for_status()
        for order in order_bodies:  # every order text cached
            (await client.post("/v1/dispatch/recommend", json=order)).raise_for_status()
        await open_loop(client, texts, order_bodies, args.rate, 2.0)  # connections warm
        for run in range(args.runs):
            idle = await open_loop(client, texts, order_bodies, args.rate, args.window)
            start = await client.post(
                "/v1/warmup", json={"path": source, "chunk_size": args.chunk_size}
            )
            start.raise_for_status()
            job_id = start.json()["id"]
            # from the moment the job reads and embeds rows
            before = await poll_job(
                client, job_id, lambda p: p["state"] != "running" or p["rows"] > p["resumed_from"]
            )
            busy = await open_loop(client, texts, order_bodies, args.rate, args.window)
            after = await poll_job(client, job_id, lambda p: True)
            whole = after["state"] == "running" and after["embedded"] > before["embedded"]
            notes.append(
                f"run {run + 1}: job {job_id} rows {before['rows']:,} -> {after['rows']:,}, "
                f"embedded {before['embedded']:,} -> {after['embedded']:,}, state at window end "
                f"{after['state']}: running for the whole window: {'yes' if whole else 'NO'}; "
                f"cached lookups that missed: idle {len(idle['missed'])}, "
                f"busy {len(busy['missed'])}"
            )
            (await client.delete(f"/v1/warmup/{job_id}")).raise_for_status()
            await poll_job(client, job_id, lambda p: p["state"] != "running")
            for phase, lat in (("idle", idle), ("busy", busy)):
                for kind in ("embeddings", "recommend"):
                    phases.setdefault(f"{phase} {kind}", []).append(lat[kind])
                phases.setdefault(f"{phase} all", []).append(lat["embeddings"] + lat["recommend"])
        stats = (await client.get("/v1/stats")).json()
    notes.append(
        f"server: by_caller {stats['by_caller']}, inference mean_batch "
        f"{stats['inference']['mean_batch']:.1f}, "
        f"p50 batch {stats['inference']['p50_batch_ms']:.1f} ms; "
        f"store tier {stats['cache']['tiers']['store']}"
    )
    return phases, notes


def dispatch(args: argparse.Namespace, tmp: Path, warmup_rate: float | None) -> None:
    data_dir = tmp / "server"
    (data_dir / "src").mkdir(parents=True)
    per_run = args.dispatch_warmup_records
    if per_run is None:  # enough rows to outlast the window, from the measured rate
        per_run = int((warmup_rate or 5_000) * (args.window + 15) * 1.5)
    total = min(per_run * args.runs, args.max_warmup_records)
    started = time.perf_counter()
    # One file; each busy window's job resumes where the previous (cancelled) one stopped.
    # Ids of its own: a driver re-embedded with new features drops its old cached vector.
    fresh = (
        d.model_copy(update={"driver_id": f"W{i:07d}"})
        for i, d in enumerate(iter_fleet(total, seed=1000))
    )
    write_records(fresh, data_dir / "src" / "warmup.jsonl")
    say(
        f"wrote {total:,} uncached drivers for the warm-up in {time.perf_counter() - started:.0f} s"
    )
    drivers = generate_fleet(args.fleet, seed=7)
    options = {"device": args.device, "store": "lmdb", "max_batch_size": str(args.max_batch_size)}
    if args.model:
        options["model_path"] = args.model
    os.environ.update(item.split("=", 1) for item in args.server_env)  # the proxy inherits them
    proc, url = start_server(args.engine, data_dir, **options)
    try:
        phases, notes = asyncio.run(dispatch_runs(args, url, drivers, "src/warmup.jsonl"))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        shutil.copy(data_dir / "server.log", Path(args.out) / "server.log")
    say()
    say(
        f"## 2. dispatch latency of cached lookups, {args.rate:g} req/s open loop (alternately "
        f"/v1/embeddings of 8 cached texts and recommend of a cached order), {args.window:g} s "
        f"per phase, fleet {args.fleet:,}; median over {args.runs} runs of each run's p50/p99"
    )
    say(
        f"{'requests':<12}{'idle p50':>10}{'idle p99':>10}{'busy p50':>10}{'busy p99':>10}"
        f"{'p99 busy/idle':>15}{'n/run':>7}"
    )
    for kind in ("embeddings", "recommend", "all"):
        cells = {}
        for phase in ("idle", "busy"):
            per_run_stats = [summarize(lat) for lat in phases[f"{phase} {kind}"]]
            cells[phase] = [statistics.median(s[i] for s in per_run_stats) for i in (0, 1)]
        ratio = cells["busy"][1] / cells["idle"][1]
        flag = "" if ratio <= 1.5 else "  MISSED (target <= 1.5x)"
        count = len(phases[f"idle {kind}"][0])
        say(
            f"{kind:<12}{cells['idle'][0]:>10.2f}{cells['idle'][1]:>10.2f}"
            f"{cells['busy'][0]:>10.2f}{cells['busy'][1]:>10.2f}{ratio:>14.2f}x{count:>7}{flag}"
        )
    for note in notes:
        say(note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", default="torch", choices=["torch", "fake"])
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    parser.add_argument("--model", default=None, help="model dir (default: the bundled one)")
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench-out/warmup")
    parser.add_argument("--max-batch-size", type=int, default=Settings().max_batch_size)
    parser.add_argument("--chunk-size", type=int, default=500, help="warm-up rows per chunk")
    parser.add_argument("--parts", default="throughput,dispatch")
    parser.add_argument("--window", type=float, default=20.0, help="seconds per phase")
    parser.add_argument("--rate", type=float, default=40.0, help="dispatch requests/s")
    parser.add_argument("--fleet", type=int, default=2000, help="drivers in the index")
    parser.add_argument("--dispatch-warmup-records", type=int, default=None, help="per run")
    parser.add_argument("--max-warmup-records", type=int, default=2_000_000)
    parser.add_argument(
        "--server-env", action="append", default=[], help="KEY=VALUE for the proxy process"
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say(f"# warmup_bench {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")
    say(f"command: {' '.join(sys.argv)}")
    say(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, load {os.getloadavg()[0]:.2f}"
    )
    warmup_rate = None
    with tempfile.TemporaryDirectory(prefix="warmup-bench-") as tmp:
        if "throughput" in parts:
            warmup_rate = throughput(args, Path(tmp))
        if "dispatch" in parts:
            dispatch(args, Path(tmp), warmup_rate)
    say(f"load at the end {os.getloadavg()[0]:.2f}")
    (out / "warmup_bench.txt").write_text("\n".join(LINES) + "\n")
    (out / "warmup_bench.json").write_text(json.dumps({"argv": sys.argv, "lines": LINES}))


if __name__ == "__main__":
    main()
