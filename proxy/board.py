"""What every process of one server counts, in shared memory, so that any worker can answer
``/v1/stats`` and ``/metrics`` for the whole server.

One *board* per process: a small memory-mapped file that only that process writes::

    <run dir>/boards/<role>-<pid>.board     role: supervisor | engine | index | worker | job

A reader (the worker serving ``/v1/stats``) maps every board in the directory and adds them
up. Nothing is sent between processes and nothing is stale: a counter is a float64 in the
mapping, written as it changes. A process that died keeps its file, so what it counted still
counts (a worker killed with -9 keeps every hit it served); *gauges* (entries in a memory tier,
queue depth) count only for live processes. A live process holds an exclusive ``flock`` on
its board: a reader that cannot take a shared lock knows the owner is alive, and the kernel
drops the lock the moment the process dies (no pid reuse to worry about).

Regions of one board (float64 unless said)::

    scalars    SCALARS: this process's totals, written as absolute values (mirrored from the
               object that counts them: the cache, the batcher, the tiers)
    gauges     GAUGES: summed over live processes only
    callers    MAX_CALLERS x (hits, coalesced, misses), names in a bytes region beside
    windows    WINDOW_S one-second slots x (second, avoided, misses): the 1m / 5m windows
    recent     RECENT histograms x RECENT_SLOTS one-minute slots x (minute, buckets...):
               p50 / p99 of the last five minutes, from merged histograms (API.md v1.1)
    histograms HISTOGRAMS x label sets x (buckets..., sum): Prometheus histograms (/metrics)
    processes  the supervisor's: a pid and a restart count per worker slot, engine (one per
               device of FLEETCACHE_DEVICE), index

An engine process's header also says which engine of the device list it is, so that
``/v1/stats`` and ``/metrics`` can count per device.

Single-process use (tests, ``create_app`` without the supervisor) gets an anonymous board and
a reader over that one board: the same code answers either way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import mmap
import os
import struct
import threading
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from proxy.settings import MAX_DEVICES

MAGIC = 0x464C_4243_0005  # "FLBC" + layout version: a reader skips boards of another layout
SCALARS: tuple[str, ...] = (
    "cache.hits",
    "cache.coalesced",
    "cache.misses",
    "cache.ms_saved",
    "cache.failed_calls",
    "cache.memory_hits",
    "cache.store_hits",
    "cache.store_errors",
    "cache.store_skipped",
    "cache.corrupt_entries",
    "cache.expired_entries",
    "cache.store_waits",
    "cache.dispatch_lookups",  # lookups by every caller but warm-up: a job's pacing reads it
    "requests",
    "requests.rejected",
    "inference.items",
    "inference.batches",
    "inference.failed_batches",
    "inference.expired_items",
    "inference.ok_items",
    "inference.engine_ms",
    "inference.drift_items",
    "requests.queue_full",  # 429s for a full inference queue (requests.rejected: worker full)
)
GAUGES: tuple[str, ...] = (
    "cache.memory_entries",
    "cache.memory_bytes",
    "cache.memory_max_bytes",
    "cache.store_degraded",
    "cache.in_flight",
    "cache.unwritten",
    "queue.depth",
    "fleet.drivers",
    "fleet.seq",
    "fleet.log_following",
)
MAX_CALLERS = 64  # X-Caller is client-controlled: further names count as "other"
CALLER_BYTES = 32
WINDOW_S = 300
# Recent latency, for /v1/stats: buckets 2**(1/8) apart (9% resolution) from 10 us to ~100 s.
RECENT: tuple[str, ...] = ("hit_requests", "miss_requests", "batch", "queue_wait")
RECENT_MINUTES = 5  # percentiles cover the current minute and the four before it
RECENT_SLOTS = RECENT_MINUTES + 1  # one-minute slots in a ring
RECENT_BOUNDS_MS: npt.NDArray[np.float64] = 0.01 * 2.0 ** (np.arange(185) / 8.0)
_RECENT_BOUNDS = tuple(RECENT_BOUNDS_MS.tolist())  # bisect: 1/30 of searchsorted's cost
# Prometheus histograms (STYLE.md rule 10: units in the name, geometric buckets).
LATENCY_BUCKETS: tuple[float, ...] = tuple(0.00025 * 2**i for i in range(17))  # 0.25 ms .. 16 s
BATCH_SIZE_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(11))  # 1 .. 1024
ROUTES = ("embeddings", "features", "fleet_upsert", "recommend")


@dataclass(frozen=True)
class HistogramSpec:
    name: str
    help: str
    labels: tuple[str, ...]
    label_sets: tuple[tuple[str, ...], ...]
    buckets: tuple[float, ...]


HISTOGRAMS: tuple[HistogramSpec, ...] = (
    HistogramSpec(
        "fleetcache_request_duration_seconds",
        "Latency of requests that look up embeddings, by route and outcome "
        "(hit: no text went to the engine; miss: at least one did).",
        ("route", "outcome"),
        tuple((r, o) for r in ROUTES for o in ("hit", "miss")),
        LATENCY_BUCKETS,
    ),
    HistogramSpec(
        "fleetcache_request_stage_duration_seconds",
        "Time one request spent in a stage: cache_lookup (tiers read), queue_wait (its "
        "misses waiting for a batch), index (the fleet index search of a recommend), "
        "engine_call (a worker's call to an engine process, sent to answered), engine_embed "
        "(that call in the engine process, from its event loop taking it to its answer), "
        "write_back (the engine writing a call's new vectors to the cache store, computed to "
        "committed), fleet_write (a fleet upsert's call to the index owner, its change log "
        "flush included).",
        ("stage",),
        tuple(
            (stage,)
            for stage in (
                "cache_lookup",
                "queue_wait",
                "index",
                "engine_call",
                "engine_embed",
                "write_back",
                "fleet_write",
            )
        ),
        LATENCY_BUCKETS,
    ),
    HistogramSpec(
        "fleetcache_lane_queue_wait_seconds",
        "Time a request's misses waited for a batch, by batcher lane (dispatch goes first; "
        "warm-up jobs, and with API keys on every key without the dispatch scope, use warmup).",
        ("lane",),
        (("dispatch",), ("warmup",)),
        LATENCY_BUCKETS,
    ),
    HistogramSpec(
        "fleetcache_engine_stage_duration_seconds",
        "Engine time per batch and stage (tokenize on CPU; forward and postprocess on the device).",
        ("stage",),
        (("tokenize",), ("forward",), ("postprocess",)),
        LATENCY_BUCKETS,
    ),
    HistogramSpec(
        "fleetcache_engine_batch_duration_seconds",
        "Device time per batch (forward + postprocess), failed batches excluded.",
        (),
        ((),),
        LATENCY_BUCKETS,
    ),
    HistogramSpec(
        "fleetcache_engine_batch_size_texts",
        "Texts per batch handed to the engine.",
        (),
        ((),),
        BATCH_SIZE_BUCKETS,
    ),
)
MAX_WORKER_SLOTS = 64
ROLES = ("supervisor", "engine", "index", "worker", "job")
_HEADER = 8  # float64 slots: magic, pid, role, started (wall clock), engine index, reserved


def _layout() -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (offset in float64s, shape) of every region."""
    regions: dict[str, tuple[int, ...]] = {
        "header": (_HEADER,),
        "scalars": (len(SCALARS),),
        "gauges": (len(GAUGES),),
        "callers": (MAX_CALLERS, 3),
        "windows": (WINDOW_S, 3),
        "recent": (len(RECENT), RECENT_SLOTS, 1 + len(RECENT_BOUNDS_MS) + 1),
        # (pid, restarts): worker slots, engine slots (one per device), index
        "processes": (MAX_WORKER_SLOTS + MAX_DEVICES + 1, 2),
    }
    for i, spec in enumerate(HISTOGRAMS):
        regions[f"hist{i}"] = (len(spec.label_sets), len(spec.buckets) + 2)  # buckets, +Inf, sum
    layout, offset = {}, 0
    for name, shape in regions.items():
        layout[name] = (offset, shape)
        offset += math.prod(shape)
    layout["_total"] = (offset, ())
    return layout


LAYOUT = _layout()
_FLOATS = LAYOUT["_total"][0]
_NAMES_BYTES = MAX_CALLERS * CALLER_BYTES
SIZE = _FLOATS * 8 + _NAMES_BYTES
_SCALAR = {name: i for i, name in enumerate(SCALARS)}
_GAUGE = {name: i for i, name in enumerate(GAUGES)}
_RECENT = {name: i for i, name in enumerate(RECENT)}
_HIST = {spec.name: i for i, spec in enumerate(HISTOGRAMS)}


def _regions(values: npt.NDArray[np.float64]) -> dict[str, npt.NDArray[np.float64]]:
    out = {}
    for name, (offset, shape) in LAYOUT.items():
        if name != "_total":
            out[name] = values[offset : offset + math.prod(shape)].reshape(shape)
    return out


class Board:
    """This process's board. Writes take a lock (the engine thread and the event loop both
    count); every value is one aligned float64, so a reader never sees half a number."""

    def __init__(self, role: str, directory: Path | None = None, engine: int = 0) -> None:
        """``engine``: which engine of the device list this process runs (role engine)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.path: Path | None = None
        self._fd: int | None = None
        if directory is None:
            self._buffer: mmap.mmap | bytearray = bytearray(SIZE)
        else:
            directory.mkdir(parents=True, exist_ok=True)
            self.path = directory / f"{role}-{os.getpid()}.board"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, SIZE)
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for life: readers see this process alive
            self._fd = fd
            self._buffer = mmap.mmap(fd, SIZE)
        values = np.frombuffer(self._buffer, dtype=np.float64, count=_FLOATS)
        self._r = _regions(values)
        self._names = memoryview(self._buffer)[_FLOATS * 8 :]
        self._callers: dict[str, int] = {}
        self._lock = threading.Lock()
        self._r["header"][:5] = (MAGIC, os.getpid(), ROLES.index(role), time.time(), engine)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with it: the process reads as gone
            self._fd = None

    # -- writing ---------------------------------------------------------------------------

    def put(self, name: str, value: float) -> None:
        """This process's total of a counter (SCALARS), as counted by its owner object."""
        self._r["scalars"][_SCALAR[name]] = value

    def add(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._r["scalars"][_SCALAR[name]] += value

    def gauge(self, name: str, value: float) -> None:
        self._r["gauges"][_GAUGE[name]] = value

    def lookups(
        self, caller: str, hits: int = 0, coalesced: int = 0, misses: int = 0, now: float = 0.0
    ) -> None:
        """Count lookups of ``caller`` and add them to the one-second window slot of ``now``
        (wall clock; 0: the present)."""
        sec = int(now or time.time())
        with self._lock:
            slot = self._callers.get(caller)
            if slot is None:
                slot = self._caller_slot(caller)
            row = self._r["callers"][slot]
            row[0] += hits
            row[1] += coalesced
            row[2] += misses
            window = self._r["windows"][sec % WINDOW_S]
            if window[0] != sec:
                window[:] = (sec, 0, 0)
            window[1] += hits + coalesced
            window[2] += misses

    def _caller_slot(self, caller: str) -> int:
        if len(self._callers) >= MAX_CALLERS - 1 and caller != "other":
            other = self._callers.get("other")
            return self._caller_slot("other") if other is None else other
        slot = len(self._callers)
        raw = caller.encode()[:CALLER_BYTES].ljust(CALLER_BYTES, b"\0")
        self._names[slot * CALLER_BYTES : (slot + 1) * CALLER_BYTES] = raw
        self._callers[caller] = slot
        return slot

    def recent(self, name: str, ms: float, now: float = 0.0) -> None:
        """A duration for the five-minute percentiles of /v1/stats."""
        minute = int((now or time.time()) // 60)
        bucket = bisect_left(_RECENT_BOUNDS, ms)
        with self._lock:
            row = self._r["recent"][_RECENT[name], minute % RECENT_SLOTS]
            if row[0] != minute:
                row[:] = 0.0
                row[0] = minute
            row[1 + bucket] += 1

    def observe(self, histogram: str, labels: tuple[str, ...], value: float) -> None:
        """A Prometheus histogram observation (``labels`` must be one of its label sets)."""
        spec = HISTOGRAMS[_HIST[histogram]]
        try:
            row = spec.label_sets.index(labels)
        except ValueError:
            return  # a label set that no panel asks for (an unknown route)
        bucket = bisect_left(spec.buckets, value)  # first bound >= value
        with self._lock:
            counts = self._r[f"hist{_HIST[histogram]}"][row]
            counts[bucket] += 1
            counts[-1] += value

    def process(self, slot: int, pid: int, restarts: int) -> None:
        """The supervisor's record of a process: worker slots 0.., ``engine_slot(k)``, INDEX."""
        self._r["processes"][slot] = (pid, restarts)


ENGINE_SLOT = MAX_WORKER_SLOTS  # the first engine's; engine k: engine_slot(k)
INDEX_SLOT = MAX_WORKER_SLOTS + MAX_DEVICES


def engine_slot(engine: int) -> int:
    return ENGINE_SLOT + engine


@dataclass(frozen=True)
class BoardView:
    """One board as read: its owner and whether it is alive, and its regions."""

    role: str
    pid: int
    started: float
    engine: int  # which engine of the device list (role engine)
    alive: bool
    regions: dict[str, npt.NDArray[np.float64]]
    callers: list[str]


def _view(buffer: Any, alive: bool) -> BoardView | None:
    values = np.frombuffer(buffer, dtype=np.float64, count=_FLOATS)
    regions = _regions(values)
    header = regions["header"]
    if header[0] != MAGIC:
        return None
    raw = bytes(memoryview(buffer)[_FLOATS * 8 : _FLOATS * 8 + _NAMES_BYTES])
    names = [
        raw[i * CALLER_BYTES : (i + 1) * CALLER_BYTES].rstrip(b"\0").decode("utf-8", "replace")
        for i in range(MAX_CALLERS)
    ]
    role, pid, started, engine = (
        ROLES[int(header[2])],
        int(header[1]),
        float(header[3]),
        int(header[4]),
    )
    return BoardView(role, pid, started, engine, alive, regions, names)


def owner_alive(path: Path) -> bool:
    """Whether the board's owner still holds its lock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # closing drops our shared lock, if we got it
    return False


class Boards:
    """Every board of a server: a directory, or one in-process board."""

    def __init__(self, directory: Path | None = None, own: Board | None = None) -> None:
        if (directory is None) == (own is None):
            raise ValueError("give the boards' directory or the one board")
        self.directory = directory
        self.own = own
        self._dead: dict[str, BoardView] = {}  # a dead board never changes: read it once

    def views(self) -> Iterator[BoardView]:
        if self.own is not None:
            view = _view(self.own._buffer, True)
            assert view is not None
            yield view
            return
        assert self.directory is not None
        for path in sorted(self.directory.glob("*.board")):
            cached = self._dead.get(path.name)
            if cached is not None:
                yield cached
                continue
            alive = owner_alive(path)
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if len(data) != SIZE:
                continue
            view = _view(bytearray(data), alive)
            if view is None:
                continue
            if not alive:
                self._dead[path.name] = view
            yield view

    def read(self, now: float | None = None) -> Totals:
        return Totals.merge(list(self.views()), time.time() if now is None else now)

    def scalar(self, name: str) -> float:
        """One counter of ``SCALARS`` summed over every board, as ``read().scalars[name]``
        gives it, from 16 bytes of each board instead of all of them (a warm-up job's pacing
        asks ten times a second)."""
        if self.own is not None:
            return float(self.own._r["scalars"][_SCALAR[name]])
        assert self.directory is not None
        at = (LAYOUT["scalars"][0] + _SCALAR[name]) * 8
        total = 0.0
        for path in self.directory.glob("*.board"):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:  # its owner went and the supervisor removed it
                continue
            try:
                raw = os.pread(fd, 8, LAYOUT["header"][0] * 8) + os.pread(fd, 8, at)
            finally:
                os.close(fd)
            if len(raw) == 16:  # else not written yet
                magic, value = struct.unpack("=dd", raw)
                total += value if magic == MAGIC else 0.0
        return total


@dataclass
class Totals:
    """Every board added up: what /v1/stats and /metrics show."""

    scalars: dict[str, float]
    gauges: dict[str, float]
    callers: dict[str, tuple[int, int, int]]  # name -> (hits, coalesced, misses)
    windows: dict[str, tuple[int, int]]  # "1m" | "5m" -> (avoided, misses)
    recent: dict[str, npt.NDArray[np.float64]]  # name -> bucket counts of the last 5 min
    histograms: dict[str, npt.NDArray[np.float64]]  # spec name -> (label sets, buckets + 2)
    views: list[BoardView]

    @classmethod
    def merge(cls, views: Sequence[BoardView], now: float) -> Totals:
        scalars = np.zeros(len(SCALARS))
        gauges = np.zeros(len(GAUGES))
        callers: dict[str, list[int]] = {}
        windows = {"1m": [0, 0], "5m": [0, 0]}
        recent = np.zeros((len(RECENT), len(RECENT_BOUNDS_MS) + 1))
        hists = {f"hist{i}": np.zeros(LAYOUT[f"hist{i}"][1]) for i in range(len(HISTOGRAMS))}
        sec, minute = int(now), int(now // 60)
        for view in views:
            r = view.regions
            scalars += r["scalars"]
            if view.alive:
                gauges += r["gauges"]
            for slot, name in enumerate(view.callers):
                if name:
                    total = callers.setdefault(name, [0, 0, 0])
                    for k in range(3):
                        total[k] += int(r["callers"][slot, k])
            w = r["windows"]
            for key, span in (("1m", 60), ("5m", 300)):
                inside = (w[:, 0] > sec - span) & (w[:, 0] <= sec)
                windows[key][0] += int(w[inside, 1].sum())
                windows[key][1] += int(w[inside, 2].sum())
            rec = r["recent"]
            fresh = (rec[:, :, 0] > minute - RECENT_MINUTES) & (rec[:, :, 0] <= minute)
            recent += (rec[:, :, 1:] * fresh[:, :, None]).sum(axis=1)
            for key in hists:
                hists[key] += r[key]
        return cls(
            scalars=dict(zip(SCALARS, scalars.tolist(), strict=True)),
            gauges=dict(zip(GAUGES, gauges.tolist(), strict=True)),
            callers={name: (c[0], c[1], c[2]) for name, c in callers.items()},
            windows={k: (v[0], v[1]) for k, v in windows.items()},
            recent={name: recent[i] for i, name in enumerate(RECENT)},
            histograms={spec.name: hists[f"hist{i}"] for i, spec in enumerate(HISTOGRAMS)},
            views=list(views),
        )

    def percentiles(self, name: str, qs: Sequence[float] = (50, 99)) -> list[float]:
        """Percentiles in ms of a recent histogram (0.0 when empty), each read as the
        geometric middle of its bucket: within 5% of the true value."""
        counts = self.recent[name]
        total = counts.sum()
        if total == 0:
            return [0.0 for _ in qs]
        cumulative = np.cumsum(counts)
        out = []
        for q in qs:
            bucket = int(np.searchsorted(cumulative, total * q / 100.0))
            upper = RECENT_BOUNDS_MS[min(bucket, len(RECENT_BOUNDS_MS) - 1)]
            lower = upper / 2.0 ** (1 / 8) if bucket else 0.0
            out.append(float(math.sqrt(lower * upper) if lower else upper))
        return out

    def per_engine(self, engines: int) -> list[dict[str, float]]:
        """Each engine's counters (SCALARS, a process that died included) and gauges (live
        ones), by its place in the device list; in one process, everything is engine 0's."""
        out = [dict.fromkeys((*SCALARS, *GAUGES), 0.0) for _ in range(engines)]
        views = [v for v in self.views if v.role == "engine" and v.engine < engines]
        if not views and engines == 1:
            return [{**self.scalars, **self.gauges}]
        for view in views:
            counts = out[view.engine]
            for name, value in zip(SCALARS, view.regions["scalars"].tolist(), strict=True):
                counts[name] += value
            if view.alive:
                for name, value in zip(GAUGES, view.regions["gauges"].tolist(), strict=True):
                    counts[name] += value
        return out

    def processes(self, devices: Sequence[str] = ("cpu",)) -> dict[str, Any]:
        """``/v1/stats`` ``processes``: the supervisor's record, each worker's requests;
        ``engine`` is the first engine's, ``engines`` lists one per entry of ``devices``."""
        requests: dict[int, int] = {}
        for view in self.views:
            if view.role == "worker":
                requests[view.pid] = int(view.regions["scalars"][_SCALAR["requests"]])
        supervisor = next((v for v in self.views if v.role == "supervisor" and v.alive), None)
        if supervisor is None:  # one process does everything
            pid = os.getpid()
            return {
                "workers": [{"pid": pid, "requests": requests.get(pid, 0), "restarts": 0}],
                "engine": {"pid": pid, "restarts": 0},
                "engines": [{"device": devices[0], "pid": pid, "restarts": 0}],
                "index": {"pid": pid, "restarts": 0},
            }
        table = supervisor.regions["processes"]
        workers = [
            {"pid": int(pid), "requests": requests.get(int(pid), 0), "restarts": int(restarts)}
            for pid, restarts in table[:MAX_WORKER_SLOTS]
            if pid
        ]

        def one(slot: int) -> dict[str, int]:
            return {"pid": int(table[slot, 0]), "restarts": int(table[slot, 1])}

        return {
            "workers": workers,
            "engine": one(ENGINE_SLOT),
            "engines": [
                {"device": device, **one(engine_slot(k))} for k, device in enumerate(devices)
            ],
            "index": one(INDEX_SLOT),
        }


def clear(directory: Path) -> None:
    """Remove the boards of an earlier server run (the supervisor does at start)."""
    with contextlib.suppress(FileNotFoundError):
        for path in directory.glob("*.board"):
            path.unlink(missing_ok=True)
