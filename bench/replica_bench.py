"""Replicas sharing one fleet log (``FLEETCACHE_FLEET_LOG_URL``): how soon a change through
one is seen through another (issue 13: p99 <= 200 ms).

A Redis with an append-only file fsynced on every write (``appendfsync always``), two
``fleetcache serve --workers 1`` on it (fake engine), ``--drivers`` upserted through replica
A. Then ``--changes`` times: one driver moved by ``PATCH /v1/fleet/positions`` through A (a
new place and a newer time), and replica B polled (``GET /v1/fleet/drivers/{id}``, every
millisecond) until it shows the new place: the time from sending the PATCH to B showing it,
and the PATCH's own latency (its 200 comes once the change is on the log and applied on A).
``--load`` runs it a second time while wrk sends bulk positions (1,000 a request) through A.

    .venv/bin/python -m bench.replica_bench --changes 300 --runs 3 --load

Needs redis-server (and wrk for ``--load``) on PATH. Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.serve_bench import Server, Wrk, median, print_table
from features.synthetic import generate_fleet
from tests.redis_server import RedisServer

TARGET_MS = 200.0
SETTINGS = {"engine": "fake", "max_delay_ms": "1", "memory_cache_mb": "64"}


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def measure(a: str, b: str, drivers: int, changes: int, seed: int) -> tuple[list[float], ...]:
    """(seen on B ms, PATCH on A ms) of each change."""
    rng = random.Random(seed)
    seen, acked = [], []
    start = datetime.datetime(2027, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(hours=seed)
    with httpx.Client(base_url=a, timeout=30) as one, httpx.Client(base_url=b, timeout=30) as two:
        for i in range(changes):
            driver_id = f"D{rng.randrange(drivers):06d}"
            lat = round(rng.uniform(30.0, 32.0), 6)
            ts = (start + datetime.timedelta(seconds=i)).isoformat()
            row = {"driver_id": driver_id, "lat": lat, "lng": 121.5, "ts": ts}
            sent = time.perf_counter()
            answer = one.patch("/v1/fleet/positions", json={"positions": [row]})
            acked.append((time.perf_counter() - sent) * 1e3)
            if answer.status_code != 200 or answer.json()["updated"] != 1:
                raise SystemExit(f"PATCH answered {answer.status_code}: {answer.text[:300]}")
            while two.get(f"/v1/fleet/drivers/{driver_id}").json()["position"]["lat"] != lat:
                time.sleep(0.001)
            seen.append((time.perf_counter() - sent) * 1e3)
    return seen, acked


@contextlib.contextmanager
def replicas(work: Path, drivers: int) -> Iterator[tuple[Server, Server]]:
    redis = RedisServer(work / "redis", durable=True).start()
    settings = {**SETTINGS, "fleet_log_url": redis.url}
    servers = [Server(1, work / name / "data", settings, work / f"{name}.log", "") for name in "ab"]
    try:
        for server in servers:
            server.wait_ready()
        fleet = generate_fleet(drivers, seed=7)
        with httpx.Client(base_url=servers[0].url, timeout=300) as client:
            for start in range(0, drivers, 1000):
                body = {"drivers": [d.model_dump(mode="json") for d in fleet[start : start + 1000]]}
                client.put("/v1/fleet/drivers", json=body).raise_for_status()
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()
        redis.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drivers", type=int, default=10_000)
    parser.add_argument("--changes", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--load", action="store_true", help="also under bulk positions (wrk)")
    parser.add_argument("--wrk", default=shutil.which("wrk") or "wrk")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="replica-bench-"))
    rows = []
    try:
        with replicas(work, args.drivers) as (a, b):
            phases = ["idle", "bulk load on A"] if args.load else ["idle"]
            for phase in phases:
                load: subprocess.Popen[str] | None = None
                if phase != "idle":
                    wrk = Wrk(args.wrk, 1, "")
                    seconds = 600.0
                    load = wrk.start("positions.lua", a.url, 2, seconds, DRIVERS=str(args.drivers))
                    time.sleep(1.0)
                try:
                    runs = [
                        measure(a.url, b.url, args.drivers, args.changes, seed=run + 10 * len(rows))
                        for run in range(args.runs)
                    ]
                finally:
                    if load is not None:
                        load.terminate()
                        load.wait(10)
                rows.append((phase, runs))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"# replica_bench {datetime.date.today()} on {platform.node()} ({os.cpu_count()} "
        f"cores): 2 replicas x 1 worker, Redis appendfsync always, {args.drivers:,} drivers, "
        f"{args.changes} changes a run, {args.runs} runs"
    )
    columns = ["phase", "seen on B p50 ms", "p99 ms", "worst p99 ms", "vs target 200 ms"]
    columns += ["PATCH on A p50 ms", "p99 ms"]
    table = []
    for phase, runs in rows:
        seen_p99 = median([p99(seen) for seen, _ in runs])
        cells = [phase, f"{median([statistics.median(s) for s, _ in runs]):.1f}"]
        cells += [f"{seen_p99:.1f}", f"{max(p99(s) for s, _ in runs):.1f}"]
        cells += [f"{seen_p99 / TARGET_MS:.2f}"]
        cells += [f"{median([statistics.median(a) for _, a in runs]):.1f}"]
        cells += [f"{median([p99(a) for _, a in runs]):.1f}"]
        table.append(cells)
    print_table(columns, table)


if __name__ == "__main__":
    main()
