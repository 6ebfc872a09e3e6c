"""The whole server under a C load generator (wrk): the process split against one process.

For each server layout (``--workers N ...``: ``fleetcache serve --workers N``; ``--single``:
the same app in one process, ``create_app`` under uvicorn, as v1 ran) on a fresh data dir:

- ``/healthz`` alone: its p99 (the idle probe latency);
- all-hit requests (``bench/wrk/hits.lua``: 32 texts from a prefilled pool of 4,096, base64),
  with a second wrk on ``/healthz`` beside them: req/s, texts/s, p50/p99, and the probe's p99
  under that load against idle (2 connections, one request each every ``PROBE_GAP_MS``: before
  2026-12-01 20:35 UTC a closed loop, which loaded the server it measured); with workers also
  the same probe on the health port (``FLEETCACHE_HEALTH_PORT``, the supervisor's);
- all-miss requests (``misses.lua``: 32 texts never seen before, in every run): texts/s,
  p50/p99, how many texts each engine process took, the engine processes' CPU per text
  they took (their main threads, the event loops, and the whole processes: ``EngineCpu``)
  and the cores the whole server kept busy meanwhile (every process of it, wrk's not),
  the seconds after the load until every vector it computed was in the store (what a burst
  left queued for a store slower than the engine) and the engine processes' peak memory
  (their LMDB writer children's included);
- the misses' stage means: each stage histogram of ``/metrics`` (``STAGES``) between a
  scrape before the first miss run and one after the last, and the share of miss requests
  whose engine call waited for the store (``cache.store_waits``: then the store bounds them);
- with ``--devices D ...``: each layout once per ``FLEETCACHE_DEVICE`` value (``cuda`` vs
  ``cuda:0,cuda:0``: one engine process or two on one GPU); with ``--kill-engine`` a
  layout of several engine processes runs its misses once more and kills the second engine
  (SIGKILL) a third of the way in: wrk's failed requests, and the seconds until it is back;
- with ``--routing hash depth``: each layout once per ``FLEETCACHE_ENGINE_ROUTING``; with
  ``--twins`` also requests whose new texts every wrk thread sends at about the same moment
  (``twins.lua``): texts/s, and engine items per text looked up (what coalescing saved);
- with ``--warmup N``: N new drivers POSTed to ``/v1/warmup`` (a job process), timed to
  ``done``; then ``--runs`` rounds of paced cached lookups (8 connections, one request each
  every ``LOOKUP_GAP_MS``) alone, then beside a job over new drivers: their p99 during each
  job against alone in the same round (median of the rounds, and each round's ratio), and
  how long the workers' threads waited for a CPU meanwhile (``RunQueueWait``); and
  the plain tokenizer's ceiling on all cores over the same texts (``tokenizers.encode_batch``,
  the median of three passes), measured in the same run. ``--job-cpus`` gives the whole
  server those CPUs for the job alone (every thread re-pinned, then back to
  ``--server-cpus``): the job on the cores the tokenizer's ceiling had, where
  ``--server-cpus`` kept some for wrk. ``--lower engine,index=10`` (or ``=idle``, or ``job``)
  lowers those processes' priority first: what of the lookups' p99 each one accounts for.
- each miss run prints its own new texts/s and p99 beside the device child's account, and
  how long the engine process's, the device child's and the workers' threads waited for a
  CPU; ``--nice engine,device=-10`` (any of ``lower_roles``' roles) sets that priority for
  the even miss runs only, so that one server gives runs with and without it in turns;
  ``--pin engine=0 --pin device=1 --pin workers,rest=2-11`` does the same with CPU
  affinity (each role's threads on those CPUs, back where they were after the run).

``--code DIR`` serves another checkout (a before/after comparison in one device call).
Each load phase runs ``--runs`` times: the table shows the median of the runs' figures and
the worst run's p99. ``--batcher`` measures the engine's batcher alone in this process
(64 concurrent submitters of 32 new texts, no HTTP, no IPC) before any server starts: the
ceiling the all-miss figure is compared with.

    .venv/bin/python -m bench.serve_bench --workers 1 2 --single --runs 3         # this box
    python -m bench.serve_bench --engine torch --device cuda --model M --workers 4 8 \\
        --single --batcher --warmup 100000 --wrk-cpus 12-15 --connections 64      # the H200
    python -m bench.serve_bench --engine torch --model M --workers 12 --devices cuda \\
        cuda:0,cuda:0 --skip-hits --kill-engine --connections 128 --wrk-cpus 12-15   # engines

Needs ``wrk`` on PATH (Debian package wrk) or ``--wrk``. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hashlib
import itertools
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.engine_bench import cpu_ticks

REPO = Path(__file__).resolve().parents[1]
WRK_DIR = Path(__file__).resolve().parent / "wrk"
RESULT = re.compile(r"RESULT (.*)")
POOL = 4096


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``fleetcache serve`` (``workers``) or the one-process app (``workers=0``), of the code
    in ``code`` (another checkout: a before/after comparison)."""

    def __init__(
        self,
        workers: int,
        data_dir: Path,
        settings: dict[str, str],
        log: Path,
        cpus: str,
        code: Path = REPO,
    ) -> None:
        self.workers = workers
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.health_url = f"http://127.0.0.1:{free_port()}" if workers else None
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETCACHE_")}
        env |= {f"FLEETCACHE_{k.upper()}": v for k, v in settings.items()}
        if self.health_url:
            env["FLEETCACHE_HEALTH_PORT"] = self.health_url.rsplit(":", 1)[1]
        env |= {"FLEETCACHE_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1"}
        env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")])
        if workers:
            command = [sys.executable, "-m", "proxy.cli", "serve", "--workers", str(workers)]
            command += ["--port", str(self.port), "--log-level", "warning"]
        else:
            command = [sys.executable, "-m", "bench.serve_bench", "--serve-single", str(self.port)]
        if cpus:
            command = ["taskset", "-c", cpus, *command]
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                command, cwd=code, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout_s: float = 600.0, in_a_row: int = 16) -> None:
        """Until ``in_a_row`` answers of /readyz in a row are 200, each on a new connection
        (each worker answers for itself, ready once its own engine and index clients are:
        one 200 does not say the others are; a prefill sent on the first 200 met a worker
        still connecting to the engine, 503, on the H200 2026-12-03)."""
        deadline, ready = time.monotonic() + timeout_s, 0
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"server exited:\n{self.log.read_text()[-4000:]}")
            with contextlib.suppress(httpx.TransportError):
                ok = httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200
                ready = ready + 1 if ok else 0
                if ready >= in_a_row:
                    return
                if ready:
                    continue
            time.sleep(0.25)
        raise SystemExit(f"server not ready in {timeout_s} s:\n{self.log.read_text()[-4000:]}")

    def stats(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/v1/stats", timeout=30).json())

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def serve_single(port: int) -> None:
    """One process does everything (v1's layout), for the comparison."""
    import uvicorn

    from proxy.app import create_app
    from proxy.settings import Settings

    app = create_app(Settings(), freeze_gc=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


class Wrk:
    def __init__(self, binary: str, threads: int, cpus: str) -> None:
        self.binary = binary
        self.threads = threads
        self.cpus = cpus

    def command(self, script: str, url: str, connections: int, seconds: float) -> list[str]:
        body = (WRK_DIR / script).read_text() + "\n" + (WRK_DIR / "report.lua").read_text()
        # One file a content, written whole before it appears: two wrk started together
        # (a probe beside the hits) used to share one path, rewritten as the first loaded
        # it, which then ran a cut script (GET / at full rate, or no RESULT line).
        digest = hashlib.sha256(body.encode()).hexdigest()[:16]
        path = Path(tempfile.gettempdir()) / f"fleetcache-{digest}-{script}"
        if not path.exists():
            partial = path.with_name(f"{path.name}.{os.getpid()}.part")
            partial.write_text(body)
            os.replace(partial, path)
        threads = min(self.threads, connections)
        command = [self.binary, f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s"]
        command += ["--timeout", "10s", "-s", str(path), url]
        return ["taskset", "-c", self.cpus, *command] if self.cpus else command

    def start(
        self, script: str, url: str, connections: int, seconds: float, **env: str
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command(script, url, connections, seconds),
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    @staticmethod
    def result(process: subprocess.Popen[str]) -> dict[str, float]:
        out, _ = process.communicate()
        match = RESULT.search(out or "")
        if match is None:
            raise SystemExit(f"wrk printed no RESULT line:\n{out}")
        return {k: float(v) for k, v in (kv.split("=") for kv in match.group(1).split())}

    def run(
        self, script: str, url: str, connections: int, seconds: float, **env: str
    ) -> dict[str, float]:
        return self.result(self.start(script, url, connections, seconds, **env))


def prefill(url: str) -> None:
    with httpx.Client(base_url=url, timeout=300) as client:
        for start in range(0, POOL, 256):
            texts = [f"pool text #{i}" for i in range(start, start + 256)]
            response = client.post("/v1/embeddings", json={"input": texts})
            if response.status_code != 200:  # the body says which 503 (or other) it was
                raise SystemExit(f"prefill: {response.status_code} {response.text[:500]}")


PROBE_GAP_MS = 10  # each probe connection sends one /healthz every 10 ms (a probe is periodic)


def settle(server: Server, timeout_s: float = 60.0) -> None:
    """Until nothing is queued at the engine or waiting to be written back, then a second
    more: an idle figure taken while the prefill's write-backs still run is not idle."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = server.stats()
        if stats["queue"]["depth"] == 0 and stats["cache"]["in_flight"] == 0:
            break
        time.sleep(0.1)
    time.sleep(1.0)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def wrk_latency(runs: Sequence[dict[str, float]], digits: int = 2) -> list[str]:
    """Table cells of several wrk runs: the median p50, the median p99, the worst run's p99."""
    p50 = median([r["p50_ms"] for r in runs])
    p99 = median([r["p99_ms"] for r in runs])
    return [f"{v:.{digits}f}" for v in (p50, p99, max(r["p99_ms"] for r in runs))]


def wrk_errors(runs: Sequence[dict[str, float]]) -> str:
    """Socket errors and non-2xx answers of several wrk runs, as a table cell."""
    return f"{sum(r['errors'] + r['non2xx'] for r in runs):.0f}"


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A markdown table."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


def measure_layout(
    args: argparse.Namespace, workers: int, settings: dict[str, str], wrk: Wrk, out: Path
) -> dict[str, Any]:
    name = f"{workers} workers" if workers else "one process"
    name += f", device {settings['device']}" if len(args.devices) > 1 else ""
    name += f", routing {settings['engine_routing']}" if len(args.routing) > 1 else ""
    tag = f"{workers}-{settings['device'].replace(',', '_').replace(':', '')}"
    tag += f"-{settings['engine_routing']}"
    data_dir = Path(tempfile.mkdtemp(prefix="fleetcache-bench-"))
    code = Path(args.code).resolve()
    server = Server(workers, data_dir, settings, out / f"server-{tag}.log", args.server_cpus, code)
    try:
        started = time.monotonic()
        server.wait_ready()
        ready_s = time.monotonic() - started
        prefill(server.url)
        settle(server)
        url, c, d = server.url, args.connections, args.duration
        gap = {"GAP_MS": str(PROBE_GAP_MS)}
        idle = wrk.run("healthz.lua", url, 2, min(d, 4), **gap)
        health = server.health_url
        idle_health = wrk.run("healthz.lua", health, 2, min(d, 4), **gap) if health else None
        runs: dict[str, list[dict[str, float]]] = {
            "hits": [], "probe": [], "health": [], "misses": [], "engine_cpu": [], "drain": []
        }  # fmt: skip
        children_runs: list[dict[str, Any] | None] = []  # the device child over each miss run
        for run in range(args.runs):
            if not args.skip_hits:
                probe = wrk.start("healthz.lua", url, 2, d, **gap)
                beside = wrk.start("healthz.lua", health, 2, d, **gap) if health else None
                runs["hits"].append(wrk.run("hits.lua", url, c, d, POOL=str(POOL), FMT="base64"))
                runs["probe"].append(wrk.result(probe))
                if beside is not None:
                    runs["health"].append(wrk.result(beside))
            cpu = EngineCpu(server)
            if run == 0:
                before = server.metrics()
            with profiled(args, server, out / f"profile-misses-{workers}.txt", run == 0):
                # (a worker's /v1/stats under the load can take seconds: asked before it)
                pids = role_pids(server)
                niced = lower_roles(server, args.nice, pids) if args.nice and run % 2 else {}
                pinned = pin_roles(args.pin, pids) if args.pin and run % 2 else {}
                before_run = server.stats()["inference"]["device_process"]
                load = wrk.start("misses.lua", url, c, d, FMT="base64", SALT=f"r{run}-")
                # from a moment into the run: a batch's wait counts from the answer before
                time.sleep(min(0.5, d / 4))
                child = first_answered(server, before_run, time.monotonic() + d / 2)
                waits = {role: RunQueueWait(pids[role]) for role in ("engine", "device", "workers")}
                tally = ThreadTally({role: pids[role] for role in ("engine", "device")})
                with contextlib.ExitStack() as stack:
                    for wait in [*waits.values(), tally]:
                        stack.enter_context(wait)
                    runs["misses"].append(wrk.result(load))
                restore_nice(niced)
                restore_pins(pinned)
            after = (time.monotonic(), server.stats()["inference"]["device_process"])
            children_runs.append(device_child(child, after))
            if children_runs[-1] is not None:
                miss = runs["misses"][-1]
                children_runs[-1]["misses"] = (miss["ok_s"] * 32, miss["p99_ms"])
                children_runs[-1]["nice"] = args.nice if niced else ""
                children_runs[-1]["pinned"] = " ".join(args.pin) if pinned else ""
                children_runs[-1]["threads"] = tally.line()
                children_runs[-1]["run_queue"] = {
                    role: (wait.per_s, wait.ran_per_s) for role, wait in waits.items()
                }
            runs["engine_cpu"].append(cpu.per_item())
            runs["drain"].append(written_back_after(server))
        row_stages = stage_means(before, server.metrics()) if args.runs else {}
        twins = measure_twins(server, wrk, c, d) if args.twins else None
        engines = server.stats()["processes"]["engines"]
        killed = None
        if args.kill_engine and len(engines) > 1:
            killed = kill_engine_under_load(server, wrk, c, d)
        stats = server.stats()
        row: dict[str, Any] = {"layout": name, "ready_s": ready_s, "idle_probe_p99": idle["p99_ms"]}
        row["idle_health_p99"] = idle_health["p99_ms"] if idle_health else None
        row["device_items"] = [device["items"] for device in stats["inference"]["devices"]]
        row["killed"] = killed
        row["twins"] = twins
        row["stages"] = row_stages
        row["miss_device"] = children_runs
        cpu_runs = runs.pop("engine_cpu")
        row["drain_s"] = median(runs.pop("drain"))
        pids = [e["pid"] for e in stats["processes"]["engines"]]
        row["engine_peak_mb"] = sum(map(peak_rss_mb, pids + children(pids)))
        row["engine_cpu"] = {
            k: median([r[k] for r in cpu_runs]) for k in ("loop", "process", "children", "cores")
        }
        for phase, results in runs.items():
            if not results:
                results = [dict.fromkeys(("req_s", "p50_ms", "p99_ms", "errors"), 0.0)]
            row[phase] = {
                "req_s": median([r["req_s"] for r in results]),
                "ok_s": median([r.get("ok_s", r["req_s"]) for r in results]),
                "non2xx": sum(r.get("non2xx", 0.0) for r in results),
                "p50_ms": median([r["p50_ms"] for r in results]),
                "p99_ms": median([r["p99_ms"] for r in results]),
                "worst_p99_ms": max(r["p99_ms"] for r in results),
                "errors": sum(r["errors"] for r in results),
            }
        row["items_equal_misses"] = stats["inference"]["items"] == stats["cache"]["misses"]
        row["mean_batch"] = stats["inference"]["mean_batch"]
        row["per_worker_requests"] = [w["requests"] for w in stats["processes"]["workers"]]
        if args.warmup and workers:
            row["warmup"] = measure_warmup(args, server, wrk, out)
        (out / f"stats-{tag}.json").write_text(json.dumps(stats, indent=1))
        return row
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
        print(f"{name}: measured", file=sys.stderr)


HISTOGRAM_PART = re.compile(r"^(fleetcache_\w+)_(sum|count)(\{[^}]*\})? (\S+)$")
STAGES = {  # the histograms of a miss's way, as /metrics names them: (name, labels) -> row
    ("fleetcache_request_duration_seconds", 'outcome="miss"'): "miss request (worker)",
    ("fleetcache_request_stage_duration_seconds", 'stage="cache_lookup"'): "cache lookup",
    ("fleetcache_request_stage_duration_seconds", 'stage="engine_call"'): "engine call (worker)",
    ("fleetcache_request_stage_duration_seconds", 'stage="engine_embed"'): "engine embed (engine)",
    ("fleetcache_lane_queue_wait_seconds", 'lane="dispatch"'): "batcher queue wait",
    ("fleetcache_engine_stage_duration_seconds", 'stage="tokenize"'): "batch: pad / tokenize",
    ("fleetcache_engine_stage_duration_seconds", 'stage="forward"'): "batch: forward",
    ("fleetcache_engine_stage_duration_seconds", 'stage="postprocess"'): "batch: postprocess",
    ("fleetcache_request_stage_duration_seconds", 'stage="write_back"'): "store write-back",
    ("fleetcache_engine_batch_size_texts", ""): "batch size (texts, not ms)",
}


WARMUP_STAGES = {  # the same histograms while a job runs alone: its calls are the only ones
    ("fleetcache_request_stage_duration_seconds", 'stage="cache_lookup"'): "cache lookup (shard)",
    ("fleetcache_request_stage_duration_seconds", 'stage="engine_call"'): "engine call (shard)",
    ("fleetcache_request_stage_duration_seconds", 'stage="engine_embed"'): "engine embed (engine)",
    ("fleetcache_lane_queue_wait_seconds", 'lane="warmup"'): "warm-up lane queue wait",
    ("fleetcache_engine_stage_duration_seconds", 'stage="forward"'): "batch: forward",
    ("fleetcache_request_stage_duration_seconds", 'stage="write_back"'): "store write-back",
    ("fleetcache_request_stage_duration_seconds", 'stage="fleet_write"'): "fleet write (shard)",
    ("fleetcache_engine_batch_size_texts", ""): "batch size (texts, not ms)",
}


def histograms(exposition: str) -> dict[tuple[str, str], list[float]]:
    """``{(histogram, labels): [sum, count]}`` of a /metrics text (fleetcache's own)."""
    found: dict[tuple[str, str], list[float]] = {}
    for line in exposition.splitlines():
        if match := HISTOGRAM_PART.match(line):
            name, part, labels, value = match.groups()
            entry = found.setdefault((name, (labels or "{}")[1:-1]), [0.0, 0.0])
            entry[part == "count"] += float(value)
    return found


STORE_WAITS = re.compile(r"^fleetcache_cache_store_waits_total(?:\{[^}]*\})? (\S+)$", re.MULTILINE)
WAITED = "engine calls that waited for the store (%, not ms)"


def stage_means(
    before_text: str, after_text: str, stages: dict[tuple[str, str], str] = STAGES
) -> dict[str, tuple[float, float]]:
    """Mean of each ``stages`` histogram over what was observed between two /metrics scrapes
    (ms, or texts for the batch size), with its count: a label set matches when it holds
    the wanted label (a route's, say). Then ``WAITED``: the share of miss requests whose
    engine call waited for the store to catch up (``FLEETCACHE_MAX_UNWRITTEN``: the store is
    then what bounds new texts), with their count (of the engine calls without requests)."""
    before, after = histograms(before_text), histograms(after_text)
    means: dict[str, tuple[float, float]] = {}
    for (name, wanted), row in stages.items():
        total = count = 0.0
        for (found, labels), (s, c) in after.items():
            if found == name and wanted in labels:
                s0, c0 = before.get((found, labels), [0.0, 0.0])
                total, count = total + s - s0, count + c - c0
        scale = 1.0 if "texts" in row else 1000.0
        means[row] = (total / count * scale if count else 0.0, count)
    waited = sum(map(float, STORE_WAITS.findall(after_text)))
    waited -= sum(map(float, STORE_WAITS.findall(before_text)))
    requests = means.get("miss request (worker)", means.get("engine call (shard)", (0, 0)))[1]
    means[WAITED] = (100.0 * waited / requests if requests else 0.0, waited)
    return means


def written_back_after(server: Server, limit_s: float = 300.0) -> float:
    """Seconds from the end of a load until nothing computed waits for the store (the
    engines' ``cache.in_flight`` at 0): what a burst of new texts left behind it."""
    started = time.monotonic()
    while server.stats()["cache"]["in_flight"] and time.monotonic() - started < limit_s:
        time.sleep(0.05)
    return time.monotonic() - started


def children(pids: list[int]) -> list[int]:
    """The processes below ``pids``, whichever thread started them (an engine's LMDB writer
    child, its device child)."""
    return [below for pid in pids for below in tree(pid)[1:]]


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident memory (``VmHWM``), MiB; 0 when it is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    found, todo = [], [pid]
    while todo:
        found.append(pid := todo.pop())
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += map(int, (task / "children").read_text().split())
    return found


class EngineCpu:
    """CPU time the engine processes spent from now on, per text they took (microseconds):
    their event loops' (the main threads) and their whole processes' (every thread). The loop
    of one engine process is what bounds new texts (docs/BENCHMARKS.md), so its microseconds
    per text say where that bound is on any machine: 1e6 / loop us per text, per engine.
    With them, the cores that the whole server (every process of it) kept busy: where that
    nears the cores it may use, the machine's CPU is the bound, not one process."""

    def __init__(self, server: Server) -> None:
        self.server = server
        stats = server.stats()
        self.pids = [e["pid"] for e in stats["processes"]["engines"]]
        self.items = stats["inference"]["items"]
        self.started = time.monotonic()
        self.ticks = self.read()

    def read(self) -> tuple[int, int, int, int]:
        loop = process = kids = server = 0
        for pid in self.pids:
            with contextlib.suppress(OSError):  # an engine restarted: its ticks are lost
                main, whole = cpu_ticks(pid)
                loop, process = loop + main, process + whole
        for pid in children(self.pids):  # the LMDB writer child, the device child
            with contextlib.suppress(OSError):
                kids += cpu_ticks(pid)[1]
        for pid in tree(self.server.process.pid):
            with contextlib.suppress(OSError):  # gone meanwhile
                server += cpu_ticks(pid)[1]
        return loop, process, kids, server

    def per_item(self) -> dict[str, float]:
        items = max(self.server.stats()["inference"]["items"] - self.items, 1)
        hz = os.sysconf("SC_CLK_TCK")
        seconds = {
            name: (after - before) / hz
            for name, before, after in zip(
                ("loop", "process", "children", "server"), self.ticks, self.read(), strict=True
            )
        }
        elapsed = time.monotonic() - self.started
        return {
            "loop": seconds["loop"] * 1e6 / items,
            "process": seconds["process"] * 1e6 / items,
            "children": seconds["children"] * 1e6 / items,
            "cores": seconds["server"] / elapsed,
        }


class RoleCpu:
    """The CPU of every process of the server by role while a block runs (a warm-up job,
    whose processes start and end inside it, so every process is read each ``every_s``):
    for each role, CPU microseconds a feature (all its processes, every thread), the cores it
    kept busy, and the busiest main thread among its processes (a share of one core: near 1,
    that interpreter's loop is what bounds the job)."""

    def __init__(self, server: Server, every_s: float = 0.1) -> None:
        self.server, self.every_s = server, every_s
        self.first: dict[int, tuple[int, int]] = {}  # pid -> ticks when first read
        self.last: dict[int, tuple[int, int]] = {}
        self.roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> RoleCpu:
        stats = self.server.stats()
        processes = stats["processes"]
        self.known = {e["pid"]: "engine" for e in processes["engines"]}
        self.known[processes["index"]["pid"]] = "index owner"
        self.known.update({w["pid"]: "workers" for w in processes["workers"]})
        device = stats["inference"].get("device_process") or {}
        if device.get("pid"):
            self.known[device["pid"]] = "device child"
        self.read(born=False)
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.read(born=True)
        self.elapsed = time.monotonic() - self.started

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.read(born=True)

    def read(self, *, born: bool) -> None:
        """Every process's ticks; one first seen now started at 0 (``born``) or is counted
        from here (before the block)."""
        for pid in tree(self.server.process.pid):
            with contextlib.suppress(OSError):  # gone meanwhile
                ticks = cpu_ticks(pid)
                self.first.setdefault(pid, (0, 0) if born else ticks)
                self.last[pid] = ticks
                if pid not in self.roles:
                    self.roles[pid] = self.role(pid)

    def role(self, pid: int) -> str:
        if pid in self.known:
            return self.known[pid]
        if pid == self.server.process.pid:
            return "supervisor"
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        below = {
            "engine": "engine's writer child",  # and the partitions' writers below it
            "engine's writer child": "engine's writer child",
            "warm-up job": "warm-up shards",
        }
        if (parent_role := self.roles.get(parent) or self.role(parent)) in below:
            return below[parent_role]  # a forked shard has its job's command line
        from proxy.jobs import STARTER_NAME

        if proc_name(pid) == STARTER_NAME:  # and its jobs
            return "job starter" if parent == self.server.process.pid else "warm-up job"
        command = Path(f"/proc/{pid}/cmdline").read_bytes()  # one a worker started itself
        return "warm-up job" if b"proxy.jobs" in command else "other"

    def rows(self, features: int) -> list[list[str]]:
        hz, seconds = os.sysconf("SC_CLK_TCK"), max(self.elapsed, 1e-9)
        whole: dict[str, float] = {}
        main: dict[str, float] = {}
        for pid, role in self.roles.items():
            (m0, w0), (m1, w1) = self.first[pid], self.last[pid]
            whole[role] = whole.get(role, 0.0) + (w1 - w0) / hz
            main[role] = max(main.get(role, 0.0), (m1 - m0) / hz / seconds)
        order = sorted(whole, key=lambda r: -whole[r])
        return [
            [
                role,
                f"{whole[role] * 1e6 / max(features, 1):.1f}",
                f"{whole[role] / seconds:.2f}",
                f"{main[role]:.2f}",
            ]
            for role in order
        ]


def measure_twins(server: Server, wrk: Wrk, connections: int, seconds: float) -> dict[str, Any]:
    """``twins.lua``: texts/s, and the engine items it cost per text looked up."""
    before = server.stats()
    result = wrk.run("twins.lua", server.url, connections, seconds, FMT="base64", SALT="t-")
    after = server.stats()

    def delta(*path: str) -> int:
        a: Any = after
        b: Any = before
        for key in path:
            a, b = a[key], b[key]
        return int(a) - int(b)

    looked_up = sum(delta("cache", k) for k in ("hits", "coalesced", "misses"))
    return {
        **result,
        "items_per_lookup": delta("inference", "items") / max(looked_up, 1),
        "coalesced_per_lookup": delta("cache", "coalesced") / max(looked_up, 1),
    }


def kill_engine_under_load(server: Server, wrk: Wrk, connections: int, seconds: float) -> Any:
    """All-miss load; a third of the way in, the second engine process gets SIGKILL. What
    wrk saw (failed requests), and the seconds until that engine answered again."""
    victim = server.stats()["processes"]["engines"][1]["pid"]
    load = wrk.start("misses.lua", server.url, connections, seconds, FMT="base64", SALT="kill-")
    time.sleep(seconds / 3)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    result = Wrk.result(load)
    back_s = None
    while time.monotonic() - killed_at < 120:
        stats = server.stats()
        engine, device = stats["processes"]["engines"][1], stats["inference"]["devices"][1]
        if engine["pid"] != victim and device["up"]:
            back_s = time.monotonic() - killed_at
            break
        time.sleep(0.2)
    return {**result, "back_s": back_s}


def run_job(server: Server, fleet: Path, full: int) -> dict[str, Any]:
    """POST a JSONL body to /v1/warmup and wait for the job to end; with its timeline
    (``started_s``: from the POST to the job's own ``started``, from which its features/s
    are timed; ``first_s``: to its first indexed records; ``steady_per_s``: features/s
    between 10% and 90% of its records, what its start and end leave out) and
    ``queue_empty``: the share of the samples of the engine's queue (``/v1/stats``
    ``queue.depth``, every ~0.1 s between the first rows and the end) that found no text
    waiting there: while it is empty, the engine waits for the job's readers;
    ``queue_full``: those that found a ``full`` batch waiting (whatever the engine waits for
    then, it is not the readers); and ``device``: what the device child did over those
    samples (``device_child``) from the first that shows a batch of the job answered."""
    samples: list[tuple[float, int]] = []  # (seconds after the POST, indexed)
    depths: list[int] = []  # the engine's queue, sampled once the first rows are in
    children: list[tuple[float, Any]] = []  # (when, /v1/stats inference.device_process)
    with httpx.Client(base_url=server.url, timeout=600) as client:
        before_job = client.get("/v1/stats").json()["inference"]["device_process"]
        posted, posted_at = time.monotonic(), time.time()
        response = client.post(
            "/v1/warmup",
            content=fleet.read_bytes(),
            headers={"Content-Type": "application/x-ndjson"},
        )
        response.raise_for_status()
        job_id = response.json()["id"]
        while (job := client.get(f"/v1/warmup/{job_id}").json())["state"] in ("queued", "running"):
            samples.append((time.monotonic() - posted, job["indexed"]))
            if job["indexed"] and len(samples) % 2:
                stats = client.get("/v1/stats").json()
                depths.append(stats["queue"]["depth"])
                children.append((time.monotonic(), stats["inference"]["device_process"]))
            time.sleep(0.05)
    if job["state"] != "done":
        raise SystemExit(f"warm-up job ended {job['state']}: {job.get('error')}")
    samples.append((time.monotonic() - posted, job["indexed"]))

    def share(found: Callable[[int], bool]) -> float:
        return sum(map(found, depths)) / len(depths) if depths else float("nan")

    # The job's first batch carries the device's idle time since the batch before the job
    # (its wait counts from that answer): the window opens after it. The first sample with
    # rows indexed may not show it yet (a worker's /v1/stats reads the engine's facts as of
    # its last ping): from such a sample, a job of 2.5 s read 9.4 s of waiting.
    answered = [c for c in children if answered_since(before_job, c[1])]
    device = device_child(answered[0], answered[-1]) if len(answered) > 1 else None
    return {
        **job,
        **job_timeline(samples),
        "started_s": job["started"] - posted_at,
        "queue_empty": share(lambda depth: depth == 0),
        "queue_full": share(lambda depth: depth >= full),
        "device": device,
    }


def first_answered(server: Server, before: Any, until: float) -> tuple[float, Any]:
    """``(when, /v1/stats inference.device_process)`` once it shows a batch answered since
    ``before`` (a run's first batch carries the device's idle time before the run: a window
    opened before it read 3.1 s of waiting over a 0.8 s run on a CPU), or as it is at
    ``until``."""
    while True:
        when, now = time.monotonic(), server.stats()["inference"]["device_process"]
        if not now or answered_since(before, now) or when >= until:
            return when, now
        time.sleep(0.05)


def answered_since(before: Any, now: Any) -> bool:
    """Whether the device child's stats ``now`` count more batches answered than ``before``
    (None: no device child then, so any answered batch counts; ``now`` None: none now)."""
    return bool(now) and now["batches"] > (before or {}).get("batches", -1)


def device_child(first: tuple[float, Any], last: tuple[float, Any]) -> dict[str, Any] | None:
    """What the device child (``proxy.device_process``) did between two samples of its
    ``/v1/stats`` (None without one, or when another child replaced it): ``span_s``, the
    batches it answered, those that found nothing padded, and its seconds."""
    (t0, a), (t1, b) = first, last
    if a is None or b is None or a["pid"] != b["pid"]:
        return None
    seconds = {k: b["seconds"][k] - a["seconds"][k] for k in b["seconds"]}
    batches = b["batches"] - a["batches"]
    starved = b["starved_batches"] - a["starved_batches"]
    return {"span_s": t1 - t0, "batches": batches, "starved": starved, "seconds": seconds}


def job_timeline(samples: list[tuple[float, int]]) -> dict[str, float]:
    """``first_s`` and ``steady_per_s`` (see ``run_job``) of ``(seconds, indexed)`` samples
    (NaN where a job too short or empty gives none). The job rewrites its progress every
    ``PROGRESS_EVERY_S`` (0.1 s) and at its first rows; this polls every ~0.05-0.1 s: each
    time here may be ~0.2 s late (0.5 s before 0.1 s; a 10%-90% rate then moved by up to a
    fifth over a 4 s job)."""
    total, nan = samples[-1][1], float("nan")
    first = next((t for t, n in samples if n > 0), nan)
    low = next(((t, n) for t, n in samples if n >= 0.1 * total), (0.0, 0))
    high = next(((t, n) for t, n in samples if n >= 0.9 * total), (0.0, 0))
    steady = (high[1] - low[1]) / (high[0] - low[0]) if total and high[0] > low[0] else nan
    return {"first_s": first, "steady_per_s": steady, "total_s": samples[-1][0]}


LOOKUP_GAP_MS = 5  # each of 8 lookup connections sends one request every ~5 ms (paced)


def measure_warmup(args: argparse.Namespace, server: Server, wrk: Wrk, out: Path) -> dict[str, Any]:
    """A job alone (its throughput), then ``--runs`` rounds of paced cached lookups (8
    connections, one request each every ``LOOKUP_GAP_MS``, as a dispatcher sends them) first
    alone, then beside a job over new drivers: their p99 during the job against alone in the
    same round. Rounds alternate so that the host's drift between them (its idle p99 swung
    4-18 ms between runs on the H200) falls on both sides of each ratio."""
    from features.readers import write_records
    from features.synthetic import iter_fleet

    files = [out / f"warmup-{i}.jsonl" for i in range(args.runs + 1)]
    for seed, path in enumerate(files):
        if not path.exists():
            write_records(iter_fleet(args.warmup, seed=97 + seed), path)
    if args.lower:
        lower_roles(server, args.lower)
    cpu = RoleCpu(server)
    before = server.metrics()
    profile = out / f"profile-warmup-{server.workers}.txt"
    with (
        pinned(server, args.job_cpus, args.server_cpus),
        profiled(args, server, profile, True),
        cpu,
    ):
        job = run_job(server, files[0], args.max_batch_size)
    stages = stage_means(before, server.metrics(), WARMUP_STAGES)
    paced = {"POOL": str(POOL), "FMT": "base64", "GAP_MS": str(LOOKUP_GAP_MS)}
    alone, during, beside = [], [], []
    waits: dict[str, list[float]] = {"alone": [], "during": []}
    ran: dict[str, list[float]] = {"alone": [], "during": []}
    workers = [w["pid"] for w in server.stats()["processes"]["workers"]]
    for path in files[1:]:
        with RunQueueWait(workers) as wait:
            alone.append(wrk.run("hits.lua", server.url, 8, 4, **paced)["p99_ms"])
        waits["alone"].append(wait.per_s)
        ran["alone"].append(wait.ran_per_s)
        with RunQueueWait(workers) as wait:
            lookups = wrk.start("hits.lua", server.url, 8, 600, **paced)
            try:
                job_beside = run_job(server, path, args.max_batch_size)
            finally:
                lookups.send_signal(signal.SIGINT)  # wrk reports what it saw so far
        waits["during"].append(wait.per_s)
        ran["during"].append(wait.ran_per_s)
        during.append(Wrk.result(lookups)["p99_ms"])
        beside.append(job_beside["indexed"] / (job_beside["finished"] - job_beside["started"]))
    return {
        "records": job["indexed"],
        "features_per_s": job["indexed"] / (job["finished"] - job["started"]),
        "started_s": job["started_s"],
        "first_s": job["first_s"],
        "steady_per_s": job["steady_per_s"],
        "total_s": job["total_s"],
        "queue_empty": job["queue_empty"],
        "queue_full": job["queue_full"],
        "device": job["device"],
        "beside_features_per_s": statistics.median(beside),
        "lookup_p99_alone_ms": alone,
        "lookup_p99_during_ms": during,
        "workers_wait_ms_per_s": waits,
        "workers_ran_ms_per_s": ran,
        "lowered": args.lower,
        "tokenizer_texts_per_s": tokenizer_ceiling(args, files[0]),
        "cpu": cpu.rows(job["indexed"]),
        "stages": stages,
        "cpu_s": cpu.elapsed,
        "job_cores": len(cpu_list(args.job_cpus or args.server_cpus)),
        "tokenizer_cores": len(os.sched_getaffinity(0)),
    }


def cpu_list(spec: str) -> set[int]:
    """A taskset cpu list (``0-11,14``) as a set; empty: every CPU this process may use."""
    from proxy.cores import cpu_list as listed

    return set(listed(spec)) if spec else set(os.sched_getaffinity(0))


def threads(pids: list[int]) -> list[int]:
    """Every thread id of the processes ``pids`` (those gone meanwhile left out)."""
    found: list[int] = []
    for pid in pids:
        with contextlib.suppress(OSError):
            found += [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    return found


def pin(server: Server, cpus: set[int]) -> None:
    """Every thread of every process of the server onto ``cpus`` (processes and threads
    started later inherit their parent's)."""
    for tid in threads(tree(server.process.pid)):
        with contextlib.suppress(OSError):  # gone meanwhile
            os.sched_setaffinity(tid, cpus)


class RunQueueWait:
    """How long the threads of ``pids`` waited for a CPU while the block ran (the kernel's
    ``schedstat``: runnable, not running), in ms per second of the block, summed (``per_s``),
    and how long they ran (``ran_per_s``)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def _ns(self) -> tuple[int, int]:
        ran = waited = 0
        for tid in threads(self.pids):
            with contextlib.suppress(OSError):  # gone meanwhile
                fields = Path(f"/proc/{tid}/schedstat").read_text().split()
                ran, waited = ran + int(fields[0]), waited + int(fields[1])
        return ran, waited

    def __enter__(self) -> RunQueueWait:
        self.started, self.before = time.monotonic(), self._ns()
        return self

    def __exit__(self, *exc: object) -> None:
        seconds = max(time.monotonic() - self.started, 1e-9)
        (ran, waited), (ran0, waited0) = self._ns(), self.before
        self.per_s = (waited - waited0) / 1e6 / seconds
        self.ran_per_s = (ran - ran0) / 1e6 / seconds


class ThreadTally:
    """Per thread name of the processes ``pids`` while the block runs: ms a second run and
    waited for a CPU (``schedstat``), and voluntary switches (sleeps), involuntary ones
    (preemptions) and migrations to another CPU a second (``/proc/<tid>/sched``): whether a
    thread's CPU a text swells by waking and moving, not by its own work."""

    FIELDS = ("nr_voluntary_switches", "nr_involuntary_switches", "se.nr_migrations")

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids  # role -> its processes

    def _read(self) -> dict[str, list[float]]:
        found: dict[str, list[float]] = {}
        for role, pid in ((r, p) for r, pids in self.pids.items() for p in pids):
            for tid in threads([pid]):
                task = Path(f"/proc/{pid}/task/{tid}")
                with contextlib.suppress(OSError, ValueError):  # gone meanwhile
                    ran, waited = map(int, (task / "schedstat").read_text().split()[:2])
                    lines = (task / "sched").read_text().splitlines()
                    sched = {
                        k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)
                    }
                    comm = (task / "comm").read_text().strip()
                    name = f"{role} {'main' if tid == pid else comm}"
                    row = [ran / 1e6, waited / 1e6, *(float(sched[f]) for f in self.FIELDS)]
                    total = found.setdefault(name, [0.0] * len(row))
                    for i, value in enumerate(row):
                        total[i] += value
        return found

    def __enter__(self) -> ThreadTally:
        self.started, self.before = time.monotonic(), self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        seconds = max(time.monotonic() - self.started, 1e-9)
        after = self._read()
        self.per_s = {
            name: [
                (a - b) / seconds
                for a, b in zip(row, self.before.get(name, [0.0] * len(row)), strict=True)
            ]
            for name, row in after.items()
        }

    def line(self) -> str:
        """The busiest threads first: ``name ran/waited ms, sleeps/preempted/moved a s``."""
        rows = sorted(self.per_s.items(), key=lambda item: -item[1][0])
        return "; ".join(
            f"{name} ran {r[0]:.0f} waited {r[1]:.0f} ms/s, slept {r[2]:,.0f} preempted "
            f"{r[3]:,.0f} moved {r[4]:,.0f} /s"
            for name, r in rows
            if r[0] >= 5
        )


def lower_roles(
    server: Server, spec: str, pids: dict[str, list[int]] | None = None
) -> dict[int, int]:
    """``--lower engine,index=10`` (a nice value) or ``=idle`` (``SCHED_IDLE``): every thread
    of those processes of the server from now on (threads they start later inherit it);
    ``job``: the job starter, so every job and reader it forks; ``writer``: the engines'
    LMDB writer children (and their partitions' writers); ``rest``: every process of the
    server but its workers and the supervisor. An experiment: what of the lookups' p99
    beside a job the priority of each process accounts for. Returns each thread's nice
    before (``restore_nice``). ``pids``: ``role_pids(server)``, when known."""
    from proxy.jobs import STARTER_NAME

    roles, _, level = spec.partition("=")
    pids = dict(pids or role_pids(server))
    pids["job"] = [p for p in tree(server.process.pid) if proc_name(p) == STARTER_NAME]
    before: dict[int, int] = {}
    for role in roles.split(","):
        print(f"lowered to {level}: {role}, {len(pids[role])} processes", flush=True)
        for tid in threads(pids[role]):
            before[tid] = os.getpriority(os.PRIO_PROCESS, tid)
            if level == "idle":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, tid, int(level))
    return before


def pin_roles(specs: list[str], pids: dict[str, list[int]]) -> dict[int, set[int]]:
    """``--pin engine,device=0-1``: every thread of those roles' processes (``role_pids``)
    on those CPUs (threads they start later inherit it); each spec in turn, so a later one
    moves a process an earlier one named. Returns each thread's CPUs before
    (``restore_pins``: the server's own placement, not ``--server-cpus``)."""
    before: dict[int, set[int]] = {}
    for spec in specs:
        roles, _, listed = spec.partition("=")
        cpus = cpu_list(listed)
        for tid in threads([pid for role in roles.split(",") for pid in pids[role]]):
            with contextlib.suppress(OSError):  # gone meanwhile
                before.setdefault(tid, os.sched_getaffinity(tid))
                os.sched_setaffinity(tid, cpus)
    return before


def restore_pins(before: dict[int, set[int]]) -> None:
    for tid, cpus in before.items():
        with contextlib.suppress(OSError):  # gone meanwhile
            os.sched_setaffinity(tid, cpus)


def restore_nice(before: dict[int, int]) -> None:
    """Each thread's nice as ``lower_roles`` found it (a nice value, not ``idle``)."""
    for tid, nice in before.items():
        with contextlib.suppress(OSError):  # gone meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def role_pids(server: Server) -> dict[str, list[int]]:
    """The server's processes by role (``lower_roles``): ``engine``, ``device`` (its device
    child), ``writer``, ``index``, ``workers``, ``rest`` (all but the workers and the
    supervisor)."""
    stats = server.stats()
    processes = stats["processes"]
    everyone = tree(server.process.pid)
    workers = [w["pid"] for w in processes["workers"]]
    engines = [e["pid"] for e in processes["engines"]]
    device = (stats["inference"].get("device_process") or {}).get("pid")
    return {
        "engine": engines,
        "device": [] if device is None else [device],
        "writer": [p for p in children(engines) if p != device],
        "index": [processes["index"]["pid"]],
        "workers": workers,
        "rest": [p for p in everyone if p not in {server.process.pid, *workers}],
    }


def proc_name(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return ""


@contextlib.contextmanager
def pinned(server: Server, cpus: str, back: str) -> Iterator[None]:
    """With ``--job-cpus``: the whole server on those CPUs while the block runs (the job
    alone, no load generator beside it), then on ``back`` (``--server-cpus``) again."""
    if not cpus:
        yield
        return
    pin(server, cpu_list(cpus))
    try:
        yield
    finally:
        pin(server, cpu_list(back))


@contextlib.contextmanager
def profiled(args: argparse.Namespace, server: Server, path: Path, wanted: bool) -> Iterator[None]:
    """With ``--profile``: py-spy samples every process of the server while the block runs
    (raw folded stacks, one line per stack, the process in the root frame)."""
    if not (args.profile and wanted):
        yield
        return
    who = ["--gil"] if args.profile_gil else ["--idle"]  # threads holding the GIL | all
    spy = subprocess.Popen(
        [args.profile, "record", "-p", str(server.process.pid), "--subprocesses", *who,
         "-r", "50", "-d", "600", "-f", "raw", "-o", str(path), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it has
        with contextlib.suppress(subprocess.TimeoutExpired):
            spy.wait(30)


def tokenizer_ceiling(args: argparse.Namespace, fleet: Path, runs: int = 3) -> float:
    """``encode_batch`` of the job's texts on every core: what tokenization alone allows (the
    median of ``runs`` passes: one pass moved between 51,000 and 73,000 texts/s on the H200
    from one command to the next)."""
    from tokenizers import Tokenizer

    from engines.torch_engine import resolve_model_dir
    from features.readers import iter_rows
    from features.text import driver_text

    texts = [driver_text(row.record) for row in iter_rows(fleet) if row.record is not None]
    tokenizer = Tokenizer.from_file(str(resolve_model_dir(args.model) / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=256)
    rates = []
    for _ in range(runs):
        started = time.perf_counter()
        for start in range(0, len(texts), 1024):
            tokenizer.encode_batch(texts[start : start + 1024])
        rates.append(len(texts) / (time.perf_counter() - started))
    return statistics.median(rates)


def batcher_alone(args: argparse.Namespace, settings: dict[str, str]) -> float:
    """Texts/s of the engine's batcher in this process: no HTTP, no IPC, all misses."""
    from engines.batcher import Batcher
    from proxy.engine_host import build_engine
    from proxy.settings import Settings

    config = Settings(**settings)  # type: ignore[arg-type]
    engine = build_engine(config)
    engine.load()
    engine.warmup()

    async def run() -> float:
        sent = 0
        async with Batcher(
            engine,
            max_batch_size=config.max_batch_size,
            max_delay_ms=config.max_delay_ms,
            max_batch_tokens=config.max_batch_tokens,
        ) as batcher:

            async def client(tag: int, until: float) -> None:
                nonlocal sent
                n = 0
                while time.monotonic() < until:
                    n += 1
                    texts = [f"fresh van electric {tag}-{n}-{j} capacity {j} kg" for j in range(32)]
                    await batcher.submit(texts)
                    sent += 32

            await asyncio.gather(*(client(t, time.monotonic() + 2) for t in range(64)))
            sent, started = 0, time.monotonic()
            await asyncio.gather(*(client(t, started + args.duration) for t in range(64)))
            return sent / (time.monotonic() - started)

    try:
        return asyncio.run(run())
    finally:
        engine.close()


def report(rows: list[dict[str, Any]], batcher: float | None, args: argparse.Namespace) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n## serve_bench, {now}, {platform.node()}, {os.cpu_count()} cores, {autogroup()}")
    print(
        f"engine {args.engine} on {args.device}, store {args.store}, {args.connections} "
        f"connections, {args.duration} s x {args.runs} runs, 32 texts a request, base64"
        + "".join(f", {pair}" for pair in args.set)
    )
    if batcher:
        print(f"batcher alone (no HTTP, no IPC): {batcher:,.0f} texts/s")
    columns = ["layout", "ready s", "hits req/s", "hit texts/s", "hit p50 / p99 ms (worst)"]
    columns += ["probe p99 idle -> under hits ms", "health port p99 idle -> under hits ms"]
    columns += ["miss texts/s (2xx)", "miss non-2xx", "miss p50 / p99 ms", "misses / batcher"]
    columns += ["items == misses"]
    columns += ["written back s after", "engine peak MiB (with its children)"]
    columns += ["engine loop / process / children CPU us per text", "server cores busy"]
    columns += ["per-worker requests"]
    columns += ["items per engine"]
    table = []
    for r in rows:
        hits, probe, misses, cpu = r["hits"], r["probe"], r["misses"], r["engine_cpu"]
        ratio = f"{misses['ok_s'] * 32 / batcher:.2f}" if batcher else "-"
        health = "-"
        if r["idle_health_p99"] and r["health"]["p99_ms"]:
            health = idle_to_busy(r["idle_health_p99"], r["health"]["p99_ms"])
        table.append(
            [
                r["layout"],
                f"{r['ready_s']:.1f}",
                f"{hits['req_s']:,.0f}",
                f"{hits['req_s'] * 32:,.0f}",
                f"{hits['p50_ms']:.1f} / {hits['p99_ms']:.1f} ({hits['worst_p99_ms']:.1f})",
                idle_to_busy(r["idle_probe_p99"], probe["p99_ms"]),
                health,
                f"{misses['ok_s'] * 32:,.0f}",
                f"{misses['non2xx']:,.0f}",
                f"{misses['p50_ms']:.1f} / {misses['p99_ms']:.1f}",
                ratio,
                str(r["items_equal_misses"]),
                f"{r['drain_s']:.1f}",
                f"{r['engine_peak_mb']:,.0f}",
                f"{cpu['loop']:.1f} / {cpu['process']:.1f} / {cpu['children']:.1f}",
                f"{cpu['cores']:.1f}",
                str(r["per_worker_requests"]),
                str(r["device_items"]),
            ]
        )
    print()
    print_table(columns, table)
    twins = [r for r in rows if r["twins"]]
    if twins:
        print()
        columns = ["layout", "twin texts/s", "p50 / p99 ms", "engine items per text"]
        print_table(
            [*columns, "coalesced per text"],
            [
                [
                    r["layout"],
                    f"{r['twins']['req_s'] * 32:,.0f}",
                    f"{r['twins']['p50_ms']:.1f} / {r['twins']['p99_ms']:.1f}",
                    f"{r['twins']['items_per_lookup']:.3f}",
                    f"{r['twins']['coalesced_per_lookup']:.3f}",
                ]
                for r in twins
            ],
        )
    for r in rows:
        k = r["killed"]
        if k:
            print(
                f"\n{r['layout']}: engine 1 killed under all-miss load: {k['requests']:.0f} "
                f"requests, {k['errors']:.0f} failed ({k['non2xx']:.0f} non-2xx), "
                f"{k['req_s'] * 32:,.0f} texts/s, p99 {k['p99_ms']:.1f} ms; back in "
                f"{k['back_s'] if k['back_s'] is None else round(k['back_s'], 1)} s"
            )
    phases = ("hits", "probe", "health", "misses")
    errors = {r["layout"]: sum(r[p]["errors"] for p in phases) for r in rows}
    print(f"\nwrk errors (connect/read/write/timeout/non-2xx): {errors}")
    staged = [r for r in rows if r.get("stages")]
    if staged:
        print("\nwhere the misses' time went (means over the miss runs, ms; observed count):")
        print_table(
            ["layout", *STAGES.values(), WAITED],
            [
                [r["layout"]]
                + [f"{mean:.2f} ({count:,.0f})" for mean, count in r["stages"].values()]
                for r in staged
            ],
        )
    for r in rows:
        for run, device in enumerate(r.get("miss_device") or []):
            if device:
                print(f"miss run {run + 1} ({r['layout']}): {device_line(device)}")
    warm = [r for r in rows if "warmup" in r]
    if warm:
        columns = ["layout", "warm-up records", "features/s alone", "tokenizer alone texts/s"]
        columns += ["ratio", "POST -> started -> first rows -> end s", "features/s from 10% to 90%"]
        columns += ["ratio", "features/s beside lookups (median)"]
        columns += ["paced lookup p99 alone -> during ms, median of rounds", "each round's ratio"]
        columns += [
            "workers' run-queue wait alone -> during, ms a second",
            "workers' CPU alone -> during, ms a second",
        ]
        table = []
        for r in warm:
            w = r["warmup"]
            alone, during = w["lookup_p99_alone_ms"], w["lookup_p99_during_ms"]
            ratios = [d / max(a, 1e-6) for a, d in zip(alone, during, strict=True)]
            table.append(
                [
                    r["layout"],
                    f"{w['records']:,}",
                    f"{w['features_per_s']:,.0f}",
                    f"{w['tokenizer_texts_per_s']:,.0f}",
                    f"{w['features_per_s'] / w['tokenizer_texts_per_s']:.2f}",
                    f"{w['started_s']:.2f} -> {w['first_s']:.2f} -> {w['total_s']:.2f}",
                    f"{w['steady_per_s']:,.0f}",
                    f"{w['steady_per_s'] / w['tokenizer_texts_per_s']:.2f}",
                    f"{w['beside_features_per_s']:,.0f}",
                    idle_to_busy(statistics.median(alone), statistics.median(during)),
                    ", ".join(f"{x:.2f}x" for x in ratios),
                    " ; ".join(
                        f"{a:.0f} -> {d:.0f}"
                        for a, d in zip(*w["workers_wait_ms_per_s"].values(), strict=True)
                    ),
                    " ; ".join(
                        f"{a:.0f} -> {d:.0f}"
                        for a, d in zip(*w["workers_ran_ms_per_s"].values(), strict=True)
                    ),
                ]
            )
        print()
        print_table(columns, table)
        for r in warm:
            job, tokenizer = r["warmup"]["job_cores"], r["warmup"]["tokenizer_cores"]
            if job != tokenizer:  # the ratios then compare unlike things
                print(
                    f"({r['layout']}: the job alone ran on {job} cores, the tokenizer's "
                    f"ceiling on {tokenizer}; --job-cpus with every core compares them alike)"
                )
            print(
                f"\nwhere the job alone's CPU went ({r['layout']}, on "
                f"{job} cores, {r['warmup']['cpu_s']:.1f} s "
                "from its POST to its end, its processes' start included):"
            )
            print_table(
                ["role", "CPU us a feature", "cores busy", "busiest main thread (of a core)"],
                r["warmup"]["cpu"],
            )
            print("the job alone's calls (means, ms; observed count):")
            stages = r["warmup"]["stages"]
            print_table(
                ["layout", *stages],
                [[r["layout"], *(f"{m:.2f} ({c:,.0f})" for m, c in stages.values())]],
            )
            w = r["warmup"]
            mean_ms, batches = stages.get("batch: forward", (0.0, 0.0))
            running = w["total_s"] - w["first_s"]
            print(
                f"from its first rows to its end ({running:.2f} s): the device's batches "
                f"{mean_ms * batches / 1e3:.2f} s of it ({mean_ms * batches / 1e3 / running:.0%}); "
                f"the engine's queue empty in {w['queue_empty']:.0%} of its samples, a full "
                f"batch waiting in {w['queue_full']:.0%}"
            )
            if device := w.get("device"):
                print(device_line(device))


def device_line(device: dict[str, Any]) -> str:
    """How the device child spent a job's span (``device_child``): a loop waiting with the
    device idle says the engine process sends batches late; batches waiting padded say the
    child's own loop is late."""
    span, n, s = device["span_s"], max(device["batches"], 1), device["seconds"]
    misses = device.get("misses")  # a miss run's (not a job's)
    return (
        ("" if misses is None else f"{misses[0]:,.0f} new texts/s, p99 {misses[1]:.1f} ms; ")
        + f"the device child over {span:.2f} s ({device['batches']:,} batches): forward "
        f"{s['forward']:.2f} s ({s['forward'] / span:.0%}); its loop waiting for a batch "
        f"{s['waiting']:.2f} s ({s['waiting'] / span:.0%}), in {device['starved']:,} of the "
        f"batches; padded batches waiting for the loop {s['queued'] * 1e3 / n:.2f} ms a "
        f"batch; padding {s['padding'] * 1e3 / n:.2f} ms a batch (its thread)"
        + "".join(
            f"; {what} {s[key] * 1e3 / n:.2f}"
            for key, what in HAND_OVER
            if key in s  # a child of code before them (--code) has not these
        )
        + " (ms a batch)"
        + "".join(
            f"; {WHOSE[role]} threads waiting for a CPU {wait:.0f} ms a second (running {ran:.0f})"
            for role, (wait, ran) in device.get("run_queue", {}).items()
        )
        + (f" (with --nice {device['nice']})" if device.get("nice") else "")
        + (f" (with --pin {device['pinned']})" if device.get("pinned") else "")
        + (f"\n    engine and device threads: {device['threads']}" if device.get("threads") else "")
    )


WHOSE = {
    "engine": "the engine process's",
    "device": "the device child's",
    "workers": "the workers'",
}
# The hand-over's steps (``proxy.device_process``), as ``device_line`` prints them.
HAND_OVER = (
    ("late", "of the waiting, before the engine process had sent the batch"),
    ("transit", "sent -> received"),
    ("pickup", "answer sent -> the engine thread holding it"),
    ("forming", "engine thread starting a batch -> the next one's tokenizing"),
    ("tokenizing", "its tokenizing -> sent"),
)


def autogroup() -> str:
    """Whether this kernel groups each session's processes for its scheduler (a nice value
    then ranks a process only within its session's group: ``proxy.jobs.lower_priority``),
    and this process's CPU cgroup (autogroup applies only in the root one)."""
    with contextlib.suppress(OSError):
        on = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        cpu = [ln.split(":", 2) for ln in lines]
        group = next((g for _, c, g in cpu if "cpu" in c.split(",")), cpu[-1][2] if cpu else "?")
        return f"autogroup {'on' if on else 'off'}, cpu cgroup {group}"
    return "no autogroup"


def idle_to_busy(idle: float, busy: float) -> str:
    """A probe's p99 idle and under load, and their ratio, as a table cell."""
    return f"{idle:.2f} -> {busy:.2f} ({busy / max(idle, 1e-6):.1f}x)"


@contextlib.contextmanager
def out_dir(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
    else:
        with tempfile.TemporaryDirectory(prefix="fleetcache-serve-bench-") as tmp:
            yield Path(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve-single", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="fake")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--devices", nargs="*", default=None, help="FLEETCACHE_DEVICE values")
    parser.add_argument("--skip-hits", action="store_true", help="misses only")
    parser.add_argument("--routing", nargs="*", default=["hash"], help="engine routing policies")
    parser.add_argument("--twins", action="store_true", help="also twins.lua (see above)")
    parser.add_argument("--fake-delay-ms", default="0", help="engine fake: ms per forward")
    parser.add_argument("--kill-engine", action="store_true", help="kill engine 1 under misses")
    parser.add_argument("--model", default=None, help="model dir (default: the packaged one)")
    parser.add_argument("--store", default="lmdb")
    parser.add_argument("--code", default=str(REPO), help="serve another checkout (A/B)")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--single", action="store_true", help="also the one-process layout")
    parser.add_argument("--batcher", action="store_true", help="the batcher alone, first")
    parser.add_argument("--warmup", type=int, default=0, help="drivers in a warm-up job")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--wrk", default=shutil.which("wrk") or "wrk")
    parser.add_argument("--wrk-threads", type=int, default=4)
    parser.add_argument("--wrk-cpus", default="", help="taskset cpu list for wrk")
    parser.add_argument("--server-cpus", default="", help="taskset cpu list for the server")
    parser.add_argument(
        "--job-cpus", default="", help="the server's cpu list while the job runs alone"
    )
    parser.add_argument("--out", default=None, help="directory for logs and stats")
    parser.add_argument("--profile", default="", help="py-spy binary: profile misses, warm-up")
    parser.add_argument(
        "--lower", default="", help="engine,index,job|rest=NICE|idle: those processes lowered"
    )
    parser.add_argument(
        "--nice",
        default="",
        help="ROLE,...=NICE (lower_roles' roles, workers and device too): set for the even "
        "miss runs only (the 2nd, 4th, ...), so that one server gives both in turns",
    )
    parser.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="ROLE,...=CPUS",
        help="CPU affinity of those roles' processes for the even miss runs only (repeat)",
    )
    parser.add_argument("--profile-gil", action="store_true", help="only threads holding the GIL")
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="a FLEETCACHE_ setting"
    )
    args = parser.parse_args()
    if args.serve_single:
        serve_single(args.serve_single)
        return
    settings = {
        "engine": args.engine,
        "device": args.device,
        "store": args.store,
        "max_batch_size": str(args.max_batch_size),
        "memory_cache_mb": "256",
    }
    if args.engine == "fake":
        settings["fake_delay_ms"] = args.fake_delay_ms
    if args.model:  # absolute: a server of another checkout (--code) runs in that directory
        settings["model_path"] = str(Path(args.model).resolve())
    settings |= dict(pair.split("=", 1) for pair in args.set)
    args.devices = args.devices or [args.device]
    wrk = Wrk(args.wrk, args.wrk_threads, args.wrk_cpus)
    with out_dir(args.out) as out:
        batcher = batcher_alone(args, settings) if args.batcher else None
        layouts = ([0] if args.single else []) + list(args.workers)
        rows = []
        for workers, device, routing in itertools.product(layouts, args.devices, args.routing):
            layout = {**settings, "device": device, "engine_routing": routing}
            try:
                rows.append(measure_layout(args, workers, layout, wrk, out))
            except (Exception, SystemExit) as exc:  # report the layouts that did run
                print(f"layout with {workers} workers failed: {exc!r}"[:4000], file=sys.stderr)
                for log in out.glob(f"server-{workers}-*.log"):  # why, before a caller drops it
                    said = [ln for ln in log.read_text().splitlines() if " INFO " not in ln]
                    print(f"{log.name}, its last lines but INFO:", *said[-40:], sep="\n  ")
        report(rows, batcher, args)
        (out / "serve_bench.json").write_text(json.dumps({"rows": rows, "batcher": batcher}))


if __name__ == "__main__":
    main()
