"""Misses spread over several engine processes, one per device of ``FLEETCACHE_DEVICE``
(ARCHITECTURE.md, "Processes"): what a worker (or a warm-up job) holds as its engine::

    EngineRouter.embed(texts)
      rank      per text, every engine in the order of rendezvous hashing (highest random
                weight) of the text's blake2b: the same order in every process of the server
      route     each text to the first engine of its rank that serves: its process answering
                and its engine healthy; else (none such) answering with a fallback serving;
                else answering; else the first, whose call fails at once with 503
      call      one IPC call per engine, side by side; rows put back in input order
      re-route  a call whose engine process stopped answering (killed, hung: its client fails
                it with ServiceUnavailableError) is sent once more, each text to the next
                serving engine of its rank: one engine dying fails no request

Why a hash and not the shortest queue: an identical text must meet its twin in ONE in-flight
map to be computed once. Routed by its hash it always reaches the same engine, whose map is
enough; routed by queue depth (``FLEETCACHE_ENGINE_ROUTING=depth``), twins land on different
engines and each computes them, since the map is not shared across the engine processes
(docs/BENCHMARKS.md: 65% more engine work on concurrent repeats). Rendezvous hashing moves only
the texts of an engine that stops serving, each to its next engine, spread evenly over the
others, and moves them back when it returns.

Counting stays exact: each engine process counts ``misses`` and ``items`` together as it takes
texts. Texts re-routed from an engine that died holding them were sent to an engine twice and
count twice, in both; so do the few texts that two workers route differently in the moment one
of them has seen an engine go or come back before the other (then each engine computes them).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import numpy.typing as npt

from cache.flight import Flown, Vectors
from engines.base import EngineInfo
from engines.batcher import EngineHealth
from proxy.engine_host import RemoteEngine
from proxy.ipc import ServiceUnavailableError

Rank = npt.NDArray[np.uint64]  # (texts, engines): a text's weight for each engine
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finalizer: every bit of the input moves every bit of the output."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def text_hashes(texts: Sequence[str]) -> npt.NDArray[np.uint64]:
    digests = b"".join(
        hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=8).digest() for t in texts
    )
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


def rank(texts: Sequence[str], engines: int) -> Rank:
    """Each text's weight for each engine; a text goes to the serving engine of highest
    weight. Depends on the text and the engine's place in the list only."""
    seeds = _mix(np.arange(1, engines + 1, dtype=np.uint64))
    return _mix(text_hashes(texts)[:, None] ^ seeds[None, :])


def by_depth(weights: Rank, outstanding: Sequence[int]) -> Rank:
    """``FLEETCACHE_ENGINE_ROUTING=depth``: the engine holding the fewest of this process's
    texts first (a text's hash breaks ties and orders the rest)."""
    room = (1 << 31) - np.minimum(np.array(outstanding, dtype=np.uint64), (1 << 31) - 1)
    return (room[None, :] << np.uint64(32)) | (weights >> np.uint64(32))


def choose(weights: Rank, usable: npt.NDArray[np.bool_]) -> npt.NDArray[np.intp]:
    """The engine of each row: the highest weight among the ``usable`` ones."""
    masked = np.where(usable[None, :], weights, np.uint64(0))
    return np.argmax(masked, axis=1)


class EngineRouter:
    """The engine processes of a server, as one ``Flight`` (see the module docstring).
    ``devices``: the device of each, in FLEETCACHE_DEVICE's order; ``policy``: ``hash``, or
    ``depth`` (FLEETCACHE_ENGINE_ROUTING: each call to the engine holding the fewest of this
    process's texts, whatever the texts: twins in flight on two engines are computed twice)."""

    def __init__(
        self, engines: Sequence[RemoteEngine], devices: Sequence[str], policy: str = "hash"
    ) -> None:
        if not engines or len(engines) != len(devices):
            raise ValueError("one RemoteEngine per device, at least one")
        self.engines = list(engines)
        self.devices = list(devices)
        self.policy = policy
        self.info: EngineInfo = engines[0].info
        self.reroutes = 0  # texts sent again after their engine stopped answering
        self.outstanding = [0] * len(engines)  # texts sent to each and not answered yet

    # -- which engine ----------------------------------------------------------------------

    def usable(self) -> npt.NDArray[np.bool_]:
        """The engines misses should go to now (module docstring, "route")."""
        up = np.array([e.client.up for e in self.engines])
        healths = [e.health() for e in self.engines]
        for wanted in (
            up & np.array([h.healthy for h in healths]),
            up & np.array([h.serving != "none" for h in healths]),
            up,
        ):
            if wanted.any():
                return wanted
        return np.ones(len(self.engines), dtype=bool)

    # -- the Flight ------------------------------------------------------------------------

    async def embed(
        self,
        texts: Sequence[str],
        *,
        lane: str,
        caller: str,
        ttl_s: Mapping[str, float],
        since: float | None = None,
        links: Sequence[tuple[str, str, str]] = (),
        durable: bool = True,
        keys: Sequence[str] | None = None,
    ) -> Flown:
        key_of = None  # per text only where texts are shared out: one engine takes them as given
        if keys is not None and len(self.engines) > 1:
            key_of = dict(zip(texts, keys, strict=True))
        asked = set(texts) if links else set()
        stored = [link for link in links if link[2] not in asked]  # the caller's hits' entities

        async def run(engine: RemoteEngine, part: list[str]) -> Flown:
            kept = set(part)
            mine = [link for link in links if link[2] in kept]  # its own texts' entities
            return await engine.embed(
                part,
                lane=lane,
                caller=caller,
                ttl_s={t: s for t, s in ttl_s.items() if t in kept},
                since=since,
                links=mine + stored if part and part[0] == texts[0] else mine,  # once
                durable=durable,
                keys=keys if key_of is None else [key_of[t] for t in part],
            )

        return await self._spread(texts, run)

    async def reembed(self, texts: Sequence[str]) -> Vectors:
        """A drift check's fresh vectors, each text on the engine that computes its misses."""

        async def run(engine: RemoteEngine, part: list[str]) -> Flown:
            return Flown(await engine.reembed(part), [False] * len(part))

        return (await self._spread(texts, run)).rows

    async def _spread(
        self, texts: Sequence[str], run: Callable[[RemoteEngine, list[str]], Awaitable[Flown]]
    ) -> Flown:
        texts = list(texts)
        if len(self.engines) == 1:  # nothing to choose, nothing to copy
            return await run(self.engines[0], texts)
        rows = np.empty((len(texts), self.info.dim), dtype=np.float32)
        coalesced = [False] * len(texts)
        if not texts:
            return Flown(rows, coalesced)
        weights = rank(texts, len(self.engines))
        if self.policy == "depth":
            weights = by_depth(weights, self.outstanding)
        chosen = choose(weights, self.usable())

        async def on(k: int, positions: npt.NDArray[np.intp], again: bool) -> None:
            part = [texts[i] for i in positions]
            self.outstanding[k] += len(part)
            try:
                flown = await run(self.engines[k], part)
            except ServiceUnavailableError:
                if again:
                    raise
                # its process went away (or never answered): the next serving engine of
                # each text's rank, once
                usable = self.usable()
                usable[k] = False
                if not usable.any():
                    raise
                self.reroutes += len(positions)
                nexts = choose(weights[positions], usable)
                await asyncio.gather(
                    *(on(j, positions[nexts == j], True) for j in np.unique(nexts).tolist())
                )
                return
            finally:
                self.outstanding[k] -= len(part)
            rows[positions] = flown.rows
            for i, joined in zip(positions.tolist(), flown.coalesced, strict=True):
                coalesced[i] = joined

        await asyncio.gather(
            *(on(k, np.flatnonzero(chosen == k), False) for k in np.unique(chosen).tolist())
        )
        return Flown(rows, coalesced)

    # -- the rest of EngineService ---------------------------------------------------------

    def _answering(self) -> RemoteEngine:
        """The first engine whose process answers (else the first): for what any of them
        can do for the whole server (reach every worker, report the shared store)."""
        return next((e for e in self.engines if e.client.up), self.engines[0])

    def health(self) -> EngineHealth:
        """The server's: healthy while any engine serves misses on its primary (preferring
        one not degraded); otherwise each device's reason."""
        healths = [e.health() for e in self.engines]
        serving = [h for h in healths if h.healthy]
        if serving:
            return next((h for h in serving if not h.degraded), serving[0])
        if len(healths) == 1:
            return healths[0]
        reason = "; ".join(f"{d}: {h.reason}" for d, h in zip(self.devices, healths, strict=True))
        by = next((h.serving for h in healths if h.serving != "none"), "none")
        return EngineHealth(False, reason, by)

    def device_health(self) -> list[dict[str, Any]]:
        """Each engine process: its device, whether it answers, its health."""
        return [
            {"device": device, "up": engine.client.up, **asdict(engine.health())}
            for device, engine in zip(self.devices, self.engines, strict=True)
        ]

    def facts(self) -> dict[str, Any]:
        return self._answering().facts()

    async def invalidate(self, keys: Sequence[str]) -> dict[str, Any]:
        return await self._answering().invalidate(keys)

    async def hit_texts(self, own: Sequence[str]) -> list[str]:
        return await self._answering().hit_texts(own)

    async def wait_up(self, timeout_s: float) -> bool:
        """Until any engine process answers (at most ``timeout_s``), as the first ping's
        answer comes: a poll every 50 ms held each reader of a warm-up job that long at its
        start (and a worker's readiness)."""
        waits = {asyncio.ensure_future(e.client.wait_up(timeout_s)) for e in self.engines}
        try:
            while waits:
                done, waits = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if any(task.result() for task in done):
                    return True
            return False
        finally:
            for task in waits:
                task.cancel()
