"""``FastTokenizer``'s word cache gives exactly the ids of ``encode_batch`` (the model's own
tokenizer), on the texts of real fleets and on random Unicode strings, and ids computed in one
process (``TokenizedTexts``) reach the padding of another, through the in-flight map and the
batcher, exactly as if tokenized there."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.flight import SingleFlight
from engines import tokenization
from engines.base import Batch, Engine, Vectors
from engines.batcher import Batcher
from engines.fake import FakeEngine
from engines.fallback import FallbackEngine
from engines.tokenization import FastTokenizer, TokenizedTexts
from engines.torch_engine import default_model_path
from features.synthetic import fleet_texts
from proxy.engine_host import RemoteEngine, tokenized

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SEQ = (16, 32, 64, 128, 256)


@pytest.fixture(scope="module")
def fast() -> FastTokenizer:
    return FastTokenizer(default_model_path(), 256)


def reference(tokenizer: FastTokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer._tokenizer.encode_batch(texts)]


def real_fleet() -> list[str]:
    return fleet_texts(3000, seed=11)


def test_word_cache_equals_the_tokenizer_on_real_fleets(fast: FastTokenizer) -> None:
    texts = real_fleet()
    assert any(not t.isascii() for t in texts)  # the non-ASCII city names are in
    assert all(fast._cached(t) for t in texts)  # ...and still take the cached path
    assert [list(ids) for ids in fast.ids(texts)] == reference(fast, texts)
    assert 0 < len(fast._words or {}) < 1000  # a small vocabulary, which is why it pays


def test_truncation_keeps_the_special_tokens() -> None:
    short = FastTokenizer(default_model_path(), 16)
    texts = ["capacity 1200 kg, volume 8.5 m3; " * 5, "a", "", "   "]
    assert [list(ids) for ids in short.ids(texts)] == reference(short, texts)
    assert len(short.ids(texts)[0]) == 16


# Characters chosen to break a wrong shortcut: accents and case, final sigma, combining marks,
# CJK (split apart), symbols and punctuation outside ASCII, other whitespace, controls, the
# added tokens' text, and plain ASCII words and digits.
PIECES = st.sampled_from(
    [
        "a", "Z", "7", " ", "  ", "_", "-", ".", ",", "%", "[", "]", "#", "van", "KG", "12.5",
        "é", "É", "ö", "ß", "İ", "Σ", "ΟΔΟΣ", "ς", "\u0301", "\u0308", "北京", "静安", "ｶ",
        "€", "°", "—", "¿", "…", "🚚", "\u00a0", "\t", "\n", "\u2028", "\u200b", "\x00",
        "\x7f", "\ufffd", "[MASK]", "[mask]", "[CLS]", "##", "un" * 60,
    ]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(PIECES, max_size=30).map("".join), min_size=1, max_size=8))
def test_word_cache_equals_the_tokenizer_on_random_strings(texts: list[str]) -> None:
    fast = FastTokenizer(default_model_path(), 64)
    assert [list(ids) for ids in fast.ids(texts)] == reference(fast, texts)
    assert [list(ids) for ids in fast.ids(texts)] == reference(fast, texts)  # cache warm


def test_texts_that_cannot_take_the_cache_go_to_the_tokenizer(fast: FastTokenizer) -> None:
    for text in ("tail\tlift", "line\nbreak", "a [MASK] b", "nbsp\u00a0van", "a\x00b"):
        assert not fast._cached(text)
    assert fast._cached("neukölln, 北京; van") and fast._cached("")


def test_the_cache_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenization, "MAX_CACHED_WORDS", 10)
    fast = FastTokenizer(default_model_path(), 256)
    texts = [f"word{i} other{i}" for i in range(50)]
    assert [list(ids) for ids in fast.ids(texts)] == reference(fast, texts)
    assert len(fast._words or {}) == len(fast._chunks or {}) == 10
    fresh = FastTokenizer(default_model_path(), 256)
    long = ["x" * 65 + " ok", "ß" * 65 + " ok"]  # an ASCII word and a non-ASCII chunk
    assert [list(ids) for ids in fresh.ids(long)] == reference(fresh, long)
    assert set(fresh._words or {}) == set(fresh._chunks or {}) == {"ok"}  # no long one kept


def as_sent(fast: FastTokenizer, texts: list[str]) -> TokenizedTexts:
    """``texts`` with their ids as a worker sends them: all in one int32 array, cut."""
    return TokenizedTexts.of(texts, fast.ids(texts))


def each_ids(texts: TokenizedTexts) -> list[list[int]]:
    flat, counts = texts.ids()
    return [part.tolist() for part in np.split(flat, np.cumsum(counts)[:-1])] if counts.size else []


def same_batch(fast: FastTokenizer, got: Sequence[str], texts: list[str]) -> None:
    a, b = fast.encode(got, BUCKETS, SEQ), fast.encode(texts, BUCKETS, SEQ)
    assert np.array_equal(a.input_ids, b.input_ids)
    assert np.array_equal(a.attention_mask, b.attention_mask)
    assert a.lengths.tolist() == [len(ids) for ids in reference(fast, texts)]


def test_ids_from_another_process_pad_like_the_texts(fast: FastTokenizer) -> None:
    texts = [*real_fleet()[:100], "tab\there"]
    sent = as_sent(fast, texts)
    assert sent == texts and {sent[0]: 1}[texts[0]] == 1  # plain texts to anyone else
    assert each_ids(sent) == reference(fast, texts)
    same_batch(fast, sent, texts)
    longest = max(len(ids) for ids in reference(fast, texts))
    assert fast.encode(sent, BUCKETS, SEQ).input_ids.shape == (
        128,
        tokenization.bucket_for(longest, SEQ),
    )  # 101 texts
    # slices, picks and joins keep each text's own ids
    picks = [5, 3, 100, 3, 0]
    for got, want in (
        (sent[10:60], texts[10:60]),
        (sent[60:], texts[60:]),
        (sent[7:7], []),
        (sent[::7], texts[::7]),
        (sent.take(picks), [texts[i] for i in picks]),
        (TokenizedTexts.join([sent[50:], sent[:50]]), texts[50:] + texts[:50]),
    ):
        assert isinstance(got, TokenizedTexts) and got == want
        assert each_ids(got) == reference(fast, want)
    mixed = TokenizedTexts.join([sent[:50], texts[50:]])  # a part without ids: none kept
    assert not isinstance(mixed, TokenizedTexts) and mixed == texts
    same_batch(fast, mixed, texts)
    with pytest.raises(ValueError, match="bounds"):
        TokenizedTexts(texts, sent.flat, sent.bounds[:-1])


class Recorder(FakeEngine):
    """Records the texts of each batch it tokenizes."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenized: list[Sequence[str]] = []

    def tokenize(self, texts: Sequence[str]) -> Batch:
        self.tokenized.append(texts)
        return super().tokenize(texts)


def test_ids_reach_the_engine_through_the_in_flight_map_and_the_batcher(
    fast: FastTokenizer,
) -> None:
    """Two callers in one turn, one repeating a text of the other and one of its own: the
    one batch the engine tokenizes holds each new text once, with its own ids."""
    texts = real_fleet()[:40]
    first, second = texts[:30], [texts[5], *texts[30:], texts[31]]

    async def run() -> list[Sequence[str]]:
        engine = Recorder()
        async with Batcher(engine, max_batch_size=64, max_delay_ms=50.0) as batcher:
            flight = SingleFlight(lambda t, lane: batcher.submit(t, lane), engine.dim)
            calls = (
                flight.embed(as_sent(fast, c), lane="dispatch", caller="d") for c in (first, second)
            )
            await asyncio.gather(*calls)
        return engine.tokenized

    batches = asyncio.run(run())
    assert len(batches) == 1 and isinstance(batches[0], TokenizedTexts)
    assert sorted(batches[0]) == sorted(texts)  # each new text once
    assert each_ids(batches[0]) == reference(fast, list(batches[0]))


def test_digest_names_the_file_and_the_truncation() -> None:
    a, b = FastTokenizer(default_model_path(), 256), FastTokenizer(default_model_path(), 256)
    assert a.digest == b.digest != FastTokenizer(default_model_path(), 128).digest


# -- over IPC: the worker tokenizes, the engine process pads -----------------------------------


class Client:
    """The ``RpcClient`` of ``RemoteEngine``: the engine's facts from its last ping."""

    def __init__(self, tokenizer: FastTokenizer | None) -> None:
        self.up = True
        self.facts = {
            "tokenizer": None
            if tokenizer is None
            else {
                "path": str(tokenizer.path.parent),
                "max_seq_length": tokenizer.max_seq_length,
                "digest": tokenizer.digest,
            }
        }


def on_the_wire(
    remote: RemoteEngine, texts: list[str]
) -> tuple[dict[str, object], list[zmq.Frame]]:
    header, blobs = remote._token_ids(texts)
    return {**header, "texts": texts}, [zmq.Frame(bytes(blob)) for blob in blobs]


def test_a_worker_sends_ids_the_engine_process_takes_as_they_are(fast: FastTokenizer) -> None:
    texts = [*real_fleet()[:40], "tab\there", "", "[MASK] me"]
    remote = RemoteEngine(Client(fast), FakeEngine().info)  # type: ignore[arg-type]
    message, frames = on_the_wire(remote, texts)
    got = tokenized(message, frames, fast)
    assert isinstance(got, TokenizedTexts) and got == texts
    assert each_ids(got) == reference(fast, texts)


def test_no_ids_for_an_engine_without_the_same_tokenizer(fast: FastTokenizer) -> None:
    texts = real_fleet()[:5]
    remote = RemoteEngine(Client(None), FakeEngine().info)  # type: ignore[arg-type]
    assert remote._token_ids(texts) == ({}, ())  # an engine that tokenizes itself (fake)
    message, frames = on_the_wire(RemoteEngine(Client(fast), FakeEngine().info), texts)  # type: ignore[arg-type]
    other = FastTokenizer(default_model_path(), 128)  # another truncation: other ids
    assert not isinstance(tokenized(message, frames, other), TokenizedTexts)
    assert not isinstance(tokenized(message, frames, None), TokenizedTexts)


class WithTokenizer(FakeEngine):
    def __init__(self, tokenizer: FastTokenizer | None) -> None:
        super().__init__()
        self._tokenizer = tokenizer

    def tokenizer(self) -> FastTokenizer | None:
        return self._tokenizer


def test_a_fallback_engine_takes_ids_only_when_both_engines_agree(fast: FastTokenizer) -> None:
    other = FastTokenizer(default_model_path(), 128)

    def pair(primary: Engine, fallback: Engine | None) -> FastTokenizer | None:
        return FallbackEngine(primary, fallback).tokenizer()

    assert pair(WithTokenizer(fast), None) is fast
    assert pair(WithTokenizer(fast), WithTokenizer(None)) is fast  # it tokenizes itself
    assert pair(WithTokenizer(fast), WithTokenizer(FastTokenizer(default_model_path(), 256)))
    assert pair(WithTokenizer(fast), WithTokenizer(other)) is None
    assert pair(WithTokenizer(None), None) is None


@pytest.mark.model
def test_the_torch_engine_embeds_texts_with_ids_as_it_embeds_them_plain() -> None:
    """The fixed-shape path (the GPU's, eager on the CPU here) cuts a batch into chunks of
    its largest bucket and the batcher into groups within the token budget: every slice
    keeps its own texts' ids, so the vectors equal those of the plain texts."""
    from engines.torch_engine import TorchEngine

    texts = [*real_fleet()[:18], "long " * 400, "van"]  # chunks of 8; one text over budget
    engine = TorchEngine(static_shapes=True, batch_buckets=(1, 8), seq_buckets=(16, 64))
    engine.load()
    tokenizer = engine.tokenizer()
    assert tokenizer is not None
    sent = as_sent(tokenizer, texts)
    plain = engine.embed(texts)
    assert np.allclose(engine.embed(sent), plain, atol=1e-6)
    other = as_sent(tokenizer, texts[::-1])  # the ids, not the strings, are what it runs
    assert np.allclose(engine.embed(TokenizedTexts(texts, other.flat, other.bounds)), plain[::-1])

    async def batched() -> Vectors:
        async with Batcher(engine, max_batch_size=64, max_batch_tokens=600) as batcher:
            parts = await asyncio.gather(batcher.submit(sent[:10]), batcher.submit(sent[10:]))
        return np.concatenate(parts)

    assert np.allclose(asyncio.run(batched()), plain, atol=1e-5)
