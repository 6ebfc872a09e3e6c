"""The fleet index owner's memory under the soak's mix, sped up: leak or high-water mark?

``bench/soak.py`` saw the index owner grow +12.9 MB in 9 minutes (about 3,200 position
PATCHes, 4,300 recommends, a snapshot a minute) and could not say whether it would stop. Here
one ``IndexHost`` (the index owner's object, its change log and snapshots included) over the
demo fleet takes the same mix without the HTTP around it: per block, ``--per-block`` position
updates of random drivers (each within 0.01 degree of where the demo put it, as the soak
sends them), a recommend there for every fourth, then a snapshot (the interval is
0.5 s). After each block: the process's resident memory. A leak grows with the blocks; a
high-water mark levels off.

    .venv/bin/python -m bench.index_memory_bench --blocks 40 --per-block 500

Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import os
import platform
import random
import tempfile
from datetime import UTC
from pathlib import Path

import numpy as np

from bench.serve_bench import print_table
from features.models import LatLng, Order, Position
from features.synthetic import generate_fleet
from proxy.board import Board
from proxy.index_host import open_index_host
from proxy.settings import Settings

DIM = 384


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc")


async def run(args: argparse.Namespace) -> list[list[str]]:
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), snapshot_interval_s=0.5)
        (Path(tmp) / "boards").mkdir()
        board = Board("index", Path(tmp) / "boards")
        async with open_index_host(settings, board, DIM) as host:
            fleet = generate_fleet(args.drivers, seed=7)
            vectors = np.random.default_rng(0).standard_normal((len(fleet), DIM), np.float32)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            await host.upsert_drivers(fleet, vectors)
            await host.set_ready()
            rows.append(["loaded", "0", "0", "0", f"{rss_mb():.1f}"])
            updates = recommends = 0
            for block in range(args.blocks):
                for i in range(args.per_block):
                    driver = fleet[rng.randrange(len(fleet))]  # near where the demo put it
                    at = driver.position
                    lat, lng = at.lat + rng.uniform(-0.01, 0.01), at.lng + rng.uniform(-0.01, 0.01)
                    await host.update_driver(
                        driver.driver_id, position=Position(lat=lat, lng=lng), status=None
                    )
                    updates += 1
                    if i % 4 == 0:
                        order = Order(order_id=f"o{block}-{i}", pickup=LatLng(lat=lat, lng=lng))
                        await host.recommend(order, vectors[i % len(fleet)])
                        recommends += 1
                await asyncio.sleep(0.6)  # the periodic snapshot runs
                gc.collect()
                snapshots = block + 1
                rows.append(
                    [
                        str(block),
                        f"{updates:,}",
                        f"{recommends:,}",
                        str(snapshots),
                        f"{rss_mb():.1f}",
                    ]
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drivers", type=int, default=2000, help="the demo fleet's size")
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--per-block", type=int, default=500)
    parser.add_argument("--every", type=int, default=4, help="print every Nth block")
    args = parser.parse_args()
    rows = asyncio.run(run(args))
    now = datetime.datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# index_memory_bench {now}, {platform.node()} ({os.cpu_count()} cores, Python "
        f"{platform.python_version()}): {args.drivers:,} drivers, {args.blocks} blocks of "
        f"{args.per_block} position updates"
    )
    shown = [r for r in rows if r[0] == "loaded" or int(r[0]) % args.every == args.every - 1]
    shown = rows[:4] + [r for r in shown if r not in rows[:4]]
    columns = ["block", "position updates", "recommends", "snapshots", "RSS MB"]
    print_table(columns, shown)
    rss = [float(r[4]) for r in rows[1:]]
    half = len(rss) // 2
    print(
        f"RSS: first block {rss[0]:.1f} MB, highest {max(rss):.1f} MB, second half "
        f"{min(rss[half:]):.1f}-{max(rss[half:]):.1f} MB"
    )


if __name__ == "__main__":
    main()
