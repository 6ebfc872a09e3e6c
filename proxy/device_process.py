"""The engine's device work in a child process of its own: the GPU's threads off the GIL of the
engine process's event loop.

``FLEETCACHE_DEVICE_PROCESS=on``, or ``auto`` (the default) on a CUDA device. The engine
process's loop (its sockets to the workers, the in-flight map, the write-backs) was the
serving path's wall on the H200: busy 97% of an all-miss run, yet 0.7 of a core, the rest
waiting for the GIL it shares with the batcher's threads, which pad, pin, copy and launch
each batch in short stretches of Python between GIL-free calls (docs/BENCHMARKS.md,
2026-12-03 13:12 UTC: about 44% of the loop's samples sat in ZeroMQ's send and receive,
taking the GIL back). Here the model, its tokenizer's padding, the pinned buffers and the
CUDA graphs live in a device child; the batcher's engine thread hands it a batch's texts
with their token ids (three frames) and waits, without the GIL, for the rows (one raw
float32 frame)::

    engine process                                   device child (device_main)
      Batcher engine thread                            create_engine(kind, options),
        DeviceProcessEngine.forward -- texts, ids -->    load, warm up; per batch:
                                    <-- rows or error --  tokenize (pad), forward, postprocess

``tokenize`` stays in the engine process (the ids a worker sent are kept as they are; other
texts are tokenized there with the same tokenizer file, in Rust without the GIL), so the
batcher's token budget sees each text's padded length as before.

A child that dies (a crashed driver, the OOM killer, kill -9) fails the batch it held with
``EngineUnavailableError``; another child is started at once in the background and, until it
is ready, every batch fails the same way at once: ``FallbackEngine`` trips to its fallback
(or misses answer 503) and its probes bring the primary back when the new child answers. A
batch the child does not answer within ``timeout_s`` kills it (a hung device) the same way.
The child dies with the engine process (PDEATHSIG).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import secrets
import threading
from collections.abc import Sequence
from dataclasses import asdict
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from engines.base import (
    Batch,
    BatchError,
    Engine,
    EngineError,
    EngineInfo,
    EngineUnavailableError,
    Vectors,
)
from engines.registry import create_engine
from engines.tokenization import FastTokenizer, TokenizedTexts, bucket_lengths

log = logging.getLogger("fleetcache.engine")

START_TIMEOUT_S = 900.0  # loading a model and capturing its CUDA graphs
BATCH_TIMEOUT_S = 120.0  # a batch unanswered this long: the device hangs, the child is killed
_POLL_MS = 500  # how often a wait checks that the child is alive
_ERRORS: dict[str, type[EngineError]] = {
    "BatchError": BatchError,
    "EngineUnavailableError": EngineUnavailableError,
}


def use_device_process(setting: str, device: str) -> bool:
    """``FLEETCACHE_DEVICE_PROCESS``: ``on`` | ``off`` | ``auto`` (on for a CUDA device)."""
    return setting == "on" or (setting == "auto" and device.startswith("cuda"))


class DeviceProcessEngine(Engine):
    """``create_engine(kind, **options)`` run by a device child (see the module docstring).
    ``load`` starts the child, which loads and warms the engine; ``close`` stops it."""

    def __init__(
        self,
        kind: str,
        options: dict[str, Any],
        *,
        log_level: str = "info",
        timeout_s: float = BATCH_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.kind, self.options = kind, dict(options)
        self.info = create_engine(kind, **options).info  # not loaded: its identity only
        self.log_level = log_level
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.starts = 0  # children started (a restart after a death counts one more)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._process: BaseProcess | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._fast: FastTokenizer | None = None
        self._seq_buckets: tuple[int, ...] | None = None
        self._lock = threading.Lock()  # one batch at a time on the socket (engine thread, probes)
        self._keeper: threading.Thread | None = None
        self._wanted = threading.Event()  # the keeper should start a child
        self._started = threading.Event()  # the keeper's last attempt is over
        self._down: str | None = None  # why no child serves now (None: one does)
        self._closed = False

    # -- the child's life ----------------------------------------------------------------------

    def load(self) -> None:
        """Start the child (through the keeper thread) and wait until it serves."""
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, name="device-keeper", daemon=True)
            self._keeper.start()
        self._started.clear()
        self._wanted.set()
        self._started.wait()
        if self._socket is None:
            raise EngineUnavailableError(self._down or "the device process did not start")

    def warmup(self) -> None:
        """Nothing: the child warms its engine before it answers ``load``."""

    def _keep(self) -> None:
        """The keeper thread starts every child: a child is sent SIGTERM when the thread
        that started it ends (PDEATHSIG), so that thread lives as long as this engine."""
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._closed:
                return
            if self._socket is None:
                try:
                    self._install(*self._start())
                except Exception as exc:  # the next batch or probe asks again (_live)
                    with self._lock:
                        self._down = f"the device process did not start: {exc}"
                    log.error("%s", self._down)
            self._started.set()

    def _start(self) -> tuple[BaseProcess, zmq.Socket[bytes], dict[str, Any]]:
        """A child and the socket to it, once it has loaded and warmed its engine (what it
        says then, its engine's identity among it)."""
        address = f"ipc://@fleetcache-device-{os.getpid()}-{secrets.token_hex(4)}"
        socket = self._context.socket(zmq.PAIR)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(address)
        context = multiprocessing.get_context("spawn")
        args = (self.kind, self.options, address, self.log_level)
        process = context.Process(
            target=device_main, args=args, name="fleetcache-device", daemon=True
        )
        process.start()
        self.starts += 1
        try:
            frames = _receive(socket, process, self.start_timeout_s)
            ready = msgspec.msgpack.decode(frames[0].buffer)
            if "error" in ready:
                raise _ERRORS.get(ready["type"], EngineUnavailableError)(ready["error"])
        except BaseException:
            _stop(process)
            socket.close()
            raise
        return process, socket, ready

    def _install(
        self, process: BaseProcess, socket: zmq.Socket[bytes], ready: dict[str, Any]
    ) -> None:
        with self._lock:
            if self._closed:
                _stop(process)
                socket.close()
                return
            self.info = EngineInfo(**ready["info"])
            if ready["tokenizer"] is not None and self._fast is None:
                path, max_seq_length = ready["tokenizer"]
                self._fast = FastTokenizer(Path(path), max_seq_length)
            buckets = ready["seq_buckets"]
            self._seq_buckets = tuple(buckets) if buckets else None
            self._process, self._socket, self._down = process, socket, None
        log.info("device process %d serving %s on %s", process.pid, self.kind, self.info.device)

    def _lost(self, reason: str) -> None:
        """Under ``_lock``: the child died or hangs; stopped, and the keeper asked for
        another (batches fail at once meanwhile)."""
        process, socket = self._process, self._socket
        self._process = self._socket = None
        self._down = reason
        if process is not None:
            _stop(process)
        if socket is not None:
            socket.close()
        log.warning("%s; starting another device process", reason)
        self._wanted.set()

    def _live(self) -> tuple[BaseProcess, zmq.Socket[bytes]]:
        """Under ``_lock``: the live child, or ``EngineUnavailableError`` at once (another
        on its way)."""
        if self._closed:
            raise EngineError("the engine is closed")
        if self._process is not None and self._process.exitcode is not None:
            self._lost(f"the device process exited ({self._process.exitcode})")
        if self._process is None or self._socket is None:
            self._wanted.set()  # the keeper starts one, unless it is starting one now
            raise EngineUnavailableError(self._down or "the device process is starting")
        return self._process, self._socket

    def close(self) -> None:
        with self._lock:
            self._closed = True
            process, socket = self._process, self._socket
            self._process = self._socket = None
        self._wanted.set()  # the keeper ends
        if process is not None:
            _stop(process)
        if socket is not None:
            socket.close()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # -- the engine interface ----------------------------------------------------------------

    def tokenizer(self) -> FastTokenizer | None:
        return self._fast

    def tokenize(self, texts: Sequence[str]) -> Batch:
        """The texts with their ids (a worker's kept as sent), each text's padded length for
        the token budget; without a tokenizer, the texts alone (the child tokenizes)."""
        if self._fast is None:
            return Batch(len(texts), 0, {"texts": texts})
        if not isinstance(texts, TokenizedTexts):
            texts = TokenizedTexts.of(texts, self._fast.ids(texts, cached=False))
        counts = np.diff(texts.bounds)
        padded = counts if self._seq_buckets is None else bucket_lengths(counts, self._seq_buckets)
        return Batch(len(texts), int(counts.sum()), {"texts": texts}, padded)

    def forward(self, batch: Batch) -> Vectors:
        texts = batch.data["texts"]
        frames: list[Any] = [msgspec.msgpack.encode(list(texts))]
        if isinstance(texts, TokenizedTexts):
            bounds = texts.bounds
            flat = texts.flat[bounds[0] : bounds[-1]]
            frames += [np.ascontiguousarray(flat, "<i4"), np.asarray(bounds - bounds[0], "<i8")]
        with self._lock:
            process, socket = self._live()
            socket.send_multipart(frames)
            try:
                reply = _receive(socket, process, self.timeout_s)
            except EngineUnavailableError as exc:
                self._lost(str(exc))
                raise
        header = msgspec.msgpack.decode(reply[0].buffer)
        if "error" in header:
            raise _ERRORS.get(header["type"], EngineError)(header["error"])
        return np.frombuffer(reply[1].buffer, "<f4").reshape(header["shape"])

    def postprocess(self, output: Any, batch: Batch) -> Vectors:
        return output  # the child's engine postprocessed them

    def health(self) -> dict[str, Any]:
        alive = self._process is not None and self._process.exitcode is None
        return {"ok": alive, "pid": self.pid, "starts": self.starts, "reason": self._down}


def _receive(socket: zmq.Socket[bytes], process: BaseProcess, timeout_s: float) -> list[zmq.Frame]:
    """The child's next message; ``EngineUnavailableError`` when it exits or is silent for
    ``timeout_s`` (the GIL let go while waiting)."""
    waited = 0.0
    while not socket.poll(_POLL_MS):
        waited += _POLL_MS / 1000
        if process.exitcode is not None:
            raise EngineUnavailableError(f"the device process exited ({process.exitcode})")
        if waited >= timeout_s:
            raise EngineUnavailableError(f"the device process did not answer in {timeout_s:g} s")
    return socket.recv_multipart(copy=False)


def _stop(process: BaseProcess) -> None:
    if process.exitcode is None:
        process.kill()
    process.join(10.0)


# -- the child ---------------------------------------------------------------------------------


def device_main(kind: str, options: dict[str, Any], address: str, log_level: str) -> None:
    """The device child: load and warm the engine, say so, then answer batches until the
    engine process goes (PDEATHSIG) or stops it."""
    from proxy.processes import become_child

    become_child("device", log_level)
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        engine = create_engine(kind, **options)
        engine.load()
        engine.warmup()
    except Exception as exc:
        socket.send(msgspec.msgpack.encode(_error(exc)))
        raise
    fast = engine.tokenizer()
    socket.send(
        msgspec.msgpack.encode(
            {
                "info": asdict(engine.info),
                "tokenizer": None if fast is None else [str(fast.path.parent), fast.max_seq_length],
                "seq_buckets": list(getattr(engine, "seq_buckets", None) or ()) or None,
            }
        )
    )
    while True:
        frames = socket.recv_multipart(copy=False)
        texts: list[str] = msgspec.msgpack.decode(frames[0].buffer)
        if len(frames) == 3:
            flat = np.frombuffer(frames[1].buffer, "<i4")
            texts = TokenizedTexts(texts, flat, np.frombuffer(frames[2].buffer, "<i8"))
        try:
            rows = np.ascontiguousarray(engine.embed(texts), np.float32)
        except Exception as exc:  # the batch's own failure: the engine process decides
            socket.send(msgspec.msgpack.encode(_error(exc)))
            continue
        socket.send_multipart(
            [msgspec.msgpack.encode({"shape": rows.shape}), rows.data], copy=False
        )


def _error(exc: Exception) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__}
