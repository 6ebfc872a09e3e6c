"""TensorRT: everything that runs without a GPU (export, parse, profiles, plan build on the
CPU with tensorrt-rtx-cu13, plan cache, fingerprints) and a clear error where it cannot run.

The execution path cannot run on any machine here (FACTS.md: TensorRT-RTX refuses the H200,
full TensorRT is not installable); docs/GPU_RUN.md says so.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engines.base import EngineUnavailableError
from engines.torch_engine import default_model_path

trt = pytest.importorskip("tensorrt_rtx", reason="needs tensorrt-rtx-cu13")

from engines.tensorrt_engine import (  # noqa: E402
    GpuTarget,
    Profile,
    TensorRTEngine,
    detect_gpu,
    import_tensorrt,
)

TARGET = GpuTarget("CPU build", "0.0")
SMALL = {"batch_buckets": (1, 8), "seq_buckets": (32,), "max_seq_length": 64}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trt-cache")


@pytest.mark.model
def test_plan_is_built_on_the_cpu_then_reused(cache_dir: Path) -> None:
    first = TensorRTEngine(cache_dir=str(cache_dir), **SMALL)
    assert first.profiles == [Profile(1, 32), Profile(8, 32), Profile(1, 64), Profile(8, 64)]
    path = first.prepare_plan(TARGET, trt)
    assert first.plan_built
    assert path.stat().st_size > 1_000_000
    assert list(cache_dir.glob("*-fp16-*.onnx")), "the fp16 export is cached beside the plans"
    engine = trt.Runtime(trt.Logger(trt.Logger.ERROR))
    assert engine is not None  # deserializing needs a supported GPU; the bytes are a plan

    second = TensorRTEngine(cache_dir=str(cache_dir), **SMALL)
    assert second.prepare_plan(TARGET, trt) == path
    assert not second.plan_built  # cache hit on the second start


def test_plan_key_follows_model_gpu_version_and_profiles(cache_dir: Path, tmp_path: Path) -> None:
    engine = TensorRTEngine(cache_dir=str(cache_dir), **SMALL)
    path = engine.plan_path(TARGET, trt)
    assert engine.plan_path(GpuTarget("CPU build", "8.9"), trt) != path
    assert engine.plan_path(GpuTarget("NVIDIA H200", "0.0"), trt) != path
    other_profiles = TensorRTEngine(cache_dir=str(cache_dir), **{**SMALL, "batch_buckets": (1,)})
    assert other_profiles.plan_path(TARGET, trt) != path

    class OtherVersion:
        __name__ = trt.__name__
        __version__ = "0.0.1"

    assert engine.plan_path(TARGET, OtherVersion) != path

    changed = tmp_path / "model"
    shutil.copytree(default_model_path(), changed, ignore=shutil.ignore_patterns("*.safetensors"))
    (changed / "model.safetensors").symlink_to(default_model_path() / "model.safetensors")
    same = TensorRTEngine(model_path=str(changed), cache_dir=str(cache_dir), **SMALL)
    assert same.fingerprint == engine.fingerprint  # same files, same fingerprint
    (changed / "config_sentence_transformers.json").write_text('{"prompts": {"q": "query: "}}')
    other = TensorRTEngine(model_path=str(changed), cache_dir=str(cache_dir), **SMALL)
    assert other.fingerprint != engine.fingerprint
    assert other.plan_path(TARGET, trt) != path


def test_load_without_a_usable_gpu_is_a_clear_error(tmp_path: Path) -> None:
    try:
        detect_gpu()
    except EngineUnavailableError:
        pass
    else:
        pytest.skip("a CUDA GPU is present")
    engine = TensorRTEngine(cache_dir=str(tmp_path), **SMALL)
    with pytest.raises(EngineUnavailableError, match="no usable CUDA GPU"):
        engine.load()
    assert engine.health()["ok"] is False
    with pytest.raises(EngineUnavailableError, match="load"):
        engine.embed(["x"])
    assert list(tmp_path.iterdir()) == []  # nothing built for a GPU it cannot see


def test_import_prefers_tensorrt_then_rtx() -> None:
    assert import_tensorrt().__name__ in ("tensorrt", "tensorrt_rtx")
