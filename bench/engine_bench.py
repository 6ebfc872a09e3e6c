"""The engine process alone under many workers' new texts: what its event loop costs per text.

On the H200 new texts are bounded by the engine process's event loop (docs/BENCHMARKS.md: 33 us
of its CPU per text, 96% busy under 8 workers). ``serve_bench`` measures that inside the whole
server, where on a small machine the workers and wrk take the same cores and the figures swing
by 20% from run to run. Here only the engine process runs beside its clients:

- the engine process is ``proxy.processes.engine_main`` of a checkout (this one, or ``--before
  DIR`` too, run after one another in each round): the real ``EngineHost`` behind its
  ``RpcServer``, writing computed rows back to LMDB (``--store``), with the fake engine made
  free of cost (rows of a constant: a device's share is not measured here) and tokenizing
  with the packaged model's tokenizer, so that clients send token ids as workers do to the
  torch engine;
- ``--clients`` processes, each a ``RemoteEngine`` over an ``RpcClient`` as an HTTP worker
  holds one, keep ``--concurrency`` calls of ``--texts`` (32) new texts in flight (dispatch,
  not durable), each with the texts' store keys, as a worker sends those it hashed for its
  lookup.

Prints per checkout: texts/s, and the engine process's CPU per text (its main thread, the
loop; and the whole process), read from ``/proc`` over each run; medians of ``--runs``
rounds, the range beside. ``--pin`` puts the engine process on the last core and the clients
on the others.

    .venv/bin/python -m bench.engine_bench                          # this checkout
    .venv/bin/python -m bench.engine_bench --before .before2        # A/B, another checkout

Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import multiprocessing
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def serve(run_dir: str, store: str, writer: str = "thread", model: str | None = None) -> None:
    """The engine process (``--serve``): ``engine_main`` of whichever checkout is first on
    PYTHONPATH, its fake engine free of cost and tokenizing like the torch engine (with
    ``model``'s tokenizer, default the packaged model's), and saying the padded lengths of
    the ids it is sent in its buckets as the device child's engine does."""
    import numpy as np

    from engines.fake import FakeEngine
    from engines.tokenization import (
        DEFAULT_SEQ_BUCKETS,
        FastTokenizer,
        TokenizedTexts,
        bucket_lengths,
    )
    from engines.torch_engine import default_model_path
    from proxy.processes import ChildSpec, engine_main

    tokenizer = FastTokenizer(Path(model) if model else default_model_path(), 128)

    def forward(self: FakeEngine, batch: Any) -> Any:
        return np.full((batch.size, self.dim), self.dim**-0.5, np.float32)

    def padded_lengths(self: FakeEngine, texts: Any) -> Any:  # as the device child's engine
        if not isinstance(texts, TokenizedTexts):
            return None
        return bucket_lengths(np.diff(texts.bounds), DEFAULT_SEQ_BUCKETS)

    FakeEngine.forward = forward  # type: ignore[method-assign]
    FakeEngine.tokenizer = lambda self: tokenizer  # type: ignore[method-assign]
    FakeEngine.padded_lengths = padded_lengths  # type: ignore[method-assign]
    settings: dict[str, Any] = {"engine": "fake", "store": store, "data_dir": f"{run_dir}/data"}
    settings["lmdb_writer"] = writer
    settings |= {"device": "cpu", "max_batch_size": 256, "gpu_health_interval_s": 0}
    engine_main(ChildSpec(settings, run_dir, "warning", ("cpu",)))


def client(
    run_dir: str,
    concurrency: int,
    seconds: float,
    tag: str,
    out: Any,
    pin: bool = False,
    size: int = 32,
    code: str = str(REPO),
) -> None:
    """One worker's engine calls: ``concurrency`` loops of ``size`` new texts until
    ``seconds``, through the ``RemoteEngine`` of ``code`` (the engine's own checkout: the
    two speak its wire format)."""
    sys.path.insert(0, code)
    if pin:
        os.sched_setaffinity(0, set(range(max(1, (os.cpu_count() or 2) - 1))))
    from cache.stores import MemoryByteStore
    from cache.writer import VectorWriter
    from proxy.engine_host import RemoteEngine
    from proxy.ipc import RpcClient, address
    from proxy.processes import read_engine_info

    async def run() -> int:
        rpc = await RpcClient(address(run_dir, "engine"), role="worker").start()
        if not await rpc.wait_up(30):
            raise SystemExit("the engine process is not answering")
        remote = RemoteEngine(rpc, read_engine_info(Path(run_dir)))
        if not remote.facts().get("tokenizer"):
            raise SystemExit("the engine names no tokenizer: the clients would send no ids")
        # the store keys a worker hashed for its lookup go with its misses (an engine that
        # does not read them hashes the texts again)
        key = VectorWriter(MemoryByteStore(0), namespace=remote.facts()["namespace"]).key
        sent = 0
        until = time.monotonic() + seconds

        async def loop(k: int) -> None:
            nonlocal sent
            n = 0
            while time.monotonic() < until:
                n += 1
                texts = [
                    f"driver {tag}{os.getpid()}-{k}-{n}-{j} van electric capacity {j * 40} kg "
                    f"zone north shift morning rating 4.{j % 10}"
                    for j in range(size)
                ]
                await remote.embed(
                    texts,
                    lane="dispatch",
                    caller="dispatch",
                    ttl_s={},
                    durable=False,
                    keys=[key(t) for t in texts],
                )
                sent += size

        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        await rpc.close()
        return sent

    out.put(asyncio.run(run()))


def cpu_ticks(pid: int) -> tuple[int, int]:
    """utime + stime (clock ticks) of the process's main thread and of the whole process."""

    def read(path: str) -> int:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    return read(f"/proc/{pid}/task/{pid}/stat"), read(f"/proc/{pid}/stat")


def round_of(code: Path, args: argparse.Namespace, tag: str) -> dict[str, float]:
    """Start the engine process of ``code``, warm it, load it for ``--duration`` seconds."""
    run_dir = Path(tempfile.mkdtemp(prefix="fleetcache-engine-bench-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETCACHE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, __file__, "--serve", str(run_dir), "--store", args.store]
    command += ["--writer", args.writer]
    command += ["--model", str(Path(args.model).resolve())] if args.model else []
    if args.pin:  # the engine process alone on the last core, the clients on the others
        command = ["taskset", "-c", str((os.cpu_count() or 2) - 1), *command]
    engine = subprocess.Popen(command, cwd=code, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "engine.sock").exists():
            if engine.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the engine process of {code} did not start")
            time.sleep(0.1)
        context = multiprocessing.get_context("spawn")
        results = context.Queue()

        def load(seconds: float, label: str) -> int:
            clients = [
                context.Process(
                    target=client,
                    args=(
                        str(run_dir),
                        args.concurrency,
                        seconds,
                        f"{label}{i}-",
                        results,
                        args.pin,
                        args.texts,
                        str(code),
                    ),
                )
                for i in range(args.clients)
            ]
            for process in clients:
                process.start()
            sent = sum(results.get() for _ in clients)
            for process in clients:
                process.join()
            return sent

        load(2.0, f"{tag}w")  # warm: imports, first batches, LMDB's first pages
        pid = engine.pid  # engine_main runs in the process started here
        before, started = cpu_ticks(pid), time.monotonic()
        sent = load(args.duration, tag)
        elapsed, after = time.monotonic() - started, cpu_ticks(pid)
        hz = os.sysconf("SC_CLK_TCK")
        return {
            "texts_s": sent / elapsed,
            "loop_us": (after[0] - before[0]) / hz * 1e6 / sent,
            "process_us": (after[1] - before[1]) / hz * 1e6 / sent,
        }
    finally:
        engine.send_signal(signal.SIGTERM)
        try:
            engine.wait(30)
        except subprocess.TimeoutExpired:
            engine.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--before", default=None, help="another checkout to compare with")
    parser.add_argument("--store", default="lmdb", choices=["lmdb", "memory"])
    parser.add_argument(
        "--writer", default="thread", choices=["thread", "process"], help="FLEETCACHE_LMDB_WRITER"
    )
    parser.add_argument("--clients", type=int, default=4, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=8, help="calls in flight per worker")
    parser.add_argument("--texts", type=int, default=32, help="new texts a call")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pin", action="store_true", help="the engine on a core of its own")
    parser.add_argument("--model", default=None, help="a model dir whose tokenizer.json to use")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.store, args.writer, args.model)
        return
    codes = ([("before", Path(args.before).resolve())] if args.before else []) + [("this", REPO)]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in codes}
    for run in range(args.runs):
        for name, code in codes:
            results[name].append(round_of(code, args, f"r{run}{name}"))
            print(f"round {run + 1}, {name}: {results[name][-1]}", file=sys.stderr)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# engine_bench {now}, {platform.node()} ({os.cpu_count()} cores): store "
        f"{args.store} (writer: {args.writer}), {args.clients} clients x {args.concurrency} "
        f"calls of {args.texts} new texts, "
        f"{args.duration} s x {args.runs} rounds; medians (range)"
    )
    print("| engine process of | new texts/s | loop CPU us per text | process CPU us per text |")
    print("|---|---|---|---|")
    for name, code in codes:
        rs = results[name]

        def cell(key: str, digits: int, rs: list[dict[str, float]] = rs) -> str:
            values = [r[key] for r in rs]
            med, low, high = statistics.median(values), min(values), max(values)
            return f"{med:,.{digits}f} ({low:,.{digits}f}-{high:,.{digits}f})"

        label = "this checkout" if name == "this" else f"{code.name}"
        print(
            f"| {label} | {cell('texts_s', 0)} | {cell('loop_us', 1)} | {cell('process_us', 1)} |"
        )
    if args.before:
        before, this = (
            statistics.median(r["texts_s"] for r in results[n]) for n in ("before", "this")
        )
        print(f"\nthis checkout / {Path(args.before).name}: {this / before:.2f}x new texts/s")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
