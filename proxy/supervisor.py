"""``fleetcache serve``: one port, a few processes, supervised (ARCHITECTURE.md, "Processes").

Start: the listening socket is bound here, once; the engine processes start first (one per
device of ``FLEETCACHE_DEVICE``, ``engine_devices``) and each writes its identity
(fingerprint, dimension) before it loads the model; they must agree on the fingerprint (one
cache namespace), or nothing else starts; then the fleet index owner,
the HTTP workers (each serving the same socket: the kernel spreads connections over them), the
job starter (it forks the warm-up jobs, ``proxy.jobs``) and, with a demo fleet, the job that
loads it. ``/readyz`` is 503 on every worker until the engine
is warm and the index is loaded.

While running: a process that exits is started again (its slot's restart count grows, shown
in ``/v1/stats`` ``processes``); one that keeps dying right after it starts waits longer each
time, up to ``MAX_BACKOFF_S``. With the engine down the workers still serve hits and answer
misses with 503; with the index down, fleet and dispatch calls get 503; both come back by
themselves. The demo job runs again whenever the index owner restarts, even as the job closes
(it marks the index ready; it loads the demo fleet into an index only once, ``load_demo_fleet``).

Health port (``FLEETCACHE_HEALTH_PORT``): the supervisor itself answers ``GET /healthz`` there,
200 while it holds live workers and is not stopping, 503 otherwise. A worker answers its own
``/healthz`` on the main port only between the requests its event loop already holds, so under
a load that keeps every worker busy its probe waits behind them (16x its idle p99 on the H200,
docs/BENCHMARKS.md); the supervisor's thread waits behind nothing. Point liveness probes here.

Stop (SIGTERM or Ctrl-C): the workers first (they stop accepting and finish what they hold),
then the job starter and the jobs, the engine (its batch in flight finishes and is written
back) and the index last (it saves its snapshot). Whatever does not stop within its grace is killed.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from engines.devices import runs_on_cuda
from proxy.board import INDEX_SLOT, Board, engine_slot
from proxy.cores import CpuPlan, cpu_plan, usable_cores
from proxy.device_process import use_device_process
from proxy.gpu_health import visible_gpus
from proxy.jobs import NO_THREADS, SPEC_FILE, starter_main, stop_jobs
from proxy.processes import (
    CANNOT_RUN,
    ChildSpec,
    demo_main,
    engine_file,
    engine_main,
    index_main,
    read_engine_info,
    serving_mark,
    worker_main,
)
from proxy.settings import MAX_DEVICES, Settings

log = logging.getLogger("fleetcache.supervisor")
MAX_BACKOFF_S = 10.0
QUICK_DEATH_S = 5.0  # a process that dies sooner than this after its start is backed off
STOP_GRACE_S = {"worker": 35.0, "starter": 5.0, "job": 10.0, "engine": 30.0, "index": 60.0}


def auto_workers(cores: int | None = None) -> int:
    """``FLEETCACHE_WORKERS=auto``: HTTP workers for the cores this server may use
    (``proxy.cores``), ``cores - 4`` (the engine's tokenizer and copy threads, the index
    owner and the supervisor keep four), at least 2, at most 16. Measured
    (docs/BENCHMARKS.md, bench/serve_bench.py): on the 2-core box 2 workers served 1.9x the
    cached texts of 1 (149k vs 79k texts/s) and 3 fewer (123k); on the H200 machine with 12
    cores for the server, 12 workers 333k, 8 308k, 4 116k cached texts/s, new texts
    30-32k/s with 8 or 12."""
    cores = cores or usable_cores()
    return max(2, min(16, cores - 4))


def engine_devices(settings: Settings, gpus: Callable[[], int] = visible_gpus) -> tuple[str, ...]:
    """One entry per engine process: ``FLEETCACHE_DEVICE`` as listed; ``auto``, for an engine
    that runs on CUDA (torch, tensorrt), is every visible GPU ``FLEETCACHE_ENGINES_PER_GPU``
    times (``cuda:0``, ``cuda:1``...; with 2, ``cuda:0``, ``cuda:0``, ``cuda:1``...: one engine
    process is bound by its interpreter long before its GPU, docs/BENCHMARKS.md), at most
    ``MAX_DEVICES`` in all; when that is one process, one engine that picks for itself as
    before (CUDA when present, the CPU otherwise)."""
    if settings.devices != ("auto",) or not runs_on_cuda(settings.engine):
        return settings.devices
    count = gpus()
    per_gpu = max(1, min(settings.engines_per_gpu, MAX_DEVICES // max(count, 1)))
    if count * per_gpu <= 1:
        return ("auto",)
    return tuple(f"cuda:{i}" for i in range(count) for _ in range(per_gpu))


def server_cpu_plan(
    settings: Settings,
    devices: Sequence[str],
    gpus: Callable[[], int] = visible_gpus,
    cpus: Sequence[int] | None = None,
) -> CpuPlan:
    """Where each process runs (``proxy.cores.cpu_plan``): ``auto`` places only engines
    that drive a GPU from a device child, and none with a fallback engine (it computes on
    the engine process's own threads: not on two CPUs); ``ENGINE/DEVICE`` places every
    engine and its device child, if it has one, as told."""
    children = [
        use_device_process(settings.device_process, d, settings.engine, gpus) for d in devices
    ]
    if settings.cpu_placement == "auto":
        # a device child on a GPU: the device where ``auto`` would give it one
        on_gpu = [use_device_process("auto", d, settings.engine, gpus) for d in devices]
        if settings.fallback_engine is not None or not all(on_gpu):
            children = []
    return cpu_plan(settings.cpu_placement, children, cpus)


def check_identities(run_dir: Path, devices: Sequence[str]) -> str | None:
    """Why the engines cannot serve one cache (different fingerprints), or None."""
    infos = [read_engine_info(run_dir, k) for k in range(len(devices))]
    for device, info in zip(devices[1:], infos[1:], strict=True):
        if info.fingerprint != infos[0].fingerprint:
            return (
                f"FLEETCACHE_DEVICE: the engine on {device} has fingerprint {info.fingerprint}, "
                f"the one on {devices[0]} {infos[0].fingerprint}: every device must compute "
                "the same vectors (one cache namespace); list devices of one kind"
            )
    return None


@dataclass
class Slot:
    """One process the supervisor keeps running."""

    role: str
    board_slot: int
    start: Callable[[], BaseProcess]
    process: BaseProcess | None = None
    pid: int = 0  # the running process's (0: none), readable from another thread
    restarts: int = 0
    started_at: float = 0.0
    backoff_s: float = 0.0
    retry_at: float = 0.0
    wanted: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    label: str = ""  # how the log names it (default: its role and worker slot)
    env: dict[str, str] = field(default_factory=dict)  # set for it (spawned: before imports)


class Supervisor:
    def __init__(
        self, settings: Settings, *, host: str, port: int, workers: int, log_level: str = "info"
    ) -> None:
        self.settings = settings
        self.host = host
        self.port = port
        self.workers = workers
        self.log_level = log_level
        self._ctx = multiprocessing.get_context("spawn")
        self._stopping = False
        self._code = 0  # what ``run`` returns: 2 when an engine cannot run here
        self.slots: list[Slot] = []
        self._run_dir: Path | None = None
        self._health: http.server.ThreadingHTTPServer | None = None

    def run(self) -> int:
        run_dir = self._run_dir = Path(tempfile.mkdtemp(prefix="fleetcache-"))
        self._run_name = run_dir.name
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in previous:
            signal.signal(sig, self._on_signal)
        try:
            return self._run(run_dir)
        finally:
            if self._health is not None:
                self._health.shutdown()
                self._health.server_close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            shutil.rmtree(run_dir, ignore_errors=True)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self._stopping:
            log.info("%s: stopping", signal.Signals(signum).name)
        self._stopping = True

    def _run(self, run_dir: Path) -> int:
        devices = engine_devices(self.settings)
        settings = self.settings
        try:
            cpus = server_cpu_plan(settings, devices)
        except ValueError as exc:  # CPUs named that this server may not use
            log.error("%s", exc)
            return 2
        log.info("%s", cpus.describe())
        board = Board("supervisor", run_dir / "boards")
        spec = ChildSpec(
            settings.model_dump(mode="json"), str(run_dir), self.log_level, devices, cpus
        )
        (run_dir / SPEC_FILE).write_text(json.dumps(asdict(spec)))  # for warm-up jobs
        check_port(self.host, self.port)  # fail here, clearly, before anything starts
        self._health = self._health_server()
        ctx = self._ctx

        def child(target: Callable[..., None], name: str, *args: Any) -> Callable[[], BaseProcess]:
            return lambda: ctx.Process(target=target, args=(spec, *args), name=name)

        engines = [
            Slot(
                "engine",
                engine_slot(k),
                child(engine_main, f"fleetcache-engine-{k}", k),
                label=f"engine {k} ({device})",
            )
            for k, device in enumerate(devices)
        ]
        self.slots = list(engines)
        for engine in engines:  # they load side by side
            self._start(engine, board)
        for k, engine in enumerate(engines):
            if not self._wait_for_file(run_dir / engine_file(k), engine):
                cannot_run = engine.process is not None and engine.process.exitcode == CANNOT_RUN
                self._stop_all(board)
                return 2 if cannot_run else 1
        mismatch = check_identities(run_dir, devices)
        if mismatch is not None:
            log.error("%s", mismatch)
            self._stop_all(board)
            return 1
        index = Slot("index", INDEX_SLOT, child(index_main, "fleetcache-index"))
        self.slots.append(index)
        self._start(index, board)
        for i in range(self.workers):
            worker = Slot("worker", i, lambda: ctx.Process())  # set just below
            # the first worker of a fresh server serves at once (its /readyz says why it is
            # not ready yet); any other, and any restarted one, once engine and index answer
            worker.start = self._worker_start(spec, worker)
            self.slots.append(worker)
            self._start(worker, board)
        starter_process = child(starter_main, "fleetcache-job-starter")
        starter = Slot("starter", -1, starter_process, label="job starter", env=NO_THREADS)
        self.slots.append(starter)
        self._start(starter, board)
        demo = None
        if self.settings.demo_drivers:
            demo = Slot("job", -1, child(demo_main, "fleetcache-demo"))
            self.slots.append(demo)
            self._start(demo, board)
        log.info(
            "serving http://%s:%d with %d workers (engine pids %s on %s, index pid %s)",
            self.host,
            self.port,
            self.workers,
            ", ".join(str(e.process.pid) if e.process else "?" for e in engines),
            ",".join(devices),
            index.process.pid if index.process else "?",
        )
        try:
            self._watch(board, index, demo)
        finally:
            self._stop_all(board)
            board.close()
        return self._code

    def _health_server(self) -> http.server.ThreadingHTTPServer | None:
        """``GET /healthz`` on ``FLEETCACHE_HEALTH_PORT``, from a thread of this process."""
        port = self.settings.health_port
        if port is None:
            return None
        supervisor = self

        class Health(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as probes and load balancers use
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms wait

            def do_GET(self) -> None:
                self._answer(*self._health())

            def do_HEAD(self) -> None:
                code, body = self._health()
                self._answer(code, body, with_body=False)

            def _refuse(self) -> None:
                message = f"{self.command}: the health port answers GET /healthz only"
                error = {"type": "method_not_allowed", "message": message, "param": None}
                self._answer(405, {"error": error}, allow="GET, HEAD")

            do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _refuse

            def _health(self) -> tuple[int, dict[str, Any]]:
                if self.path.partition("?")[0] != "/healthz":
                    message = f"{self.path}: the health port answers GET /healthz only"
                    error = {"type": "not_found", "message": message, "param": None}
                    return 404, {"error": error}
                live = supervisor.live_workers()
                if supervisor._stopping or not live:
                    reason = "stopping" if supervisor._stopping else "no live worker"
                    return 503, {"status": reason, "workers": live}
                return 200, {"status": "ok", "workers": live}

            def _answer(
                self, code: int, body: dict[str, Any], with_body: bool = True, allow: str = ""
            ) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if allow:
                    self.send_header("Allow", allow)
                self.end_headers()
                if with_body:
                    self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a probe every few seconds is not news

        try:
            server = http.server.ThreadingHTTPServer((self.host, port), Health)
        except OSError as exc:  # the CLI names the main port: say which one failed
            raise OSError(exc.errno, f"health port {port}: {exc.strerror or exc}") from exc
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="health-port", daemon=True).start()
        log.info("health port: http://%s:%d/healthz", self.host, port)
        return server

    def live_workers(self) -> int:
        """Workers whose process runs and whose socket listens (``serving_mark``): read by
        the health port's thread at each probe."""
        run_dir = self._run_dir
        if run_dir is None:
            return 0
        return sum(
            s.role == "worker" and (pid := s.pid) > 0 and serving_mark(run_dir, pid).exists()
            for s in list(self.slots)
        )

    def _watch(self, board: Board, index: Slot, demo: Slot | None) -> None:
        while not self._stopping:
            sentinels = [s.process.sentinel for s in self.slots if s.process is not None]
            multiprocessing.connection.wait(sentinels, timeout=0.5)
            now = time.monotonic()
            for slot in self.slots:
                process = slot.process
                if process is not None and process.exitcode is not None:
                    self._exited(slot, now)
                    if demo is not None and (slot is index or slot is demo):
                        demo.wanted = demo.wanted or not marked_ready(index, demo)
                if slot.process is None and slot.wanted and now >= slot.retry_at:
                    if self._stopping:
                        break
                    slot.restarts += slot.role != "job"
                    self._start(slot, board)

    def _worker_start(self, spec: ChildSpec, slot: Slot) -> Callable[[], BaseProcess]:
        def start() -> BaseProcess:
            at_once = slot.board_slot == 0 and slot.restarts == 0
            args = (spec, self.host, self.port, at_once)
            return self._ctx.Process(
                target=worker_main, args=args, name=f"fleetcache-worker-{slot.board_slot}"
            )

        return start

    def _exited(self, slot: Slot, now: float) -> None:
        process = slot.process
        assert process is not None
        code = process.exitcode
        if self._run_dir is not None:  # its pid may come again: no mark may wait for it
            serving_mark(self._run_dir, slot.pid).unlink(missing_ok=True)
        process.close()
        slot.process, slot.pid = None, 0
        if slot.role == "job" and code == 0:
            slot.wanted = False  # done, unless the index restarted meanwhile (``_watch``)
            log.info("demo fleet job done")
            return
        if self._stopping:
            return
        if slot.role == "engine" and code == CANNOT_RUN and slot.restarts == 0:
            # a setting or this machine, not a crash: restarting cannot help (its log says why)
            log.error("%s cannot run here (see its log above): stopping", slot.label)
            self._code, self._stopping = 2, True
            return
        quick = now - slot.started_at < QUICK_DEATH_S
        slot.backoff_s = min(MAX_BACKOFF_S, max(0.5, slot.backoff_s * 2)) if quick else 0.0
        slot.retry_at = now + slot.backoff_s
        log.warning(
            "%s exited with %s; restarting%s",
            slot.label or f"{slot.role} {'' if slot.board_slot < 0 else slot.board_slot}",
            code,
            f" in {slot.backoff_s:.1f} s" if slot.backoff_s else "",
        )

    def _start(self, slot: Slot, board: Board) -> None:
        process = slot.start()
        with environment(slot.env):
            process.start()
        slot.process, slot.pid, slot.started_at = process, process.pid or 0, time.monotonic()
        if slot.board_slot >= 0:
            board.process(slot.board_slot, process.pid or 0, slot.restarts)

    def _wait_for_file(self, path: Path, slot: Slot) -> bool:
        """Until the engine wrote its identity (it builds the engine first), or it died."""
        while not path.exists():
            if self._stopping or (slot.process is not None and slot.process.exitcode is not None):
                log.error("the engine process exited before it started (see its log above)")
                return False
            time.sleep(0.05)
        return True

    def _stop_all(self, board: Board) -> None:
        self._stopping = True
        for role in ("worker", "starter", "job", "engine", "index"):
            if role == "job":  # warm-up jobs too (they keep their checkpoint)
                stop_jobs(self.settings, self._run_name, STOP_GRACE_S["job"])
            stopping = [s for s in self.slots if s.role == role and s.process is not None]
            for slot in stopping:
                assert slot.process is not None
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(slot.process.pid or 0, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S[role]
            for slot in stopping:
                process = slot.process
                assert process is not None
                process.join(max(0.0, deadline - time.monotonic()))
                if process.exitcode is None:
                    log.warning("%s pid %s did not stop in time: killed", role, process.pid)
                    process.kill()
                    process.join(5)
                slot.process, slot.pid = None, 0


def marked_ready(index: Slot, demo: Slot) -> bool:
    """Whether the demo job's last run marked the index owner running now ready: not when the
    index exited or was started again after the job started (a job still closing as the index
    was killed exits 0, yet the index it marked is gone and the new one would never be ready)."""
    return index.process is not None and index.started_at <= demo.started_at


@contextlib.contextmanager
def environment(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``extra`` while the block runs: what a spawned child inherits.
    (Only the supervisor's own thread reads or writes it.)"""
    before = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def bind_socket(host: str, port: int) -> socket.socket:
    """One worker's listening socket. SO_REUSEPORT: every worker binds its own on the same
    port and the kernel spreads new connections over them; a worker that dies leaves the
    group, its replacement joins it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def check_port(host: str, port: int) -> None:
    """OSError (address in use, no such address) unless ``host:port`` can be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


@contextlib.contextmanager
def local_cluster(settings: Settings, log_level: str = "warning") -> Iterator[ChildSpec]:
    """The engine process and the fleet index owner, without HTTP workers or restarts: what
    ``fleetcache warmup FILE`` (direct mode) runs its reader processes against. On the way
    out the engines stop first (their batches in flight are written back), then the index
    (it saves its snapshot)."""
    run_dir = Path(tempfile.mkdtemp(prefix="fleetcache-"))
    devices = engine_devices(settings)
    spec = ChildSpec(settings.model_dump(mode="json"), str(run_dir), log_level, devices)
    (run_dir / SPEC_FILE).write_text(json.dumps(asdict(spec)))
    ctx = multiprocessing.get_context("spawn")
    started: list[BaseProcess] = []
    try:
        for k in range(len(devices)):
            engine = ctx.Process(target=engine_main, args=(spec, k), name=f"fleetcache-engine-{k}")
            engine.start()
            started.append(engine)
        for k, process in enumerate(started):
            while not (run_dir / engine_file(k)).exists():
                if process.exitcode is not None:
                    raise RuntimeError("an engine process exited before it started (see its log)")
                time.sleep(0.05)
        mismatch = check_identities(run_dir, devices)
        if mismatch is not None:
            raise RuntimeError(mismatch)
        index = ctx.Process(target=index_main, args=(spec,), name="fleetcache-index")
        index.start()
        started.append(index)
        yield spec
    finally:
        for process in started:  # engines first, index last
            if process.exitcode is None and process.pid:
                os.kill(process.pid, signal.SIGTERM)
                grace = STOP_GRACE_S["index" if process.name == "fleetcache-index" else "engine"]
                process.join(grace)
            if process.exitcode is None:
                process.kill()
                process.join(5)
        shutil.rmtree(run_dir, ignore_errors=True)
