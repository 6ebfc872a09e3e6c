"""The batcher beside a busy event loop: does the engine wait for the loop between batches?

In the engine process of ``fleetcache serve`` one event loop answers every worker's calls and
also runs the batcher; on the H200 under 8 workers' new texts that loop was busy nearly all
the time, and each batch waited for turns of it before the engine could start (full batches,
queue wait p50 60 ms, forwards 23% of the wall time). Here: ``--submitters`` tasks each burn
``work`` microseconds of Python on the loop (a request's handling, the GIL held) and then
submit 32 new texts; the fake engine sleeps ``--forward-ms`` per batch with the GIL released,
as a device does. For each version of ``engines/batcher.py`` (a worktree of ``--before``, and
this checkout) the table shows texts/s, the texts a forward held and its wall milliseconds
(medians of ``--runs``; a forward's milliseconds include its wait for the GIL after the
sleep, while the loop's work holds it).

    .venv/bin/python -m bench.batcher_bench --before 68dc2e9 --runs 3

Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


async def measure(work_us: float, args: argparse.Namespace) -> dict[str, float]:
    import numpy as np

    from engines.base import Batch, Vectors
    from engines.batcher import Batcher
    from engines.fake import FakeEngine

    class Timed(FakeEngine):
        """A device's forward: a sleep with the GIL released, rows of zeros (no CPU work)."""

        busy = 0.0

        def forward(self, batch: Batch) -> Vectors:
            started = time.perf_counter()
            self.calls += 1
            time.sleep(self.delay_s)
            self.busy += time.perf_counter() - started
            return np.zeros((batch.size, self.dim), np.float32)

    engine = Timed(dim=384, delay_s=args.forward_ms / 1000)
    loop = asyncio.get_running_loop()
    sent = 0

    async def submitter(batcher: Batcher, i: int, stop: float) -> None:
        nonlocal sent
        n = 0
        while loop.time() < stop:
            until = time.perf_counter() + work_us / 1e6
            while time.perf_counter() < until:  # the loop's own work, holding the GIL
                pass
            await batcher.submit([f"s{i} r{n} t{k}" for k in range(args.texts)])
            sent += args.texts
            n += 1

    async with Batcher(engine, max_batch_size=args.max_batch, max_delay_ms=2.0) as batcher:
        started = time.perf_counter()
        stop = loop.time() + args.duration
        await asyncio.gather(*(submitter(batcher, i, stop) for i in range(args.submitters)))
        wall = time.perf_counter() - started
    return {
        "texts_s": sent / wall,
        "fill": sent / engine.calls,
        "forward_ms": engine.busy / engine.calls * 1000,
    }


def child(args: argparse.Namespace) -> None:
    """In a version's tree: every work level, ``--runs`` times, as JSON on stdout."""
    sys.path.insert(0, os.getcwd())
    out = {
        str(work): [asyncio.run(measure(work, args)) for _ in range(args.runs)]
        for work in args.work
    }
    print(json.dumps(out))


def run_version(tree: Path, argv: list[str]) -> dict[str, list[dict[str, float]]]:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", *argv],
        cwd=tree,
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, list[dict[str, float]]] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare against")
    parser.add_argument("--work", type=float, nargs="+", default=[0.0, 300.0, 1000.0])
    parser.add_argument("--submitters", type=int, default=64)
    parser.add_argument("--texts", type=int, default=32, help="texts a submission")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--forward-ms", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    argv = [a for a in sys.argv[1:] if a != "--child"]
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        git = ["git", "-C", str(ROOT)]
        subprocess.run([*git, "worktree", "add", "--detach", str(before), args.before], check=True)
        try:
            results = {"before": run_version(before, argv), "after": run_version(ROOT, argv)}
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(before)], check=False)
    from bench.serve_bench import print_table

    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    now = datetime.datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# batcher_bench {now}, {platform.node()} ({os.cpu_count()} cores, Python "
        f"{platform.python_version()}): before {args.before}, after {head.stdout.strip()}; "
        f"{args.submitters} submitters of {args.texts} texts, batches of {args.max_batch}, "
        f"forward {args.forward_ms:g} ms, {args.runs} runs of {args.duration:g} s"
    )

    def cells(runs: list[dict[str, Any]]) -> tuple[float, str]:
        rate = statistics.median(r["texts_s"] for r in runs)
        fill = statistics.median(r["fill"] for r in runs)
        forward_ms = statistics.median(r["forward_ms"] for r in runs)
        return rate, f"{fill:.0f} / {forward_ms:.1f}"

    rows = []
    for work in args.work:
        b_rate, b_busy = cells(results["before"][str(work)])
        a_rate, a_busy = cells(results["after"][str(work)])
        ratio = f"{a_rate / b_rate:.2f}x"
        rows.append([f"{work:g}", f"{b_rate:,.0f}", b_busy, f"{a_rate:,.0f}", a_busy, ratio])
    columns = [
        "loop work per submission (us)",
        "before texts/s",
        "before: texts / ms a forward",
        "after texts/s",
        "after: texts / ms a forward",
        "after / before",
    ]
    print_table(columns, rows)


if __name__ == "__main__":
    main()
