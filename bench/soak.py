"""A soak: a fixed-rate mixed workload against a real ``fleetcache serve`` for minutes.

Client processes (``--clients``) each send their share of ``--rate`` requests a second on a
fixed schedule (open loop: a late answer does not slow the schedule, and each latency is
measured from the moment its request was due, so a stall shows up in full), mixing:

    50%  POST /v1/embeddings, 8 texts repeated from a pool of 400 (hits once warm)
    15%  POST /v1/embeddings, 2 texts never sent before (misses: the engine runs)
    20%  POST /v1/dispatch/recommend near a random demo driver
    15%  PATCH /v1/fleet/drivers/{id}, a demo driver's new position (no inference)

Every minute it prints requests, errors, p50/p99 (all kinds) and the server's resident memory
(every process of the tree, from /proc: all of it, and its anonymous part) beside the bytes of
entries the workers' memory tiers hold (``/v1/stats``), so that a growth can be set against
the tiers filling. The verdict, as
issue 12 asks: zero errors; p99 of the last minute within 1.5x of the first; RSS growth after
the first minute under 5% (with ``FLEETCACHE_MEMORY_CACHE_MB=16`` so that a filling memory
tier is not taken for a leak).

    .venv/bin/python -m bench.soak --minutes 10 --rate 40 --out /tmp/soak     # the CPU box

Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serve_bench import Server

KINDS = (("repeat", 0.50), ("new", 0.15), ("recommend", 0.20), ("position", 0.15))
POOL = 400


def request_for(kind: str, rng: random.Random, client: int, i: int, drivers: list[Any]) -> Any:
    """(method, path, json) of one request of ``kind``."""
    if kind == "repeat":
        texts = [f"soak pool text {rng.randrange(POOL)}" for _ in range(8)]
        return "POST", "/v1/embeddings", {"input": texts}
    if kind == "new":
        return "POST", "/v1/embeddings", {"input": [f"soak new {client} {i} {j}" for j in (0, 1)]}
    driver = rng.choice(drivers)
    lat = driver["position"]["lat"] + rng.uniform(-0.01, 0.01)
    lng = driver["position"]["lng"] + rng.uniform(-0.01, 0.01)
    if kind == "recommend":
        order = {"order_id": f"o-{client}-{i}", "pickup": {"lat": lat, "lng": lng}, "k": 10}
        return "POST", "/v1/dispatch/recommend", order
    position = {"position": {"lat": lat, "lng": lng}}
    return "PATCH", f"/v1/fleet/drivers/{driver['driver_id']}", position


async def client_loop(
    url: str, client: int, rate: float, seconds: float, start_at: float, drivers: list[Any]
) -> list[tuple[float, str, int, float]]:
    """(due second, kind, status, latency ms) of every request this client sent."""
    rng = random.Random(client)
    kinds, weights = zip(*KINDS, strict=True)
    results: list[tuple[float, str, int, float]] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:

        async def one(i: int, due: float) -> None:
            kind = rng.choices(kinds, weights)[0]
            method, path, body = request_for(kind, rng, client, i, drivers)
            try:
                status = (await http.request(method, path, json=body)).status_code
            except httpx.HTTPError:
                status = 0
            results.append((due - start_at, kind, status, (time.time() - due) * 1000))

        tasks = []
        count = int(seconds * rate)
        for i in range(count):
            due = start_at + i / rate + client / (rate * 97)  # clients interleave
            await asyncio.sleep(max(0.0, due - time.time()))
            tasks.append(asyncio.create_task(one(i, due)))
        await asyncio.gather(*tasks)
    return results


def ready(_: int) -> None:
    time.sleep(0.3)  # long enough for each process of the pool to take one


def run_client(args: tuple[str, int, float, float, float, list[Any], str]) -> None:
    url, client, rate, seconds, start_at, drivers, out = args
    results = asyncio.run(client_loop(url, client, rate, seconds, start_at, drivers))
    Path(out).write_text(json.dumps(results))


def roles(stats: dict[str, Any]) -> dict[int, str]:
    """pid -> its role, from ``/v1/stats`` ``processes`` (spawned children share a cmdline)."""
    processes = stats["processes"]
    named = {w["pid"]: f"worker {i}" for i, w in enumerate(processes["workers"])}
    named |= {e["pid"]: f"engine {k}" for k, e in enumerate(processes["engines"])}
    return named | {processes["index"]["pid"]: "index owner"}


def tree_memory(root: int, named: dict[int, str]) -> dict[str, tuple[float, float]]:
    """Resident memory of ``root`` and every descendant (from /proc), in MB, by process
    (``pid role``, else ``pid name``): all of it, and its anonymous part (``RssAnon``: heaps;
    the rest is mapped files, such as the LMDB file that every process maps and that grows as
    the cache fills)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    memory, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            fields = dict(
                line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            )
            name = (
                named.get(pid)
                or Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-2].decode()[-24:]
            )
        except (OSError, IndexError, ValueError):
            continue
        kb = [int(fields.get(key, "0 kB").split()[0]) for key in ("VmRSS", "RssAnon")]
        memory[f"{pid} {name}"] = (kb[0] / 1024, kb[1] / 1024)
    return memory


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=40.0, help="requests/s, all clients")
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--engine", default="torch")
    parser.add_argument("--demo-drivers", type=int, default=2000)
    parser.add_argument("--memory-cache-mb", type=float, default=16.0)
    parser.add_argument("--out", default=None, help="a directory for the log and the JSON")
    args = parser.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="soak-"))
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "engine": args.engine,
        "demo_drivers": str(args.demo_drivers),
        "memory_cache_mb": str(args.memory_cache_mb),
    }
    shutil.rmtree(out / "data", ignore_errors=True)  # a fresh cache: the "new" texts are new
    server = Server(args.workers, out / "data", settings, out / "server.log", cpus="")
    try:
        server.wait_ready()
        drivers = [
            httpx.get(f"{server.url}/v1/fleet/drivers/D{n:06d}", timeout=10).json()
            for n in range(0, args.demo_drivers, max(1, args.demo_drivers // 200))
        ]
        drivers = [d for d in drivers if "driver_id" in d]
        seconds = args.minutes * 60
        pool = multiprocessing.get_context("spawn").Pool(args.clients)
        pool.map(ready, range(args.clients), chunksize=1)  # client processes up and imported
        start_at = time.time() + 1.0
        share = args.rate / args.clients
        jobs = [
            (server.url, c, share, seconds, start_at, drivers, str(out / f"client-{c}.json"))
            for c in range(args.clients)
        ]
        pending = pool.map_async(run_client, jobs)
        rss: list[tuple[float, float, float, float]] = []
        processes: list[tuple[float, dict[str, tuple[float, float]]]] = []
        while not pending.ready():
            stats = server.stats()
            sample = tree_memory(server.process.pid, roles(stats))
            processes.append((time.time() - start_at, sample))
            total = [sum(m[i] for m in sample.values()) for i in (0, 1)]
            tier = stats["cache"]["tiers"]["memory"]["bytes"] / 2**20  # every worker's
            rss.append((time.time() - start_at, total[0], total[1], tier))
            pending.wait(10)
        pending.get()
        pool.close()
        stats = server.stats()
    finally:
        server.stop()

    results = [
        r for c in range(args.clients) for r in json.loads((out / f"client-{c}.json").read_text())
    ]
    minutes = int(args.minutes + 0.999)
    now = datetime.datetime.now(datetime.UTC)
    print(
        f"soak: {args.minutes:g} min at {args.rate:g} req/s, {args.clients} client processes, "
        f"{args.workers} workers, engine {args.engine}, memory tier {args.memory_cache_mb:g} MB, "
        f"{platform.node()} ({os.cpu_count()} cores), {now:%Y-%m-%d %H:%M} UTC"
    )
    print(
        f"{'minute':>6} {'requests':>9} {'errors':>7} {'p50 ms':>8} {'p99 ms':>8} {'RSS MB':>8} "
        f"{'anon MB':>8} {'tiers MB':>8}"
    )
    rows = []
    for m in range(minutes):
        inside = [r for r in results if m * 60 <= r[0] < (m + 1) * 60]
        latencies = [r[3] for r in inside]
        memory = [(mb, anon, tier) for t, mb, anon, tier in rss if m * 60 <= t < (m + 1) * 60]
        row = {
            "minute": m + 1,
            "requests": len(inside),
            "errors": sum(1 for r in inside if r[2] != 200),
            "p50_ms": statistics.median(latencies) if latencies else float("nan"),
            "p99_ms": p99(latencies),
            "rss_mb": memory[-1][0] if memory else float("nan"),
            "anon_mb": memory[-1][1] if memory else float("nan"),
            "tiers_mb": memory[-1][2] if memory else float("nan"),
        }
        rows.append(row)
        print(
            f"{row['minute']:>6} {row['requests']:>9} {row['errors']:>7} {row['p50_ms']:>8.2f} "
            f"{row['p99_ms']:>8.2f} {row['rss_mb']:>8.1f} {row['anon_mb']:>8.1f} "
            f"{row['tiers_mb']:>8.1f}"
        )
    errors = sum(r["errors"] for r in rows)
    ratio = rows[-1]["p99_ms"] / rows[0]["p99_ms"]
    growth = (rows[-1]["rss_mb"] - rows[0]["rss_mb"]) / rows[0]["rss_mb"]
    anon = (rows[-1]["anon_mb"] - rows[0]["anon_mb"]) / rows[0]["anon_mb"]
    by_kind = {kind: f"{p99([r[3] for r in results if r[1] == kind]):.2f}" for kind, _ in KINDS}
    print(f"p99 by kind (whole run, ms): {by_kind}")
    print(
        f"errors {errors} (want 0); p99 last/first minute {ratio:.2f} (want <= 1.5); "
        f"RSS growth after minute 1 {100 * growth:+.2f}% (want < 5%; anonymous "
        f"{100 * anon:+.2f}%)"
    )
    grown = rows[-1]["anon_mb"] - rows[0]["anon_mb"]
    filled = rows[-1]["tiers_mb"] - rows[0]["tiers_mb"]
    print(
        f"anonymous memory after minute 1 {grown:+.1f} MB, of which the memory tiers' entries "
        f"{filled:+.1f} MB (cap {args.memory_cache_mb:g} MB a worker; their bytes of entries, "
        f"not the allocator's overhead)"
    )
    print(
        f"server counted: hits {stats['cache']['hits']}, misses {stats['cache']['misses']}, "
        f"items {stats['inference']['items']}"
    )
    first = next(m for t, m in processes if t >= 60) if rss[-1][0] >= 60 else processes[0][1]
    last = processes[-1][1]
    print("anonymous MB by process, after minute 1 -> end (a process restarted shows once):")
    for name in sorted(set(first) & set(last)):
        print(f"  {name:>32}  {first[name][1]:8.1f} -> {last[name][1]:8.1f}")
    record = {"rows": rows, "rss": rss, "by_kind": by_kind, "processes": processes}
    (out / "soak.json").write_text(json.dumps(record))
    print(f"logs and JSON: {out}")


if __name__ == "__main__":
    main()
