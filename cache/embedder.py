"""CachedEmbedder: LangChain's CacheBackedEmbeddings over a tiered ByteStore, plus
single-flight and exact per-call counting.

Path of one call (``aembed``)::

    texts --key--> "{namespace}:{blake2b-256(text)}"        (namespace = engine fingerprint)
      CacheBackedEmbeddings.aembed_documents
        _VectorStore.amget     (EncoderBackedStore + binary codec; corrupt entry -> miss)
        _SingleFlight.aembed_documents(the store misses only)
            text already in flight (another request, or earlier in this batch) -> coalesced
            otherwise -> miss; all new misses -> ONE compute(texts, lane) call
        _VectorStore.amset     (write-back of the call's own misses: store tier, then memory;
                                each with its text's expiry when the call gave it a TTL)
    aembed_entities: the same, then EntityLinks.relink (links.py) for the records' ids

Counts of one call travel in a ``ContextVar`` (CacheBackedEmbeddings awaits the store and
the underlying embedder directly, so the context is the call's own), which keeps them exact
under any concurrency.

Expiry: ``ttl_s`` writes version-2 codec entries carrying ``wall_clock() + ttl``; a read at
or after that time is a miss (counted in ``expired_entries``, not as a store error) and the
text is computed and written again. The call that computes a text writes it with its own
TTL (a coalesced caller's TTL does not apply). Redis also expires such keys itself.

Failure rules: a store that raises is absorbed (logged, counted in ``store_errors``); a
compute error reaches every waiter of the texts of that compute call, coalesced ones
included, nothing is written back, and the next request computes again. A computation runs
in its own task: when the request that started it is cancelled, the requests coalesced on
it still get their vectors and the result is still written back.

Deliberate departure from the ``Embeddings`` types: rows travel through
CacheBackedEmbeddings as read-only float32 ``np.ndarray`` views, not ``list[float]``, so a
hit costs a header check and a CRC instead of building 384 Python floats; ``aembed`` joins
them into one ``(n, dim)`` array.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt
from langchain_classic.embeddings import CacheBackedEmbeddings
from langchain_classic.storage.encoder_backed import EncoderBackedStore
from langchain_core.embeddings import Embeddings
from langchain_core.stores import BaseStore, ByteStore

from cache import codec
from cache.links import Entity, EntityLinks
from cache.stats import CacheStats
from cache.stores import CacheStore, ErrorLog, MemoryByteStore, TieredByteStore, log
from engines.base import EngineError

Vectors = npt.NDArray[np.float32]
Row = npt.NDArray[np.float32]
ComputeFn = Callable[[Sequence[str], str], Awaitable[Vectors]]
"""``async compute(texts, lane) -> (len(texts), dim) float32``; production: Batcher.submit."""
Ttls = Mapping[str, float]  # text -> seconds, for the texts written with a TTL
WriteBackFn = Callable[[Sequence[tuple[str, Row]], Ttls], Awaitable[None]]
TtlArg = float | Sequence[float | None] | None

Status = Literal["hit", "coalesced", "miss"]


class InvalidTextError(ValueError):
    """A text that is not valid Unicode (a lone surrogate): refused before any lookup, so it
    never reaches the engine, whose tokenizer cannot encode it."""

    def __init__(self, index: int) -> None:
        super().__init__(f"text {index} is not a valid Unicode string (a lone surrogate)")
        self.index = index


def check_texts(texts: Sequence[str]) -> None:
    """``InvalidTextError`` for the first text that cannot be encoded as UTF-8."""
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidTextError(i) from None


@dataclass(frozen=True, slots=True)
class EmbedResult:
    """The vectors of one call, in input order, and how each text was served.

    ``statuses[i]`` is ``"hit"`` (found in a cache tier), ``"coalesced"`` (computed once for
    an identical text in flight) or ``"miss"`` (sent to the engine by this call).
    """

    vectors: Vectors  # (n, dim) float32, C-contiguous, writable (the caller's own copy)
    hits: int
    coalesced: int
    misses: int
    statuses: tuple[Status, ...]

    @property
    def not_sent(self) -> int:
        """Texts this call did not send to the engine: ``X-Cache-Hits``."""
        return self.hits + self.coalesced


@dataclass(slots=True)
class _Call:
    lane: str
    missing: list[int] = field(default_factory=list)  # input indices the store lacked
    statuses: list[Status] = field(default_factory=list)  # per text sent to _SingleFlight
    owned: list[_Flight] = field(default_factory=list)  # the computations this call started
    ttl_s: dict[str, float] = field(default_factory=dict)  # texts written with a TTL
    keys: dict[str, str] = field(default_factory=dict)  # text -> store key, hashed once


_CALL: ContextVar[_Call | None] = ContextVar("fleetcache_cache_call", default=None)


class _Flight:
    """One compute call: its texts and ONE future for all their rows (not one per text:
    at warm-up sizes, a future and its callbacks per text cost more than the cache)."""

    __slots__ = ("future", "texts")

    def __init__(self, texts: list[str], future: asyncio.Future[Vectors]) -> None:
        self.texts = texts
        self.future = future
        future.add_done_callback(_retrieve)

    def rows(self) -> list[tuple[str, Row]]:
        """``(text, row)`` of a successful computation."""
        return list(zip(self.texts, self.future.result(), strict=True))


def _retrieve(fut: asyncio.Future[Vectors]) -> None:
    # Mark the exception as retrieved: every waiter already re-raises it, and a future
    # whose waiters all left must not log "exception was never retrieved".
    if not fut.cancelled():
        fut.exception()


class _SingleFlight(Embeddings):
    """The ``underlying`` embedder: receives exactly the store misses of a call."""

    def __init__(self, compute: ComputeFn, dim: int, write_back: WriteBackFn) -> None:
        self._compute = compute
        self._dim = dim
        self._write_back = write_back
        self._inflight: dict[str, tuple[_Flight, int]] = {}  # text -> (flight, its row)
        self._tasks: set[asyncio.Task[None]] = set()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        raise NotImplementedError("the cache is async-only; use aembed_documents")

    def embed_query(self, text: str) -> list[float]:
        raise NotImplementedError("the cache is async-only; use aembed")

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        outer = _CALL.get()
        call = outer if outer is not None else _Call(lane="dispatch")
        loop = asyncio.get_running_loop()
        inflight = self._inflight
        flight: _Flight | None = None  # this call's own computation, if it needs one
        waits: list[tuple[_Flight, int]] = []
        statuses = call.statuses
        for text in texts:
            entry = inflight.get(text)
            if entry is None:
                if flight is None:
                    flight = _Flight([], loop.create_future())
                entry = inflight[text] = (flight, len(flight.texts))
                flight.texts.append(text)
                statuses.append("miss")
            else:
                statuses.append("coalesced")
            waits.append(entry)
        if flight is not None:
            call.owned.append(flight)
            # Its own task: if this request is cancelled, the requests coalesced on these
            # texts still get their vectors.
            task = loop.create_task(self._run(flight, call.lane))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            # asyncio.wait, not ``await fut``: cancelling this waiter must not cancel the
            # futures other requests share.
            pending = {f.future for f, _ in waits if not f.future.done()}
            if pending:
                await asyncio.wait(pending)
            rows = [f.future.result()[i] for f, i in waits]
        finally:
            if outer is None:  # used outside aembed: CacheBackedEmbeddings writes them back
                self.release(call, written=True)
        return cast("list[list[float]]", rows)

    async def _run(self, flight: _Flight, lane: str) -> None:
        texts, fut = flight.texts, flight.future
        try:
            # A copy, read-only: these rows are shared by every request coalesced on them.
            rows = np.array(await self._compute(texts, lane), dtype=np.float32)
            if rows.shape != (len(texts), self._dim):
                raise EngineError(
                    f"compute returned shape {rows.shape} for {len(texts)} texts, "
                    f"expected ({len(texts)}, {self._dim})"
                )
            rows.flags.writeable = False
        except BaseException as exc:
            err = (
                exc if isinstance(exc, Exception) else EngineError(f"computation aborted: {exc!r}")
            )
            if not fut.done():
                fut.set_exception(err)
            self._forget(flight)
            if err is not exc:
                raise
            return
        if not fut.done():
            fut.set_result(rows)

    def _forget(self, flight: _Flight) -> None:
        inflight = self._inflight
        for text in flight.texts:
            entry = inflight.get(text)
            if entry is not None and entry[0] is flight:
                del inflight[text]

    def release(self, call: _Call, *, written: bool) -> None:
        """Drop a call's in-flight entries once they are written back.

        Keeping them until after the write-back closes the window in which a new request
        would miss both the store and the in-flight map and compute the text again. When
        the owner did not get to write (cancelled, or failed), a task adopts its entries:
        it waits for the computation, writes back what succeeded, then drops them.
        """
        orphans = []
        for flight in call.owned:
            if written and flight.future.done():
                self._forget(flight)
            else:
                orphans.append(flight)
        if orphans:
            task = asyncio.get_running_loop().create_task(self._adopt(orphans, call.ttl_s))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _adopt(self, orphans: list[_Flight], ttl_s: Ttls) -> None:
        """Write back what the owner could not (coalesced waiters never write)."""
        try:
            await asyncio.wait([flight.future for flight in orphans])
            computed = [
                pair
                for flight in orphans
                if flight.future.exception() is None
                for pair in flight.rows()
            ]
            if computed:
                await self._write_back(computed, ttl_s)
        finally:
            for flight in orphans:
                self._forget(flight)

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    async def drain(self, grace_s: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)


class _VectorStore(EncoderBackedStore[str, Any]):
    """EncoderBackedStore that records the call's misses and absorbs store failures.

    CacheBackedEmbeddings writes back every text it sent to the underlying embedder; this
    store keeps only the texts the call computed itself (its ``owned`` misses, once each):
    a coalesced text is written by the call that computed it.
    """

    def __init__(
        self,
        store: ByteStore,
        key_encoder: Callable[[str], str],
        serializer: Callable[[Sequence[Row], Sequence[float | None]], list[bytes]],
        deserializer: Callable[[bytes], Row | None],
        errors: ErrorLog,
        wall_clock: Callable[[], float],
        on_lookup: Callable[[float], None] | None = None,
    ) -> None:
        super().__init__(store, key_encoder, lambda row: serializer([row], [None])[0], deserializer)
        self._serialize_many = serializer  # rows and their expiry times -> entries
        self._errors = errors
        self._wall_clock = wall_clock
        self._on_lookup = on_lookup

    async def amget(self, keys: Sequence[str]) -> list[Any]:
        call = _CALL.get()
        encoded = [self.key_encoder(text) for text in keys]
        if call is not None:  # each text is hashed once per call: write-back and links reuse it
            call.keys = dict(zip(keys, encoded, strict=True))
        started = time.perf_counter()
        try:
            raw = await self.store.amget(encoded)
            values = [None if v is None else self.value_deserializer(v) for v in raw]
        except Exception as exc:
            self._errors.record("mget", exc)
            values = [None] * len(keys)
        if self._on_lookup is not None:
            self._on_lookup(time.perf_counter() - started)
        if call is not None:
            call.missing = [i for i, v in enumerate(values) if v is None]
        return values

    async def amset(self, key_value_pairs: Sequence[tuple[str, Any]]) -> None:
        call = _CALL.get()
        if call is None:
            await self.write(key_value_pairs, {})
        else:
            owned = {text for flight in call.owned for text in flight.texts}
            pairs = [(t, row) for t, row in key_value_pairs if t in owned]
            await self.write(pairs, call.ttl_s, call.keys)

    async def write(
        self,
        key_value_pairs: Sequence[tuple[str, Any]],
        ttl_s: Ttls,
        keys: Mapping[str, str] | None = None,
    ) -> None:
        unique = dict(key_value_pairs)
        if not unique:
            return
        now = self._wall_clock()
        texts = list(unique)
        expiry = [None if (ttl := ttl_s.get(t)) is None else now + ttl for t in texts]
        values = self._serialize_many(list(unique.values()), expiry)
        known = keys or {}
        encoded = [
            (known.get(t) or self.key_encoder(t), v) for t, v in zip(texts, values, strict=True)
        ]
        try:
            await self.store.amset(encoded)
        except Exception as exc:
            self._errors.record("mset", exc)


def _ttl_map(texts: Sequence[str], ttl_s: TtlArg) -> dict[str, float]:
    """text -> TTL for the texts that have one (a text given twice keeps the shorter)."""
    if ttl_s is None:
        return {}
    ttls = [ttl_s] * len(texts) if isinstance(ttl_s, int | float) else list(ttl_s)
    if len(ttls) != len(texts):
        raise ValueError(f"{len(ttls)} TTLs for {len(texts)} texts")
    out: dict[str, float] = {}
    for text, ttl in zip(texts, ttls, strict=True):
        if ttl is not None:
            if ttl <= 0:
                raise ValueError(f"a TTL must be positive, got {ttl}")
            out[text] = min(ttl, out.get(text, ttl))
    return out


class _AsyncEmbeddings(Embeddings):
    """LangChain ``Embeddings`` whose vectors come from ``_vectors`` (async only: the
    engine's batcher lives on the event loop)."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        raise NotImplementedError("the cache is async-only; use aembed_documents")

    def embed_query(self, text: str) -> list[float]:
        raise NotImplementedError("the cache is async-only; use aembed_query")

    async def _vectors(self, texts: list[str]) -> Vectors:
        raise NotImplementedError

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return cast("list[list[float]]", (await self._vectors(texts)).tolist())

    async def aembed_query(self, text: str) -> list[float]:
        return (await self.aembed_documents([text]))[0]


class _CallerView(_AsyncEmbeddings):
    def __init__(self, cache: CachedEmbedder, caller: str) -> None:
        self._cache = cache
        self._caller = caller

    async def _vectors(self, texts: list[str]) -> Vectors:
        return (await self._cache.aembed(texts, caller=self._caller)).vectors


class CachedEmbedder(_AsyncEmbeddings):
    """Embeds texts through the cache; misses go to ``compute`` (the engine's batcher).

    ``namespace`` must change whenever the vectors would (derive it from the engine
    fingerprint); keys are ``f"{namespace}:{blake2b-256(text).hexdigest()}"``. Values are
    ``cache.codec`` entries in ``dtype`` (float16 halves the bytes; hits then return the
    float16-rounded values widened to float32). ``on_lookup(seconds)``, when given, is called
    once per call with the time its tier lookup took (the proxy's ``cache_lookup`` stage).

    Statistics, shaped for ``/v1/stats``:

    - ``stats()``: the ``"cache"`` object: ``hits``, ``misses``, ``coalesced``,
      ``hit_ratio``, ``tiers`` = ``{"memory": {"hits", "entries", "bytes", "max_bytes"},
      "store": {"hits", "kind", "errors", "degraded", "skipped", "last_error",
      "last_error_at"}}`` (``degraded``: the store failed and has not answered since),
      ``windows`` = ``{"1m"|"5m": {"hits",
      "misses", "hit_ratio"}}`` (window hits = hits + coalesced), plus ``store_errors`` (all
      absorbed failures, corrupt entries included), ``corrupt_entries``, ``expired_entries``
      (entries read after their TTL: misses, not errors), ``failed_calls``,
      ``in_flight``.
    - ``savings()``: ``{"calls_avoided", "ms_saved"}`` for the ``"inference"`` object.
    - ``by_caller()``: ``{caller: {"hits", "misses", "coalesced"}}`` where ``hits`` counts
      hits + coalesced (not sent to the engine), as ``X-Cache-Hits`` does.

    It is also a LangChain ``Embeddings`` (async only, caller ``dispatch``);
    ``with_caller("warmup")`` gives one for another caller.
    """

    def __init__(
        self,
        compute: ComputeFn,
        store: ByteStore,
        *,
        namespace: str,
        dim: int,
        per_item_ms: Callable[[], float] = lambda: 0.0,
        dtype: codec.Dtype = "float32",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        on_lookup: Callable[[float], None] | None = None,
    ) -> None:
        if not namespace or len(namespace) > 200 or any(c.isspace() for c in namespace):
            raise ValueError(f"namespace must be 1..200 non-blank characters: {namespace!r}")
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        codec.encode(np.zeros(1, np.float32), dtype)  # fail fast on an unknown dtype
        self.namespace = namespace
        self.dim = dim
        self.dtype: codec.Dtype = dtype
        self._store = store
        self._per_item_ms = per_item_ms
        self._stats = CacheStats(clock)
        self._errors = ErrorLog(f"cache namespace {namespace}")
        self._corrupt = 0
        self._expired = 0
        self._wall_clock = wall_clock
        self.links = EntityLinks(store, namespace, self._errors)
        vectors = _VectorStore(
            store, self.key, self._encode, self._decode, self._errors, wall_clock, on_lookup
        )
        self._flight = _SingleFlight(compute, dim, vectors.write)
        # batch_size=None: all misses of a call in one underlying call, one write-back.
        self._cbe = CacheBackedEmbeddings(
            self._flight, cast("BaseStore[str, list[float]]", vectors), batch_size=None
        )

    def key(self, text: str) -> str:
        """The store key of ``text`` in this namespace."""
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=32)
        return f"{self.namespace}:{digest.hexdigest()}"

    def _encode(self, rows: Sequence[Row], expires_at: Sequence[float | None]) -> list[bytes]:
        return codec.encode_many(rows, self.dtype, expires_at=expires_at)

    def _decode(self, data: bytes) -> Row | None:
        try:
            return codec.decode(data, self.dim, now=self._wall_clock())
        except codec.ExpiredEntryError:
            self._expired += 1
            return None
        except codec.CorruptEntryError as exc:
            self._corrupt += 1
            self._errors.record("decode", exc)
            return None

    async def aembed(
        self,
        texts: Sequence[str],
        *,
        caller: str = "dispatch",
        lane: str | None = None,
        ttl_s: TtlArg = None,
    ) -> EmbedResult:
        """Vectors for ``texts`` in order; misses go to the engine on ``lane``.

        ``lane`` defaults to ``"warmup"`` for caller ``"warmup"``, else ``"dispatch"``.
        ``ttl_s`` (seconds, one for every text or one per text, None: never) makes the
        entries this call writes expire. Raises ``InvalidTextError`` (nothing looked up)
        for a text that is not valid Unicode, and what ``compute`` raised (e.g.
        ``EngineError``) for texts it had to compute.
        """
        return (await self._aembed(texts, caller, lane, ttl_s))[0]

    async def _aembed(
        self, texts: Sequence[str], caller: str, lane: str | None, ttl_s: TtlArg
    ) -> tuple[EmbedResult, _Call]:
        """``aembed``, and the call's bookkeeping (its texts' keys)."""
        n = len(texts)
        check_texts(texts)
        call = _Call(lane=lane or ("warmup" if caller == "warmup" else "dispatch"))
        if n == 0:
            return EmbedResult(np.empty((0, self.dim), np.float32), 0, 0, 0, ()), call
        call.ttl_s = _ttl_map(texts, ttl_s)
        token = _CALL.set(call)
        written = False
        try:
            rows = await self._cbe.aembed_documents(list(texts))
            written = True
        except BaseException:
            self._stats.record_failure()
            raise
        finally:
            _CALL.reset(token)
            self._flight.release(call, written=written)
        statuses: list[Status] = ["hit"] * n
        for i, status in zip(call.missing, call.statuses, strict=True):
            statuses[i] = status
        coalesced = call.statuses.count("coalesced")
        misses = len(call.statuses) - coalesced
        hits = n - len(call.statuses)
        avoided_ms = self._per_item_ms() if hits + coalesced else 0.0
        self._stats.record(caller, hits, coalesced, misses, avoided_ms)
        # Every row is 1-d of length dim (decode and _run check it); concatenate is ~5x
        # faster than np.stack for 1,000 rows.
        vectors = np.concatenate(cast("list[Row]", rows)).reshape(n, self.dim)
        return EmbedResult(vectors, hits, coalesced, misses, tuple(statuses)), call

    async def aembed_entities(
        self,
        entities: Sequence[Entity],
        *,
        caller: str = "dispatch",
        lane: str | None = None,
        ttl_s: Mapping[str, float | None] | None = None,
    ) -> EmbedResult:
        """``aembed`` of the entities' texts with the TTL of their kind (``ttl_s``), then
        each entity linked to its vector key (its previous vector dropped if it changed)."""
        ttls = ttl_s or {}
        texts = [e.text for e in entities]
        result, call = await self._aembed(texts, caller, lane, [ttls.get(e.kind) for e in entities])
        keys = [call.keys.get(t) or self.key(t) for t in texts]
        await self.links.relink([(e.kind, e.id) for e in entities], keys)
        return result

    async def _vectors(self, texts: list[str]) -> Vectors:
        return (await self.aembed(texts)).vectors

    def with_caller(self, caller: str) -> Embeddings:
        """A LangChain ``Embeddings`` view that counts its lookups under ``caller``."""
        return _CallerView(self, caller)

    async def acontains(self, texts: Sequence[str]) -> list[bool]:
        """Which texts have an entry in some tier; counts nothing, promotes nothing.

        A corrupt entry counts as present here (it is only decoded on a real lookup).
        """
        keys = [self.key(t) for t in texts]
        try:
            if isinstance(self._store, CacheStore):
                return await self._store.acontains(keys)
            return [v is not None for v in await self._store.amget(keys)]
        except Exception as exc:
            self._errors.record("contains", exc)
            return [False] * len(keys)

    # -- statistics ----------------------------------------------------------------------

    @property
    def store_errors(self) -> int:
        tier_errors = self._store.store_errors if isinstance(self._store, TieredByteStore) else 0
        return self._errors.count + tier_errors

    def _tiers(self) -> dict[str, dict[str, Any]]:
        s = self._store
        if isinstance(s, TieredByteStore):
            memory: dict[str, Any] = {"hits": s.memory_hits, **self._memory_facts(s.memory)}
            store = s.store_health()
        elif isinstance(s, MemoryByteStore):
            memory = {"hits": self._stats.hits, **self._memory_facts(s)}
            store = {"hits": 0, "kind": "none", "errors": 0, "degraded": False}
        else:
            memory = {"hits": 0, "entries": 0, "bytes": 0, "max_bytes": 0}
            kind = str(getattr(s, "kind", type(s).__name__))
            store = {
                "hits": self._stats.hits,
                "kind": kind,
                "errors": self._errors.count,
                "degraded": False,
            }
        return {"memory": memory, "store": store}

    @staticmethod
    def _memory_facts(memory: MemoryByteStore) -> dict[str, int]:
        return {"entries": memory.entries, "bytes": memory.bytes, "max_bytes": memory.max_bytes}

    def stats(self) -> dict[str, Any]:
        """The ``"cache"`` object of ``/v1/stats`` (see the class docstring)."""
        return {
            **self._stats.totals(),
            "tiers": self._tiers(),
            "windows": self._stats.windows(),
            "store_errors": self.store_errors,
            "corrupt_entries": self._corrupt,
            "expired_entries": self._expired,
            "failed_calls": self._stats.failed_calls,
            "in_flight": self._flight.in_flight,
        }

    def savings(self) -> dict[str, Any]:
        """``{"calls_avoided": hits + coalesced, "ms_saved": float}``."""
        return self._stats.savings()

    def by_caller(self) -> dict[str, dict[str, int]]:
        return self._stats.by_caller()

    async def aclose(self, grace_s: float = 5.0) -> None:
        """Let in-flight computations finish and write back (up to ``grace_s`` seconds),
        then close the stores (the LMDB environment)."""
        await self._flight.drain(grace_s)
        if isinstance(self._store, CacheStore):
            await self._store.aclose()
        log.debug("cache namespace %s closed", self.namespace)
