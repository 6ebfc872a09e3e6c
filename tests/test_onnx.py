"""ONNX export (pooling + normalisation in the graph, cached by model hash) and onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engines.base import EngineUnavailableError
from engines.registry import create_engine
from engines.tokenization import FastTokenizer, bucket_for, seq_buckets_for
from engines.torch_engine import TorchEngine, default_model_path, model_files_digest
from tests.test_engines import PARITY_TEXTS

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(default_model_path()), device="cpu")
    return model.encode(PARITY_TEXTS, normalize_embeddings=True)


# -- tokenization shared by the fixed-shape engines ---------------------------------------------


def test_buckets() -> None:
    assert [bucket_for(n, (1, 4, 16)) for n in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16]
    with pytest.raises(ValueError, match="largest bucket"):
        bucket_for(17, (1, 4, 16))
    assert seq_buckets_for(256) == (16, 32, 48, 64, 96, 128, 192, 256)
    assert seq_buckets_for(100) == (16, 32, 48, 64, 96, 100)


@pytest.mark.model
def test_fast_tokenizer_matches_sentence_transformers_and_pads_to_buckets() -> None:
    engine = TorchEngine(max_seq_length=256)
    engine.load()
    expected = engine._preprocess(PARITY_TEXTS)
    fast = FastTokenizer(default_model_path(), 256)
    tokens = fast.encode(PARITY_TEXTS)
    np.testing.assert_array_equal(tokens.input_ids, expected["input_ids"].numpy())
    np.testing.assert_array_equal(tokens.attention_mask, expected["attention_mask"].numpy())
    assert tokens.tokens == int(expected["attention_mask"].sum())
    padded = fast.encode(["a b c", "d"], batch_buckets=(1, 4), seq_buckets=(8, 256))
    assert padded.input_ids.shape == (4, 8)
    assert padded.size == 2
    assert padded.attention_mask.sum(axis=1).tolist() == [5, 3, 0, 0]


# -- export -------------------------------------------------------------------------------------


@pytest.mark.model
def test_export_has_dynamic_axes_and_is_cached_by_model_hash(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engines.onnx_export import export_onnx

    path = export_onnx(default_model_path(), cache_dir)
    graph = onnx.load(str(path)).graph
    inputs = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in graph.input
    }
    assert inputs == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
    output = graph.output[0]
    assert output.name == "sentence_embedding"
    assert output.type.tensor_type.shape.dim[0].dim_param == "batch"  # dim 1 is inferred: 384
    assert list(cache_dir.glob("*.tmp")) == []

    import torch

    def no_export(*args: object, **kwargs: object) -> None:
        raise AssertionError("exported again instead of using the cache")

    monkeypatch.setattr(torch.onnx, "export", no_export)
    assert export_onnx(default_model_path(), cache_dir) == path
    assert path.name.startswith(model_files_digest(default_model_path()))


# -- onnxruntime engine ---------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize(("fp16", "target"), [(False, 0.9999), (True, 0.999)])
def test_onnxruntime_matches_sentence_transformers(
    cache_dir: Path, reference: np.ndarray, fp16: bool, target: float
) -> None:
    engine = create_engine("onnxruntime", cache_dir=str(cache_dir), fp16=fp16)
    assert engine.health()["ok"] is False
    engine.load()
    engine.warmup()
    vectors = engine.embed(PARITY_TEXTS)
    assert vectors.shape == (len(PARITY_TEXTS), 384)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.sum(vectors * reference, axis=1).min() >= target
    together = engine.embed(PARITY_TEXTS[:8])
    alone = np.concatenate([engine.embed([text]) for text in PARITY_TEXTS[:8]])
    assert np.sum(together * alone, axis=1).min() >= target
    assert engine.embed([]).shape == (0, 384)
    assert engine.info.kind == "onnxruntime"
    assert engine.info.precision == ("fp16" if fp16 else "fp32")


def test_onnxruntime_fingerprint_and_errors(tmp_path: Path) -> None:
    from engines.onnxruntime_engine import OnnxRuntimeEngine

    fp32 = OnnxRuntimeEngine(cache_dir=str(tmp_path))
    assert fp32.fingerprint == OnnxRuntimeEngine(cache_dir=str(tmp_path / "x")).fingerprint
    assert fp32.fingerprint != OnnxRuntimeEngine(fp16=True).fingerprint
    assert fp32.fingerprint != TorchEngine().fingerprint
    with pytest.raises(EngineUnavailableError, match="load"):
        fp32.embed(["not loaded"])
    with pytest.raises(EngineUnavailableError, match="not found"):
        OnnxRuntimeEngine(model_path=str(tmp_path / "missing"))


@pytest.mark.model
def test_static_shape_torch_path_matches_on_cpu(reference: np.ndarray) -> None:
    """The CUDA path's bucketing and pooling, run eagerly on the CPU (no graphs there)."""
    engine = TorchEngine(
        static_shapes=True, max_seq_length=256, batch_buckets=(1, 8), seq_buckets=(16,)
    )
    engine.load()
    vectors = engine.embed(PARITY_TEXTS)  # 50 texts: chunks of 8, padded to (8, 16|256)
    assert np.sum(vectors * reference, axis=1).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)  # unit rows
    assert engine.health()["cuda_graphs"] == 0
