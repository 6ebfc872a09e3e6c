"""API keys and scopes (API.md, "Authentication and scopes"): every route against every scope,
401/403 in the error shape before any work, the file reloaded while serving (a revoked key
refused, a broken file refusing everyone, never opening), the lane following the key, the
CLI's keys commands and ``--api-key``, and no key in any log line."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import re
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from engines.fake import FakeEngine
from features.synthetic import iter_fleet
from proxy.app import create_app
from proxy.auth import (
    SCOPES,
    KeyRing,
    KeysFileError,
    add_key,
    parse_keys,
    revoke_key,
    route_rows,
)
from proxy.cli import app as cli
from tests.conftest import LiveServer, make_settings, wait_ready
from tests.serve_process import FleetcacheServer

SCOPE_NAMES = ("dispatch", "fleet", "warmup", "operator", "admin")
DRIVER = next(iter(iter_fleet(1, seed=3))).model_dump(mode="json")
DRIVER_ID = DRIVER["driver_id"]
JOB = "w-1"


def request_for(row: str) -> tuple[str, str, dict[str, Any] | None]:
    """A well-formed request for each row of ``SCOPES``."""
    method, template = row.split(" ", 1)
    path = template.format(driver_id=DRIVER_ID, job_id=JOB, kind="driver", entity_id=DRIVER_ID)
    bodies: dict[str, dict[str, Any]] = {
        "POST /v1/embeddings": {"input": ["a text"]},
        "POST /v1/features/embed": {"drivers": [DRIVER]},
        "POST /v1/dispatch/recommend": {"order_id": "o-1", "pickup": DRIVER["position"]},
        "PATCH /v1/fleet/drivers/{driver_id}": {"status": "busy"},
        "PUT /v1/fleet/drivers": {"drivers": [DRIVER]},
        "POST /v1/warmup": {"path": "missing.jsonl"},
        "POST /v1/coverage": {"driver_ids": [DRIVER_ID]},
    }
    return method, path, bodies.get(row)


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    return tmp_path / "keys"


@pytest.fixture
def keys(keys_file: Path) -> dict[str, str]:
    """One key per scope, named ``SCOPE-key``."""
    return {s: add_key(keys_file, f"{s}-key", frozenset({s})) for s in SCOPE_NAMES}


def settle() -> None:
    """Long enough for the server to see a change to the keys file (API.md: no restart)."""
    time.sleep(KeyRing.CHECK_EVERY_S + 0.1)


@pytest.fixture
def secured(tmp_path: Path, keys_file: Path, keys: dict[str, str]) -> Iterator[TestClient]:
    settings = make_settings(tmp_path / "data", api_keys_file=keys_file)
    with TestClient(create_app(settings, engine=FakeEngine())) as client:
        wait_ready(client)
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def send(client: TestClient, row: str, headers: dict[str, str]) -> httpx.Response:
    method, path, body = request_for(row)
    return client.request(method, path, json=body, headers=headers)


def test_every_route_has_exactly_one_row_of_scopes() -> None:
    """A route without a row would stop the app from being built; a row without a route is
    a stale promise. Both directions, so the table is the whole truth."""
    app = create_app(make_settings(Path("/nonexistent")), engine=FakeEngine())
    rows = {row for _, row in route_rows(app)}
    assert rows == set(SCOPES)


@pytest.mark.parametrize("row", [r for r, scopes in SCOPES.items() if scopes])
def test_each_scope_opens_exactly_its_routes(
    secured: TestClient, keys: dict[str, str], row: str
) -> None:
    for scope, key in keys.items():
        response = send(secured, row, bearer(key))
        if scope in SCOPES[row] or scope == "admin":
            assert response.status_code not in (401, 403), (scope, row, response.text)
        else:
            assert response.status_code == 403, (scope, row, response.text)
            error = response.json()["error"]
            assert error["type"] == "permission_error"
            for needed in SCOPES[row]:
                assert f"'{needed}'" in error["message"]
            assert f"'{scope}-key'" in error["message"]  # the key's name


@pytest.mark.parametrize("row", [r for r, scopes in SCOPES.items() if scopes])
@pytest.mark.parametrize("header", [None, "Bearer fc_not-a-key", "Basic abc", "Bearer "])
def test_no_or_unknown_key_is_401_with_www_authenticate(
    secured: TestClient, row: str, header: str | None
) -> None:
    response = send(secured, row, {"Authorization": header} if header else {})
    assert response.status_code == 401, response.text
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert response.json()["error"]["type"] == "authentication_error"
    assert response.json()["error"]["param"] == "Authorization"


def test_probes_and_the_dashboard_stay_open(secured: TestClient) -> None:
    for path in ("/healthz", "/readyz", "/dashboard", "/metrics", "/openapi.json"):
        assert secured.get(path).status_code == 200, path


def test_metrics_can_be_closed_to_all_but_operators(
    tmp_path: Path, keys_file: Path, keys: dict[str, str]
) -> None:
    settings = make_settings(tmp_path / "data", api_keys_file=keys_file, metrics_public=False)
    with TestClient(create_app(settings, engine=FakeEngine())) as client:
        wait_ready(client)
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=bearer(keys["dispatch"])).status_code == 403
        assert client.get("/metrics", headers=bearer(keys["operator"])).status_code == 200


@pytest.mark.parametrize("admin_token", [None, "s3cret"])
def test_closed_metrics_stay_closed_without_a_keys_file(
    tmp_path: Path, admin_token: str | None
) -> None:
    """With no keys file every route but the admin ones is open, and FLEETCACHE_METRICS_PUBLIC
    =false was silently ignored: /metrics is then an admin route (the admin token opens it)."""
    settings = make_settings(tmp_path / "data", metrics_public=False, admin_token=admin_token)
    with TestClient(create_app(settings, engine=FakeEngine())) as client:
        wait_ready(client)
        assert client.get("/metrics").status_code == (401 if admin_token else 403)
        assert client.get("/v1/stats").status_code == 200  # the rest stays open
        if admin_token:
            assert client.get("/metrics", headers=bearer(admin_token)).status_code == 200


def test_a_refused_write_changes_nothing(secured: TestClient, keys: dict[str, str]) -> None:
    """A dispatch key may not overwrite or delete drivers: nothing is embedded or indexed."""
    before = secured.get("/v1/stats", headers=bearer(keys["operator"])).json()
    assert send(secured, "PUT /v1/fleet/drivers", bearer(keys["dispatch"])).status_code == 403
    assert send(secured, "PUT /v1/fleet/drivers", {}).status_code == 401
    after = secured.get("/v1/stats", headers=bearer(keys["operator"])).json()
    assert after["fleet"]["drivers"] == before["fleet"]["drivers"]
    assert after["inference"]["items"] == before["inference"]["items"]
    got = secured.get(f"/v1/fleet/drivers/{DRIVER_ID}", headers=bearer(keys["dispatch"]))
    assert got.status_code == 404


def test_stats_say_whether_auth_is_on(client: TestClient) -> None:
    assert client.get("/v1/stats").json()["auth"] == "off"


def test_stats_say_auth_is_on(secured: TestClient, keys: dict[str, str]) -> None:
    assert secured.get("/v1/stats", headers=bearer(keys["operator"])).json()["auth"] == "on"


def test_the_admin_token_is_one_admin_key_when_keys_are_on(
    tmp_path: Path, keys_file: Path, keys: dict[str, str]
) -> None:
    settings = make_settings(tmp_path / "data", api_keys_file=keys_file, admin_token="t0ken")
    with TestClient(create_app(settings, engine=FakeEngine())) as client:
        wait_ready(client)
        admin = bearer("t0ken")
        assert send(client, "PUT /v1/fleet/drivers", admin).status_code == 200
        response = client.delete(f"/v1/cache/entities/driver/{DRIVER_ID}", headers=admin)
        assert response.status_code == 200, response.text
        assert client.get("/v1/stats", headers=bearer("t0ke")).status_code == 401


def test_keys_added_and_revoked_while_serving(secured: TestClient, keys_file: Path) -> None:
    """The file is re-read when it changes, within a second; no restart."""
    runner = CliRunner()
    args = ["--file", str(keys_file)]
    added = runner.invoke(cli, ["keys", "add", "late", "--scopes", "operator", *args])
    assert added.exit_code == 0, added.output
    key = added.stdout.strip().splitlines()[-1]
    assert secured.get("/v1/stats", headers=bearer(key)).status_code == 401  # not seen yet
    settle()
    assert secured.get("/v1/stats", headers=bearer(key)).status_code == 200

    assert runner.invoke(cli, ["keys", "revoke", "late", *args]).exit_code == 0
    settle()
    response = secured.get("/v1/stats", headers=bearer(key))
    assert response.status_code == 401
    assert "unknown API key" in response.json()["error"]["message"]


def test_a_broken_or_missing_file_refuses_every_key_until_fixed(
    secured: TestClient, keys_file: Path, keys: dict[str, str]
) -> None:
    """Never open by accident: a file that cannot be read or parsed any more leaves no key
    valid (and open routes open), until it is fixed."""
    good = keys_file.read_text()
    operator = bearer(keys["operator"])
    for broken in (lambda: keys_file.write_text(good + "oops\n"), keys_file.unlink):
        broken()
        settle()
        assert secured.get("/v1/stats", headers=operator).status_code == 401
        assert secured.post("/v1/embeddings", json={"input": "x"}).status_code == 401
        assert secured.get("/healthz").status_code == 200
        keys_file.write_text(good)
        settle()
        assert secured.get("/v1/stats", headers=operator).status_code == 200


def test_lane_follows_the_key_not_x_caller(secured: TestClient, keys: dict[str, str]) -> None:
    """A dispatch key that calls itself 'warmup' still rides the dispatch lane; a warm-up key
    calling itself 'dispatch' rides the warm-up lane. X-Caller stays the stats label."""
    pattern = re.compile(r'^fleetcache_lane_queue_wait_seconds_count\{lane="(\w+)"\} (\S+)$', re.M)

    def waits() -> dict[str, float]:
        return {lane: float(n) for lane, n in pattern.findall(secured.get("/metrics").text)}

    before = waits()
    response = secured.post(
        "/v1/embeddings",
        json={"input": ["dispatch key, warm-up label"]},
        headers={**bearer(keys["dispatch"]), "X-Caller": "warmup"},
    )
    assert response.status_code == 200
    middle = waits()
    assert middle["dispatch"] == before["dispatch"] + 1
    assert middle["warmup"] == before["warmup"]
    driver = {**DRIVER, "driver_id": "lane-test"}
    response = secured.put(
        "/v1/fleet/drivers",
        json={"drivers": [driver]},
        headers={**bearer(keys["warmup"]), "X-Caller": "dispatch"},
    )
    assert response.status_code == 200
    after = waits()
    assert after["warmup"] == middle["warmup"] + 1
    assert after["dispatch"] == middle["dispatch"]
    by_caller = secured.get("/v1/stats", headers=bearer(keys["operator"])).json()["by_caller"]
    assert by_caller["warmup"]["misses"] >= 1  # the label, not the lane


def test_open_mode_keeps_x_caller_as_the_lane(client: TestClient) -> None:
    pattern = re.compile(r'^fleetcache_lane_queue_wait_seconds_count\{lane="warmup"\} (\S+)$', re.M)
    before = float(pattern.findall(client.get("/metrics").text)[0])
    response = client.post("/v1/embeddings", json={"input": "open"}, headers={"X-Caller": "warmup"})
    assert response.status_code == 200
    assert float(pattern.findall(client.get("/metrics").text)[0]) == before + 1


def test_keys_cli_keeps_only_hashes(keys_file: Path) -> None:
    runner = CliRunner()
    args = ["--file", str(keys_file)]
    added = runner.invoke(cli, ["keys", "add", "ops-1", "--scopes", "operator,fleet", *args])
    assert added.exit_code == 0, added.output
    key = added.stdout.strip().splitlines()[-1]
    assert key.startswith("fc_") and len(key) > 40
    text = keys_file.read_text()
    assert key not in text
    assert re.fullmatch(r"ops-1 fleet,operator [0-9a-f]{64}\n", text)
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600

    listed = runner.invoke(cli, ["keys", "list", *args])
    assert listed.exit_code == 0 and "ops-1" in listed.stdout
    assert "fleet,operator" in listed.stdout and text.split()[2] not in listed.stdout

    for bad in (
        ["keys", "add", "ops-1", "--scopes", "operator", *args],  # the name is taken
        ["keys", "add", "ops-2", "--scopes", "root", *args],  # no such scope
        ["keys", "add", "two words", "--scopes", "operator", *args],
        ["keys", "revoke", "nobody", *args],
    ):
        result = runner.invoke(cli, bad)
        assert result.exit_code == 2, (bad, result.output)
    assert keys_file.read_text() == text  # a refused command changes nothing
    assert runner.invoke(cli, ["keys", "revoke", "ops-1", *args]).exit_code == 0
    assert keys_file.read_text() == ""


def test_keys_commands_run_as_python_m_proxy_cli(keys_file: Path) -> None:
    """``python -m proxy.cli keys add`` (the image's entry point as a module) has the keys
    commands too: they were defined below the module's ``__main__`` call, so that form
    answered "No such command 'add'"."""
    command = [sys.executable, "-m", "proxy.cli", "keys", "add", "ops-9", "--scopes", "fleet"]
    added = subprocess.run(
        [*command, "--file", str(keys_file)], capture_output=True, text=True, timeout=60
    )
    assert added.returncode == 0, added.stderr
    assert keys_file.read_text().startswith("ops-9 fleet ")


def test_a_bad_keys_file_stops_the_start(tmp_path: Path, keys_file: Path) -> None:
    keys_file.write_text(
        "# comment\nops operator " + "0" * 64 + "\nops dispatch " + "1" * 64 + "\n"
    )
    settings = make_settings(tmp_path / "data", api_keys_file=keys_file)
    with pytest.raises(KeysFileError, match="line 3: the name 'ops' is used twice"):
        create_app(settings, engine=FakeEngine())
    missing = make_settings(tmp_path / "data", api_keys_file=tmp_path / "absent")
    with pytest.raises(KeysFileError, match="cannot read"):
        create_app(missing, engine=FakeEngine())


def test_cli_clients_send_the_key(
    tmp_path: Path, keys_file: Path, keys: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stats --url`` and ``warmup --url`` take ``--api-key`` or ``FLEETCACHE_API_KEY``;
    without one they fail with the service's own message."""
    settings = make_settings(tmp_path / "data", api_keys_file=keys_file)
    fleet = tmp_path / "fleet.jsonl"
    fleet.write_text("".join(r.model_dump_json() + "\n" for r in iter_fleet(20, seed=5)))
    runner = CliRunner()
    monkeypatch.chdir(tmp_path)
    with LiveServer(create_app(settings, engine=FakeEngine())) as server:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/readyz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = runner.invoke(cli, ["stats", "--url", server.url])
        assert refused.exit_code == 1
        assert "401" in refused.output and "no API key" in refused.output
        shown = runner.invoke(cli, ["stats", "--url", server.url, "--api-key", keys["operator"]])
        assert shown.exit_code == 0, shown.output

        warm = ["warmup", str(fleet), "--url", server.url]
        refused = runner.invoke(cli, warm, env={"FLEETCACHE_API_KEY": keys["dispatch"]})
        assert refused.exit_code == 1 and "403" in refused.output
        done = runner.invoke(cli, warm, env={"FLEETCACHE_API_KEY": keys["warmup"]})
        assert done.exit_code == 0, done.output
        stats = httpx.get(f"{server.url}/v1/stats", headers=bearer(keys["operator"])).json()
        assert stats["fleet"]["drivers"] == 20


def test_keys_never_reach_the_log(
    secured: TestClient, keys: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for key in (*keys.values(), "fc_wrong-key"):
        for row in SCOPES:
            send(secured, row, bearer(key))
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for key in (*keys.values(), "fc_wrong-key"):
        assert key not in logged


def test_every_worker_of_a_served_tree_reloads_the_keys(tmp_path: Path) -> None:
    """``fleetcache serve`` with three workers: each reads the file itself, so a key added or
    revoked is honoured by whichever worker a new connection lands on."""
    keys_file = tmp_path / "keys"
    operator = add_key(keys_file, "ops", frozenset({"operator"}))
    server = FleetcacheServer(tmp_path / "served", workers=3, api_keys_file=keys_file).start()
    try:

        def statuses(key: str) -> set[int]:  # a new connection each: spread over the workers
            return {
                httpx.get(f"{server.url}/v1/stats", headers=bearer(key)).status_code
                for _ in range(30)
            }

        late = add_key(keys_file, "late", frozenset({"operator"}))
        settle()
        assert statuses(late) == {200} and statuses(operator) == {200}
        assert httpx.get(f"{server.url}/v1/stats").status_code == 401
        revoke_key(keys_file, "late")
        settle()
        assert statuses(late) == {401} and statuses(operator) == {200}
    finally:
        assert server.stop() == 0


def test_a_hash_written_in_upper_case_is_the_same_key() -> None:
    """A keys file written by another tool than ``fleetcache keys`` (upper-case hex) used to
    stop the server at start."""
    digest = hashlib.sha256(b"fc_some_key").hexdigest()
    assert parse_keys(f"ops operator {digest.upper()}") == parse_keys(f"ops operator {digest}")


def _add_then_exit(path: Path, name: str, start: Any) -> None:
    start.wait()
    add_key(path, name, frozenset({"dispatch"}))


def test_keys_added_and_revoked_at_once_lose_nothing(tmp_path: Path) -> None:
    """``keys add`` and ``keys revoke`` each rewrite the file: run at the same time, a revoked
    key came back (its old copy written over the revocation), or the added one was lost."""
    path = tmp_path / "keys"
    ctx = multiprocessing.get_context("fork")
    for round_ in range(20):
        add_key(path, f"victim{round_}", frozenset({"admin"}))
        start = ctx.Event()
        adder = ctx.Process(target=_add_then_exit, args=(path, f"new{round_}", start))
        adder.start()
        start.set()
        revoke_key(path, f"victim{round_}")
        adder.join()
        names = {key.name for key in parse_keys(path.read_text())}
        assert f"new{round_}" in names and f"victim{round_}" not in names, (round_, names)
