"""A deterministic engine for tests: unit vectors seeded by a hash of each text.

The same text always gives the same vector (across processes and machines), different texts
give unrelated vectors, and nothing heavier than numpy is imported. ``calls`` and ``items``
count every ``forward`` call and every text it received (including calls that then fail), so
tests can check exactly what reached the engine.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence

import numpy as np

from engines.base import Batch, Engine, EngineError, EngineInfo, Vectors, make_fingerprint


class FakeEngine(Engine):
    """Hash-seeded unit vectors; ``delay_s`` slows ``forward``, ``fail_on`` makes it raise.
    ``device`` is a name only (``cpu`` or ``cpu:N``): it runs on the CPU whatever it says, so
    that tests can run one fake engine process per "device" of a list; it is not part of the
    fingerprint, so every such device shares one cache namespace."""

    def __init__(
        self,
        dim: int = 384,
        delay_s: float = 0.0,
        fail_on: str | None = None,
        device: str = "cpu",
    ) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        if device == "auto":
            device = "cpu"
        if device != "cpu" and not (device.startswith("cpu:") and device[4:].isdigit()):
            raise ValueError(f"the fake engine's device is 'cpu' or 'cpu:N', got {device!r}")
        model = f"fake-hash-{dim}"
        self.info = EngineInfo(
            kind="fake",
            device=device,
            precision="fp32",
            model=model,
            dim=dim,
            max_seq_length=256,  # nominal: the fake hashes the whole text, it never truncates
            fingerprint=make_fingerprint(kind="fake", model=model, dim=dim),
        )
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.calls = 0
        self.items = 0
        self._lock = threading.Lock()

    def vector(self, text: str) -> Vectors:
        """The unit vector of one text (what ``embed`` returns for it, row by row)."""
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        vector = np.random.default_rng(seed).standard_normal(self.dim, dtype=np.float32)
        return vector / np.float32(np.linalg.norm(vector))

    def tokenize(self, texts: Sequence[str]) -> Batch:
        texts = list(texts)
        words = np.fromiter((len(text.split()) for text in texts), np.int64, len(texts))
        return Batch(
            size=len(texts),
            tokens=int(words.sum()),
            data={"texts": texts},
            seq_lengths=np.maximum(words, 1),  # a "token" is a word; an empty text costs one
        )

    def forward(self, batch: Batch) -> Vectors:
        texts: list[str] = batch.data["texts"]
        with self._lock:
            self.calls += 1
            self.items += len(texts)
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        if self.fail_on is not None and any(self.fail_on in text for text in texts):
            raise EngineError(f"fake engine asked to fail on {self.fail_on!r}")
        if not texts:
            return np.empty((0, self.dim), dtype=np.float32)
        return np.stack([self.vector(text) for text in texts])

    def postprocess(self, output: Vectors, batch: Batch) -> Vectors:
        # Rows are unit already; not renormalising keeps embed() bit-identical to vector(),
        # whatever the batch composition.
        return np.ascontiguousarray(output, dtype=np.float32)
