"""All-hit lookups through the full cache path: stock LangChain cache vs fleetcache's tiers.

On the same N texts (synthetic driver/vehicle feature strings), all cached first, each variant
embeds the texts again in requests of 1,000 and the time of every request is recorded:

- ``stock``: ``CacheBackedEmbeddings.from_bytes_store(underlying, LocalFileStore(tmp),
  namespace=..., key_encoder="sha256")`` (JSON values, one file per key), ``embed_documents``;
- ``memory``: ``CachedEmbedder.aembed`` over a warm memory tier;
- ``lmdb``: memory tier of size 0 in front of LMDB (every lookup reaches LMDB), one
  environment and 8 partitions (``FLEETCACHE_LMDB_PARTITIONS``: a read transaction a
  partition a request touches);
- ``redis``: memory tier of size 0 in front of Redis (``RedisByteStore``, async forms on its
  thread pool);
- ``redis-asyncio``: the same with ``amget`` through ``redis.asyncio`` instead, to compare the
  two async paths.

Prints, per variant and size: median and p99 milliseconds per 1,000 lookups, bytes per entry
(key + value as stored), and the ratio of the stock median to the variant's. Not a test.

    .venv/bin/python -m bench.cache_bench                  # 1,000 and 100,000 texts, 7 runs
    .venv/bin/python -m bench.cache_bench --sizes 1000 --runs 3

Redis: ``--redis-url`` uses a running server (its database is flushed), otherwise a private
``redis-server`` is started on a free loopback port as the tests do.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import redis
import redis.asyncio
from langchain_classic.embeddings import CacheBackedEmbeddings
from langchain_classic.storage import LocalFileStore
from langchain_core.embeddings import Embeddings

from cache.embedder import CachedEmbedder
from cache.stores import LmdbByteStore, MemoryByteStore, RedisByteStore, TieredByteStore

DIM = 384
BATCH = 1_000
MiB = 1 << 20


def feature_texts(n: int) -> list[str]:
    """Distinct strings shaped like the service's driver features (~50-60 tokens)."""
    rng = np.random.default_rng(42)
    kinds = ["sedan", "van", "truck", "scooter", "suv", "pickup"]
    zones = ["north", "south", "east", "west", "centre", "airport", "harbour"]
    out = []
    for i in range(n):
        r = rng.random(6)
        out.append(
            f"driver {i} vehicle {kinds[i % 6]} capacity {int(r[0] * 40)} kg rating "
            f"{3 + 2 * r[1]:.2f} zone {zones[i % 7]} shift {int(r[2] * 24):02d}:00 "
            f"languages en,{'fr' if r[3] > 0.5 else 'es'} refrigerated {r[4] > 0.8} "
            f"hazmat {r[5] > 0.9} experience {int(r[0] * 20)} years lat {r[1] * 90:.4f} "
            f"lon {r[2] * 180:.4f}"
        )
    return out


def fake_vectors(texts: Sequence[str]) -> np.ndarray:
    out = np.empty((len(texts), DIM), np.float32)
    for i, t in enumerate(texts):
        seed = int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little")
        out[i] = np.random.default_rng(seed).standard_normal(DIM, dtype=np.float32)
    out /= np.linalg.norm(out, axis=1, keepdims=True)
    return out


class FakeEmbeddings(Embeddings):
    """The stock cache's underlying embedder (only called during warm-up)."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return fake_vectors(texts).tolist()  # type: ignore[no-any-return]

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


async def fake_compute(texts: Sequence[str], lane: str) -> np.ndarray:
    return fake_vectors(texts)


def batches(texts: list[str]) -> list[list[str]]:
    return [texts[i : i + BATCH] for i in range(0, len(texts), BATCH)]


def summarize(ms: list[float]) -> tuple[float, float]:
    ordered = sorted(ms)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered), p99


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -- variants ----------------------------------------------------------------------------


def run_stock(texts: list[str], runs: int, tmp: Path) -> tuple[list[float], float]:
    root = tmp / "stock"
    emb = CacheBackedEmbeddings.from_bytes_store(
        FakeEmbeddings(), LocalFileStore(root), namespace="bench-v1", key_encoder="sha256"
    )
    for part in batches(texts):  # warm-up: every text cached
        emb.embed_documents(part)
    ms = []
    for _ in range(runs):
        for part in batches(texts):
            t0 = time.perf_counter()
            emb.embed_documents(part)
            ms.append((time.perf_counter() - t0) * 1e3)
    files = [f for f in root.rglob("*") if f.is_file()]
    per_entry = sum(f.stat().st_size + len(f.name) for f in files) / len(files)
    shutil.rmtree(root)
    return ms, per_entry


async def time_ours(emb: CachedEmbedder, texts: list[str], runs: int) -> list[float]:
    for part in batches(texts):  # warm-up: every text cached
        await emb.aembed(part)
    ms = []
    for _ in range(runs):
        for part in batches(texts):
            t0 = time.perf_counter()
            result = await emb.aembed(part)
            ms.append((time.perf_counter() - t0) * 1e3)
            assert result.misses == 0, "a lookup missed: the benchmark is not all-hit"
    return ms


class AsyncioRedisByteStore(RedisByteStore):
    """``amget`` over ``redis.asyncio`` (one client per run, on that run's event loop)."""

    def __init__(self, url: str, **kw: Any) -> None:
        super().__init__(url, **kw)
        self._raw_url = url
        self._aclient: redis.asyncio.Redis | None = None

    async def amget(self, keys: Sequence[str]) -> list[bytes | None]:
        if self._aclient is None:
            self._aclient = redis.asyncio.Redis.from_url(self._raw_url, socket_timeout=2.0)
        return list(await self._aclient.mget([self._k(k) for k in keys]))

    async def aclose(self) -> None:
        if self._aclient is not None:
            await self._aclient.aclose()
        await super().aclose()


def run_ours(
    make_store: Callable[[], TieredByteStore], texts: list[str], runs: int
) -> tuple[list[float], float]:
    store = make_store()
    emb = CachedEmbedder(fake_compute, store, namespace="bench-v1", dim=DIM)

    async def main() -> list[float]:
        try:
            return await time_ours(emb, texts, runs)
        finally:
            await store.aclose()

    ms = asyncio.run(main())
    key_len = len(emb.key(texts[0]))
    return ms, key_len + 12 + 4 * DIM


# -- main --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,100000")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument(
        "--stock-runs-large",
        type=int,
        default=1,
        help="runs of the stock cache above 10,000 texts (one file per key is slow)",
    )
    parser.add_argument(
        "--stock-max",
        type=int,
        default=None,
        help="skip the stock cache above this many texts (ratios then use the smaller size)",
    )
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    server = None
    url = args.redis_url
    if url is None:
        from tests.redis_server import RedisServer

        server = RedisServer(Path(tempfile.mkdtemp(prefix="bench-redis-"))).start()
        url = server.url
    flush = redis.Redis.from_url(url)

    rows = []
    try:
        for n in sizes:
            texts = feature_texts(n)
            with tempfile.TemporaryDirectory(prefix="cache-bench-") as tmp_name:
                tmp = Path(tmp_name)
                stock_runs = args.runs if n <= 10_000 else args.stock_runs_large
                results: dict[str, tuple[list[float], float, int]] = {}
                t0 = time.perf_counter()
                if args.stock_max is None or n <= args.stock_max:
                    stock_ms, stock_bytes = run_stock(texts, stock_runs, tmp)
                    results["stock (LocalFileStore+JSON)"] = (stock_ms, stock_bytes, stock_runs)
                stock_s = time.perf_counter() - t0
                mem_budget = int(n * 2_000 * 1.2) + MiB
                variants: dict[str, Callable[[], TieredByteStore]] = {
                    "memory tier hot": lambda b=mem_budget: TieredByteStore(MemoryByteStore(b)),
                    "LMDB only (memory 0)": lambda t=tmp: TieredByteStore(
                        MemoryByteStore(0), LmdbByteStore(t / "lmdb", 4 << 30, sync=False)
                    ),
                    "LMDB in 8 partitions only (memory 0)": lambda t=tmp: TieredByteStore(
                        MemoryByteStore(0),
                        LmdbByteStore(t / "lmdb8", 4 << 30, sync=False, partitions=8),
                    ),
                    "Redis only (memory 0)": lambda: TieredByteStore(
                        MemoryByteStore(0), RedisByteStore(url, socket_timeout_s=5.0)
                    ),
                    "Redis only, redis.asyncio amget": lambda: TieredByteStore(
                        MemoryByteStore(0), AsyncioRedisByteStore(url, socket_timeout_s=5.0)
                    ),
                }
                for name, make in variants.items():
                    flush.flushdb()
                    ms, per_entry = run_ours(make, texts, args.runs)
                    if name.startswith("LMDB"):
                        lmdb_dir = tmp / ("lmdb8" if "partitions" in name else "lmdb")
                        per_entry = dir_bytes(lmdb_dir) / n  # as allocated on disk
                    results[name] = (ms, per_entry, args.runs)
                for name, (ms, per_entry, runs) in results.items():
                    rows.append((n, name, runs, *summarize(ms), per_entry))
                print(f"# {n:,} texts: stock warm-up + {stock_runs} run(s) took {stock_s:.0f} s")
    finally:
        flush.flushdb()
        flush.close()
        if server is not None:
            server.stop()

    print()
    print(f"date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(f"vectors: {DIM}-d float32; requests of {BATCH:,} texts, all hits; ms per 1,000 lookups")
    print()
    header = f"{'texts':>8}  {'variant':<34}{'runs':>5}{'median ms':>11}{'p99 ms':>9}"
    header += f"{'bytes/entry':>13}{'x stock':>9}"
    print(header)
    print("-" * len(header))
    stock_median = {n: med for n, name, _, med, _, _ in rows if name.startswith("stock")}
    for n, name, runs, med, p99, per_entry in rows:
        # Without a stock run at this size, compare with the largest size that has one.
        base = stock_median.get(n) or stock_median[max(stock_median)]
        ratio = base / med
        print(
            f"{n:>8,}  {name:<34}{runs:>5}{med:>11.2f}{p99:>9.2f}{per_entry:>13,.0f}{ratio:>8.1f}x"
        )


if __name__ == "__main__":
    main()
