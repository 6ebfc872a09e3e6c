"""FLEETCACHE_INDEX_DEVICE: the index owner answers recommends that arrive together with one
first pass on a torch device (``FleetTable.recommend_many``), each answer the CPU path's. Here
the device is torch's CPU (the same code runs on CUDA: tests/test_index_gpu.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from indexes import FleetTable
from proxy.board import Board
from proxy.index_host import IndexHost, open_index_host
from tests.conftest import make_settings
from tests.test_index import DIM, SHANGHAI, driver, gaussian_unit, order

pytest.importorskip("torch")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def host_on(data_dir: Path, **settings: Any) -> AsyncIterator[IndexHost]:
    board = Board("worker")
    try:
        async with open_index_host(make_settings(data_dir, **settings), board, DIM) as host:
            yield host
    finally:
        board.close()


@pytest.mark.anyio
async def test_concurrent_recommends_share_one_device_pass_and_answer_as_the_cpu(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(8)
    near = rng.uniform(-0.05, 0.05, size=(400, 2)) + SHANGHAI
    statuses = ["available", "available", "busy"]
    fleet = [
        driver(i, lat, lng, status=statuses[i % 3], energy=("electric", "diesel")[i % 2])
        for i, (lat, lng) in enumerate(near.tolist())
    ]
    vectors = gaussian_unit(rng, len(fleet))
    orders = [
        order(*(rng.uniform(-0.03, 0.03, 2) + SHANGHAI), radius_km=r, k=15, constraints=c)
        for r in (1.0, 3.0, 8.0)
        for c in ([], ["electric_only"])
    ] * 3
    queries = gaussian_unit(rng, len(orders))
    cpu = FleetTable(DIM)
    cpu.upsert_drivers(fleet, vectors)
    async with host_on(tmp_path / "data", index_device="cpu") as host:
        await host.upsert_drivers(fleet, vectors)
        answers = await asyncio.gather(
            *(host.recommend(o, q) for o, q in zip(orders, queries, strict=True))
        )
        assert host.recommend_batches == 1
        assert answers == [cpu.recommend(o, q) for o, q in zip(orders, queries, strict=True)]
        assert sum(len(a.candidates) for a in answers) > 100
        alone = await host.recommend(orders[0], queries[0])  # a lone one is a batch of one
        assert host.recommend_batches == 2 and alone == answers[0]
