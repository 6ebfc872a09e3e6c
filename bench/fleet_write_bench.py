"""What durable fleet writes cost: ``PUT /v1/fleet/drivers`` before and after the change log.

Each *version* is a checkout the server runs from: ``after`` a worktree of ``--after``
(default HEAD), ``before`` the same worktree with ``proxy/index_host.py`` and ``indexes/``
taken from ``--before`` (the commit without the log), so that nothing else differs. For each
run and each version in turn (interleaved, so that a noisy box drifts into both alike):
``fleetcache serve --workers 2`` with the fake engine on a fresh data dir, a pool of
``--pool`` drivers PUT once (their embeddings are then cached: the timed requests measure the
write path, not the engine), then wrk PUTs requests of 1 and of 100 drivers of that pool with
1 and 16 connections, ``--duration`` seconds each. The table shows the median over the runs
of each run's req/s and p50/p99, the worst run's p99, and (after) how many changes shared one
fsync, read from the index owner (``ping``: ``facts()["log"]``).

    .venv/bin/python -m bench.fleet_write_bench --before HEAD~1 --runs 3

Needs ``wrk`` on PATH. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.serve_bench import REPO, Server, Wrk, median, print_table, wrk_errors, wrk_latency
from features.synthetic import generate_fleet
from proxy.ipc import RpcClient, address

_CLIENTS = itertools.count()
SIZES = (1, 100)
CONNECTIONS = (1, 16)
JSON = {"Content-Type": "application/json"}
SETTINGS = {"engine": "fake", "max_delay_ms": "1", "memory_cache_mb": "64"}


@contextlib.contextmanager
def checkouts(before: str, after: str) -> Iterator[dict[str, Path]]:
    """Two worktrees: ``after`` at ``after``; ``before`` the same with the index owner and
    indexes/ of ``before``."""
    root = Path(tempfile.mkdtemp(prefix="fleet-write-bench-"))
    trees = {"before": root / "before", "after": root / "after"}
    try:
        for tree in trees.values():
            git("worktree", "add", "--detach", str(tree), after)
        git("-C", str(trees["before"]), "checkout", before, "--", "proxy/index_host.py", "indexes")
        yield trees
    finally:
        for tree in trees.values():
            git("worktree", "remove", "--force", str(tree), check=False)
        shutil.rmtree(root, ignore_errors=True)


def git(*args: str, check: bool = True) -> None:
    subprocess.run(["git", *args], cwd=REPO, check=check, capture_output=True)


def bodies(pool: list[dict[str, Any]], size: int, path: Path) -> Path:
    lines = [json.dumps({"drivers": pool[i : i + size]}) for i in range(0, len(pool), size)]
    path.write_text("\n".join(lines) + "\n")
    return path


def log_facts(run_root: Path) -> dict[str, int]:
    """The index owner's change-log counters ({} before the log existed)."""
    [run_dir] = run_root.glob("fleetcache-*")

    async def ping() -> dict[str, Any]:
        # a new name each time: the server's ROUTER ignores a peer that reuses the name of one
        # it has not yet seen go (the first bench run hung on that)
        role = f"bench{next(_CLIENTS)}"
        client = await RpcClient(address(run_dir, "index"), role=role).start()
        try:
            if not await client.wait_up(30):
                raise SystemExit(f"the index process at {run_dir} does not answer")
            reply, _ = await client.call("ping", timeout_s=10)
            return dict(reply.get("log", {}))
        finally:
            await client.close()

    return asyncio.run(ping())


def measure(args: argparse.Namespace, code: Path, files: dict[int, Path], out: Path) -> list[Any]:
    """One server of ``code``: the pool PUT once, then every (size, connections) phase."""
    work = Path(tempfile.mkdtemp(prefix="fleet-write-", dir=out))
    os.environ["TMPDIR"] = str(work)  # the supervisor's run dir, where the index socket lives
    try:
        server = Server(2, work / "data", SETTINGS, work / "server.log", "", code=code)
    finally:
        os.environ.pop("TMPDIR")
    wrk = Wrk(args.wrk, 2, "")
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for line in files[100].read_text().splitlines():
                answer = client.put("/v1/fleet/drivers", content=line, headers=JSON)
                if answer.status_code != 200:
                    raise SystemExit(f"PUT answered {answer.status_code}: {answer.text[:500]}")
        results = []
        for size in SIZES:
            for connections in CONNECTIONS:
                before = log_facts(work)
                result = wrk.run(
                    "put_drivers.lua",
                    server.url,
                    connections,
                    args.duration,
                    BODIES=str(files[size]),
                )
                after = log_facts(work)
                flushes = after.get("flushes", 0) - before.get("flushes", 0)
                records = after.get("records", 0) - before.get("records", 0)
                result["per_flush"] = records / flushes if flushes else 0.0
                results.append(result)
        return results
    finally:
        server.stop()
        shutil.rmtree(work / "data", ignore_errors=True)


def fsync_ms(directory: Path) -> float:
    """Median fdatasync of a 300-byte append on this disk (what one flush costs at least)."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    times = []
    try:
        for _ in range(200):
            started = time.perf_counter()
            os.write(fd, b"x" * 300)
            os.fdatasync(fd)
            times.append(time.perf_counter() - started)
    finally:
        os.close(fd)
        path.unlink()
    return median(times) * 1e3


def report(rows: dict[str, list[list[dict[str, float]]]], args: argparse.Namespace) -> None:
    print(
        f"# fleet_write_bench {datetime.date.today()} on {platform.node()} "
        f"({os.cpu_count()} cores, Python {platform.python_version()}): --before {args.before} "
        f"--after {args.after}, {args.runs} runs of {args.duration:g} s, pool {args.pool} "
        f"drivers; fdatasync of 300 B here: {fsync_ms(Path(tempfile.gettempdir())):.3f} ms median"
    )
    columns = ["version", "drivers/req", "conns", "req/s", "drivers/s", "p50 ms", "p99 ms"]
    columns += ["worst p99 ms", "changes/fsync", "errors"]
    table = []
    phases = [(size, c) for size in SIZES for c in CONNECTIONS]
    for i, (size, connections) in enumerate(phases):
        for version in ("before", "after"):
            runs = [run[i] for run in rows[version]]
            req_s = median([r["req_s"] for r in runs])
            per_flush = median([r["per_flush"] for r in runs])
            cells = [version, str(size), str(connections), f"{req_s:,.0f}", f"{req_s * size:,.0f}"]
            cells += [*wrk_latency(runs), f"{per_flush:.1f}" if per_flush else "-"]
            table.append([*cells, wrk_errors(runs)])
    print_table(columns, table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="commit without the change log")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--pool", type=int, default=2000, help="drivers the requests draw on")
    parser.add_argument("--wrk", default=shutil.which("wrk") or "wrk")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="fleet-write-bench-out-"))
    pool = [json.loads(d.model_dump_json()) for d in generate_fleet(args.pool, seed=21)]
    files = {size: bodies(pool, size, out / f"bodies-{size}.jsonl") for size in SIZES}
    rows: dict[str, list[list[dict[str, float]]]] = {"before": [], "after": []}
    with checkouts(args.before, args.after) as trees:
        for run in range(args.runs):
            for version, code in trees.items():
                rows[version].append(measure(args, code, files, out))
                print(f"run {run + 1}: {version} measured", file=sys.stderr)
    report(rows, args)
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
