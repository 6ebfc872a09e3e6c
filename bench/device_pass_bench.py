"""Where a batch of concurrent recommends spends its time on the device (issue 13's GPU target:
``FleetTable.recommend_many`` p99 <= 2 ms at 10 km, 16 orders a batch, 1,000,000 drivers).

The fleet is ``bench.index_bench``'s (synthetic drivers around six cities, a random unit vector
each, the same orders: pickups at random drivers, k=10, every other one with a constraint and a
cargo), built once, saved to ``--snapshot`` and loaded from there by every run (rows in
grid-cell order), so that two versions can be timed on the same fleet in one command. Each
batch's ``recommend_many`` is timed whole and by phase, read through the device object's own
methods: ``sync`` (the device mirror brought up to date), ``first pass`` (the device
synchronised after it) and ``finish`` (the rest: each order's exact rescoring on the CPU), and
how many orders the first pass sent to its dense pass (``indexes.gpu``: near-ties beyond its
top K). ``--moves N [N ...]``: N position updates (jitters of ~100 m) between batches, so
that every batch syncs them (0: the fleet stands still). ``--torch-ops``: the top pass in
torch operations where its Triton kernel (``indexes.rank_kernel``) would run. ``--profile``:
the torch profiler's kernel table for 10 batches. Prints one table row per radius and moves.
Not a test.

    python3 -m bench.device_pass_bench --snapshot /tmp/fleet1m --label fused
    python3 -m bench.device_pass_bench --snapshot /tmp/fleet1m --label torch-ops --torch-ops
    # another checkout's indexes/ (e.g. git archive into OLD): the script by path, so that
    # OLD comes first on the path
    PYTHONPATH=OLD:$PWD python3 bench/device_pass_bench.py --snapshot /tmp/fleet1m --label old
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.index_bench import make_orders, pct, unit_rows
from features.models import Order
from features.synthetic import iter_fleet
from indexes import FleetTable, timestamp_us


def build(n: int, dim: int, seed: int, snapshot: Path) -> None:
    """The fleet, saved to ``snapshot`` with its ids and positions beside it."""
    rng = np.random.default_rng(seed)
    table = FleetTable(dim)
    fleet, pos, ids = iter_fleet(n, seed=seed), np.zeros((n, 2)), []
    gc.disable()
    try:
        for start in range(0, n, 10_000):
            chunk = list(itertools.islice(fleet, 10_000))
            table.upsert_drivers(chunk, unit_rows(rng, len(chunk), dim))
            pos[start : start + len(chunk)] = [(r.position.lat, r.position.lng) for r in chunk]
            ids += [r.driver_id for r in chunk]
    finally:
        gc.enable()
    table.save(snapshot)
    np.savez(snapshot / "bench.npz", pos=pos, ids=np.array(ids))


class Timed:
    """Wraps the table's device object: the time of each ``sync`` and ``first_pass``."""

    def __init__(self, device: Any) -> None:
        self.device, self.torch = device, device._torch
        self.ms: dict[str, float] = {}
        self.sync, self.first_pass = (
            self._timed("sync", device.sync),
            self._timed("first pass", device.first_pass),
        )

    def _timed(self, name: str, call: Any) -> Any:
        def timed(*args: Any) -> Any:
            t = time.perf_counter()
            out = call(*args)
            if self.device.device.type == "cuda":
                self.torch.cuda.synchronize()
            self.ms[name] = (time.perf_counter() - t) * 1e3
            return out

        return timed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.device, name)


def timed_batches(
    table: FleetTable,
    orders: list[Order],
    q: np.ndarray,
    batch: int,
    moves: int,
    pos: np.ndarray,
    ids: list[str],
    rng: np.random.Generator,
) -> dict[str, list[float]]:
    """Each batch's phases in ms."""
    timed = Timed(table._device)
    table._device = timed
    phases: dict[str, list[float]] = {"whole": [], "sync": [], "first pass": [], "finish": []}
    dense = getattr(timed.device, "dense_orders", 0)
    try:
        for start in range(0, len(orders), batch):
            if moves:
                pick = rng.integers(len(ids), size=moves)
                lats = pos[pick, 0] + rng.uniform(-9e-4, 9e-4, moves)
                lngs = pos[pick, 1] + rng.uniform(-9e-4, 9e-4, moves)
                now = timestamp_us(datetime.datetime.now(datetime.UTC))
                table.move([ids[i] for i in pick.tolist()], lats, lngs, np.full(moves, now))
            part = orders[start : start + batch]
            t = time.perf_counter()
            table.recommend_many(part, [q] * len(part))
            whole = (time.perf_counter() - t) * 1e3
            sync, first = timed.ms["sync"], timed.ms["first pass"]
            for key, ms in zip(phases, (whole, sync, first, whole - sync - first), strict=True):
                phases[key].append(ms)
    finally:
        table._device = timed.device
    phases["dense"] = [getattr(timed.device, "dense_orders", 0) - dense]
    return phases


def profile(table: FleetTable, orders: list[Order], q: np.ndarray, batch: int) -> None:
    torch = table._device._torch
    table.recommend_many(orders[:batch], [q] * batch)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(10):
            table.recommend_many(orders[:batch], [q] * batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_cuda_time_total", "self_device_time_total", "self_cpu_time_total"):
        try:
            print(averages.table(sort_by=key, row_limit=30))
            return
        except (AttributeError, KeyError, ValueError):
            continue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drivers", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--snapshot", type=Path, required=True, help="built there if absent")
    parser.add_argument("--label", default="this")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batches", type=int, default=100, help="batches per radius and run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--radius", type=float, nargs="+", default=[3.0, 10.0])
    parser.add_argument(
        "--moves", type=int, nargs="+", default=[0], help="position updates between batches"
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--torch-ops",
        action="store_true",
        help="the top pass in torch operations even where its Triton kernel is installed",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t = time.perf_counter()
    if not (args.snapshot / "bench.npz").exists():
        build(args.drivers, args.dim, args.seed, args.snapshot)
    table = FleetTable.load(args.snapshot, args.dim, device=args.device)
    if args.torch_ops:
        table._device._kernel = None
    saved = np.load(args.snapshot / "bench.npz")
    pos, ids = saved["pos"], saved["ids"].tolist()
    print(
        f"# device_pass_bench {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC "
        f"({args.label}): {len(table):,} drivers (ready in {time.perf_counter() - t:.0f} s) on "
        f"{args.device}, batches of {args.batch}, {args.batches} batches x {args.runs} runs a "
        f"radius; ms per batch, p50 / p99 (median of the runs' p99)"
    )
    rng = np.random.default_rng(args.seed + 1)
    q = unit_rows(rng, 1, args.dim)[0]
    rows = [
        "| version | radius | moves | whole | sync | first pass | finish | dense pass |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for radius, moves in itertools.product(args.radius, args.moves):
        orders = make_orders(rng, pos[:, 0], pos[:, 1], radius, 1)
        orders = (orders * (args.batch * args.batches // len(orders) + 1))[
            : args.batch * args.batches
        ]
        table.recommend_many(orders[: args.batch], [q] * args.batch)  # warm, sync
        runs = [
            timed_batches(table, orders, q, args.batch, moves, pos, ids, rng)
            for _ in range(args.runs)
        ]
        cells = []
        for key in ("whole", "sync", "first pass", "finish"):
            p50 = pct([x for r in runs for x in r[key]], 50)
            p99 = statistics.median(pct(r[key], 99) for r in runs)
            cells.append(f"{p50:.2f} / {p99:.2f}")
        dense = sum(r["dense"][0] for r in runs)
        cells.append(f"{dense} of {len(orders) * args.runs} orders")
        rows.append(f"| {args.label} | {radius:g} km | {moves} | " + " | ".join(cells) + " |")
    print("\n".join(rows), flush=True)
    if args.profile:
        profile(table, make_orders(rng, pos[:, 0], pos[:, 1], max(args.radius), 1), q, args.batch)


if __name__ == "__main__":
    main()
