"""The exported ONNX model (pooling + L2 normalisation in the graph) on onnxruntime's CPU.

``load`` exports the model once into ``cache_dir`` (``onnx_export``; needs torch only then)
and opens an ``InferenceSession`` whose intra-op threads do not spin: spinning threads
doubled torch's latency in the same process on 2 cores (FACTS.md). Tokenization is
``FastTokenizer`` (numpy, no torch). onnxruntime is imported in ``load`` only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import (
    Batch,
    Engine,
    EngineError,
    EngineUnavailableError,
)
from engines.tokenization import FastTokenizer
from engines.torch_engine import resolve_model_dir, sentence_model_info


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fleetcache/onnx`` (``~/.cache/fleetcache/onnx``)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fleetcache" / "onnx"


class OnnxRuntimeEngine(Engine):
    """sentence-transformers vectors from an exported ONNX graph on the CPU."""

    def __init__(
        self,
        model_path: str | None = None,
        cache_dir: str | None = None,
        max_seq_length: int = 256,
        fp16: bool = False,
        threads: int | None = None,
    ) -> None:
        if max_seq_length <= 0:
            raise ValueError(f"max_seq_length must be positive, got {max_seq_length}")
        self.model_path = resolve_model_dir(model_path)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.fp16 = fp16
        self.threads = threads
        precision = "fp16" if fp16 else "fp32"
        self.info = sentence_model_info(
            "onnxruntime",
            self.model_path,
            device="cpu",
            precision=precision,
            max_seq_length=max_seq_length,
        )
        self.onnx_path: Path | None = None
        self._session: Any = None
        self._tokenizer: FastTokenizer | None = None

    def load(self) -> None:
        if self._session is not None:
            return
        try:
            import onnxruntime
        except ImportError as exc:
            raise EngineUnavailableError(
                "engine 'onnxruntime' needs onnxruntime: pip install 'fleetcache[onnx]'"
            ) from exc
        from engines.onnx_export import export_onnx

        self.onnx_path = export_onnx(self.model_path, self.cache_dir, fp16=self.fp16)
        options = onnxruntime.SessionOptions()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        if self.threads is not None:
            options.intra_op_num_threads = self.threads
        try:
            self._session = onnxruntime.InferenceSession(
                str(self.onnx_path), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # a corrupt cache file, an unsupported op
            raise EngineUnavailableError(f"cannot open {self.onnx_path}: {exc}") from exc
        self._tokenizer = FastTokenizer(self.model_path, self.info.max_seq_length)

    def tokenizer(self) -> FastTokenizer | None:
        return self._tokenizer

    def tokenize(self, texts: Sequence[str]) -> Batch:
        tokens = self._loaded_tokenizer().encode(texts)
        return Batch(
            size=tokens.size,
            tokens=tokens.tokens,
            data={"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask},
            seq_lengths=tokens.lengths,  # padded to the longest text, no buckets
        )

    def forward(self, batch: Batch) -> Any:
        if self._session is None:
            raise EngineUnavailableError("OnnxRuntimeEngine.load() has not been called")
        if batch.size == 0:
            return np.empty((0, self.dim), dtype=np.float32)
        try:
            return self._session.run(None, batch.data)[0]
        except Exception as exc:
            raise EngineError(f"onnxruntime forward failed: {exc}") from exc

    def health(self) -> dict[str, Any]:
        return {"ok": self._session is not None, "device": "cpu", "onnx": str(self.onnx_path)}

    def close(self) -> None:
        self._session = None

    def _loaded_tokenizer(self) -> FastTokenizer:
        if self._tokenizer is None:
            raise EngineUnavailableError("OnnxRuntimeEngine.load() has not been called")
        return self._tokenizer
