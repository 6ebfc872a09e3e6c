"""The one small interface every inference engine implements.

Exceptions::

    EngineError                 anything an engine or the batcher raises on purpose
     +-- EngineUnavailableError the engine cannot run here (missing extra, no GPU), or it is
     |                          unhealthy and nothing may serve in its place (HTTP 503)
     +-- QueueFullError         the batcher's bounded queue is full (the proxy answers 429)
     |    +-- TooLargeError     more texts than the queue can ever hold (413: retrying is useless)
     +-- DeadlineExceededError  an item's deadline passed before it reached the engine

An engine turns texts into L2-normalised float32 vectors in three steps: ``tokenize`` (CPU, any
thread), ``forward`` (the device, called from the batcher's single engine thread) and
``postprocess`` (to a contiguous ``(n, dim)`` float32 array of unit rows). ``embed`` runs the
three. ``fingerprint`` names everything that changes the vectors: two engines with the same
fingerprint give interchangeable vectors, and the cache namespace is derived from it.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from engines.tokenization import FastTokenizer

Vectors = npt.NDArray[np.float32]


class EngineError(RuntimeError):
    """An engine failed; the waiters of the batch that hit it get this error."""


class BatchError(EngineError):
    """One batch failed while the engine still answers (a probe right after it succeeded):
    what the batch held is to blame, so the batcher runs each request of it alone."""


class EngineUnavailableError(EngineError):
    """The engine cannot run here; the message says what is missing (extra, GPU, file)."""


class QueueFullError(EngineError):
    """The batcher's queue is full; retry later (HTTP 429)."""


class TooLargeError(QueueFullError):
    """More texts at once than the queue can ever hold: no retry would help (HTTP 413)."""


class DeadlineExceededError(EngineError):
    """The item waited past its deadline and was dropped before the engine saw it."""


@dataclass(frozen=True)
class EngineInfo:
    kind: str  # tensorrt | torch | onnxruntime | fake
    device: str  # "cpu", "cuda:0 (NVIDIA H200)", ...
    precision: str  # fp32 | fp16
    model: str  # model name or path
    dim: int
    max_seq_length: int
    fingerprint: str


@dataclass
class Batch:
    """What ``tokenize`` hands to ``forward``: engine-specific tensors plus the count."""

    size: int
    tokens: int  # real (unpadded) tokens in the batch
    data: dict[str, Any] = field(default_factory=dict)
    # Per text, the sequence length it is padded to when alone (its sequence bucket); a batch
    # costs size x max of these (the batcher's token budget). None: unknown, the batcher
    # assumes max_seq_length for every text.
    seq_lengths: npt.NDArray[np.int64] | None = None


def make_fingerprint(**parts: object) -> str:
    """A short stable hash of everything that changes the vectors (sorted key=value pairs)."""
    text = ";".join(f"{k}={parts[k]}" for k in sorted(parts))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class Engine(ABC):
    """Base class; subclasses set ``info`` in ``__init__`` and load weights in ``load``."""

    info: EngineInfo

    @property
    def fingerprint(self) -> str:
        return self.info.fingerprint

    @property
    def dim(self) -> int:
        return self.info.dim

    def load(self) -> None:  # noqa: B027 - optional hook
        """Load weights and allocate buffers (called once, off the event loop)."""

    def warmup(self) -> None:
        """Run every shape the engine will see so no request pays for first-use costs."""
        self.embed(["warm-up"] * 4)

    @abstractmethod
    def tokenize(self, texts: Sequence[str]) -> Batch: ...

    @abstractmethod
    def forward(self, batch: Batch) -> Any: ...

    def postprocess(self, output: Any, batch: Batch) -> Vectors:
        vectors = np.ascontiguousarray(np.asarray(output, dtype=np.float32))
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.maximum(norms, 1e-12)

    def embed(self, texts: Sequence[str]) -> Vectors:
        batch = self.tokenize(texts)
        return self.postprocess(self.forward(batch), batch)

    def tokenizer(self) -> FastTokenizer | None:
        """The tokenizer whose ids this engine pads as they are when texts come with them
        (``engines.tokenization.TokenizedTexts``); None: it tokenizes every text itself."""
        return None

    def padded_lengths(self, texts: Sequence[str]) -> npt.NDArray[np.int64] | None:
        """Each text's padded length as ``tokenize`` would give it (``Batch.seq_lengths``),
        when it is known without tokenizing (texts that come with this engine's ids): the
        batcher then forms its batches within the token budget. None: known once tokenized
        (the batcher's engine thread splits a batch over the budget)."""
        return None

    def health(self) -> dict[str, Any]:
        """Cheap liveness facts for /readyz and /v1/stats; never raises.

        ``ok`` is required. An engine that judges its own health (``FallbackEngine``) adds
        ``reason`` (why not ok) and ``serving`` (``primary`` | ``fallback`` | ``none``); the
        batcher reports them and refuses submissions at once while ``serving`` is ``none``.
        """
        return {"ok": True}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release device memory, streams and threads."""
