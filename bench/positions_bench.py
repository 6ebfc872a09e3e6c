"""Bulk positions through HTTP: ``PATCH /v1/fleet/positions`` in requests of 1,000 (issue 13:
>= 100,000 positions/s on the 2-core box; a million drivers reporting every 10 s).

A fleet of ``--drivers`` (fake engine) is PUT into ``fleetcache serve --workers N`` for each
``--workers`` value; then wrk (``bench/wrk/positions.lua``, each request 1,000 random drivers
with ever newer times, so none is stale) runs ``--duration`` seconds at each ``--connections``,
``--runs`` times. Every request is durable before its 200 (the change log's group commit).
Beside it, in this process, ``FleetTable.move`` alone over a table of the same size, batches
of 1,000: the index's own ceiling, that the HTTP figures are compared with (ratio).

    .venv/bin/python -m bench.positions_bench --drivers 100000 --workers 1 2 --runs 3

Needs ``wrk`` on PATH. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.serve_bench import Server, Wrk, median, print_table, wrk_errors, wrk_latency
from features.synthetic import generate_fleet
from indexes import FleetTable
from indexes.columns import timestamp_us

BATCH = 1000
TARGET = 100_000
SETTINGS = {"engine": "fake", "max_delay_ms": "1", "memory_cache_mb": "64"}


def load(url: str, drivers: int) -> None:
    fleet = generate_fleet(drivers, seed=7)
    with httpx.Client(base_url=url, timeout=300) as client:
        for start in range(0, drivers, 2000):
            body = {"drivers": [d.model_dump(mode="json") for d in fleet[start : start + 2000]]}
            answer = client.put("/v1/fleet/drivers", json=body)
            if answer.status_code != 200:
                raise SystemExit(f"PUT answered {answer.status_code}: {answer.text[:300]}")


def in_process(drivers: int, seconds: float) -> float:
    """``FleetTable.move`` positions/s, batches of ``BATCH`` random drivers, newer times."""
    fleet = generate_fleet(drivers, seed=7)
    table = FleetTable(8)
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((drivers, 8)).astype(np.float32)
    table.upsert_drivers(fleet, vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    ids = np.array([d.driver_id for d in fleet])
    ts = timestamp_us(datetime.datetime(2026, 12, 1, 8, tzinfo=datetime.UTC))
    moved, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        pick = rng.integers(0, drivers, BATCH)
        lats, lngs = 31.0 + rng.random(BATCH) * 0.4, 121.2 + rng.random(BATCH) * 0.5
        table.move(ids[pick].tolist(), lats, lngs, np.full(BATCH, ts + moved, dtype=np.int64))
        moved += BATCH
    return moved / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drivers", type=int, default=100_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--connections", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--wrk", default=shutil.which("wrk") or "wrk")
    args = parser.parse_args()
    ceiling = in_process(args.drivers, 5.0)
    wrk = Wrk(args.wrk, 1, "")
    rows = []
    for workers in args.workers:
        work = Path(tempfile.mkdtemp(prefix="positions-bench-"))
        server = Server(workers, work / "data", SETTINGS, work / "server.log", "")
        try:
            server.wait_ready()
            load(server.url, args.drivers)
            for connections in args.connections:
                runs = [
                    wrk.run(
                        "positions.lua",
                        server.url,
                        connections,
                        args.duration,
                        DRIVERS=str(args.drivers),
                        BATCH=str(BATCH),
                    )
                    for _ in range(args.runs)
                ]
                rows.append((workers, connections, runs))
        finally:
            server.stop()
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"# positions_bench {datetime.date.today()} on {platform.node()} ({os.cpu_count()} "
        f"cores): {args.drivers:,} drivers, requests of {BATCH}, {args.runs} runs of "
        f"{args.duration:g} s; FleetTable.move alone: {ceiling:,.0f} positions/s"
    )
    columns = ["workers", "conns", "positions/s", "p50 ms", "p99 ms", "worst p99 ms"]
    columns += ["vs move alone", "vs target 100k", "errors"]
    table = []
    for workers, connections, runs in rows:
        rate = median([r["req_s"] for r in runs]) * BATCH
        cells = [str(workers), str(connections), f"{rate:,.0f}", *wrk_latency(runs, 1)]
        cells += [f"{rate / ceiling:.2f}", f"{rate / TARGET:.2f}", wrk_errors(runs)]
        table.append(cells)
    print_table(columns, table)


if __name__ == "__main__":
    main()
