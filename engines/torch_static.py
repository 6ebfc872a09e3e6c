"""The torch engine's fixed-shape path: bucketed shapes, one CUDA graph per bucket on a GPU.

A MiniLM-sized forward is launch-bound on a big GPU (FACTS.md: 2.3 ms eager whether 1 or 512
texts, 0.28 ms as a CUDA graph at batch 1). So on CUDA every batch is padded to a (batch,
sequence) bucket, and each bucket has a graph captured at warm-up with static input and output
tensors. A forward is then: pinned host ids -> static inputs (async copy on the engine's own
stream), one graph replay, static output -> pinned host rows, one stream synchronise.

The model math is the sentence-transformers pipeline (Transformer -> mean Pooling -> Normalize)
written out, with the attention mask passed as a ready 4D additive mask so that transformers
takes no data-dependent branch (``mask.all()``) that would break graph capture. Pooling and
normalisation run in float32 even for an fp16 model. Without CUDA (tests) the same path runs
eagerly on the CPU. torch is imported only by whoever builds a ``StaticRunner``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.base import EngineError, Vectors

logger = logging.getLogger(__name__)


def pooled_embedding(transformer: Any, input_ids: Any, attention_mask: Any, dtype: Any) -> Any:
    """Transformer -> mean pooling -> L2 normalise, float32 out; only tensor ops, no host
    syncs (CUDA-graph capturable, ONNX-exportable with dynamic batch and sequence axes)."""
    import torch

    additive = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
    hidden = transformer(
        input_ids=input_ids,
        attention_mask=additive,
        token_type_ids=torch.zeros_like(input_ids),
    ).last_hidden_state
    weights = attention_mask.unsqueeze(-1).to(torch.float32)
    pooled = (hidden.to(torch.float32) * weights).sum(dim=1)
    pooled = pooled / weights.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2.0, dim=1)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    input_ids: Any  # static device tensors the graph reads
    attention_mask: Any
    output: Any  # static device tensor the graph writes: (rows, dim) float32
    host_output: Any  # pinned host copy of ``output``


class StaticRunner:
    """Runs a sentence-transformers BERT-style model at bucket shapes.

    ``run`` takes int64 arrays already padded to a bucket (host tensors, pinned on CUDA) and
    returns the unit float32 rows of the real texts. ``prepare`` (call it off the GPU thread)
    turns numpy arrays into those host tensors.
    """

    def __init__(
        self,
        model: Any,
        batch_buckets: tuple[int, ...],
        seq_buckets: tuple[int, ...],
        cuda_graphs: bool,
    ) -> None:
        import torch

        self._torch = torch
        self._transformer = model[0].auto_model
        self.device = model.device
        self.dtype = next(self._transformer.parameters()).dtype
        self.batch_buckets = batch_buckets
        self.seq_buckets = seq_buckets
        self.on_cuda = self.device.type == "cuda"
        self.cuda_graphs = cuda_graphs and self.on_cuda
        self.graph_error: str | None = None
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool: Any = None
        self._stream: Any = torch.cuda.Stream(self.device) if self.on_cuda else None

    # -- the model math ----------------------------------------------------------------------

    def _encode(self, input_ids: Any, attention_mask: Any) -> Any:
        return pooled_embedding(self._transformer, input_ids, attention_mask, self.dtype)

    # -- host side (any thread) --------------------------------------------------------------

    def prepare(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[Any, Any]:
        """numpy -> host tensors (pinned on CUDA, so the copy to the GPU is async)."""
        torch = self._torch
        ids, mask = torch.from_numpy(input_ids), torch.from_numpy(attention_mask)
        if self.on_cuda:
            ids, mask = ids.pin_memory(), mask.pin_memory()
        return ids, mask

    # -- device side (the engine thread) -----------------------------------------------------

    def run(self, input_ids: Any, attention_mask: Any, size: int) -> Vectors:
        shape = (int(input_ids.shape[0]), int(input_ids.shape[1]))
        with self._torch.no_grad():
            if self.cuda_graphs:
                graph = self._graphs.get(shape)
                if graph is None:
                    logger.warning("no CUDA graph for bucket %s; capturing it now", shape)
                    graph = self._capture(*shape)
                if graph is not None:
                    return self._replay(graph, input_ids, attention_mask, size)
            return self._eager(input_ids, attention_mask, size)

    def _eager(self, input_ids: Any, attention_mask: Any, size: int) -> Vectors:
        if not self.on_cuda:
            return np.ascontiguousarray(self._encode(input_ids, attention_mask)[:size].numpy())
        torch = self._torch
        with torch.cuda.stream(self._stream):
            ids = input_ids.to(self.device, non_blocking=True)
            mask = attention_mask.to(self.device, non_blocking=True)
            output = self._encode(ids, mask)[:size].to("cpu", non_blocking=True)
        self._stream.synchronize()
        return np.ascontiguousarray(output.numpy())

    def _replay(self, graph: _Graph, input_ids: Any, attention_mask: Any, size: int) -> Vectors:
        torch = self._torch
        with torch.cuda.stream(self._stream):
            graph.input_ids.copy_(input_ids, non_blocking=True)
            graph.attention_mask.copy_(attention_mask, non_blocking=True)
            graph.graph.replay()
            graph.host_output.copy_(graph.output, non_blocking=True)
        self._stream.synchronize()
        return np.array(graph.host_output[:size].numpy())  # a copy: the buffer is reused

    def warmup(self) -> None:
        """Capture a graph per bucket (largest first, one shared memory pool), or run each
        bucket once eagerly. A capture failure is logged and the runner stays eager."""
        shapes = sorted(
            ((b, s) for b in self.batch_buckets for s in self.seq_buckets),
            key=lambda shape: shape[0] * shape[1],
            reverse=True,
        )
        with self._torch.no_grad():
            for rows, cols in shapes:
                if self.cuda_graphs:
                    self._capture(rows, cols)
                    if self.cuda_graphs:
                        continue
                ids = np.zeros((rows, cols), dtype=np.int64)
                self._eager(*self.prepare(ids, np.ones_like(ids)), size=rows)

    def _capture(self, rows: int, cols: int) -> _Graph | None:
        torch = self._torch
        try:
            input_ids = torch.zeros((rows, cols), dtype=torch.int64, device=self.device)
            attention_mask = torch.ones((rows, cols), dtype=torch.int64, device=self.device)
            with torch.cuda.stream(self._stream):  # warm the kernels on the side stream first
                for _ in range(2):
                    self._encode(input_ids, attention_mask)
            self._stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"
            ):
                output = self._encode(input_ids, attention_mask)
            self._pool = self._pool if self._pool is not None else graph.pool()
            host_output = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
        except Exception as exc:  # keep serving eagerly, and say why in health()
            self.graph_error = f"CUDA graph capture failed at {(rows, cols)}: {exc!r}"
            logger.error("%s; running eagerly", self.graph_error)
            self.cuda_graphs = False
            self._graphs.clear()
            return None
        captured = _Graph(graph, input_ids, attention_mask, output, host_output)
        self._graphs[(rows, cols)] = captured
        return captured

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def close(self) -> None:
        self._graphs.clear()
        self._pool = None


def check_supported(model: Any) -> None:
    """The fixed-shape path writes out Transformer -> mean Pooling -> Normalize; refuse others."""
    names = [type(module).__name__ for module in model]
    pooling = getattr(model[1], "pooling_mode", None) if len(names) > 1 else None
    mean = pooling == "mean" or getattr(model[1], "pooling_mode_mean_tokens", False)
    if names[:1] != ["Transformer"] or names[1:] != ["Pooling", "Normalize"] or not mean:
        raise EngineError(
            f"the fixed-shape torch path supports Transformer -> mean Pooling -> Normalize, "
            f"this model is {' -> '.join(names)} (pooling {pooling!r}); use static_shapes=False"
        )
