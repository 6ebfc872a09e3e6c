"""Engines: the fake, the registry, and the torch engine against sentence-transformers."""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.base import Batch, Engine, EngineError, EngineUnavailableError, Vectors
from engines.batcher import Batcher
from engines.fake import FakeEngine
from engines.registry import create_engine, cuda_ordinal, engine_kinds
from engines.tokenization import FastTokenizer, TokenizedTexts, bucket_lengths
from engines.torch_engine import TorchEngine, default_model_path, model_files_digest
from proxy.engine_host import build_engine
from proxy.settings import Settings

# -- FakeEngine ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "wrapper", ["engines.fallback.FallbackEngine", "proxy.telemetry.StageTimingEngine"]
)
def test_an_engine_wrapper_passes_every_hook_of_the_interface_on(wrapper: str) -> None:
    """A hook a wrapper leaves to ``Engine``'s default answers for the wrapper, not for the
    engine inside: so the timing wrapper hid ``padded_lengths`` from the batcher, which then
    cut batches a device child could have had ahead. ``embed`` is made of the others."""
    module, name = wrapper.rsplit(".", 1)
    wrapping = vars(getattr(importlib.import_module(module), name))
    hooks = {n for n, v in vars(Engine).items() if callable(v) and not n.startswith("_")}
    assert hooks - {"embed"} <= set(wrapping), hooks - {"embed"} - set(wrapping)


def test_fake_vectors_are_deterministic_unit_float32() -> None:
    texts = ["driver 1 van", "driver 2 truck", "driver 1 van", ""]
    first = FakeEngine().embed(texts)
    second = FakeEngine().embed(texts)
    assert first.dtype == np.float32
    assert first.shape == (4, 384)
    assert first.flags.c_contiguous
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(np.linalg.norm(first, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(first[0], first[2])
    assert abs(float(first[0] @ first[1])) < 0.5  # unrelated texts, unrelated vectors


def test_fake_embed_matches_vector_and_handles_empty() -> None:
    engine = FakeEngine(dim=16)
    np.testing.assert_array_equal(
        engine.embed(["a", "b"]), np.stack([engine.vector("a"), engine.vector("b")])
    )
    assert engine.embed([]).shape == (0, 16)


def test_fake_info_and_fingerprint() -> None:
    engine = FakeEngine(dim=8)
    info = engine.info
    assert (info.kind, info.device, info.precision, info.model, info.dim) == (
        "fake",
        "cpu",
        "fp32",
        "fake-hash-8",
        8,
    )
    assert engine.fingerprint == FakeEngine(dim=8, delay_s=0.5).fingerprint
    assert engine.fingerprint != FakeEngine(dim=16).fingerprint
    assert engine.health()["ok"] is True


def test_fake_counts_forward_calls_and_items() -> None:
    engine = FakeEngine(dim=8)
    engine.embed(["a", "b", "c"])
    engine.embed(["d"])
    assert (engine.calls, engine.items) == (2, 4)


def test_fake_fail_on_raises_engine_error_and_still_counts() -> None:
    engine = FakeEngine(dim=8, fail_on="boom")
    with pytest.raises(EngineError, match="boom"):
        engine.embed(["fine", "a boom here"])
    assert engine.embed(["fine"]).shape == (1, 8)
    assert (engine.calls, engine.items) == (2, 3)


def test_fake_sequence_lengths_are_words_at_least_one() -> None:
    batch = FakeEngine(dim=8).tokenize(["a b", "", "x y z"])
    assert batch.seq_lengths is not None
    assert batch.seq_lengths.tolist() == [2, 1, 3]
    assert batch.tokens == 5


def test_bucket_lengths_round_up_to_the_sequence_bucket() -> None:
    lengths = np.array([1, 16, 17, 64, 65, 256], dtype=np.int64)
    assert bucket_lengths(lengths, (16, 64, 256)).tolist() == [16, 16, 64, 64, 256, 256]


def test_fast_tokenizer_reports_each_texts_truncated_length() -> None:
    tokenizer = FastTokenizer(default_model_path(), 32)
    tokens = tokenizer.encode(["a b c", "word " * 100, "d"], seq_buckets=(8, 32))
    assert tokens.lengths.tolist() == [5, 32, 3]  # [CLS] ... [SEP], truncated at 32
    assert tokens.lengths.tolist() == tokens.attention_mask.sum(axis=1).tolist()


def test_fake_rejects_bad_dim() -> None:
    with pytest.raises(ValueError):
        FakeEngine(dim=0)


# -- registry --------------------------------------------------------------------------------


def test_registry_creates_fake_with_options() -> None:
    engine = create_engine("fake", dim=12, fail_on="x")
    assert isinstance(engine, FakeEngine)
    assert engine.dim == 12


def test_registry_unknown_kind_lists_known_kinds() -> None:
    assert engine_kinds() == ("fake", "onnxruntime", "tensorrt", "torch")
    with pytest.raises(
        ValueError, match=r"unknown engine kind 'nope'.*fake, onnxruntime, tensorrt, torch"
    ):
        create_engine("nope")


@pytest.mark.parametrize(
    ("kind", "module", "hint"),
    [
        ("onnxruntime", "onnxruntime", r"fleetcache\[onnx\]"),
        ("tensorrt", "tensorrt_rtx", r"fleetcache\[tensorrt-rtx\]"),
    ],
)
def test_registry_missing_extras_name_the_pip_extra(
    monkeypatch: pytest.MonkeyPatch, kind: str, module: str, hint: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # find_spec -> None
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(EngineUnavailableError, match=hint):
        create_engine(kind)


def test_registry_missing_dependency_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # find_spec -> None
    with pytest.raises(EngineUnavailableError, match=r"sentence_transformers.*pip install"):
        create_engine("torch")


def test_registry_gives_each_engine_the_device_it_runs_on() -> None:
    """``FLEETCACHE_DEVICE``'s names, as every engine is given them (``engine_options``)."""
    assert cuda_ordinal("auto") == cuda_ordinal("cuda") == 0 and cuda_ordinal("cuda:3") == 3
    with pytest.raises(
        EngineUnavailableError,
        match=r"runs on a CUDA GPU, not on 'cpu' \(use 'onnxruntime' or 'torch'\)",
    ):
        cuda_ordinal("cpu")
    pytest.importorskip("onnxruntime")
    with pytest.raises(
        EngineUnavailableError, match=r"the CPU, not on 'cuda:0' \(use 'tensorrt' or 'torch'\)"
    ):
        create_engine("onnxruntime", device="cuda:0")


def test_onnxruntime_is_built_from_settings() -> None:
    """``build_engine`` gives every engine a device: onnxruntime, which takes none, used to
    fail with a TypeError at start (``FLEETCACHE_ENGINE=onnxruntime``)."""
    pytest.importorskip("onnxruntime")
    from engines.onnxruntime_engine import OnnxRuntimeEngine

    assert isinstance(build_engine(Settings(engine="onnxruntime")).primary, OnnxRuntimeEngine)


def test_registry_creates_torch_without_loading() -> None:
    engine = create_engine("torch", max_seq_length=128)
    assert isinstance(engine, TorchEngine)
    assert engine.info.max_seq_length == 128
    assert engine.health()["ok"] is False
    with pytest.raises(EngineUnavailableError, match="load"):
        engine.embed(["not loaded"])


# -- TorchEngine without loading the weights ---------------------------------------------------


def test_torch_fingerprint_is_stable_and_names_what_changes_vectors() -> None:
    base = TorchEngine()
    assert TorchEngine().fingerprint == base.fingerprint
    assert TorchEngine(model_path=str(default_model_path())).fingerprint == base.fingerprint
    assert TorchEngine(max_seq_length=128).fingerprint != base.fingerprint
    assert TorchEngine(fp16=True).fingerprint != base.fingerprint
    assert base.info.precision == "fp32"
    assert TorchEngine(device="cuda").info.precision == "fp16"  # no GPU needed until load()
    assert base.dim == 384


def test_model_files_digest_follows_content_and_skips_exports(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    (tmp_path / "model.safetensors").write_bytes(b"weights-1")
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "model.json").write_text("exported copy")
    (tmp_path / "README.md").write_text("docs")
    first = model_files_digest(tmp_path)
    (tmp_path / "onnx" / "model.json").write_text("another exported copy")
    (tmp_path / "README.md").write_text("other docs")
    assert model_files_digest(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"weights-2")
    assert model_files_digest(tmp_path) != first
    assert TorchEngine(model_path=str(tmp_path)).dim == 4


def test_torch_missing_model_dir_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailableError, match="not found"):
        TorchEngine(model_path=str(tmp_path / "missing"))


# -- TorchEngine with the real model -----------------------------------------------------------

PARITY_TEXTS = [
    "driver 17 | van | refrigerated | hazmat: no | languages: en, de",
    "vehicle 4401 box truck, liftgate, 12 pallets, zone north",
    "",
    " ",
    "a",
    "Fahrer mit Kühlwagen, Führerschein C1E, spricht Deutsch und Türkisch",
    "司机 上海 冷链 货车",
    "conductor con furgoneta eléctrica en Madrid",
    "🚚 emoji-heavy record ✅✅✅",
    "UPPER CASE DRIVER RECORD WITH CAPITALS",
    "driver-42;van;lat=52.5200;lon=13.4050;shift=night",
    "pets ok, wheelchair ramp, child seat x2",
    "long " * 400,  # truncated at max_seq_length
    "token " * 255,
    "tabs\tand\nnewlines\r\nin the text",
    "numbers 1234567890 3.14159 -42 1e10",
    "https://example.com/driver?id=7&zone=3",
    "quotes \"double\" and 'single' and `back`",
] + [
    f"driver {i} vehicle {'van' if i % 2 else 'truck'} capacity {i * 3} kg zone {i % 7}"
    for i in range(32)
]


@pytest.fixture(scope="module")
def torch_engine() -> TorchEngine:
    engine = TorchEngine()
    engine.load()
    engine.warmup()
    return engine


@pytest.mark.model
def test_torch_matches_sentence_transformers(torch_engine: TorchEngine) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(default_model_path()), device="cpu").encode(
        PARITY_TEXTS, normalize_embeddings=True
    )
    vectors = torch_engine.embed(PARITY_TEXTS)
    assert len(PARITY_TEXTS) == 50
    assert vectors.shape == (50, 384)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    cosines = np.sum(vectors * reference, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosines.min() >= 0.9999


@pytest.mark.model
def test_torch_batch_composition_does_not_change_vectors(torch_engine: TorchEngine) -> None:
    together = torch_engine.embed(PARITY_TEXTS[:10])
    alone = np.concatenate([torch_engine.embed([text]) for text in PARITY_TEXTS[:10]])
    assert np.sum(together * alone, axis=1).min() >= 0.9999


@pytest.mark.model
def test_torch_loaded_info_health_and_tokens(torch_engine: TorchEngine) -> None:
    assert torch_engine.info.device == "cpu"
    assert torch_engine.health() == {"ok": True, "device": "cpu"}
    batch = torch_engine.tokenize(["one two", "long " * 400])
    assert batch.size == 2
    assert batch.tokens <= 2 * 256
    assert torch_engine.embed([]).shape == (0, 384)


class ShapeRecorder(Engine):
    """Runs ``inner`` and records each forward's size and padded sequence length."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.info = inner.info
        self.shapes: list[tuple[int, int]] = []

    def tokenize(self, texts: Sequence[str]) -> Batch:
        return self.inner.tokenize(texts)

    def forward(self, batch: Batch) -> Any:
        assert batch.seq_lengths is not None
        self.shapes.append((batch.size, int(batch.seq_lengths.max())))
        return self.inner.forward(batch)

    def postprocess(self, output: Any, batch: Batch) -> Vectors:
        return self.inner.postprocess(output, batch)


@pytest.mark.model
def test_torch_sequence_lengths_follow_the_tokenizer(torch_engine: TorchEngine) -> None:
    batch = torch_engine.tokenize(["one two", "long " * 400, ""])
    assert batch.seq_lengths is not None
    assert batch.seq_lengths.tolist() == batch.data["attention_mask"].sum(dim=1).tolist()
    assert batch.seq_lengths.tolist()[1:] == [256, 2]
    static = TorchEngine(static_shapes=True, batch_buckets=(1, 8), seq_buckets=(16,))
    static.load()
    texts = ["one two", "long " * 400, ""]
    bucketed = static.tokenize(texts)
    assert bucketed.seq_lengths is not None
    assert bucketed.seq_lengths.tolist() == [16, 256, 16]
    fast = static.tokenizer()  # known before tokenizing for texts with its ids (the batcher's)
    assert fast is not None and torch_engine.padded_lengths(texts) is None
    known = static.padded_lengths(TokenizedTexts.of(texts, fast.ids(texts)))
    assert known is not None and known.tolist() == [16, 256, 16]
    assert static.padded_lengths(texts) is None  # plain texts: once tokenized


@pytest.mark.model
def test_torch_through_the_batcher_keeps_each_forward_within_the_token_budget(
    torch_engine: TorchEngine,
) -> None:
    recorder = ShapeRecorder(torch_engine)
    texts = PARITY_TEXTS[:20]  # two texts of 256 tokens (over the budget) among them

    async def submit_all() -> list[Vectors]:
        async with Batcher(recorder, max_batch_size=64, max_batch_tokens=200) as batcher:
            return await asyncio.gather(*(batcher.submit([text]) for text in texts))

    vectors = np.concatenate(asyncio.run(submit_all()))
    assert len(recorder.shapes) > 2
    assert all(size * length <= 200 for size, length in recorder.shapes if size > 1)
    assert [shape for shape in recorder.shapes if shape[1] > 200] == [(1, 256), (1, 256)]
    alone = np.concatenate([torch_engine.embed([text]) for text in texts])
    assert np.sum(vectors * alone, axis=1).min() >= 0.9999
