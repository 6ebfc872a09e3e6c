"""CachedEmbedder: LangChain's CacheBackedEmbeddings over a tiered ByteStore, with exact
per-call counting; its misses go to a single-flight (cache.flight).

Path of one call (``aembed``)::

    texts --key--> "{namespace}:{blake2b-256(text)}"        (namespace = engine fingerprint)
      CacheBackedEmbeddings.aembed_documents
        _VectorStore.amget     (EncoderBackedStore + binary codec; corrupt entry -> miss;
                                the hits are counted here)
        _Misses.aembed_documents(the store misses only) -> flight.embed
            SingleFlight (this process) or the engine process (one map for all workers):
            text already in flight -> coalesced, otherwise -> miss; the flight writes the
            computed rows back before it lets go of them
        _VectorStore.amset     (the rows also land in this process's memory tier when the
                                flight wrote only the shared tier)
    aembed_entities: the same, then EntityLinks.relink (links.py) for the records' ids

``CachedEmbedder(compute, store)`` over a plain compute function builds its own
``SingleFlight`` (which writes back to ``store``, both tiers) and counts everything itself.
``CachedEmbedder(flight, store)`` over a ``Flight`` (the engine process's client) counts only
its hits: coalesced and misses are counted where the flight decides them.

The state of one call travels in a ``ContextVar`` (CacheBackedEmbeddings awaits the store and
the underlying embedder directly, so the context is the call's own), which keeps the counts
exact under any concurrency.

Expiry: ``ttl_s`` writes version-2 codec entries carrying ``wall_clock() + ttl``; a read at
or after that time is a miss (counted in ``expired_entries``, not as a store error) and the
text is computed and written again. The call that computes a text writes it with its own
TTL (a coalesced caller's TTL does not apply). Redis also expires such keys itself.

Failure rules: a store that raises is absorbed (logged, counted in ``store_errors``); a
compute error reaches every waiter of the texts of that compute call, coalesced ones
included, nothing is written back, and the next request computes again (cache.flight).

Deliberate departure from the ``Embeddings`` types: rows travel through
CacheBackedEmbeddings as read-only float32 ``np.ndarray`` views, not ``list[float]``, so a
hit costs a header check and a CRC instead of building 384 Python floats; ``aembed`` joins
them into one ``(n, dim)`` array.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
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
from cache.flight import ComputeFn, Flight, SingleFlight
from cache.links import Entity, EntityLinks
from cache.stats import CacheStats
from cache.stores import (
    CacheStore,
    ErrorLog,
    MemoryByteStore,
    TieredByteStore,
    log,
    read_uncounted,
)
from cache.writer import VectorWriter

Vectors = npt.NDArray[np.float32]
Row = npt.NDArray[np.float32]
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
    caller: str
    ttl_s: dict[str, float] = field(default_factory=dict)  # texts written with a TTL
    keys: dict[str, str] = field(default_factory=dict)  # text -> store key, hashed once
    looked_up_at: float | None = None  # when its store lookup began (time.monotonic)
    links: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, id, text)
    durable: bool = True  # return once its computed rows are written back
    missing: list[int] = field(default_factory=list)  # input indices the store lacked
    statuses: list[Status] = field(default_factory=list)  # per text sent to the flight

    def keys_of(self, texts: Sequence[str]) -> list[str] | None:
        """The store keys of ``texts`` from this call's lookup; None if one was not hashed."""
        try:
            return [self.keys[t] for t in texts]
        except KeyError:
            return None


_CALL: ContextVar[_Call | None] = ContextVar("fleetcache_cache_call", default=None)


class _Misses(Embeddings):
    """CacheBackedEmbeddings' ``underlying`` embedder: receives exactly the store misses of
    a call and hands them to the flight (``SingleFlight`` or the engine process)."""

    def __init__(self, flight: Flight) -> None:
        self._flight = flight

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        raise NotImplementedError("the cache is async-only; use aembed_documents")

    def embed_query(self, text: str) -> list[float]:
        raise NotImplementedError("the cache is async-only; use aembed")

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        call = _CALL.get() or _Call(lane="dispatch", caller="dispatch")
        flight = self._flight
        flown = await flight.embed(
            texts,
            lane=call.lane,
            caller=call.caller,
            ttl_s=call.ttl_s,
            since=call.looked_up_at,
            links=call.links,
            durable=call.durable,
            keys=call.keys_of(texts),
        )
        call.statuses += ["coalesced" if c else "miss" for c in flown.coalesced]
        return cast("list[list[float]]", list(flown.rows))


class _VectorStore(EncoderBackedStore[str, Any]):
    """EncoderBackedStore that counts a call's hits, absorbs store failures, and writes back
    only where the flight did not already.

    The flight writes computed rows back before it lets go of them (``SingleFlight``: to
    ``store`` itself; the engine process: to the shared tier). CacheBackedEmbeddings then
    writes back every text it sent to the underlying embedder: that lands in ``write_to``
    (the worker's own memory tier, or None when the flight already wrote everything or that
    tier keeps nothing, as a warm-up reader's).
    """

    def __init__(
        self,
        store: ByteStore,
        writer: VectorWriter,
        deserializer: Callable[[bytes], Row | None],
        errors: ErrorLog,
        stats: CacheStats,
        per_item_ms: Callable[[], float],
        write_to: VectorWriter | None,
        on_lookup: Callable[[float], None] | None = None,
        on_hits: Callable[[list[str]], None] | None = None,
    ) -> None:
        super().__init__(store, writer.key, writer.encode_one, deserializer)
        self._errors = errors
        self._stats = stats
        self._per_item_ms = per_item_ms
        self._write_to = write_to
        self._on_lookup = on_lookup
        self._on_hits = on_hits

    async def amget(self, keys: Sequence[str]) -> list[Any]:
        call = _CALL.get()
        encoded = [self.key_encoder(text) for text in keys]
        if call is not None:  # each text is hashed once per call: write-back and links reuse it
            call.keys = dict(zip(keys, encoded, strict=True))
            call.looked_up_at = time.monotonic()
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
            hits = len(keys) - len(call.missing)
            if hits:  # counted at the lookup: a call that fails later still found these
                self._stats.record(call.caller, hits, 0, 0, self._per_item_ms())
                if self._on_hits is not None:
                    self._on_hits([t for t, v in zip(keys, values, strict=True) if v is not None])
        return values

    async def amset(self, key_value_pairs: Sequence[tuple[str, Any]]) -> None:
        if self._write_to is not None:
            call = _CALL.get()
            ttl_s, keys = (call.ttl_s, call.keys) if call is not None else ({}, None)
            await self._write_to.write(key_value_pairs, ttl_s, keys)


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
    once per call with the time its tier lookup took (the proxy's ``cache_lookup`` stage);
    ``on_hits(texts)`` with the texts each lookup found (the drift check's reservoir).

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
        compute: ComputeFn | Flight,
        store: ByteStore,
        *,
        namespace: str,
        dim: int,
        per_item_ms: Callable[[], float] = lambda: 0.0,
        dtype: codec.Dtype = "float32",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        on_lookup: Callable[[float], None] | None = None,
        stats: CacheStats | None = None,
        on_hits: Callable[[list[str]], None] | None = None,
    ) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self._errors = ErrorLog(f"cache namespace {namespace}")
        self._writer = VectorWriter(
            store, namespace=namespace, dtype=dtype, errors=self._errors, wall_clock=wall_clock
        )
        self.namespace = namespace
        self.dim = dim
        self.dtype: codec.Dtype = dtype
        self._store = store
        self._per_item_ms = per_item_ms
        self._stats = stats or CacheStats(clock)
        self._corrupt = 0
        self._expired = 0
        self._wall_clock = wall_clock
        self.links = EntityLinks(store, namespace, self._errors)
        write_to = None
        if isinstance(compute, Flight):  # it writes the shared tier; this process's own after
            self._flight: Flight = compute
            self._local: SingleFlight | None = None
            own = store.memory if isinstance(store, TieredByteStore) else store
            if not (isinstance(own, MemoryByteStore) and own.keeps_nothing):
                write_to = VectorWriter(
                    own,
                    namespace=namespace,
                    dtype=dtype,
                    errors=self._errors,
                    wall_clock=wall_clock,
                )
        else:
            writer = self._writer
            self._local = SingleFlight(
                compute,
                dim,
                write_back=writer.write_rows,
                stats=self._stats,
                per_item_ms=per_item_ms,
            )
            self._flight = self._local
        vectors = _VectorStore(
            store,
            self._writer,
            self._decode,
            self._errors,
            self._stats,
            per_item_ms,
            write_to,
            on_lookup,
            on_hits,
        )
        # batch_size=None: all misses of a call in one underlying call, one write-back.
        self._cbe = CacheBackedEmbeddings(
            _Misses(self._flight), cast("BaseStore[str, list[float]]", vectors), batch_size=None
        )

    def key(self, text: str) -> str:
        """The store key of ``text`` in this namespace."""
        return self._writer.key(text)

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
        durable: bool = True,
    ) -> EmbedResult:
        """Vectors for ``texts`` in order; misses go to the engine on ``lane``.

        ``lane`` defaults to ``"warmup"`` for caller ``"warmup"``, else ``"dispatch"``.
        ``ttl_s`` (seconds, one for every text or one per text, None: never) makes the
        entries this call writes expire. ``durable=False`` returns as soon as the misses are
        computed, while they are still being written back (they stay in flight, so nobody
        computes them twice meanwhile). Raises ``InvalidTextError`` (nothing looked up)
        for a text that is not valid Unicode, and what ``compute`` raised (e.g.
        ``EngineError``) for texts it had to compute.
        """
        return (await self._aembed(texts, caller, lane, ttl_s, durable=durable))[0]

    async def _aembed(
        self,
        texts: Sequence[str],
        caller: str,
        lane: str | None,
        ttl_s: TtlArg,
        *,
        durable: bool = True,
        entities: Sequence[Entity] = (),
    ) -> tuple[EmbedResult, _Call]:
        """``aembed``, and the call's bookkeeping (its texts' keys)."""
        n = len(texts)
        check_texts(texts)
        call = _Call(lane=lane or ("warmup" if caller == "warmup" else "dispatch"), caller=caller)
        call.durable = durable
        call.links = [(e.kind, e.id, e.text) for e in entities]
        if n == 0:
            return EmbedResult(np.empty((0, self.dim), np.float32), 0, 0, 0, ()), call
        call.ttl_s = _ttl_map(texts, ttl_s)
        token = _CALL.set(call)
        try:
            rows = await self._cbe.aembed_documents(list(texts))
        except BaseException:
            self._stats.record_failure()
            raise
        finally:
            _CALL.reset(token)
        statuses: list[Status] = ["hit"] * n
        for i, status in zip(call.missing, call.statuses, strict=True):
            statuses[i] = status
        coalesced = call.statuses.count("coalesced")
        misses = len(call.statuses) - coalesced
        hits = n - len(call.statuses)
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
        each entity linked to its vector key (its previous vector dropped if it changed).
        The entities of texts computed now are linked by the write-back, in the same
        transaction as their vectors; ``relink`` then finds those unchanged."""
        ttls = ttl_s or {}
        texts = [e.text for e in entities]
        result, call = await self._aembed(
            texts, caller, lane, [ttls.get(e.kind) for e in entities], entities=entities
        )
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

    async def stored(self, texts: Sequence[str]) -> list[Row | None]:
        """The vector each text has in the cache now (None: none, expired or unreadable);
        counts no lookup (the drift check compares these with fresh ones)."""
        keys = [self.key(t) for t in texts]
        try:
            raw = await read_uncounted(self._store, keys)
        except Exception as exc:
            self._errors.record("stored", exc)
            return [None] * len(keys)
        return [None if v is None else self._decode(v) for v in raw]

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
            "in_flight": 0 if self._local is None else self._local.in_flight,
        }

    def savings(self) -> dict[str, Any]:
        """``{"calls_avoided": hits + coalesced, "ms_saved": float}``."""
        return self._stats.savings()

    def by_caller(self) -> dict[str, dict[str, int]]:
        return self._stats.by_caller()

    @property
    def dispatch_lookups(self) -> int:
        """Lookups by every caller but ``warmup`` so far (a warm-up job paces itself by it)."""
        return self._stats.dispatch_lookups

    @property
    def corrupt_entries(self) -> int:
        return self._corrupt

    @property
    def expired_entries(self) -> int:
        return self._expired

    async def aclose(self, grace_s: float = 5.0) -> None:
        """Let in-flight computations finish and write back (up to ``grace_s`` seconds),
        then close the stores (the LMDB environment)."""
        if self._local is not None:
            await self._local.drain(grace_s)
        if isinstance(self._store, CacheStore):
            await self._store.aclose()
        log.debug("cache namespace %s closed", self.namespace)
