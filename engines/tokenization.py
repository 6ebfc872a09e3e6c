"""Tokenization straight to numpy, for the engines that feed fixed-shape buffers.

``FastTokenizer`` reads the model's ``tokenizer.json`` with HF ``tokenizers`` (no torch, no
transformers) and gives the ids sentence-transformers would feed the model (same normaliser,
special tokens and truncation at ``max_seq_length``), as int64 arrays padded to any
``(rows, cols)`` at least as large as the batch: the bucket shapes of CUDA graphs and
TensorRT profiles. Building arrays from numpy, not Python lists through ``torch.tensor``, is
what keeps tokenization off the critical path (FACTS.md: 5x).

Word cache. A lowercasing BERT WordPiece tokenizer (this model's) normalises character by
character, splits on whitespace and on every punctuation character, then runs WordPiece on each
word alone: the ids of a text are the ids of its space-separated chunks, joined, between [CLS]
and [SEP]. Feature texts reuse a small vocabulary (a few hundred words, ~1,100 chunks in
3,000 drivers, ~21,000 in 200,000), so ``FastTokenizer`` keeps the ids of each chunk (an ASCII
one's from its words, each kept too: ``_WORD`` is BERT's split of lowercased ASCII) and joins
them. On fleet texts in requests of 32 (``bench/tokenize_bench.py`` on the 2-core box,
2026-12-03): 144,247 and 191,534 texts/s, 8.5-9x ``encode_batch`` on one core; word by word,
as before, 89,587 and 105,886 in the same turns (a regular expression and a lookup a word
where a chunk now takes a split and a lookup; a driver's text is ~30 chunks, ~60 words).
Texts with any other whitespace, a control character or an added token ("[MASK]") go to
``encode_batch``. tests/test_tokenization.py proves the ids equal on real fleets and on random
Unicode strings.

``TokenizedTexts``: texts whose ids some other process computed with the same tokenizer (the
workers tokenize their misses through the word cache, so the engine process only pads), the
ids of all of them in one int32 array beside the plain strings: no object per text on the
engine process's loop (one a text cost that loop ~0.5 us of its ~4.5 a new text on the 2-core
box, and the padding a Python call a text). Slices, ``take`` and ``join`` keep the ids;
``encode`` pads them as they are.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, SupportsIndex, overload

import numpy as np
import numpy.typing as npt

from engines.base import Batch, EngineUnavailableError

IntArray = npt.NDArray[np.int64]
Ids = Sequence[int]  # one text's token ids, [CLS] and [SEP] included

# After lowercasing, a printable-ASCII text's words: runs of letters and digits, and each other
# non-space character alone (BERT counts every ASCII symbol as punctuation, "_" included).
_WORD = re.compile(r"[a-z0-9]+|[^a-z0-9 ]")
# The word cache's bounds (a client choosing its texts must not grow a worker's memory): past
# MAX_CACHED_WORDS, or for a word longer than MAX_CACHED_WORD_CHARS, ids are computed each
# time. Worst case ~50k x (64 chars + their ids) = tens of MB; a fleet's texts need hundreds.
MAX_CACHED_WORDS = 50_000
MAX_CACHED_WORD_CHARS = 64

# Shape buckets: a batch runs at the smallest bucket that holds it (graphs and profiles exist
# for these shapes only). Powers of two keep padding under 2x; the sequence buckets also have
# the steps between (1.5x): a fleet's driver texts are 31-86 tokens, so their batches ran at
# 128 columns, and at 96 the H200's forward of 256 of them took 2.83 ms against 3.55, the
# same vectors (``bench/seq_bucket_bench.py``, docs/BENCHMARKS.md, 2026-12-04).
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_SEQ_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256)


def bucket_for(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= size; ``ValueError`` when none is large enough."""
    for bucket in buckets:
        if bucket >= size:
            return bucket
    raise ValueError(f"{size} exceeds the largest bucket {buckets[-1]}")


def bucket_lengths(lengths: IntArray, buckets: Sequence[int]) -> IntArray:
    """Each length rounded up to its bucket (lengths never exceed the last bucket)."""
    table = np.asarray(buckets, dtype=np.int64)
    return table[np.minimum(np.searchsorted(table, lengths), len(table) - 1)]


def seq_buckets_for(
    max_seq_length: int, buckets: Sequence[int] = DEFAULT_SEQ_BUCKETS
) -> tuple[int, ...]:
    """``buckets`` below ``max_seq_length``, then ``max_seq_length`` itself (always the last)."""
    return (*sorted(b for b in set(buckets) if b < max_seq_length), max_seq_length)


@dataclass(frozen=True)
class Tokens:
    """A padded batch: rows past ``size`` and columns past each text's length are padding."""

    input_ids: IntArray  # (rows, cols) int64
    attention_mask: IntArray  # (rows, cols) int64, 1 for real tokens
    size: int  # real texts
    tokens: int  # real tokens
    longest: int  # real length of the longest text
    lengths: IntArray  # (size,) real length of each text


def _bounds(counts: IntArray) -> IntArray:
    """Where each of ``len(counts)`` runs begins in their concatenation, and where the last
    ends (``len(counts) + 1`` offsets from 0)."""
    bounds = np.zeros(len(counts) + 1, dtype="<i8")
    np.cumsum(counts, out=bounds[1:])
    return bounds


def owned(texts: Sequence[str]) -> list[str]:
    """``texts`` as a list to keep: ``TokenizedTexts`` as they are (read-only, their ids
    with them), any other sequence copied."""
    return texts if isinstance(texts, TokenizedTexts) else list(texts)


class TokenizedTexts(list[str]):
    """Plain texts with their token ids (from a ``FastTokenizer`` of the same ``digest``):
    text ``i``'s ids are ``flat[bounds[i]:bounds[i + 1]]``. A list of its texts to anyone who
    does not look further; a slice is one too (sharing ``flat``); treat it as read-only."""

    __slots__ = ("bounds", "flat")

    def __init__(self, texts: Sequence[str], flat: npt.NDArray[np.int32], bounds: IntArray) -> None:
        super().__init__(texts)
        if len(bounds) != len(self) + 1:
            raise ValueError(f"{len(bounds)} bounds for {len(self)} texts")
        self.flat, self.bounds = flat, bounds

    @overload
    def __getitem__(self, index: SupportsIndex) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: SupportsIndex | slice) -> str | list[str]:
        if not isinstance(index, slice):
            return super().__getitem__(index)
        start, stop, step = index.indices(len(self))
        if step != 1:
            return self.take(range(start, stop, step))
        stop = max(start, stop)
        return TokenizedTexts(super().__getitem__(index), self.flat, self.bounds[start : stop + 1])

    @classmethod
    def of(cls, texts: Sequence[str], ids: Sequence[Ids]) -> TokenizedTexts:
        """``texts`` with ``ids[i]`` the ids of text ``i`` (as a worker sends them)."""
        bounds = _bounds(np.fromiter(map(len, ids), np.int64, len(ids)))
        return cls(texts, np.fromiter(chain.from_iterable(ids), "<i4", int(bounds[-1])), bounds)

    def take(self, positions: Sequence[int]) -> TokenizedTexts:
        """The texts at ``positions``, in that order, with their ids (copied together)."""
        at = np.asarray(positions, dtype=np.int64)
        starts, lengths = self.bounds[at], np.diff(self.bounds)[at]
        bounds = _bounds(lengths)
        # each kept id's place in ``flat``: its text's start, plus its rank within the text
        index = np.repeat(starts - bounds[:-1], lengths) + np.arange(bounds[-1])
        get = super().__getitem__
        return TokenizedTexts([get(i) for i in at.tolist()], self.flat[index], bounds)

    def ids(self) -> tuple[npt.NDArray[np.int32], IntArray]:
        """All the ids, in order, and each text's count of them."""
        return self.flat[self.bounds[0] : self.bounds[-1]], np.diff(self.bounds)

    @staticmethod
    def join(parts: Sequence[Sequence[str]]) -> list[str]:
        """The parts' texts in order: a ``TokenizedTexts`` when each part is one, else a plain
        list (the engine then tokenizes every text itself)."""
        texts = [text for part in parts for text in part]
        if not parts or not all(isinstance(part, TokenizedTexts) for part in parts):
            return texts
        ids = [part.ids() for part in parts if isinstance(part, TokenizedTexts)]
        bounds = _bounds(np.concatenate([counts for _, counts in ids]))
        return TokenizedTexts(texts, np.concatenate([flat for flat, _ in ids]), bounds)


class _WordIds(dict[str, tuple[int, ...]]):
    """word -> its WordPiece ids (no special tokens), computed on first sight."""

    def __init__(self, encode: Any, lock: threading.Lock) -> None:
        super().__init__()
        self._encode, self._lock = encode, lock

    def __missing__(self, word: str) -> tuple[int, ...]:
        with self._lock:  # HF tokenizers raise "Already borrowed" when used concurrently
            ids = tuple(self._encode(word, add_special_tokens=False).ids)
        if len(self) < MAX_CACHED_WORDS and len(word) <= MAX_CACHED_WORD_CHARS:
            self[word] = ids
        return ids


class _ChunkIds(dict[str, tuple[int, ...]]):
    """space-separated chunk -> its ids (no special tokens), computed on first sight: an
    ASCII chunk's from its words (``_WORD``, lowercased), another's by the tokenizer itself
    (its own normalisation of the whole chunk). Same bounds as the words."""

    def __init__(self, words: _WordIds) -> None:
        super().__init__()
        self._words = words

    def __missing__(self, chunk: str) -> tuple[int, ...]:
        words = self._words
        if chunk.isascii():
            ids = tuple(chain.from_iterable(map(words.__getitem__, _WORD.findall(chunk.lower()))))
        else:
            ids = words[chunk]
        if len(self) < MAX_CACHED_WORDS and len(chunk) <= MAX_CACHED_WORD_CHARS:
            self[chunk] = ids
        return ids


def _plain_bert(config: dict[str, Any]) -> bool:
    """A lowercasing BERT normaliser, BERT's split and WordPiece: the word cache is exact."""
    normalizer, pre = config.get("normalizer") or {}, config.get("pre_tokenizer") or {}
    return (
        normalizer.get("type") == "BertNormalizer"
        and normalizer.get("lowercase") is True
        and pre.get("type") == "BertPreTokenizer"
        and (config.get("model") or {}).get("type") == "WordPiece"
    )


class FastTokenizer:
    """The model's ``tokenizer.json`` with truncation at ``max_seq_length`` and no padding.

    ``digest`` names the file and the truncation: ids from tokenizers of equal digests are
    interchangeable. Thread-safe."""

    def __init__(self, model_path: Path, max_seq_length: int) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise EngineUnavailableError(
                "fast tokenization needs the tokenizers package: pip install tokenizers"
            ) from exc
        path = Path(model_path) / "tokenizer.json"
        if not path.is_file():
            raise EngineUnavailableError(f"no tokenizer.json in {model_path} (a fast tokenizer)")
        raw = path.read_bytes()
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
        tokenizer.no_padding()  # the file may pin a fixed padding; we pad to buckets ourselves
        tokenizer.enable_truncation(max_length=max_seq_length)
        self.path = path
        self.digest = hashlib.blake2b(
            raw + f";{max_seq_length}".encode(), digest_size=8
        ).hexdigest()
        self._tokenizer = tokenizer
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.max_seq_length = max_seq_length
        self._lock = threading.Lock()  # settings are never changed after this, but be safe
        config = json.loads(raw)
        self._words = _WordIds(tokenizer.encode, self._lock) if _plain_bert(config) else None
        self._chunks = _ChunkIds(self._words) if self._words is not None else None
        self._added = tuple(token["content"] for token in config.get("added_tokens") or ())
        bare = tokenizer.encode("a", add_special_tokens=False).ids
        whole = tokenizer.encode("a").ids
        at = next(i for i in range(len(whole)) if whole[i : i + len(bare)] == bare)
        self._prefix, self._suffix = whole[:at], whole[at + len(bare) :]
        self._room = max_seq_length - len(self._prefix) - len(self._suffix)

    def _cached(self, text: str) -> bool:
        """Whether the word cache gives ``text``'s exact ids (see the module docstring):
        printable, so " " is its only whitespace, and no added token in it."""
        if self._words is None or not text.isprintable():
            return False
        lowered = text.lower()
        return not any(token in text or token in lowered for token in self._added)

    @staticmethod
    def _body(text: str, chunks: _ChunkIds) -> list[int]:
        return list(chain.from_iterable(map(chunks.__getitem__, filter(None, text.split(" ")))))

    def ids(self, texts: Sequence[str], *, cached: bool = True) -> list[Ids]:
        """Each text's token ids, special tokens included, truncated at ``max_seq_length``.

        ``cached``: through the word cache where it is exact (one core, holding the GIL: for
        a process with cores to spare, a worker); else ``encode_batch`` (Rust on every core,
        without the GIL: for the engine process, whose one interpreter drives the device)."""
        out: list[Ids] = [()] * len(texts)
        rest: list[int] = []
        chunks, prefix, suffix, room = self._chunks, self._prefix, self._suffix, self._room
        for i, text in enumerate(texts):
            if cached and chunks is not None and self._cached(text):
                out[i] = [*prefix, *self._body(text, chunks)[:room], *suffix]
            else:
                rest.append(i)
        if rest:
            with self._lock:
                encodings = self._encode_batch([texts[i] for i in rest])
            for i, encoding in zip(rest, encodings, strict=True):
                out[i] = encoding.ids
        return out

    def encode(
        self,
        texts: Sequence[str],
        batch_buckets: Sequence[int] | None = None,
        seq_buckets: Sequence[int] | None = None,
    ) -> Tokens:
        """Rows padded to a batch bucket, columns to a sequence bucket (default: no padding).

        ``ValueError`` when the batch is larger than the largest batch bucket. The ids of
        ``TokenizedTexts`` are padded as they are.
        """
        if isinstance(texts, TokenizedTexts):
            return pad_flat(*texts.ids(), batch_buckets, seq_buckets)
        return pad(self.ids(texts, cached=False), batch_buckets, seq_buckets)


def pad(
    ids: Sequence[Ids],
    batch_buckets: Sequence[int] | None = None,
    seq_buckets: Sequence[int] | None = None,
) -> Tokens:
    """Texts' ids as one zero-padded batch (``FastTokenizer.encode``'s buckets)."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    return pad_flat(flat, lengths, batch_buckets, seq_buckets)


def pad_flat(
    flat: npt.NDArray[np.integer[Any]],
    lengths: IntArray,
    batch_buckets: Sequence[int] | None = None,
    seq_buckets: Sequence[int] | None = None,
) -> Tokens:
    """``pad`` of texts whose ids are ``flat``, ``lengths[i]`` of them for text ``i``."""
    size = len(lengths)
    total, longest = int(lengths.sum()), int(lengths.max()) if size else 0
    rows = bucket_for(size, batch_buckets) if batch_buckets else size
    cols = bucket_for(longest, seq_buckets) if seq_buckets else longest
    attention_mask = np.zeros((rows, cols), dtype=np.int64)
    attention_mask[:size] = np.arange(cols) < lengths[:, None]
    input_ids = np.zeros((rows, cols), dtype=np.int64)
    input_ids[attention_mask.astype(bool)] = flat  # row-major: each row's first columns
    return Tokens(input_ids, attention_mask, size, total, longest, lengths)


def chunked_batch(
    size: int, chunks: Sequence[Tokens], seq_buckets: Sequence[int], data: dict[str, Any]
) -> Batch:
    """The ``Batch`` of texts tokenized in bucket-padded ``chunks`` (fixed-shape engines)."""
    lengths = np.concatenate([chunk.lengths for chunk in chunks]) if chunks else np.empty(0)
    return Batch(
        size=size,
        tokens=sum(chunk.tokens for chunk in chunks),
        data=data,
        seq_lengths=bucket_lengths(lengths.astype(np.int64), seq_buckets),
    )
