"""Warm-up jobs: the three formats, bad rows, dry runs, resume after kill -9, cancel, coverage."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import gc
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cache.codec import decode
from cache.links import LINK_PREFIX
from cache.stores import LmdbByteStore
from engines.fake import FakeEngine
from features.readers import iter_rows, write_records
from features.synthetic import generate_fleet
from features.text import driver_text
from proxy import jobs, warmup
from proxy import services as services_module
from proxy.cli import app as cli
from proxy.ipc import ServiceUnavailableError
from proxy.jobs import ProcessJobs
from proxy.processes import ChildSpec
from proxy.settings import Settings
from proxy.warmup import (
    RemoteSink,
    Shard,
    WarmupProgress,
    checkpoint_files,
    checkpoint_for,
    run_warmup,
)
from tests.conftest import make_settings, open_client, wait_ready
from tests.serve_process import crash

REPO = Path(__file__).resolve().parents[1]


def fleet_file(path: Path, n: int, seed: int = 0) -> list[str]:
    """Write n drivers, then append two bad rows where the format allows; return the ids."""
    drivers = generate_fleet(n, seed=seed)
    write_records(drivers, path)
    if path.suffix == ".jsonl":
        with path.open("a") as f:
            f.write('{"driver_id": "BAD1", "status": "available"\n')  # line n+1: bad JSON
            bad = drivers[0].model_dump(mode="json")
            bad["vehicle"]["capacity_kg"] = -5
            f.write(json.dumps({**bad, "driver_id": "BAD2"}) + "\n")  # line n+2
    elif path.suffix == ".csv":
        with path.open("a") as f:
            f.write("BAD3,available,91.0,0,,V1,van,electric,100,1,1,,,,,,,,,\n")  # line n+2
    return [d.driver_id for d in drivers]


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    data = tmp_path / "data"
    monkeypatch.setenv("FLEETCACHE_ENGINE", "fake")
    monkeypatch.setenv("FLEETCACHE_DATA_DIR", str(data))
    monkeypatch.setenv("FLEETCACHE_LMDB_MAP_SIZE_GB", "0.25")
    monkeypatch.chdir(tmp_path)
    return data


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_cli_warmup_fills_cache_and_index_from_each_format(
    env: Path, tmp_path: Path, suffix: str
) -> None:
    source = tmp_path / f"fleet{suffix}"
    ids = fleet_file(source, 120, seed=2)
    result = CliRunner().invoke(cli, ["warmup", str(source), "--chunk-size", "50"])
    assert result.exit_code == 0, result.output
    assert "warm-up done" in result.output and "120 indexed" in result.output

    lines = Path(f"fleet{suffix}.rejects.jsonl").read_text().splitlines()
    rejects = [json.loads(line) for line in lines]
    if suffix == ".jsonl":
        assert [r["line"] for r in rejects] == [121, 122]
        assert "JSON" in rejects[0]["error"] and "vehicle.capacity_kg" in rejects[1]["error"]
    elif suffix == ".csv":
        assert [r["line"] for r in rejects] == [122] and "position.lat" in rejects[0]["error"]

    engine = FakeEngine()
    with open_client(make_settings(env), engine) as client:
        wait_ready(client)
        warm = engine.items
        assert client.get(f"/v1/fleet/drivers/{ids[77]}").status_code == 200
        texts = [driver_text(d) for d in generate_fleet(120, seed=2)]
        response = client.post("/v1/embeddings", json={"input": texts})
        assert response.headers["X-Cache-Misses"] == "0"
        assert engine.items == warm


def test_the_rejects_file_lies_beside_the_file_and_a_run_from_row_one_starts_it_afresh(
    env: Path, tmp_path: Path
) -> None:
    """README: invalid rows go to FILE.rejects.jsonl. It was named after the file in the
    working directory, and every run appended to it (a finished job run again listed its
    rejects twice)."""
    (tmp_path / "in").mkdir()
    source = tmp_path / "in" / "fleet.jsonl"
    fleet_file(source, 30)
    for _ in range(2):  # the second run reads the file again from row 1 (the job finished)
        result = CliRunner().invoke(cli, ["warmup", str(source)])
        assert result.exit_code == 0, result.output
        lines = (tmp_path / "in" / "fleet.jsonl.rejects.jsonl").read_text().splitlines()
        assert [json.loads(line)["line"] for line in lines] == [31, 32]
    assert not (tmp_path / "fleet.jsonl.rejects.jsonl").exists()


def test_a_direct_warmup_on_a_data_dir_a_server_owns_stops_at_once_saying_so(
    env: Path, tmp_path: Path
) -> None:
    """It started its own index owner, which could not take the fleet change log, and
    waited two minutes for it before a traceback."""
    from indexes.changelog import LOCK_FILE
    from proxy.index_host import LOG_DIR

    source = tmp_path / "fleet.jsonl"
    fleet_file(source, 10)
    log_dir = env / "index" / LOG_DIR
    log_dir.mkdir(parents=True)
    with (log_dir / LOCK_FILE).open("w") as held:  # as a server's index owner holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        result = CliRunner().invoke(cli, ["warmup", str(source)])
        assert time.monotonic() - started < 10
    assert result.exit_code == 1, result.output
    assert "a running server owns the data dir" in result.output and "--url" in result.output


def test_a_file_whose_name_holds_glob_characters_restarts_and_settles_by_its_checkpoints(
    env: Path, tmp_path: Path
) -> None:
    """Its checkpoints were looked up with its name as a glob pattern (``fleet[1].jsonl``
    matches ``fleet1.jsonl``, not itself): ``--restart`` kept them and resumed, and a killed
    job's rejects were cut to nothing instead of to its place."""
    source = tmp_path / "fleet[1].jsonl"
    fleet_file(source, 30)
    for shards in range(1, 5):  # whatever the shard count of the run that left them
        for index in range(shards):
            checkpoint_for(env, source, Shard(index, shards)).save(20)
    assert len(checkpoint_files(env, source)) == 10
    result = CliRunner().invoke(cli, ["warmup", str(source), "--restart"])
    assert result.exit_code == 0, result.output
    assert "30 indexed" in result.output, result.output
    assert checkpoint_files(env, source) == []


def test_the_progress_total_counts_a_last_line_without_its_newline(tmp_path: Path) -> None:
    from proxy.cli import count_rows

    source = tmp_path / "fleet.jsonl"
    fleet_file(source, 5)
    source.write_bytes(source.read_bytes().rstrip(b"\n"))  # 7 rows, the last unterminated
    assert count_rows(source) == 7
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert count_rows(tmp_path / "empty.jsonl") == 0


def test_dry_run_validates_and_writes_nothing(env: Path, tmp_path: Path) -> None:
    source = tmp_path / "fleet.jsonl"
    fleet_file(source, 40)
    result = CliRunner().invoke(cli, ["warmup", str(source), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "40 would index" in result.output and "2 rejected" in result.output
    assert not (env / "cache.lmdb").exists() and not (env / "index").exists()


def test_a_dry_run_or_a_run_through_a_server_caps_its_rejects_file_too(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``FLEETCACHE_MAX_REJECTS`` caps the rejects file of direct runs and server jobs; a
    dry run and ``--url`` (one code path) wrote every reject."""
    monkeypatch.setenv("FLEETCACHE_MAX_REJECTS", "1")
    source = tmp_path / "fleet.jsonl"
    fleet_file(source, 40)
    result = CliRunner().invoke(cli, ["warmup", str(source), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "2 rejected" in result.output  # counted all ...
    assert len((tmp_path / "fleet.jsonl.rejects.jsonl").read_text().splitlines()) == 1  # kept 1


def test_unreadable_input_is_a_nonzero_exit(env: Path, tmp_path: Path) -> None:
    assert CliRunner().invoke(cli, ["warmup", str(tmp_path / "missing.jsonl")]).exit_code == 2
    (tmp_path / "fleet.xml").write_text("<drivers/>")
    assert CliRunner().invoke(cli, ["warmup", str(tmp_path / "fleet.xml")]).exit_code == 2


def test_a_direct_warmup_whose_readers_fail_exits_non_zero_saying_why(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """API.md: the exit code is non-zero when the job could not run. With two reader
    processes (``auto`` on 4 cores or more) a job whose every engine call failed printed
    "warm-up failed: ... 0 indexed" and exited 0, so a script went on with an empty cache."""
    monkeypatch.setenv("FLEETCACHE_WARMUP_PROCESSES", "2")
    monkeypatch.setenv("FLEETCACHE_FAKE_FAIL_ON", "capacity")  # in every driver's text
    source = tmp_path / "fleet.jsonl"
    fleet_file(source, 40)
    result = CliRunner().invoke(cli, ["warmup", str(source)])
    assert result.exit_code == 1, result.output
    assert "could not run" in result.output and "0 indexed" in result.output


def test_resume_after_kill_embeds_nothing_twice(env: Path, tmp_path: Path) -> None:
    source = tmp_path / "big.jsonl"
    drivers = generate_fleet(12_000, seed=7)
    write_records(drivers, source)
    command = [
        sys.executable,
        "-m",
        "proxy.cli",
        "warmup",
        str(source),
        "--chunk-size",
        "100",
        "--checkpoint-every",
        "0.2",
    ]
    checkpoint = checkpoint_for(env, source).file
    first = subprocess.Popen(
        command,
        cwd=tmp_path,
        # one reader, one checkpoint file (with N, one a reader: ``FILE.shard<i>of<N>...``)
        env={**os.environ, "PYTHONPATH": str(REPO), "FLEETCACHE_WARMUP_PROCESSES": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None:
        if checkpoint.exists() and json.loads(checkpoint.read_text())["rows"] >= 1000:
            break
        time.sleep(0.05)
    assert first.poll() is None, "the first run ended before it could be killed"
    # The run and the engine and index processes it started, all at once: a crash, with no
    # graceful drain anywhere (left alone, the engine would go on writing for a moment).
    crash(first.pid)
    first.wait()
    done_before = json.loads(checkpoint.read_text())["rows"]
    assert 0 < done_before < 12_000

    store = LmdbByteStore(env / "cache.lmdb")
    durable = sorted(k for k in store.yield_keys() if not k.startswith(LINK_PREFIX))
    for value in store.mget(durable):  # nothing half-written decodes wrongly
        assert value is not None and decode(value, expected_dim=384).shape == (384,)
    links = list(store.yield_keys(prefix=LINK_PREFIX))
    assert links  # the drivers are linked to their vectors ...
    targets = {v.decode() for v in store.mget(links) if v is not None}
    assert targets <= set(durable)  # ... and a link is only written after its vector
    store.close()

    second = subprocess.run(
        command,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "FLEETCACHE_WARMUP_PROCESSES": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stderr
    summary = second.stderr + second.stdout
    assert f"resumed after row {done_before}" in summary
    embedded = int(summary.split(" embedded")[0].rsplit(" ", 1)[1].replace(",", ""))
    distinct = len({driver_text(d) for d in drivers})
    assert len(durable) + embedded == distinct  # every text embedded exactly once in all
    assert not checkpoint.exists()

    engine = FakeEngine()
    with open_client(make_settings(env), engine) as client:
        wait_ready(client)
        stats = client.get("/v1/stats").json()
        assert stats["fleet"]["drivers"] == 12_000


def test_every_invalid_row_is_listed_once_across_a_kill_and_a_resume(
    env: Path, tmp_path: Path
) -> None:
    """API.md: invalid rows are skipped and reported. The checkpoint moved past rejected rows
    while their lines sat in a buffer, and a resumed run started its readers' files anew: a
    kill -9 then lost them. Now each reader's rejects are on disk before its checkpoint
    moves, and a resumed run cuts them back to it (no row listed twice either)."""
    source = tmp_path / "big.jsonl"
    lines = [json.dumps(d.model_dump(mode="json")) for d in generate_fleet(12_000, seed=5)]
    bad = set(range(7, 12_000, 400))  # 1-based line numbers, spread over the whole file
    for line in bad:
        lines[line - 1] = f'{{"driver_id": "BAD{line}", "status": "available"'  # cut short
    source.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "proxy.cli", "warmup", str(source), "--chunk-size", "100"]
    command += ["--checkpoint-every", "0.2"]
    run_env = {**os.environ, "PYTHONPATH": str(REPO), "FLEETCACHE_WARMUP_PROCESSES": "2"}
    run_env["FLEETCACHE_FAKE_DELAY_MS"] = "10"  # a run of seconds, to be killed mid-way
    places = [checkpoint_for(env, source, Shard(i, 2)).file for i in range(2)]
    first = subprocess.Popen(
        command, cwd=tmp_path, env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None:
        if all(p.exists() and json.loads(p.read_text())["rows"] >= 3000 for p in places):
            break
        time.sleep(0.05)
    assert first.poll() is None, "the first run ended before it could be killed"
    crash(first.pid)
    first.wait()
    assert all(json.loads(p.read_text())["rows"] < 12_000 for p in places)

    second = subprocess.run(command, cwd=tmp_path, env=run_env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert "resumed after row" in second.stdout + second.stderr
    listed = [
        json.loads(line)["line"]
        for line in (tmp_path / "big.jsonl.rejects.jsonl").read_text().splitlines()
    ]
    assert listed == sorted(bad)  # each once, none lost, in the file's order
    assert not list(tmp_path.glob("big.jsonl.rejects.jsonl.part*"))


def test_a_json_array_is_refused_at_once_naming_json_lines(env: Path, tmp_path: Path) -> None:
    """A .json file (or a JSONL upload) holding one JSON array was read as lines: every
    row rejected, exit 0 and a job "done". Now the CLI, the path and the upload refuse it;
    an upload of no rows too (it was a job "done" with 0 rows)."""
    records = [orjson.loads(d.model_dump_json()) for d in generate_fleet(3, seed=5)]
    array = tmp_path / "fleet.json"
    array.write_bytes(b"\n  " + orjson.dumps(records, option=orjson.OPT_INDENT_2))
    result = CliRunner().invoke(cli, ["warmup", str(array)])
    assert result.exit_code == 2 and "JSON Lines" in result.output, result.output
    assert not (env / "index").exists()
    lines = tmp_path / "lines.json"  # the same records, one a line: read as before
    lines.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    assert CliRunner().invoke(cli, ["warmup", str(lines)]).exit_code == 0

    settings = make_settings(tmp_path / "served")
    settings.data_dir.mkdir(parents=True)
    (settings.data_dir / "fleet.json").write_bytes(array.read_bytes())
    with open_client(settings) as client:
        wait_ready(client)
        by_path = client.post("/v1/warmup", json={"path": "fleet.json"})
        assert by_path.status_code == 422, by_path.text
        assert by_path.json()["error"]["param"] == "path"
        assert "JSON Lines" in by_path.json()["error"]["message"]
        upload = client.post(
            "/v1/warmup",
            content=array.read_bytes(),
            headers={"Content-Type": "application/x-ndjson"},
        )
        assert upload.status_code == 422 and upload.json()["error"]["param"] == "body"
        for empty in (b"", b"\n \n"):  # ``curl --data-binary @FILE`` of a file not there
            refused = client.post(
                "/v1/warmup", content=empty, headers={"Content-Type": "application/x-ndjson"}
            )
            assert refused.status_code == 422, refused.text
            error = refused.json()["error"]
            assert error["param"] == "body" and "no rows" in error["message"]
        assert client.get("/v1/warmup").json()["jobs"] == []
    assert list((settings.data_dir / "warmup").glob("upload-*")) == []


def test_api_job_from_upload_cancel_and_resume(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "data")
    settings.data_dir.mkdir(parents=True)
    source = settings.data_dir / "fleet.jsonl"
    write_records(generate_fleet(6_000, seed=4), source)
    with open_client(settings) as client:
        wait_ready(client)
        started = client.post("/v1/warmup", json={"path": "fleet.jsonl", "chunk_size": 50})
        assert started.status_code == 200, started.text
        job = started.json()["id"]
        # a second job of the file while this one runs: both would write its checkpoint
        second = client.post("/v1/warmup", json={"path": "fleet.jsonl"})
        assert second.status_code == 409, second.text
        error = second.json()["error"]
        assert (error["type"], error["param"]) == ("conflict", "path")
        assert job in error["message"]
        cancelled = client.delete(f"/v1/warmup/{job}")
        assert cancelled.status_code == 200
        state = cancelled.json()  # the answer comes once the job stopped (it said "running")
        assert state["state"] == "cancelled" and state["rows"] < 6_000, state
        again = client.get(f"/v1/warmup/{job}").json()
        assert (again["state"], again["rows"]) == ("cancelled", state["rows"])

        resumed = poll(client, client.post("/v1/warmup", json={"path": "fleet.jsonl"}).json()["id"])
        assert resumed["state"] == "done", resumed
        assert resumed["resumed_from"] == state["rows"] and resumed["rows"] == 6_000
        assert client.get("/v1/stats").json()["by_caller"]["warmup"]["misses"] > 0

        body = "".join(d.model_dump_json() + "\n" for d in generate_fleet(30, seed=99))
        body += "not json\n"
        upload = client.post(
            "/v1/warmup", content=body.encode(), headers={"Content-Type": "application/x-ndjson"}
        )
        finished = poll(client, upload.json()["id"])
        assert (finished["state"], finished["indexed"], finished["rejected"]) == ("done", 30, 1)

        # An upload job stopped, then the same POST (the same body, stored under a name of
        # its own): it resumes from its place as a path job does, its checkpoint following
        # the body's SHA-256 (a name and an mtime of each upload's own made it start again).
        body = "".join(d.model_dump_json() + "\n" for d in generate_fleet(20_000, seed=98))
        jsonl = {"Content-Type": "application/x-ndjson"}
        first = client.post("/v1/warmup", content=body.encode(), headers=jsonl).json()["id"]
        while client.get(f"/v1/warmup/{first}").json()["indexed"] < 500:
            time.sleep(0.005)
        refused = client.post("/v1/warmup", content=body.encode(), headers=jsonl)
        assert refused.status_code == 409 and refused.json()["error"]["param"] == "body"
        stopped = client.delete(f"/v1/warmup/{first}").json()
        assert stopped["state"] == "cancelled" and 0 < stopped["rows"] < 20_000, stopped
        uploads = settings.data_dir / "warmup"
        assert list(uploads.glob("upload-*")) == []  # the stopped one's and the refused copy
        again = client.post("/v1/warmup", content=body.encode(), headers=jsonl)
        resumed_upload = poll(client, again.json()["id"])
        assert resumed_upload["state"] == "done", resumed_upload
        assert resumed_upload["resumed_from"] == stopped["rows"]
        assert resumed_upload["indexed"] == 20_000 - stopped["rows"]
        assert list(uploads.glob("upload-*")) + list(uploads.glob("sha256-*")) == []

        (settings.data_dir / "broken.parquet").write_bytes(b"not a parquet file")
        broken = poll(
            client, client.post("/v1/warmup", json={"path": "broken.parquet"}).json()["id"]
        )
        assert broken["state"] == "failed"  # its error as a served job's: kind, no directories
        assert broken["error"].startswith("ArrowInvalid: "), broken
        assert str(settings.data_dir) not in broken["error"]

        outside = client.post("/v1/warmup", json={"path": "../../etc/passwd"})
        assert outside.status_code == 422 and outside.json()["error"]["param"] == "path"
        assert client.get("/v1/warmup/nope").status_code == 404


def test_a_stopped_job_and_the_one_that_resumes_it_list_each_invalid_row_once(
    tmp_path: Path,
) -> None:
    """A cancelled job kept the rejects of rows past its place (its chunks let go), which the
    job that resumes it reads and lists again: across the two files some rows were listed
    twice. The stopped job's file now ends at its place."""
    settings = make_settings(tmp_path / "data")
    settings.data_dir.mkdir(parents=True)
    lines = [json.dumps(d.model_dump(mode="json")) for d in generate_fleet(20_000, seed=6)]
    bad = list(range(5, 20_000, 97))  # 1-based line numbers
    for line in bad:
        lines[line - 1] = '{"driver_id": "BAD", "status": "available"'  # cut short
    (settings.data_dir / "fleet.jsonl").write_text("\n".join(lines) + "\n")
    with open_client(settings) as client:
        wait_ready(client)
        job = {"path": "fleet.jsonl", "chunk_size": 50}
        first = client.post("/v1/warmup", json=job).json()["id"]
        while client.get(f"/v1/warmup/{first}").json()["indexed"] < 2_000:
            time.sleep(0.005)
        stopped = client.delete(f"/v1/warmup/{first}").json()
        assert stopped["state"] == "cancelled" and stopped["rows"] < 20_000, stopped
        second = poll(client, client.post("/v1/warmup", json=job).json()["id"])
        assert (second["state"], second["resumed_from"]) == ("done", stopped["rows"])
    listed = [
        [json.loads(line)["line"] for line in path.read_text().splitlines()]
        for path in (
            settings.data_dir / "warmup" / f"{i}.rejects.jsonl" for i in (first, second["id"])
        )
    ]
    assert all(line <= stopped["rows"] for line in listed[0]), (stopped["rows"], listed[0])
    assert listed[0] + listed[1] == bad  # each once, in order


def test_two_files_of_one_name_in_two_directories_each_keep_their_place(tmp_path: Path) -> None:
    """Checkpoints were named by the file's name alone: a job of ``a/fleet.jsonl`` and one of
    ``b/fleet.jsonl`` shared one checkpoint file (each clearing or overwriting the other's
    place), and the second was refused as a job of the same source."""
    settings = make_settings(tmp_path / "data")
    for folder, seed in (("a", 1), ("b", 2)):
        (settings.data_dir / folder).mkdir(parents=True)
        write_records(generate_fleet(20_000, seed=seed), settings.data_dir / folder / "fleet.jsonl")
    places = {
        checkpoint_for(settings.data_dir, settings.data_dir / f / "fleet.jsonl").file for f in "ab"
    }
    assert len(places) == 2
    with open_client(settings) as client:
        wait_ready(client)
        first = client.post("/v1/warmup", json={"path": "a/fleet.jsonl", "chunk_size": 50})
        assert client.get(f"/v1/warmup/{first.json()['id']}").json()["state"] == "running"
        second = client.post("/v1/warmup", json={"path": "b/fleet.jsonl", "chunk_size": 50})
        assert second.status_code == 200, second.text
        jobs = [poll(client, answer.json()["id"]) for answer in (first, second)]
    assert [(job["state"], job["indexed"]) for job in jobs] == [("done", 20_000)] * 2


def poll(client: TestClient, job: str) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = client.get(f"/v1/warmup/{job}").json()
        if state["state"] != "running":
            return state
        time.sleep(0.05)
    raise AssertionError(f"job {job} still running")


def test_coverage_of_a_roster(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "data", store="memory")
    drivers = generate_fleet(10, seed=12)
    with open_client(settings) as client:
        wait_ready(client)
        client.put(
            "/v1/fleet/drivers", json={"drivers": [d.model_dump(mode="json") for d in drivers]}
        )
        roster = [d.driver_id for d in drivers] + ["GHOST1", "GHOST2"]
        result = client.post("/v1/coverage", json={"driver_ids": roster}).json()
        assert (result["roster"], result["known"], result["cached"]) == (12, 10, 10)
        assert result["share"] == pytest.approx(10 / 12)
        assert sorted(result["not_covered"]) == ["GHOST1", "GHOST2"]
        assert client.get("/v1/stats").json()["coverage"]["cached"] == 10
    # a restart with a memory-only cache keeps the index but not the vectors
    with open_client(settings) as client:
        wait_ready(client)
        result = client.post("/v1/coverage", json={"driver_ids": roster}).json()
        assert (result["known"], result["cached"]) == (10, 0)


def test_remote_sink_waits_out_429_503_and_a_restart() -> None:
    """API.md v1.1: ``fleetcache warmup --url`` retries after Retry-After instead of aborting."""
    answers = iter(
        [
            httpx.Response(429, headers={"Retry-After": "2"}),
            httpx.ConnectError("refused"),  # the server restarting
            httpx.Response(503, headers={"Retry-After": "1"}),
            httpx.Response(
                200, json={"upserted": 3}, headers={"X-Cache-Misses": "2", "X-Cache-Hits": "1"}
            ),
        ]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async def scenario() -> tuple[int, int, int]:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://fleet") as client:
            sink = RemoteSink(client, first_wait_s=0.5, sleep=sleep)
            return await sink.upsert(generate_fleet(3))

    assert asyncio.run(scenario()) == (3, 2, 1)
    assert waits == [2.0, 1.0, 1.0]  # Retry-After, then the doubled backoff, then Retry-After


def test_remote_sink_gives_up_after_its_bound() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, headers={"Retry-After": "30"})

    async def scenario() -> None:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://fleet") as client:
            sink = RemoteSink(client, max_wait_s=10, give_up_s=60, sleep=lambda s: asyncio.sleep(0))
            await sink.upsert(generate_fleet(1))

    with pytest.raises(RuntimeError, match="503; still failing after 60 s"):
        asyncio.run(scenario())


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_three_reader_processes_index_every_row_once_and_later_rows_win(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    """``FLEETCACHE_WARMUP_PROCESSES``: the rows are shared out by driver id, so every row is
    validated by one reader, a driver's later row still wins, the rejects are all reported
    once, and every distinct text is embedded once."""
    monkeypatch.setenv("FLEETCACHE_WARMUP_PROCESSES", "3")
    drivers = generate_fleet(300, seed=4)
    moved = [
        d.model_copy(update={"status": "busy", "vehicle": drivers[-1 - i].vehicle})
        for i, d in enumerate(drivers[:40])
    ]  # the first 40 drivers again, later in the file, with other vehicles
    source = tmp_path / f"fleet{suffix}"
    write_records([*drivers, *moved], source)
    with source.open("a") as f:  # a bad row
        if suffix == ".jsonl":
            f.write('{"driver_id": "BAD1", "status": "available"\n')
        else:
            f.write("BAD3,available,91.0,0,,V1,van,electric,100,1,1,,,,,,,,,\n")
    result = CliRunner().invoke(cli, ["warmup", str(source), "--chunk-size", "32"])
    assert result.exit_code == 0, result.output
    assert "warm-up done" in result.output and "340 indexed" in result.output
    assert "1 rejected" in result.output
    texts = {driver_text(d) for d in [*drivers[40:], *moved]} | {
        driver_text(d) for d in drivers[:40]
    }
    embedded = int(result.output.split(" embedded")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert embedded == len(texts)  # each distinct text once, whatever reader met it
    rejects = Path(f"fleet{suffix}.rejects.jsonl").read_text().splitlines()
    assert len(rejects) == 1

    engine = FakeEngine()
    with open_client(make_settings(env), engine) as client:
        wait_ready(client)
        for later in moved[::7]:
            stored = client.get(f"/v1/fleet/drivers/{later.driver_id}").json()
            assert stored["status"] == "busy"
            assert stored["vehicle"]["vehicle_id"] == later.vehicle.vehicle_id
        assert client.get("/v1/stats").json()["fleet"]["drivers"] == 300


def test_readers_split_every_line_of_a_jsonl_once_deciding_most_on_its_bytes(
    tmp_path: Path,
) -> None:
    """Each of N readers parses only the lines its bytes give it (``Shard.keeps_raw``); the
    lines the bytes do not settle (an escape, a second "driver_id", an id that is no string)
    are parsed and decided as before. Together the readers see every line once, valid or
    not, exactly as one reader would; a driver's rows all go to one reader."""
    source = tmp_path / "fleet.jsonl"
    write_records(generate_fleet(200, seed=8), source)
    fleet_lines = source.read_bytes().splitlines()
    record = orjson.loads(fleet_lines[0])
    third, fourth = (orjson.loads(fleet_lines[i])["driver_id"] for i in (2, 3))
    escaped = f"{fourth[0]}\\u{ord(fourth[1]):04x}{fourth[2:]}"
    odd = [
        {**record, "driver_id": "Dé-7"},  # raw UTF-8, no escape
        orjson.dumps({**record, "driver_id": fourth}).replace(
            f'"{fourth}"'.encode(), f'"{escaped}"'.encode()
        ),  # the fourth row's driver, its id spelled with an escape
        {**record, "driver_id": 17},  # not a string: rejected, by one reader
        {key: value for key, value in record.items() if key != "driver_id"}
        | {"vehicle": {**record["vehicle"], "driver_id": "Z9"}},  # only nested: rejected
        b'{"driver_id": "A1", ' + fleet_lines[1][1:],  # the later key wins: the 2nd driver's
        b'{"driver_id" :\t"D0002", "status": ',  # cut short
        b'[{"driver_id": "D0003"}]',  # not an object
        b'["driver_id", 1]',
        fleet_lines[5],  # a driver's later row
        {**record, "driver_id": f" {third} "},  # the third row's driver (validation strips)
        {**record, "driver_id": f"\u00a0{third}"},  # ... and so (a no-break space, in UTF-8)
    ]
    with source.open("ab") as out:
        for line in odd:
            out.write((line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n")
    alone = [(r.line, r.record, r.error) for r in iter_rows(source)]
    first_odd = len(fleet_lines) + 1
    for count in (2, 3, 8):
        shards = [Shard(i, count) for i in range(count)]
        owner = {}
        for i, shard in enumerate(shards):
            for r in iter_rows(source, keep=shard.keeps, keep_raw=shard.keeps_raw):
                if not r.passed_by:
                    assert r.line not in owner  # one reader a line
                    owner[r.line] = (i, r.record, r.error)
        assert [(line, *owner[line][1:]) for line in sorted(owner)] == alone
        assert owner[first_odd + 1][0] == owner[4][0]  # one driver, one reader
        assert owner[first_odd + 4][0] == owner[2][0]
        assert owner[first_odd + len(odd) - 3][0] == owner[6][0]
        assert owner[first_odd + len(odd) - 2][0] == owner[first_odd + len(odd) - 1][0]
        assert owner[first_odd + len(odd) - 1][0] == owner[3][0]
        for line_no, raw in enumerate(fleet_lines, start=1):  # fleet rows: decided on bytes,
            data = orjson.loads(raw)  # as parsing them would
            assert [s.keeps_raw(line_no, raw) for s in shards] == [
                s.keeps(line_no, data) for s in shards
            ]
    undecided = [Shard(0, 3).keeps_raw(1, line) for line in odd if isinstance(line, bytes)]
    assert undecided[:2] == [None, None]  # a backslash, two "driver_id"s


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # its Popen
def test_a_job_process_runs_below_the_workers_from_its_start(tmp_path: Path) -> None:
    """Its imports too: the worker that starts it sets it 10 below its own priority."""
    settings = make_settings(tmp_path / "data")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    source = tmp_path / "fleet.jsonl"
    fleet_file(source, 10)
    expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + jobs.NICE)
    job_id = asyncio.run(ProcessJobs(settings, run_dir).start(None, source))
    pid = json.loads((settings.data_dir / "warmup" / "jobs" / f"{job_id}.json").read_text())["pid"]
    assert os.getpriority(os.PRIO_PROCESS, pid) == expected
    wait_reaped(pid)  # it fails at once: this run dir has no server's spec


def wait_reaped(pid: int, within_s: float = 60.0) -> None:
    """Until process ``pid``, a job a worker (this process) started, is gone: the worker
    waits for the jobs it starts (a zombie of it read "running" for ever), and no one else
    can reap its child."""
    deadline = time.monotonic() + within_s
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, f"the job {pid} started here was not reaped"
        time.sleep(0.02)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # its Popen
def test_a_worker_starts_a_job_itself_only_when_the_job_starter_did_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The starter answers 0 when it could not fork the job: the worker starts it itself.
    One that took the job id and closed without a word may have forked it: the POST fails
    with a 503 rather than start a second process for the job, the job is marked failed,
    and a process started for it later (the starter forking it at last) does not run it.
    One that does not answer fails the POST the same way after ``STARTER_REPLY_S``, while
    the worker's loop serves its other requests."""
    settings = make_settings(tmp_path / "data")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    source = tmp_path / "fleet.jsonl"
    fleet_file(source, 10)
    state_dir = settings.data_dir / "warmup" / "jobs"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as starter:
        starter.bind(str(run_dir / jobs.STARTER_SOCKET))
        starter.listen()

        def answer(reply: bytes) -> str:
            connection, _ = starter.accept()
            with connection:
                asked = connection.recv(64).decode().strip()
                connection.sendall(reply)
            return asked

        with ThreadPoolExecutor(1) as pool:
            said_no = pool.submit(answer, b"0\n")
            job_id = asyncio.run(ProcessJobs(settings, run_dir).start(None, source))
            assert said_no.result(timeout=10) == job_id
            pid = json.loads((state_dir / f"{job_id}.json").read_text())["pid"]
            wait_reaped(pid)  # this process's child, started here, and waited for by it
            went_silent = pool.submit(answer, b"")
            with pytest.raises(ServiceUnavailableError, match="job starter stopped") as info:
                asyncio.run(ProcessJobs(settings, run_dir).start(None, source))
            assert info.value.service == "job_starter"  # 503 job_starter_unavailable
            asked = went_silent.result(timeout=10)
            given_up = (state_dir / f"{asked}.json").read_text()
            state = json.loads(given_up)
            assert (state["state"], state["pid"]) == ("failed", 0)
            assert "will not run; POST again" in state["error"]
            spec = ChildSpec(settings.model_dump(mode="json"), str(run_dir))
            (run_dir / jobs.SPEC_FILE).write_text(json.dumps(asdict(spec)))
            late = subprocess.run(  # the job's process, started after the worker gave it up
                [sys.executable, "-m", "proxy.jobs", str(run_dir), asked], timeout=120
            )
            assert late.returncode == 0
            assert (state_dir / f"{asked}.json").read_text() == given_up  # it did not run

            # one that never answers holds the POST, not the worker's other requests
            monkeypatch.setattr(jobs, "STARTER_REPLY_S", 0.5)
            ticks = 0

            async def serve_meanwhile() -> None:
                nonlocal ticks

                async def tick() -> None:
                    nonlocal ticks
                    while True:
                        await asyncio.sleep(0.01)
                        ticks += 1

                ticker = asyncio.create_task(tick())
                try:
                    with pytest.raises(ServiceUnavailableError, match="did not answer in time"):
                        await ProcessJobs(settings, run_dir).start(None, source)
                finally:
                    ticker.cancel()

            asyncio.run(serve_meanwhile())
            assert ticks >= 20, ticks  # ~50 in 0.5 s
            (silent,) = {p.stem for p in state_dir.glob("*.json")} - {job_id, asked}
            assert json.loads((state_dir / f"{silent}.json").read_text())["state"] == "failed"


def test_an_upload_whose_job_could_not_be_written_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing names the upload of a POST that failed before its job's state file was
    written (a full disk, right after a large body): it stayed in the data dir for good."""
    settings = make_settings(tmp_path / "data")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    upload = settings.data_dir / "warmup" / "upload-1.jsonl"
    upload.parent.mkdir(parents=True)
    fleet_file(upload, 10)

    def full_disk(path: Path, data: dict[str, object]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jobs, "_write_json", full_disk)
    with pytest.raises(OSError, match="No space left"):
        asyncio.run(ProcessJobs(settings, run_dir).start(None, upload, upload="ab" * 32))
    assert not upload.exists()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # its Popen
def test_after_a_silent_starter_a_worker_starts_its_next_jobs_itself_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A starter that took a job and fell silent held that POST ``STARTER_REPLY_S`` with
    the start lock, and every POST after it as long again, one after another, for as long
    as it hung: for ``STARTER_PASSED_S`` after a silence the worker starts jobs itself."""
    settings = make_settings(tmp_path / "data")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    source = tmp_path / "fleet.jsonl"
    fleet_file(source, 10)
    monkeypatch.setattr(jobs, "STARTER_REPLY_S", 0.5)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as starter:
        starter.bind(str(run_dir / jobs.STARTER_SOCKET))
        starter.listen()  # never accepts: each worker's connection waits in its backlog
        worker = ProcessJobs(settings, run_dir)
        with pytest.raises(ServiceUnavailableError, match="did not answer in time"):
            asyncio.run(worker.start(None, source))
        began = time.monotonic()
        job_id = asyncio.run(worker.start(None, source))
        assert time.monotonic() - began < 0.4  # not asked
    state = json.loads((settings.data_dir / "warmup" / "jobs" / f"{job_id}.json").read_text())
    assert state["pid"] > 0
    wait_reaped(state["pid"])  # it fails at once: this run dir has no server's spec


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # its Popen
def test_a_job_started_before_its_worker_gave_it_up_does_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A starter that forked the job and then fell silent: the job's process reads its state
    only once the worker has let go of the start lock, so it finds the job given up (the
    POST's 503) and does not run beside the one the POST sent again will start; before, it
    read ``queued`` and ran, and its writes and the worker's undid each other's."""
    settings = make_settings(tmp_path / "data")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = ChildSpec(settings.model_dump(mode="json"), str(run_dir))
    (run_dir / jobs.SPEC_FILE).write_text(json.dumps(asdict(spec)))
    source = tmp_path / "fleet.jsonl"
    fleet_file(source, 10)
    state_dir = settings.data_dir / "warmup" / "jobs"
    monkeypatch.setattr(jobs, "STARTER_REPLY_S", 4.0)  # the job's imports take 1-2 s
    started: list[subprocess.Popen[bytes]] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as starter:
        starter.bind(str(run_dir / jobs.STARTER_SOCKET))
        starter.listen()

        def fork_then_fall_silent() -> None:
            connection, _ = starter.accept()
            with connection:
                job_id = connection.recv(64).decode().strip()
                command = [sys.executable, "-m", "proxy.jobs", str(run_dir), job_id]
                started.append(subprocess.Popen(command))
                connection.recv(1)  # until the worker gives up and closes

        with ThreadPoolExecutor(1) as pool:
            silent = pool.submit(fork_then_fall_silent)
            with pytest.raises(ServiceUnavailableError, match="did not answer in time"):
                asyncio.run(ProcessJobs(settings, run_dir).start(None, source))
            silent.result(timeout=10)
    (job,) = started
    assert job.wait(timeout=120) == 0
    (state_file,) = state_dir.glob("*.json")
    state = json.loads(state_file.read_text())
    assert (state["state"], state["pid"], state["rows"]) == ("failed", 0, 0)
    assert "will not run" in state["error"]
    # it never began: a job that runs leaves a rejects file, however soon it stops
    assert not (settings.data_dir / "warmup" / f"{state_file.stem}.rejects.jsonl").exists()


ONE_READER_FAILS = """
import asyncio, json, sys, time
from pathlib import Path
from proxy import jobs
from proxy.processes import ChildSpec
from proxy.warmup import WarmupProgress, checkpoint_for
from tests.conftest import make_settings

async def run_shard(spec, options, shard, progress, on_progress, stopped):
    place = checkpoint_for(spec.load_settings().data_dir, Path(options.path), shard)
    with jobs.rejects_part(options.rejects, shard.index).open("a") as rejects:
        for line in (1, 2, 9):  # line 9 past the place its checkpoint keeps
            if line == 9:
                rejects.flush()
                place.save(5, rejects, rejects.tell())
            rejects.write(json.dumps({"line": 10 * shard.index + line, "error": "bad"}) + "\\n")
    progress.state = "running"
    on_progress(progress)
    if shard.index == 0:
        raise RuntimeError("the engine is gone")
    deadline = time.monotonic() + 20  # the others would read on for a long while
    while not stopped() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    progress.state = "cancelled" if stopped() else "done"
    return progress

jobs.run_shard = run_shard
tmp = Path(sys.argv[1])
settings = make_settings(tmp / "data")
spec = ChildSpec(settings.model_dump(mode="json"), str(tmp))
options = jobs.JobOptions(str(tmp / "fleet.jsonl"), 500, 5.0, str(tmp / "r.jsonl"), str(tmp / "c"))
shown = []
began = time.monotonic()
progress = asyncio.run(jobs.run_sharded(
    spec, options, WarmupProgress(source="fleet.jsonl"), 3, lambda p: shown.append(p.state),
    start_method="fork",
))
print(json.dumps({"state": progress.state, "error": progress.error, "shown": shown,
                  "seconds": time.monotonic() - began}))
"""


def test_one_reader_failing_stops_the_others_and_lists_each_rejected_row_once(
    tmp_path: Path,
) -> None:
    """A job of three readers, one of which fails at once: the others stop at the place
    they keep, and the job reads ``running`` until they have (it read ``failed`` while they
    ran on to their end: the next POST took their source and settled their files under
    them). Each reader's rejects are cut back to its checkpoint before they are merged: the
    job that resumes from those places lists the rest (the failed reader's were listed in
    both jobs' files)."""
    (tmp_path / "fleet.jsonl").write_text("{}\n")
    run = subprocess.run(  # a process of its own: its readers are forked, as a job's are
        [sys.executable, "-c", ONE_READER_FAILS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert run.returncode == 0, run.stderr
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    assert outcome["state"] == "failed" and "the engine is gone" in outcome["error"]
    assert outcome["seconds"] < 10, outcome  # the others were stopped, not waited for
    assert set(outcome["shown"][:-1]) == {"running"} and outcome["shown"][-1] == "failed"
    listed = [json.loads(line)["line"] for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert listed == [1, 2, 11, 12, 21, 22]
    assert not list(tmp_path.glob("r.jsonl.part*"))


def test_a_jobs_state_file_written_by_two_processes_at_once_is_always_whole(
    tmp_path: Path,
) -> None:
    """The worker that starts a job and the job forked for it write its state file at the same
    moment: neither write fails, and a reader always finds one of them whole."""
    state = tmp_path / "w1-abc.json"
    jobs._write_json(state, {"pid": 0})
    children = []
    for writer in range(2):
        if (pid := os.fork()) == 0:
            code = 0
            try:
                for i in range(2_000):
                    jobs._write_json(state, {"pid": writer, "i": i})
            except BaseException:
                code = 1
            os._exit(code)
        children.append(pid)
    codes: dict[int, int] = {}
    while len(codes) < len(children):
        assert json.loads(state.read_text())["pid"] in (0, 1)  # read while they write
        for pid in set(children) - set(codes):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
    assert list(codes.values()) == [0, 0]  # neither write failed
    assert not list(tmp_path.glob("*.tmp"))


def test_a_cancelled_job_stops_at_once_and_keeps_the_place_of_its_finished_chunks(
    tmp_path: Path,
) -> None:
    """It does not wait for its chunks still in the sink (a slow engine held them for longer
    than a stopping server waits): it abandons them and resumes from the first of them."""
    source = tmp_path / "fleet.jsonl"
    fleet_file(source, 1_000)
    held = asyncio.Event()  # never set: the third chunk and those after it never finish

    class Sink:
        calls = 0

        async def upsert(self, records: list[Any]) -> tuple[int, int, int]:
            self.calls += 1
            if self.calls >= 3:
                await held.wait()
            return len(records), len(records), 0

    checkpoint = warmup.checkpoint_for(tmp_path, source)
    progress = WarmupProgress(source="fleet.jsonl")
    stop_at = time.monotonic() + 0.3

    async def run() -> WarmupProgress:
        return await run_warmup(
            source,
            Sink(),
            progress,
            chunk_size=100,
            depth=12,
            checkpoint=checkpoint,
            cancelled=lambda: time.monotonic() >= stop_at,
        )

    asyncio.run(asyncio.wait_for(run(), timeout=5))
    assert time.monotonic() - stop_at < 1.0
    two_chunks = 100 // warmup.RAMP[0] + 100 // warmup.RAMP[1]  # a job's first chunks: smaller
    assert (progress.state, progress.indexed) == ("cancelled", two_chunks)
    assert checkpoint.rows_done() == two_chunks


def test_readers_rejects_merge_in_line_order_to_the_cap_dropping_a_half_written_line(
    tmp_path: Path,
) -> None:
    """Each reader lists its rejects in order, up to the cap; merged, the file holds the first
    ``cap`` of them in the file's line order, as one reader would. A reader killed mid-write
    leaves a half line: it is dropped (its JSON error had replaced the job's own outcome)."""
    rejects = tmp_path / "job.rejects.jsonl"
    parts = {0: [3, 9, 12], 1: [1, 4, 10, 11]}
    for i, numbers in parts.items():
        lines = "".join(json.dumps({"line": n, "error": "bad"}) + "\n" for n in numbers)
        Path(f"{rejects}.part{i}").write_text(lines + ('{"line": 20, "err' if i else ""))
    jobs._merge_rejects(rejects, [Path(f"{rejects}.part{i}") for i in range(3)], cap=5)
    listed = [json.loads(line)["line"] for line in rejects.read_text().splitlines()]
    assert listed == [1, 3, 4, 9, 10]
    assert not list(tmp_path.glob("*.part*"))


def test_a_zombie_job_process_is_not_alive(tmp_path: Path) -> None:
    """A job a worker started itself and that died stayed its zombie (nothing waited for it):
    ``kill(pid, 0)`` still succeeds, so it read "running" for ever and every POST of its
    source was a 409. A zombie is dead; and the worker now waits for the jobs it starts."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    stat = Path(f"/proc/{process.pid}/stat")
    deadline = time.monotonic() + 10
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child did not end within 10 s"
        time.sleep(0.01)
    assert not jobs._alive(process.pid)
    assert jobs._alive(os.getpid())
    process.wait()


def test_a_jobs_rejects_file_is_capped_but_every_reject_counted(tmp_path: Path) -> None:
    source = tmp_path / "junk.jsonl"
    source.write_text("".join(f'{{"driver_id": "J{i}"}}\n' for i in range(50)))
    progress = WarmupProgress(source="junk.jsonl")
    rejects = tmp_path / "rejects.jsonl"
    with rejects.open("w") as out:
        asyncio.run(run_warmup(source, None, progress, rejects=out, max_rejects=7))
    assert progress.rejected == 50
    assert len(rejects.read_text().splitlines()) == 7


def test_a_job_whose_process_is_gone_reads_failed_and_resumable(tmp_path: Path) -> None:
    """Defect 7 of issue 12: a job running when the server died was never shown as ended."""
    settings = make_settings(tmp_path / "data")
    jobs_dir = settings.data_dir / "warmup" / "jobs"
    jobs_dir.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    state = {**asdict(WarmupProgress(source="fleet.jsonl", state="running", rows=500))}
    state |= {"pid": dead.pid, "server": "fleetcache-old", "path": "x", "chunk_size": 500}
    (jobs_dir / "w1-abc.json").write_text(json.dumps(state))
    run_dir = tmp_path / "fleetcache-new"
    run_dir.mkdir()
    progress = ProcessJobs(settings, run_dir).get("w1-abc")
    assert progress is not None
    assert (progress.state, progress.error, progress.rows) == ("failed", "server restarted", 500)
    assert progress.finished is not None


def job_of_a_dead_process(tmp_path: Path, server: str) -> tuple[Settings, Path, Path]:
    """Job ``w1-abc`` of run ``server``, running by its state file, its process gone; the
    settings, the jobs dir and the run dir of a server run named ``fleetcache-now``."""
    settings = make_settings(tmp_path / "data")
    jobs_dir = settings.data_dir / "warmup" / "jobs"
    jobs_dir.mkdir(parents=True)
    run_dir = tmp_path / "fleetcache-now"
    run_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    state = {**asdict(WarmupProgress(source="fleet.jsonl", state="running", rows=500))}
    state |= {"pid": dead.pid, "server": server, "path": "x", "chunk_size": 500}
    (jobs_dir / "w1-abc.json").write_text(json.dumps({**state, "checkpoint": "cp"}))
    return settings, jobs_dir, run_dir


def test_a_job_killed_outright_is_live_until_its_readers_have_stopped(tmp_path: Path) -> None:
    """Its readers outlive it by the time they take to stop and keep their places (they
    are sent SIGTERM when it dies): a job judged by its own pid alone read ``failed`` at
    once, and the next POST settled its readers' rejects under them (their later lines
    went to files it had unlinked) and started a second job on their checkpoints. The job
    and the readers it forks hold one lock (``life_lock``) while any of them lives."""
    settings, jobs_dir, run_dir = job_of_a_dead_process(tmp_path, "another run")
    part = settings.data_dir / "warmup" / "w1-abc.rejects.jsonl.part1"
    part.write_text('{"line": 7, "error": "bad"}\n')
    reader = subprocess.Popen(  # a reader still stopping: it holds the job's lock
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
            str(jobs.life_lock(jobs_dir, "w1-abc")),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline() == b"held\n"
        processes = ProcessJobs(settings, run_dir)
        live = processes.get("w1-abc")
        assert live is not None and live.state == "running"
        with pytest.raises(warmup.JobRunning):
            processes._refuse_a_second("cp")
        assert part.exists()  # not settled under it
    finally:
        reader.kill()
        reader.communicate()
    ended = ProcessJobs(settings, run_dir).get("w1-abc")
    assert ended is not None and (ended.state, ended.error) == ("failed", "server restarted")
    (jobs_dir / "w1-abc.cancel").touch()  # a DELETE that its end never took away
    ProcessJobs(settings, run_dir)._refuse_a_second("another source's checkpoint")
    assert not part.exists() and not jobs.life_lock(jobs_dir, "w1-abc").exists()
    assert not (jobs_dir / "w1-abc.cancel").exists()
    merged = (settings.data_dir / "warmup" / "w1-abc.rejects.jsonl").read_text()
    assert merged == ""  # no checkpoint kept its place: its rows are read again


def test_a_job_whose_process_died_in_this_servers_run_says_so_and_ends_once(
    tmp_path: Path,
) -> None:
    """A job's process killed while its server runs (the OOM killer) read "server restarted",
    which had not happened, with a ``finished`` that moved at every read; and a DELETE of
    a job that had ended left a ``.cancel`` file that nothing removed."""
    settings, jobs_dir, run_dir = job_of_a_dead_process(tmp_path, "fleetcache-now")
    jobs = ProcessJobs(settings, run_dir)
    first = jobs.get("w1-abc")
    assert first is not None and first.state == "failed"
    assert first.error is not None and "process died" in first.error
    time.sleep(0.05)
    again = jobs.get("w1-abc")
    assert again is not None and again.finished == first.finished

    assert jobs.cancel("w1-abc") is not None  # ended: nothing to stop
    assert not (jobs_dir / "w1-abc.cancel").exists()


def test_a_reader_runs_its_rows_with_the_heap_frozen_and_the_collector_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader keeps a chunk's records alive while their slices run: at the collector's
    default thresholds it walked them again and again (a third of a reader's own work on 2
    cores, ``bench/reader_bench.py``). Its services and the loop's rows run with the heap
    frozen and the thresholds of ``READER_GC_THRESHOLDS``; both undone after. It opens no
    memory tier either."""
    settings = make_settings(tmp_path / "data")
    seen: dict[str, object] = {}

    @contextlib.asynccontextmanager
    async def worker_services(opened: Settings, cluster: object) -> AsyncIterator[object]:
        seen["memory_cache_mb"] = opened.memory_cache_mb

        async def answering(timeout_s: float) -> list[str]:
            return []

        yield SimpleNamespace(settings=opened, boards=None, wait_answering=answering)

    async def rows(path: Path, sink: object, progress: WarmupProgress, **_: object) -> object:
        seen["during"] = (gc.get_threshold(), gc.get_freeze_count() > 0)
        return progress

    monkeypatch.setattr(services_module, "open_worker_services", worker_services)
    monkeypatch.setattr(warmup, "run_warmup", rows)
    monkeypatch.setattr(ChildSpec, "cluster", lambda self, role="worker": None)
    source = tmp_path / "fleet.jsonl"
    fleet_file(source, 10)
    options = jobs.JobOptions(str(source), 500, 5.0, str(tmp_path / "r.jsonl"), str(tmp_path / "c"))
    spec = ChildSpec(settings.model_dump(mode="json"), str(tmp_path))
    before = gc.get_threshold()
    progress = WarmupProgress(source="fleet.jsonl")
    asyncio.run(jobs.run_shard(spec, options, Shard(0, 1), progress, print, lambda: False))
    assert seen == {"memory_cache_mb": 0.0, "during": (jobs.READER_GC_THRESHOLDS, True)}
    assert (gc.get_threshold(), gc.get_freeze_count()) == (before, 0)


def test_a_jobs_progress_is_passed_on_every_interval_and_at_its_first_rows() -> None:
    """A job's state file is rewritten every ``every_s`` and, whatever the interval, at once
    when its first rows are indexed and at its end: /v1/warmup/{id} (and the benchmark that
    times a job's start from it) never shows a started job as empty for a whole interval."""
    now = [100.0]
    due = jobs.ProgressDue(0.1, clock=lambda: now[0])
    progress = warmup.WarmupProgress(source="fleet.jsonl")
    assert due(progress)  # the first one
    now[0] += 0.05
    assert not due(progress)
    progress.indexed = 256  # the first rows, 0.05 s after the last write
    assert due(progress)
    now[0] += 0.05
    progress.indexed = 512
    assert not due(progress)  # later rows wait for the interval
    assert due(progress, forced=True)  # the last
    now[0] += 0.11
    assert due(progress)
    assert jobs.PROGRESS_EVERY_S <= 0.1
