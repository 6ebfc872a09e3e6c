"""Tokenization straight to numpy, for the engines that feed fixed-shape buffers.

``FastTokenizer`` reads the model's ``tokenizer.json`` with HF ``tokenizers`` (no torch, no
transformers) and gives the ids sentence-transformers would feed the model (same normaliser,
special tokens and truncation at ``max_seq_length``), as int64 arrays padded to any
``(rows, cols)`` at least as large as the batch: the bucket shapes of CUDA graphs and
TensorRT profiles. Building arrays from numpy, not Python lists through ``torch.tensor``, is
what keeps tokenization off the critical path (FACTS.md: 5x).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.base import Batch, EngineUnavailableError

IntArray = npt.NDArray[np.int64]

# Shape buckets: a batch runs at the smallest bucket that holds it (graphs and profiles exist
# for these shapes only). Powers of two keep padding under 2x.
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_SEQ_BUCKETS = (16, 32, 64, 128, 256)


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


class FastTokenizer:
    """The model's ``tokenizer.json`` with truncation at ``max_seq_length`` and no padding."""

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
        tokenizer = Tokenizer.from_file(str(path))
        tokenizer.no_padding()  # the file may pin a fixed padding; we pad to buckets ourselves
        tokenizer.enable_truncation(max_length=max_seq_length)
        self._tokenizer = tokenizer
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.max_seq_length = max_seq_length
        self._lock = threading.Lock()  # settings are never changed after this, but be safe

    def encode(
        self,
        texts: Sequence[str],
        batch_buckets: Sequence[int] | None = None,
        seq_buckets: Sequence[int] | None = None,
    ) -> Tokens:
        """Rows padded to a batch bucket, columns to a sequence bucket (default: no padding).

        ``ValueError`` when the batch is larger than the largest batch bucket.
        """
        with self._lock:
            encodings = self._encode_batch(list(texts))
        size = len(encodings)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=size)
        longest = int(lengths.max()) if size else 0
        rows = bucket_for(size, batch_buckets) if batch_buckets else size
        cols = bucket_for(longest, seq_buckets) if seq_buckets else longest
        input_ids = np.zeros((rows, cols), dtype=np.int64)
        for row, encoding in enumerate(encodings):
            input_ids[row, : lengths[row]] = encoding.ids
        attention_mask = np.zeros((rows, cols), dtype=np.int64)
        attention_mask[:size] = np.arange(cols) < lengths[:, None]
        return Tokens(input_ids, attention_mask, size, int(lengths.sum()), longest, lengths)


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
