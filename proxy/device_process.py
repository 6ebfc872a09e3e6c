"""The engine's device work in a child process of its own: the GPU's threads off the GIL of the
engine process's event loop.

``FLEETCACHE_DEVICE_PROCESS=on``, or ``auto`` (the default) on a CUDA device. On the H200 the
engine process's event loop (its sockets to the workers, the in-flight map, the write-backs)
bounded new texts: busy about 97% of an all-miss run at 0.7 of a core, about 40% of its
samples inside ZeroMQ's sends and receives (which let the GIL go and take it back), while
the batcher's threads padded, pinned, copied and launched each batch in short stretches of
Python on the same GIL (py-spy, docs/BENCHMARKS.md, 2026-12-03 13:12 UTC). Here the model,
the padding of its ids, the pinned buffers and the CUDA graphs live in a device child. A
batch goes to it as soon as the batcher tokenizes it (its texts and their token ids, raw
frames), so the child pads and pins the next batch while the device runs this one; the
batcher's engine thread then waits, without the GIL, for the rows of its batch (one raw
float32 frame). Measured there (13:36-13:39 UTC, tmpfs, in turns with ``off``): 85,446 and
80,307 new texts/s against 72,234 (0.81 of the batcher alone in the same run), a batch's
forward 1.9-2.0 ms against 2.5, the engine process's CPU a new text 13-14 us against 21::

    engine process                                   device child (device_main)
      Batcher tokenizer thread                         create_engine(kind, options),
        DeviceProcessEngine.tokenize -- seq, texts, ids -->  load, warm up
      Batcher engine thread                              its thread: tokenize (pad, pin)
        DeviceProcessEngine.forward  <-- seq, rows | error --  main: forward, postprocess

Tokenization proper stays in the engine process (the ids a worker sent are kept as they are;
other texts are tokenized there with the same tokenizer file, in Rust without the GIL), so
the batcher's token budget sees each text's padded length as before. Answers come in the
order sent; whoever waits files those of other batches by their sequence number (a batch
the batcher dropped after sending it is computed and its answer forgotten).

Each answer carries how the child spent that batch's time (``TIMES``), summed in
``health()`` (``/v1/stats`` ``inference.device_process``): the seconds its device loop waited
with nothing padded (``waiting``; ``starved_batches`` counts the batches that found none
ready), those a padded batch waited for the loop (``queued``), its thread's padding
(``padding``), the forward with its postprocessing (``forward``), a batch's way from the
engine process's send to the child (``transit``) and, of a starved loop's wait, the part
before the engine process had sent the batch (``late``). A loop starved while the device is
idle says the engine process sends batches late; batches queued while it is idle say the
child's own loop is late. The engine process times its side of the hand-over (``HAND_OFF``):
``pickup``, an answer sent -> the batcher's engine thread holding it (that thread's wake, and
its wait for the GIL); ``forming``, the engine thread starting on a batch -> the batcher's
tokenizer thread starting on one ahead of it (the event loop's turn that takes it from the
queue, then the tokenizer thread's wait); ``tokenizing``, that thread's tokenize -> the
batch sent. Together they say which step leaves a starved child without its next batch.

A child that dies (a crashed driver, the OOM killer, kill -9) fails the batch it held with
``EngineUnavailableError``; another child is started at once in the background and, until it
is ready, every batch fails the same way at once: ``FallbackEngine`` trips to its fallback
(or misses answer 503) and its probes bring the primary back when the new child answers. A
batch the child does not answer within ``timeout_s`` kills it (a hung device) the same way.
The child dies with the engine process (PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import secrets
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, NamedTuple

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
from engines.batcher import budget_groups, name_thread
from engines.devices import runs_on_cuda
from engines.registry import create_engine
from engines.tokenization import FastTokenizer, IntArray, TokenizedTexts, bucket_lengths
from proxy.cores import pin_threads
from proxy.gpu_health import visible_gpus

log = logging.getLogger("fleetcache.engine")

START_TIMEOUT_S = 900.0  # loading a model and capturing its CUDA graphs
BATCH_TIMEOUT_S = 120.0  # a batch unanswered this long: the device hangs, the child is killed
_POLL_MS = 500  # how often a wait checks that the child is alive
_KEPT_ANSWERS = 16  # answers filed for batches nobody waits for yet (the batcher sends 2 ahead)
# What an answer's "t" holds, in order (see the module docstring): summed by the engine process.
TIMES = ("starved_batches", "waiting", "queued", "padding", "forward", "transit", "late")
HAND_OFF = ("pickup", "forming", "tokenizing")  # the engine process's side, timed there
_SENT = struct.Struct("<qd")  # a batch's first frame: its sequence number, when it was sent
_ERRORS: dict[str, type[EngineError]] = {
    "BatchError": BatchError,
    "EngineUnavailableError": EngineUnavailableError,
}


def use_device_process(
    setting: str, device: str, engine: str, gpus: Callable[[], int] = visible_gpus
) -> bool:
    """``FLEETCACHE_DEVICE_PROCESS``: ``on`` | ``off`` | ``auto``: on for a CUDA device, as
    ``auto`` is for an engine that runs on CUDA where a GPU is visible (one GPU: the device
    stays ``auto`` and the engine picks it, ``proxy.supervisor.engine_devices``)."""
    if setting != "auto":
        return setting == "on"
    if device == "auto":
        return runs_on_cuda(engine) and gpus() > 0
    return device.startswith("cuda")


class _Child(NamedTuple):
    process: BaseProcess
    to: zmq.Socket[bytes]  # batches to the child (senders, under _send_lock)
    back: zmq.Socket[bytes]  # its answers (readers, under _read_lock)
    generation: int  # its start's count: a ticket of an earlier child is never answered


class DeviceProcessEngine(Engine):
    """``create_engine(kind, **options)`` run by a device child (see the module docstring).
    ``load`` starts the child, which loads and warms the engine; ``close`` stops it."""

    def __init__(
        self,
        kind: str,
        options: dict[str, Any],
        *,
        log_level: str = "info",
        max_batch_tokens: int | None = None,
        timeout_s: float = BATCH_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
        cpus: Sequence[int] = (),
    ) -> None:
        """``cpus``: where each child runs (empty: where this process does)."""
        self.kind, self.options = kind, dict(options)
        self.cpus = tuple(cpus)
        self.info = create_engine(kind, **options).info  # not loaded: its identity only
        self.log_level = log_level
        self.max_batch_tokens = max_batch_tokens  # the batcher's: it cuts a batch over it
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.starts = 0  # children started (a restart after a death counts one more)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._child: _Child | None = None
        self._fast: FastTokenizer | None = None
        self._seq_buckets: tuple[int, ...] | None = None
        # Lock order: _read_lock, then _send_lock. Batches are sent by whoever tokenizes them
        # (the batcher's tokenizer thread, ahead of the forward); one reader at a time files
        # every answer that comes by its ticket, for the thread that waits for it.
        self._send_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._sent = 0
        self._answers: dict[tuple[int, int], list[zmq.Frame]] = {}
        # TIMES summed over the answered batches; HAND_OFF over the batches it timed
        self._times = dict.fromkeys(TIMES + HAND_OFF, 0.0)
        self._timed = 0  # batches answered with rows
        self._times_lock = threading.Lock()
        self._forward_at = 0.0  # when the engine thread last started on a batch (forming)
        self._forward_thread: int | None = None  # that thread
        self._forming = False  # no batch ahead was tokenized since then
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
        if self._child is None:
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
            if self._child is None:
                try:
                    self._install(*self._start())
                except Exception as exc:  # the next batch or probe asks again
                    self._down = f"the device process did not start: {type(exc).__name__}: {exc}"
                    log.error("%s", self._down)
            self._started.set()

    def _start(self) -> tuple[BaseProcess, zmq.Socket[bytes], zmq.Socket[bytes], dict[str, Any]]:
        """A child and the sockets to it, once it has loaded and warmed its engine (what it
        says then, its engine's identity among it)."""
        name = f"ipc://@fleetcache-device-{os.getpid()}-{secrets.token_hex(4)}"
        to, back = self._context.socket(zmq.PAIR), self._context.socket(zmq.PAIR)
        for socket, suffix in ((to, "-to"), (back, "-back")):
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(name + suffix)
        context = multiprocessing.get_context("spawn")
        args = (self.kind, self.options, name, self.log_level, self.cpus)
        process = context.Process(
            target=device_main, args=args, name="fleetcache-device", daemon=True
        )
        process.start()
        self.starts += 1
        try:
            frames = _receive(back, process, self.start_timeout_s)
            ready = msgspec.msgpack.decode(frames[0].buffer)
            if "error" in ready:
                raise _ERRORS.get(ready["type"], EngineUnavailableError)(ready["error"])
        except BaseException:
            _stop(process, to, back)
            raise
        return process, to, back, ready

    def _install(
        self,
        process: BaseProcess,
        to: zmq.Socket[bytes],
        back: zmq.Socket[bytes],
        ready: dict[str, Any],
    ) -> None:
        with self._read_lock, self._send_lock:
            if self._closed:
                _stop(process, to, back)
                return
            self.info = EngineInfo(**ready["info"])
            if ready["tokenizer"] is not None and self._fast is None:
                path, max_seq_length = ready["tokenizer"]
                self._fast = FastTokenizer(Path(path), max_seq_length)
            buckets = ready["seq_buckets"]
            self._seq_buckets = tuple(buckets) if buckets else None
            self._child, self._down = _Child(process, to, back, self.starts), None
        log.info("device process %d serving %s on %s", process.pid, self.kind, self.info.device)

    def _lost(self, reason: str) -> None:
        """Under ``_read_lock``: the child died or hangs; stopped, and the keeper asked for
        another (batches fail at once meanwhile, those sent to this one included)."""
        with self._send_lock:
            child, self._child = self._child, None
            self._down = reason
            self._answers.clear()
        if child is not None:
            _stop(child.process, child.to, child.back)
            log.warning("%s; starting another device process", reason)
        self._wanted.set()

    def close(self) -> None:
        with self._read_lock, self._send_lock:
            self._closed = True
            child, self._child = self._child, None
        self._wanted.set()  # the keeper ends
        if child is not None:
            _stop(child.process, child.to, child.back)

    @property
    def pid(self) -> int | None:
        child = self._child
        return None if child is None else child.process.pid

    # -- the engine interface ----------------------------------------------------------------

    def tokenizer(self) -> FastTokenizer | None:
        return self._fast

    def padded_lengths(self, texts: Sequence[str]) -> IntArray | None:
        """Known for texts with this tokenizer's ids, and for any text without a tokenizer
        (each counts ``max_seq_length``: the child tokenizes it)."""
        if self._fast is None:
            return np.full(len(texts), self.info.max_seq_length, np.int64)
        return self._padded(np.diff(texts.bounds)) if isinstance(texts, TokenizedTexts) else None

    def _padded(self, counts: IntArray) -> IntArray:
        buckets = self._seq_buckets
        return counts if buckets is None else bucket_lengths(counts, buckets)

    def tokenize(self, texts: Sequence[str]) -> Batch:
        """The texts with their ids (a worker's kept as sent) and each text's padded length
        for the token budget (without a tokenizer: the texts alone, the child tokenizes),
        sent to the child at once, so that it pads them while the device runs the batch
        before; not a batch over ``max_batch_tokens``, which the batcher runs in groups."""
        began = time.perf_counter()
        if self._forming and threading.get_ident() != self._forward_thread:  # a batch ahead
            self._forming = False
            self._note("forming", began - self._forward_at)
        if self._fast is None:
            batch = Batch(len(texts), 0, {"texts": texts})
            padded = np.full(len(texts), self.info.max_seq_length, np.int64)
        else:
            if not isinstance(texts, TokenizedTexts):
                texts = TokenizedTexts.of(texts, self._fast.ids(texts, cached=False))
            counts = np.diff(texts.bounds)
            padded = self._padded(counts)
            batch = Batch(len(texts), int(counts.sum()), {"texts": texts}, padded)
        if len(budget_groups(padded, self.max_batch_tokens)) == 1:
            with contextlib.suppress(EngineUnavailableError):  # forward tries again, says so
                batch.data["ticket"] = self._send(texts)
                self._note("tokenizing", time.perf_counter() - began)
        return batch

    def forward(self, batch: Batch) -> Vectors:
        self._forward_at, self._forward_thread = time.perf_counter(), threading.get_ident()
        self._forming = True
        ticket = batch.data.get("ticket")
        if ticket is None:
            try:
                ticket = self._send(batch.data["texts"])
            except EngineUnavailableError:
                with self._read_lock:
                    child = self._child
                    if child is not None and child.process.exitcode is not None:
                        self._lost(f"the device process exited ({child.process.exitcode})")
                raise
        frames = self._answer(ticket)
        header = msgspec.msgpack.decode(frames[0].buffer)
        if "error" in header:
            raise _ERRORS.get(header["type"], EngineError)(header["error"])
        pickup = time.perf_counter() - header["d"]  # one clock (CLOCK_MONOTONIC) for both
        with self._times_lock:
            self._timed += 1
            for name, value in zip(TIMES, header["t"], strict=True):
                self._times[name] += value
            self._times["pickup"] += pickup
        return np.frombuffer(frames[1].buffer, "<f4").reshape(header["shape"])

    def _note(self, name: str, seconds: float) -> None:
        with self._times_lock:
            self._times[name] += seconds

    def postprocess(self, output: Any, batch: Batch) -> Vectors:
        return output  # the child's engine postprocessed them

    def health(self) -> dict[str, Any]:
        child = self._child
        alive = child is not None and child.process.exitcode is None
        with self._times_lock:
            starved, *seconds = self._times.values()
            timed = {"batches": self._timed, "starved_batches": int(starved)}
        return {
            "ok": alive,
            "pid": self.pid,
            "starts": self.starts,
            "reason": self._down,
            **timed,
            "seconds": dict(zip(TIMES[1:] + HAND_OFF, seconds, strict=True)),
        }

    def _send(self, texts: Sequence[str]) -> tuple[int, int]:
        """Send a batch to the child; its ticket. ``EngineUnavailableError`` at once while
        no child serves (the keeper is asked for one)."""
        frames: list[Any] = [b"", msgspec.msgpack.encode(list(texts))]
        if isinstance(texts, TokenizedTexts):
            bounds = texts.bounds
            flat = texts.flat[bounds[0] : bounds[-1]]
            frames += [np.ascontiguousarray(flat, "<i4"), np.asarray(bounds - bounds[0], "<i8")]
        with self._send_lock:
            if self._closed:
                raise EngineError("the engine is closed")
            child = self._child
            if child is None or child.process.exitcode is not None:
                self._wanted.set()  # the keeper starts one, unless it is starting one now
                raise EngineUnavailableError(self._down or "the device process exited")
            self._sent += 1
            frames[0] = _SENT.pack(self._sent, time.perf_counter())
            child.to.send_multipart(frames)
            return child.generation, self._sent

    def _answer(self, ticket: tuple[int, int]) -> list[zmq.Frame]:
        """The child's answer to the batch of ``ticket``, filing those of others that come
        first; ``EngineUnavailableError`` when the child exits or is silent for
        ``timeout_s`` (it is replaced) or was replaced since."""
        waited = 0.0
        with self._read_lock:
            while (frames := self._answers.pop(ticket, None)) is None:
                child = self._child
                if child is None or child.generation != ticket[0]:
                    raise EngineUnavailableError(self._down or "the device process was replaced")
                if child.back.poll(_POLL_MS):
                    frames = child.back.recv_multipart(copy=False)
                    seq = int.from_bytes(frames[0].bytes, "little")
                    self._answers[(child.generation, seq)] = frames[1:]
                    while len(self._answers) > _KEPT_ANSWERS:  # never asked for (dropped)
                        del self._answers[next(iter(self._answers))]
                    continue
                waited += _POLL_MS / 1000
                if child.process.exitcode is not None:
                    self._lost(f"the device process exited ({child.process.exitcode})")
                elif waited >= self.timeout_s:
                    self._lost(f"the device process did not answer in {self.timeout_s:g} s")
        return frames


def _receive(socket: zmq.Socket[bytes], process: BaseProcess, timeout_s: float) -> list[zmq.Frame]:
    """The child's first message; ``EngineUnavailableError`` when it exits or is silent for
    ``timeout_s``."""
    waited = 0.0
    while not socket.poll(_POLL_MS):
        waited += _POLL_MS / 1000
        if process.exitcode is not None:
            raise EngineUnavailableError(f"the device process exited ({process.exitcode})")
        if waited >= timeout_s:
            raise EngineUnavailableError(f"the device process did not answer in {timeout_s:g} s")
    return socket.recv_multipart(copy=False)


def _stop(process: BaseProcess, *sockets: zmq.Socket[bytes]) -> None:
    """Kill a child and close the sockets to it."""
    if process.exitcode is None:
        process.kill()
    process.join(10.0)
    for socket in sockets:
        socket.close()


# -- the child ---------------------------------------------------------------------------------


def device_main(
    kind: str, options: dict[str, Any], name: str, log_level: str, cpus: Sequence[int] = ()
) -> None:
    """The device child: load and warm the engine, say so, then run batches in the order
    they come until the engine process goes (PDEATHSIG) or stops it. A thread receives and
    tokenizes (pads, pins) each batch while this one runs the one before on the device."""
    from proxy.processes import become_child

    become_child("device", log_level)  # loads on every CPU of its parent; then on ``cpus``
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    incoming, back = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    for socket, suffix in ((incoming, "-to"), (back, "-back")):
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(name + suffix)
    try:
        engine = create_engine(kind, **options)
        engine.load()
        engine.warmup()
    except Exception as exc:
        back.send(msgspec.msgpack.encode(_error(exc)))
        raise
    pin_threads(cpus)  # its threads so far (the engine's among them), and those it starts
    fast = engine.tokenizer()
    ready = {
        "info": asdict(engine.info),
        "tokenizer": None if fast is None else [str(fast.path.parent), fast.max_seq_length],
        "seq_buckets": list(getattr(engine, "seq_buckets", None) or ()) or None,
    }
    # (seq, the padded batch or its failure, when it was sent, when its frames came, when it
    # was padded)
    tokenized: queue.SimpleQueue[tuple[bytes, Batch | Exception, float, float, float]]
    tokenized = queue.SimpleQueue()
    # when the loop was last free: a batch padded after it found the loop starved (the first
    # always: no batch is sent before ``ready``, though the thread may pad it before the loop's
    # first turn)
    idle = time.perf_counter()
    back.send(msgspec.msgpack.encode(ready))

    def receive() -> None:
        name_thread("device-pad")
        while True:
            frames = incoming.recv_multipart(copy=False)
            came = time.perf_counter()
            seq, sent = _SENT.unpack(frames[0].bytes)
            texts: list[str] = msgspec.msgpack.decode(frames[1].buffer)
            if len(frames) == 4:
                flat = np.frombuffer(frames[2].buffer, "<i4")
                texts = TokenizedTexts(texts, flat, np.frombuffer(frames[3].buffer, "<i8"))
            padded: Batch | Exception
            try:
                padded = engine.tokenize(texts)
            except Exception as exc:  # the batch's own failure: the engine process decides
                padded = exc
            tokenized.put((seq.to_bytes(8, "little"), padded, sent, came, time.perf_counter()))

    threading.Thread(target=receive, name="device-tokenizer", daemon=True).start()
    while True:
        seq, batch, sent, came, padded = tokenized.get()
        start = time.perf_counter()
        try:
            if isinstance(batch, Exception):
                raise batch
            rows = np.ascontiguousarray(engine.postprocess(engine.forward(batch), batch), "<f4")
        except Exception as exc:
            back.send_multipart([seq, msgspec.msgpack.encode(_error(exc))])
            idle = time.perf_counter()
            continue
        # TIMES: a starved loop's wait counts from its last answer (from ``ready``: the first)
        starved = padded > idle
        late = min(start - idle, max(0.0, sent - idle)) if starved else 0.0
        forward = time.perf_counter() - start
        times = (starved, start - idle, start - padded, padded - came, forward, came - sent, late)
        header = msgspec.msgpack.encode({"shape": rows.shape, "t": times, "d": time.perf_counter()})
        back.send_multipart([seq, header, rows.data], copy=False)
        idle = time.perf_counter()


def _error(exc: Exception) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__}
