"""recommend through HTTP, the index's first pass on the CPU against one on a device
(``FLEETCACHE_INDEX_DEVICE``: concurrent recommends batched into one pass), issue 13.

A fleet of ``--drivers`` (random unit vectors, the synthetic fleet's positions around its city
centres) is written once as the index snapshot of a data dir; for each ``--index-device``
(``none``: the CPU path) ``fleetcache serve --workers N`` (fake engine: the order's text is
embedded once and then cached, so the index is what is measured) loads it, and wrk sends
orders within ``--radius`` km of a city centre at ``--connections``, ``--runs`` times.

    python -m bench.recommend_bench --drivers 1000000 --index-device none cuda --radius 10

Needs ``wrk`` (``--wrk``). Not a test.
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

import numpy as np

from bench.serve_bench import Server, Wrk, median, print_table, wrk_errors, wrk_latency
from features.synthetic import CITIES, generate_fleet
from indexes import FleetTable

DIM = 384  # the fake engine's


def build(index_dir: Path, drivers: int) -> float:
    """Write the fleet's snapshot; returns the seconds it took."""
    started = time.perf_counter()
    fleet = generate_fleet(drivers, seed=7)
    table = FleetTable(DIM)
    rng = np.random.default_rng(0)
    for start in range(0, drivers, 100_000):
        chunk = fleet[start : start + 100_000]
        vectors = rng.standard_normal((len(chunk), DIM)).astype(np.float32)
        table.upsert_drivers(chunk, vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    table.save(index_dir)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drivers", type=int, default=1_000_000)
    parser.add_argument("--index-device", nargs="+", default=["none", "cuda"])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--radius", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--wrk", default=shutil.which("wrk") or "wrk")
    parser.add_argument("--out", default=None, help="a directory for the servers' logs")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="recommend-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    fleet_dir = Path(tempfile.mkdtemp(prefix="recommend-fleet-"))
    built = build(fleet_dir / "index", args.drivers)
    centres = ";".join(f"{c.lat},{c.lng}" for c in CITIES.values())
    wrk = Wrk(args.wrk, 2, "")
    rows = []
    for device in args.index_device:
        data = out / f"data-{device}"
        shutil.copytree(fleet_dir, data)
        settings = {"engine": "fake", "max_delay_ms": "1", "snapshot_interval_s": "3600"}
        if device != "none":
            settings["index_device"] = device
        server = Server(args.workers, data, settings, out / f"server-{device}.log", "")
        try:
            server.wait_ready()
            wrk.run("recommend.lua", server.url, 4, 2.0, CENTRES=centres, RADIUS=str(args.radius))
            runs = [
                wrk.run(
                    "recommend.lua",
                    server.url,
                    args.connections,
                    args.duration,
                    CENTRES=centres,
                    RADIUS=str(args.radius),
                )
                for _ in range(args.runs)
            ]
            rows.append((device, runs))
        finally:
            server.stop()
            shutil.rmtree(data, ignore_errors=True)
    shutil.rmtree(fleet_dir, ignore_errors=True)
    print(
        f"# recommend_bench {datetime.date.today()} on {platform.node()} ({os.cpu_count()} "
        f"cores): {args.drivers:,} drivers (snapshot written in {built:.0f} s), "
        f"{args.workers} workers, {args.connections} connections, radius {args.radius:g} km, "
        f"{args.runs} runs of {args.duration:g} s"
    )
    columns = ["index device", "req/s", "p50 ms", "p99 ms", "worst p99 ms", "errors"]
    table = [
        [device, f"{median([r['req_s'] for r in runs]):,.0f}", *wrk_latency(runs), wrk_errors(runs)]
        for device, runs in rows
    ]
    print_table(columns, table)


if __name__ == "__main__":
    main()
