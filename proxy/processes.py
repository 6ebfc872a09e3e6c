"""The processes of ``fleetcache serve`` and what each one runs (ARCHITECTURE.md, "Processes")::

    supervisor (proxy.supervisor)  binds the port; starts, watches and restarts the others
    engine x D  engine_main        one per device of FLEETCACHE_DEVICE: EngineHost behind an
                                   RpcServer at <run dir>/engine.sock (the first; engine k:
                                   engine-k.sock); writes engine[-k].json (its identity)
                                   before loading
    index       index_main         IndexHost behind an RpcServer at <run dir>/index.sock
    worker x N  worker_main        uvicorn on the shared listening socket, create_app(cluster)
    starter     starter_main       (proxy.jobs) forks each warm-up job of the server, asked by
                                   a worker at <run dir>/job-starter.sock
    job         demo_main          loads the demo fleet through the cache, the engine and the
                                   index like any client, then marks the index ready

Every child leaves the terminal's process group (Ctrl-C reaches the supervisor alone, which
stops them in order) and is sent SIGTERM by the kernel if the supervisor dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from engines.base import EngineInfo, EngineUnavailableError
from features.synthetic import generate_fleet
from indexes.snapshot import replace_durably
from proxy.board import Board
from proxy.cores import NO_PLACEMENT, CpuPlan, pin_threads
from proxy.engine_host import (
    build_engine,
    engine_handlers,
    engine_name,
    open_engine_host,
)
from proxy.index_host import index_handlers, open_index_host
from proxy.ipc import RpcServer, address
from proxy.services import Cluster, Services, open_worker_services
from proxy.settings import DEMO_CHUNK, Settings

log = logging.getLogger("fleetcache.proxy")
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildSpec:
    """What the supervisor hands a child (picklable, for the spawn start method)."""

    settings: dict[str, Any]
    run_dir: str
    log_level: str = "info"
    devices: tuple[str, ...] = ()  # one engine process each (default: FLEETCACHE_DEVICE's)
    cpus: CpuPlan = NO_PLACEMENT  # where each process runs (proxy.cores.cpu_plan)

    def __post_init__(self) -> None:
        devices = tuple(self.devices) or self.load_settings().devices
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "cpus", CpuPlan.of(self.cpus))  # read back from JSON too

    def load_settings(self) -> Settings:
        return Settings.model_validate(self.settings)

    def engine_settings(self, engine: int) -> Settings:
        """The settings of engine ``engine``: its one device."""
        return Settings.model_validate({**self.settings, "device": self.devices[engine]})

    def cluster(self, role: str = "worker") -> Cluster:
        info = read_engine_info(Path(self.run_dir))
        return Cluster(Path(self.run_dir), info, role, devices=self.devices)


def engine_file(engine: int) -> str:
    return f"{engine_name(engine)}.json"


def read_engine_info(run_dir: Path, engine: int = 0) -> EngineInfo:
    return EngineInfo(**json.loads((run_dir / engine_file(engine)).read_text()))


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s",
        force=True,
    )


def become_child(role: str, level: str, cpus: Sequence[int] = ()) -> None:
    """Leave the terminal's process group; die with the supervisor; run on ``cpus`` (empty:
    where the parent ran)."""
    pin_threads(cpus)
    setup_logging(level, role)
    with contextlib.suppress(OSError):
        os.setpgrp()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _prctl(option: int, value: int | bytes) -> None:
    """Linux's prctl(2) through libc; nothing where there is none."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_until_stopped(server: RpcServer) -> None:
    """Serve until SIGTERM or SIGINT (a child that owns nothing else)."""
    await _serve(server, _stop_event())


async def _serve(server: RpcServer, stop: asyncio.Event) -> None:
    task = asyncio.create_task(server.serve(), name=f"serve {server.address}")
    try:
        await stop.wait()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        server.close()


# The engine process's collector runs when 50,000 more containers live than at its last run,
# not 700: each request allocates hundreds and frees nearly all by reference counting, and
# at the default the collections took ~24% of its loop's CPU per new text (2-core box,
# bench/engine_bench.py, docs/BENCHMARKS.md). What cycles there are wait a little longer.
ENGINE_GC_THRESHOLDS = (50_000, 20, 20)
# An engine process's exit code when its engine cannot run here (``EngineUnavailableError``
# from its load: a missing package, no GPU, a setting the model refuses): on a server's first
# start of it the supervisor stops with its reason instead of restarting it for ever.
CANNOT_RUN = 3


@contextlib.contextmanager
def frozen_heap(thresholds: tuple[int, int, int] | None = None) -> Iterator[None]:
    """Move everything alive now (imports, the model, the loaded fleet) out of the garbage
    collector's reach while the block runs, so that a full collection walks only what was
    created since.

    Measured during a 10,000-driver warm-up in the server: a full collection on the event loop
    took 241 ms (every dispatch request waited for it), 37 ms with the heap frozen; the engine
    process's loop, 40.6 -> 33.0 us of CPU per new text on the H200 (docs/BENCHMARKS.md). The
    processes ``fleetcache serve`` and ``fleetcache warmup`` start do it (workers, engine and
    index processes, a job's readers), and undo it on the way out: while frozen, hypothesis'
    reference checks (tests) cannot see those objects. ``thresholds``: the collector's
    (``gc.set_threshold``) while the block runs.
    """
    gc.collect()
    gc.freeze()
    log.info("heap frozen: %d objects left out of garbage collection", gc.get_freeze_count())
    before = gc.get_threshold()
    if thresholds is not None:
        gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


# -- engine ------------------------------------------------------------------------------


def engine_main(spec: ChildSpec, engine: int = 0) -> None:
    become_child("engine", spec.log_level)  # on its own CPUs once loaded (``_engine``)
    asyncio.run(_engine(spec, engine))


async def _engine(spec: ChildSpec, index: int) -> None:
    settings, run_dir = spec.engine_settings(index), Path(spec.run_dir)
    stop = _stop_event()
    loaded = False
    try:
        engine = build_engine(settings, device_cpus=spec.cpus.device(index))
        info_file = run_dir / engine_file(index)
        tmp = info_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(engine.info)))
        tmp.replace(info_file)  # the supervisor starts the others once it reads this
        board = Board("engine", run_dir / "boards", engine=index)
        writer_cpus = spec.cpus.shared
        async with open_engine_host(settings, board, engine, writer_cpus=writer_cpus) as host:
            loaded = True
            # Loaded on every CPU of the server; from now on on its own (a writer child, made
            # above, on the shared ones): sized by the server's cores, not by its own two.
            pin_threads(spec.cpus.engine(index))
            server = RpcServer(address(run_dir, engine_name(index)), {})
            server.handlers.update(engine_handlers(host, server))
            log.info("engine process serving at %s", server.address)
            # the model's objects: each full collection would walk them all
            with frozen_heap(ENGINE_GC_THRESHOLDS):
                await _serve(server, stop)
        board.close()
    except EngineUnavailableError as exc:
        if loaded:  # served: a crash like any other, to be restarted
            raise
        log.error("the engine cannot run here: %s", exc)
        raise SystemExit(CANNOT_RUN) from None


# -- fleet index ---------------------------------------------------------------------------


def index_main(spec: ChildSpec) -> None:
    become_child("index", spec.log_level, spec.cpus.shared)
    asyncio.run(_index(spec))


async def _index(spec: ChildSpec) -> None:
    settings, run_dir = spec.load_settings(), Path(spec.run_dir)
    stop = _stop_event()
    info = read_engine_info(run_dir)
    board = Board("index", run_dir / "boards")
    async with open_index_host(settings, board, info.dim) as host:
        server = RpcServer(address(run_dir, "index"), index_handlers(host))
        log.info("index process serving at %s", server.address)
        with frozen_heap():
            await _serve(server, stop)
    board.close()


# -- HTTP workers --------------------------------------------------------------------------


SERVING_DIR = "serving"  # of the run directory: a worker's mark, named by its pid


def serving_mark(run_dir: Path, pid: int) -> Path:
    """The file a worker makes once its socket listens: the supervisor's health port counts
    it live from then on (its process alone says nothing of its socket)."""
    return run_dir / SERVING_DIR / str(pid)


class LateSocket:
    """The worker's listening socket, bound only when uvicorn asks for it: after the app's
    lifespan started, which waits for the engine and the index when the worker is told to.
    (SO_REUSEPORT: binding is joining the port; until then the kernel sends the connections
    to the workers already serving.) Once it listens, the worker's ``serving_mark``."""

    def __init__(self, host: str, port: int, run_dir: Path, stopping: Callable[[], bool]) -> None:
        self.host, self.port, self.run_dir, self.stopping = host, port, run_dir, stopping

    def __iter__(self) -> Iterator[socket.socket]:
        from proxy.supervisor import bind_socket

        if self.stopping():  # told to stop as it started: it never joins the port
            return
        sock = bind_socket(self.host, self.port)
        mark = serving_mark(self.run_dir, os.getpid())
        mark.parent.mkdir(exist_ok=True)
        mark.touch()
        yield sock


def worker_main(spec: ChildSpec, host: str, port: int, serve_at_once: bool) -> None:
    import uvicorn

    from proxy.app import create_app
    from proxy.http_head import BoundedHeadProtocol

    become_child("worker", spec.log_level, spec.cpus.shared)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # uvicorn installs its own handlers
    server: uvicorn.Server | None = None  # made below, from the app that reads it
    cluster = replace(
        spec.cluster(),
        serve_after_ready_s=0.0 if serve_at_once else 30.0,
        stopping=lambda: server is not None and server.should_exit,
    )
    app = create_app(spec.load_settings(), cluster=cluster, freeze_gc=True)
    config = uvicorn.Config(
        app,
        log_level=spec.log_level,
        timeout_graceful_shutdown=30,
        log_config=None,
        http=BoundedHeadProtocol,
    )
    server = uvicorn.Server(config)
    sockets = LateSocket(host, port, Path(spec.run_dir), cluster.stopping)
    server.run(sockets=sockets)  # type: ignore[arg-type]


# -- the demo fleet ------------------------------------------------------------------------


# Beside the index's snapshots: which demo fleet this index was given (JSON).
DEMO_MARK = "demo-fleet.json"


async def load_demo_fleet(services: Services, settings: Settings) -> None:
    """Index ``FLEETCACHE_DEMO_DRIVERS`` synthetic drivers once per index, then say the index
    is ready. A later start, or the index owner's restart, finds them in the index with every
    change acknowledged since (a driver deleted stays deleted), and only marks it ready; a
    demo fleet of another size or seed is loaded over it."""
    n, seed = settings.demo_drivers, settings.demo_seed
    mark, wanted = settings.index_dir / DEMO_MARK, {"drivers": n, "seed": seed}
    with contextlib.suppress(OSError, ValueError):
        if json.loads(mark.read_bytes()) == wanted:
            log.info("demo fleet: loaded into this index before, kept as it is now")
            await services.index.set_ready()
            return
    drivers = await asyncio.to_thread(generate_fleet, n, seed)
    embedded = 0
    for start in range(0, n, DEMO_CHUNK):
        _, result = await services.upsert_drivers(drivers[start : start + DEMO_CHUNK], "warmup")
        embedded += result.misses
        log.info(
            "demo fleet: %d/%d drivers indexed (%d embedded, rest cached)",
            min(start + DEMO_CHUNK, n),
            n,
            embedded,
        )
    # every upsert above is in the index's change log (flushed) before its call returned
    mark.parent.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(replace_durably, mark, json.dumps(wanted).encode())
    await services.index.set_ready()


def demo_main(spec: ChildSpec) -> None:
    become_child("job", spec.log_level, spec.cpus.shared)
    asyncio.run(_demo(spec))


async def _demo(spec: ChildSpec) -> None:
    settings = spec.load_settings()
    async with open_worker_services(settings, spec.cluster("job")) as services:
        while waiting := await services.wait_answering(60.0):
            log.info("demo fleet: waiting for the %s process", " and the ".join(waiting))
        if not services.index.ready:
            await load_demo_fleet(services, settings)
