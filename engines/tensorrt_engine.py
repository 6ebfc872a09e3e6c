"""TensorRT: the fp16 ONNX export built into a plan with one optimisation profile per bucket.

Pipeline::

    model dir --onnx_export--> <hash>-fp16.onnx --build (CPU is enough)--> <key>.plan
    load(): detect GPU -> plan from cache or build -> deserialize -> one execution context
            per worker, a non-blocking CUDA stream, device buffers and pinned host buffers
            sized for the largest bucket -> warm every profile (never on the first request)
    forward: tokens (numpy, padded to a bucket) -> pinned host -> async H2D -> set profile and
             shapes -> execute_async_v3 -> async D2H -> stream synchronise

The plan cache key is the engine fingerprint + GPU name + compute capability + TensorRT
module and version + the profiles: a plan is never reused across any of them. The same code
drives ``tensorrt`` (data-center GPUs) and ``tensorrt_rtx`` (RTX-class GPUs); both speak the
TensorRT 10 API used here. tensorrt and ``cuda.bindings`` (cuda-python) are imported lazily.

Where this cannot run: FACTS.md records that no TensorRT on these machines can execute a plan
on the H200 (full TensorRT is not installable; TensorRT-RTX refuses compute capability 9.0).
Export, parse, profiles, plan build and the plan cache are tested on the CPU with
``tensorrt-rtx-cu13``; the execution path (``_Executor``) has not been run anywhere here.
``load`` raises ``EngineUnavailableError`` with the reason wherever it cannot run.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import (
    Batch,
    Engine,
    EngineError,
    EngineUnavailableError,
    Vectors,
    make_fingerprint,
)
from engines.tokenization import FastTokenizer, bucket_for, chunked_batch, seq_buckets_for
from engines.torch_engine import resolve_model_dir, sentence_model_info

logger = logging.getLogger(__name__)

TRT_BATCH_BUCKETS = (1, 8, 32, 128)
TRT_SEQ_BUCKETS = (32, 64, 128)  # plus max_seq_length
TRT_MODULES = ("tensorrt", "tensorrt_rtx")
INSTALL_HINT = (
    "pip install 'fleetcache[tensorrt-rtx]' (tensorrt-rtx-cu13, RTX-class GPUs) or NVIDIA's "
    "tensorrt (data-center GPUs), plus cuda-python"
)


def import_tensorrt() -> Any:
    """``tensorrt`` if installed, else ``tensorrt_rtx``; ``EngineUnavailableError`` if neither."""
    for name in TRT_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise EngineUnavailableError(f"engine 'tensorrt' needs TensorRT: {INSTALL_HINT}")


@dataclass(frozen=True)
class GpuTarget:
    name: str
    compute_capability: str  # "9.0"


def _cuda_runtime() -> Any:
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise EngineUnavailableError(
            "engine 'tensorrt' needs cuda-python (cuda.bindings): pip install cuda-python"
        ) from exc
    return runtime


def _check(result: Any, what: str) -> Any:
    """cuda.bindings calls return (error, *values): raise on error, return the values."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if int(error) != 0:
        raise EngineUnavailableError(f"CUDA {what} failed: {error!r}")
    return values[0] if len(values) == 1 else values


def detect_gpu(device: int = 0) -> GpuTarget:
    """Name and compute capability of CUDA device ``device``, or ``EngineUnavailableError``."""
    runtime = _cuda_runtime()
    try:
        count = _check(runtime.cudaGetDeviceCount(), "cudaGetDeviceCount")
    except EngineUnavailableError as exc:
        raise EngineUnavailableError(f"engine 'tensorrt' found no usable CUDA GPU ({exc})") from exc
    if count <= device:
        raise EngineUnavailableError(f"engine 'tensorrt' found {count} CUDA GPUs, needs #{device}")
    props = _check(runtime.cudaGetDeviceProperties(device), "cudaGetDeviceProperties")
    name = props.name.split(b"\0", 1)[0].decode() if isinstance(props.name, bytes) else props.name
    return GpuTarget(str(name), f"{props.major}.{props.minor}")


@dataclass(frozen=True)
class Profile:
    batch: int  # the bucket's largest batch
    seq: int  # the bucket's longest sequence


def build_plan(trt: Any, onnx_path: Path, profiles: Sequence[Profile]) -> bytes:
    """Parse the ONNX and build a serialized plan with one profile per bucket (no GPU needed
    for TensorRT-RTX). Strongly typed: the fp16 ONNX decides the precision."""
    trt_logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(trt_logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, trt_logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT could not parse {onnx_path}: {errors}")
    inputs = [network.get_input(i).name for i in range(network.num_inputs)]
    config = builder.create_builder_config()
    for profile in profiles:  # profile i of the plan is profiles[i]
        shapes = builder.create_optimization_profile()
        largest = (profile.batch, profile.seq)
        for name in inputs:
            shapes.set_shape(name, (1, 1), largest, largest)
        config.add_optimization_profile(shapes)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineError(f"TensorRT failed to build a plan from {onnx_path} (see its log)")
    return bytes(plan)


class TensorRTEngine(Engine):
    """The exported model as a TensorRT plan (fp16) on one GPU."""

    def __init__(
        self,
        model_path: str | None = None,
        cache_dir: str | None = None,
        max_seq_length: int = 256,
        batch_buckets: Sequence[int] = TRT_BATCH_BUCKETS,
        seq_buckets: Sequence[int] = TRT_SEQ_BUCKETS,
        workers: int = 1,
        device: int = 0,
    ) -> None:
        from engines.onnxruntime_engine import default_cache_dir

        if max_seq_length <= 0 or workers < 1 or not batch_buckets:
            raise ValueError("max_seq_length and workers must be positive, batch_buckets non-empty")
        self.model_path = resolve_model_dir(model_path)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        self.seq_buckets = seq_buckets_for(max_seq_length, seq_buckets)
        self.profiles = [Profile(b, s) for s in self.seq_buckets for b in self.batch_buckets]
        self.workers = workers
        self.device = device
        self.info = sentence_model_info(
            "tensorrt",
            self.model_path,
            device=f"cuda:{device}",
            precision="fp16",
            max_seq_length=max_seq_length,
        )
        self.plan_built = False  # True when the last prepare_plan() built instead of reusing
        self._tokenizer: FastTokenizer | None = None
        self._executors: list[_Executor] = []

    # -- plan (no GPU needed) -------------------------------------------------------------

    def plan_path(self, target: GpuTarget, trt: Any) -> Path:
        key = make_fingerprint(
            engine=self.fingerprint,
            gpu=target.name,
            compute_capability=target.compute_capability,
            tensorrt=f"{trt.__name__}-{trt.__version__}",
            profiles=",".join(f"{p.batch}x{p.seq}" for p in self.profiles),
        )
        return self.cache_dir / "plans" / f"{key}.plan"

    def prepare_plan(self, target: GpuTarget, trt: Any | None = None) -> Path:
        """The cached plan for ``target``, built (from the cached fp16 ONNX) if missing."""
        from engines.onnx_export import export_onnx

        trt = trt or import_tensorrt()
        path = self.plan_path(target, trt)
        self.plan_built = not path.is_file()
        if self.plan_built:
            onnx_path = export_onnx(self.model_path, self.cache_dir, fp16=True)
            plan = build_plan(trt, onnx_path, self.profiles)
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".plan.tmp")
            with os.fdopen(handle, "wb") as out:
                out.write(plan)
            os.replace(temporary, path)
            logger.info("built TensorRT plan %s (%d profiles)", path, len(self.profiles))
        return path

    # -- the engine -------------------------------------------------------------------------

    def load(self) -> None:
        if self._executors:
            return
        trt = import_tensorrt()
        target = detect_gpu(self.device)
        plan = self.prepare_plan(target, trt).read_bytes()
        trt_logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(trt_logger)
        cuda_engine = runtime.deserialize_cuda_engine(plan)
        if cuda_engine is None:
            raise EngineUnavailableError(
                f"{trt.__name__} {trt.__version__} could not deserialize the plan on "
                f"{target.name} (compute capability {target.compute_capability}); "
                "TensorRT-RTX runs on RTX-class GPUs only, data-center GPUs need NVIDIA's tensorrt"
            )
        self._tokenizer = FastTokenizer(self.model_path, self.info.max_seq_length)
        self._executors = [
            _Executor(cuda_engine, self.profiles, self.dim) for _ in range(self.workers)
        ]
        self.info = dataclasses.replace(self.info, device=f"cuda:{self.device} ({target.name})")

    def warmup(self) -> None:
        for executor in self._executors:
            for index, profile in enumerate(self.profiles):
                ids = np.zeros((profile.batch, profile.seq), dtype=np.int64)
                executor.run(index, ids, np.ones_like(ids), profile.batch)

    def tokenizer(self) -> FastTokenizer | None:
        return self._tokenizer

    def tokenize(self, texts: Sequence[str]) -> Batch:
        if self._tokenizer is None:
            raise EngineUnavailableError("TensorRTEngine.load() has not been called")
        largest = self.batch_buckets[-1]
        chunks = [
            self._tokenizer.encode(
                texts[start : start + largest], self.batch_buckets, self.seq_buckets
            )
            for start in range(0, len(texts), largest)
        ]
        return chunked_batch(len(texts), chunks, self.seq_buckets, {"chunks": chunks})

    def forward(self, batch: Batch, worker: int = 0) -> Vectors:
        if not self._executors:
            raise EngineUnavailableError("TensorRTEngine.load() has not been called")
        if batch.size == 0:
            return np.empty((0, self.dim), dtype=np.float32)
        executor = self._executors[worker]
        parts = []
        for tokens in batch.data["chunks"]:
            rows, cols = tokens.input_ids.shape
            index = self.profiles.index(
                Profile(bucket_for(rows, self.batch_buckets), bucket_for(cols, self.seq_buckets))
            )
            parts.append(executor.run(index, tokens.input_ids, tokens.attention_mask, tokens.size))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def health(self) -> dict[str, Any]:
        return {
            "ok": bool(self._executors),
            "device": self.info.device,
            "profiles": len(self.profiles),
        }

    def close(self) -> None:
        executors, self._executors = self._executors, []
        for executor in executors:
            executor.close()


class _Executor:
    """One execution context, its own non-blocking stream, device and pinned host buffers
    sized for the largest profile. Used by one thread at a time."""

    def __init__(self, cuda_engine: Any, profiles: Sequence[Profile], dim: int) -> None:
        self._rt = _cuda_runtime()
        rt = self._rt
        self.context = cuda_engine.create_execution_context()
        self.stream = _check(
            rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate"
        )
        rows = max(p.batch for p in profiles)
        cols = max(p.seq for p in profiles)
        self.profile = -1
        self.names = ("input_ids", "attention_mask")
        self.out_name = "sentence_embedding"
        sizes = {"input_ids": rows * cols * 8, "attention_mask": rows * cols * 8}
        sizes[self.out_name] = rows * dim * 4
        self.device_ptr = {n: _check(rt.cudaMalloc(s), "cudaMalloc") for n, s in sizes.items()}
        self.host_ptr = {
            n: _check(rt.cudaMallocHost(s), "cudaMallocHost") for n, s in sizes.items()
        }
        self.host = {
            n: np.ctypeslib.as_array((ctypes.c_byte * s).from_address(int(self.host_ptr[n])))
            for n, s in sizes.items()
        }
        self.dim = dim

    def run(self, profile: int, input_ids: np.ndarray, mask: np.ndarray, size: int) -> Vectors:
        rt, stream, context = self._rt, self.stream, self.context
        if profile != self.profile:
            if not context.set_optimization_profile_async(profile, stream):
                raise EngineError(f"TensorRT refused optimisation profile {profile}")
            self.profile = profile
        rows, cols = input_ids.shape
        for name, array in zip(self.names, (input_ids, mask), strict=True):
            nbytes = array.nbytes
            self.host[name][:nbytes] = (
                np.ascontiguousarray(array, dtype=np.int64).view(np.int8).ravel()
            )
            _check(
                rt.cudaMemcpyAsync(
                    self.device_ptr[name],
                    self.host_ptr[name],
                    nbytes,
                    rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
                    stream,
                ),
                "cudaMemcpyAsync",
            )
            context.set_input_shape(name, (rows, cols))
            context.set_tensor_address(name, int(self.device_ptr[name]))
        context.set_tensor_address(self.out_name, int(self.device_ptr[self.out_name]))
        if not context.execute_async_v3(int(stream)):
            raise EngineError("TensorRT execute_async_v3 failed")
        out_bytes = rows * self.dim * 4
        _check(
            rt.cudaMemcpyAsync(
                self.host_ptr[self.out_name],
                self.device_ptr[self.out_name],
                out_bytes,
                rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                stream,
            ),
            "cudaMemcpyAsync",
        )
        _check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        output = self.host[self.out_name][:out_bytes].view(np.float32).reshape(rows, self.dim)
        return np.array(output[:size])  # a copy: the pinned buffer is reused

    def close(self) -> None:
        rt = self._rt
        for pointer in self.device_ptr.values():
            rt.cudaFree(pointer)
        for pointer in self.host_ptr.values():
            rt.cudaFreeHost(pointer)
        rt.cudaStreamDestroy(self.stream)
        self.device_ptr, self.host_ptr, self.host = {}, {}, {}
