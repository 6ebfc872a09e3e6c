"""Cached vs new texts over HTTP: a real ``fleetcache serve`` process, a separate load process.

Usage: python bench/http_bench.py [--engine torch|fake] [--concurrency 8] [--requests 200]
                                   [--new-requests 40] [--texts 32] [--runs 3]

Starts the proxy on a free loopback port with an empty data dir, prefills a pool of texts,
then sends requests of ``--texts`` texts at a fixed concurrency: first all cached (random
draws from the pool), then all new (never seen). Prints p50/p99 latency, requests/s and the
ratios, as the median over ``--runs`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    engine: str, data_dir: Path, **settings: str
) -> tuple[subprocess.Popen[bytes], str]:
    """``fleetcache serve`` on a free port; ``settings`` are extra FLEETCACHE_* variables
    (lower-case names, e.g. ``device="cuda"``, ``model_path=...``)."""
    port = free_port()
    env = {
        **os.environ,
        "FLEETCACHE_ENGINE": engine,
        "FLEETCACHE_DATA_DIR": str(data_dir),
        "FLEETCACHE_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        **{f"FLEETCACHE_{name.upper()}": value for name, value in settings.items()},
    }
    cmd = [
        sys.executable,
        "-m",
        "proxy.cli",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "server.log"
    with log.open("wb") as sink:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=sink, stderr=sink, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"server did not become ready; its log ends with:\n{tail}")


async def load(url: str, batches: list[list[str]], concurrency: int) -> tuple[list[float], float]:
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for batch in batches:
        queue.put_nowait(batch)
    latencies: list[float] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            batch = queue.get_nowait()
            t0 = time.perf_counter()
            r = await client.post("/v1/embeddings", json={"input": batch})
            latencies.append((time.perf_counter() - t0) * 1000)
            r.raise_for_status()

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return latencies, len(batches) / elapsed


def _load_in_process(args: tuple[str, list[list[str]], int, float]) -> tuple[list[float], float]:
    url, batches, concurrency, start_at = args
    time.sleep(max(0.0, start_at - time.time()))  # every process starts together
    latencies, _ = asyncio.run(load(url, batches, concurrency))
    return latencies, time.time()


def load_processes(
    url: str, batches: list[list[str]], concurrency: int, processes: int
) -> tuple[list[float], float]:
    """``load`` split over ``processes`` client processes (one Python client tops out near a
    few hundred requests/s): the pooled latencies and the requests/s of all of them."""
    import multiprocessing

    start_at = time.time() + 1.0
    shares = [
        (url, batches[i::processes], max(1, concurrency // processes), start_at)
        for i in range(processes)
    ]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        results = pool.map(_load_in_process, shares)
    latencies = [ms for part, _ in results for ms in part]
    return latencies, len(batches) / (max(end for _, end in results) - start_at)


def text(i: int, tag: str) -> str:
    return f"{tag} electric van {i % 97}, tail lift; capacity {600 + i % 900} kg; zone {i}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="torch")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--new-requests", type=int, default=40)
    ap.add_argument("--texts", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(args.engine, Path(tmp) / "data")
        try:
            pool = [text(i, "pool") for i in range(1024)]
            for start in range(0, len(pool), 256):
                httpx.post(
                    f"{url}/v1/embeddings", json={"input": pool[start : start + 256]}, timeout=600
                ).raise_for_status()
            rows = {"cached": [], "new": []}
            for run in range(args.runs):
                cached = [rng.sample(pool, args.texts) for _ in range(args.requests)]
                new = [
                    [text(i, f"new{run}-{r}") for i in range(args.texts)]
                    for r in range(args.new_requests)
                ]
                for kind, batches in (("cached", cached), ("new", new)):
                    lat, rps = asyncio.run(load(url, batches, args.concurrency))
                    rows[kind].append((np.percentile(lat, 50), np.percentile(lat, 99), rps))
            stats = httpx.get(f"{url}/v1/stats").json()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    med = {k: [statistics.median(r[i] for r in v) for i in range(3)] for k, v in rows.items()}
    print(
        f"engine={args.engine} concurrency={args.concurrency} texts/request={args.texts} "
        f"runs={args.runs} (median of runs)"
    )
    print(f"{'requests':<10}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}")
    for kind in ("cached", "new"):
        p50, p99, rps = med[kind]
        print(f"{kind:<10}{p50:>10.2f}{p99:>10.2f}{rps:>10.1f}")
    c, n = med["cached"], med["new"]
    print(
        f"{'ratio':<10}{n[0] / c[0]:>9.1f}x{n[1] / c[1]:>9.1f}x{c[2] / n[2]:>9.1f}x"
        "   (new/cached latency, cached/new throughput)"
    )
    print(
        f"server: hits={stats['cache']['hits']} misses={stats['cache']['misses']} "
        f"items={stats['inference']['items']} mean_batch={stats['inference']['mean_batch']:.1f}"
    )


if __name__ == "__main__":
    main()
