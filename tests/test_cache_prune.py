"""``fleetcache cache prune``: only the current engine fingerprint's namespace stays."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cache.embedder import CachedEmbedder
from cache.links import Entity
from cache.prune import prune
from cache.stores import TieredByteStore
from engines.fake import FakeEngine
from proxy.cli import app as cli
from proxy.engine_host import cache_namespace
from proxy.services import build_tiers
from proxy.settings import Settings
from tests.conftest import make_settings
from tests.redis_server import (  # noqa: F401  (pytest fixtures)
    RedisServer,
    redis_server_fixture,
    redis_session_fixture,
)
from tests.test_cache import DIM, FakeCompute, run

CURRENT = cache_namespace(FakeEngine().info)  # what FLEETCACHE_ENGINE=fake serves
OLD = "t1-0ldf1ngerpr1nt0"
OLDER = "t0-ancient"


def fill(store: TieredByteStore, namespace: str, n: int) -> None:
    """n driver entities (n vectors and n links) in ``namespace``."""
    emb = CachedEmbedder(FakeCompute(), store, namespace=namespace, dim=DIM)
    entities = [Entity("driver", f"D{i}", f"{namespace} driver {i}") for i in range(n)]
    run(lambda: emb.aembed_entities(entities))


def sizes(settings: Settings) -> dict[str, int]:
    """key -> key + value bytes, for every key of the store tier."""
    tiered = build_tiers(settings)
    assert tiered.store is not None
    keys = list(tiered.store.yield_keys())
    values = tiered.store.mget(keys)
    tiered.close()
    return {k: len(k.encode()) + len(v) for k, v in zip(keys, values, strict=True) if v}


def invoke(settings: Settings, monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    env = {"ENGINE": "fake", "STORE": settings.store, "DATA_DIR": str(settings.data_dir)}
    env["REDIS_URL"] = settings.redis_url
    for name, value in env.items():
        monkeypatch.setenv(f"FLEETCACHE_{name}", value)
    result = CliRunner().invoke(cli, ["cache", "prune", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def row(output: str, namespace: str) -> list[str]:
    (line,) = [line for line in output.splitlines() if f"│ {namespace} " in line]
    return [cell.strip() for cell in line.split("│")[1:-1]]


def number(cell: str) -> int:
    return int(cell.replace(",", ""))


@pytest.fixture(params=["lmdb", pytest.param("redis", marks=pytest.mark.redis)])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    if request.param == "lmdb":
        return make_settings(tmp_path / "data")
    server: RedisServer = request.getfixturevalue("redis_server")
    return make_settings(tmp_path / "data", store="redis", redis_url=server.url)


def test_prune_keeps_only_the_current_namespace(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiered = build_tiers(settings)
    fill(tiered, CURRENT, 5)
    fill(tiered, OLD, 7)
    fill(tiered, OLDER, 2)
    tiered.close()
    before = sizes(settings)
    assert len(before) == 2 * (5 + 7 + 2)  # a vector and a link per entity

    dry = invoke(settings, monkeypatch, "--dry-run")
    assert sizes(settings) == before  # a dry run changes nothing
    assert "dry run: freed is what would be freed" in dry

    out = invoke(settings, monkeypatch)
    after = sizes(settings)
    assert set(after) == {k for k in before if k.startswith((CURRENT, f"link:{CURRENT}:"))}
    assert len(after) == 10

    for output in (dry, out):
        for namespace, n in ((OLD, 7), (OLDER, 2)):
            freed = sum(
                size
                for key, size in before.items()
                if key.startswith((f"{namespace}:", f"link:{namespace}:"))
            )
            cells = row(output, namespace)
            assert cells[1] == "old"
            assert [number(c) for c in cells[2:]] == [2 * n, n, freed, 2 * n, freed]
        current = row(output, CURRENT)
        assert current[1] == "current"
        assert [number(c) for c in current[2:]] == [10, 5, sum(after.values()), 0, 0]
        assert number(row(output, "total")[-1]) == sum(before.values()) - sum(after.values())

    again = invoke(settings, monkeypatch)  # nothing left to free
    assert OLD not in again and number(row(again, "total")[-1]) == 0
    assert sizes(settings) == after


def test_prune_removes_expired_entries_of_the_current_namespace(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "data")
    tiered = build_tiers(settings)
    fill(tiered, CURRENT, 3)
    fill(tiered, CURRENT + "x", 1)  # another namespace, however alike
    past = time.time() - 3600
    emb = CachedEmbedder(FakeCompute(), tiered, namespace=CURRENT, dim=DIM, wall_clock=lambda: past)
    run(lambda: emb.aembed(["long expired"], ttl_s=10.0))
    store = tiered.store
    assert store is not None
    usage = prune(store, CURRENT)
    assert [(u.namespace, u.entries, u.freed_entries) for u in usage] == [
        (CURRENT, 7, 1),
        (CURRENT + "x", 2, 2),
    ]
    assert store.mget([emb.key("long expired")]) == [None]
    assert len(list(store.yield_keys())) == 6
    tiered.close()


def test_prune_of_a_memory_store_or_a_missing_data_dir_is_a_no_op(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = make_settings(tmp_path / "data", store="memory")
    assert "nothing to prune" in invoke(memory, monkeypatch)
    lmdb = make_settings(tmp_path / "nowhere")
    assert "nothing to prune" in invoke(lmdb, monkeypatch)
    assert not (tmp_path / "nowhere").exists()
