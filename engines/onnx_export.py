"""ONNX export of a sentence-transformers model, pooling and L2 normalisation in the graph.

``export_onnx(model_dir, cache_dir, fp16=...)`` writes ``<model hash>-<precision>-opset17.onnx``
under ``cache_dir`` once (a temporary file renamed into place, so a crash leaves no half
file) and returns its path; later calls with the same model files return the cached file
without importing torch. The graph::

    input_ids (batch, sequence) int64, attention_mask (batch, sequence) int64
        -> sentence_embedding (batch, dim) float32, unit rows

uses the legacy TorchScript exporter (``dynamo=False``, opset 17: FACTS.md measured 2e-7 max
abs diff vs sentence-transformers). The fp16 variant keeps inputs and output as above and
computes in fp16 inside (pooling in fp32): it is what strongly typed TensorRT builds need.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from engines.base import EngineUnavailableError
from engines.torch_engine import model_files_digest

OPSET = 17
EXPORT_VERSION = 1  # bump when the exported graph changes for the same weights
INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAME = "sentence_embedding"


def onnx_file_name(model_dir: Path, fp16: bool) -> str:
    precision = "fp16" if fp16 else "fp32"
    return f"{model_files_digest(model_dir)}-{precision}-opset{OPSET}-v{EXPORT_VERSION}.onnx"


def export_onnx(model_dir: str | Path, cache_dir: str | Path, *, fp16: bool = False) -> Path:
    """The cached ONNX file of ``model_dir`` (exported now if missing)."""
    model_dir, cache_dir = Path(model_dir), Path(cache_dir)
    target = cache_dir / onnx_file_name(model_dir, fp16)
    if target.is_file():
        return target
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise EngineUnavailableError(
            "ONNX export needs torch and sentence-transformers (and onnx): "
            "pip install torch sentence-transformers 'fleetcache[onnx]'"
        ) from exc
    from engines.torch_static import check_supported, pooled_embedding

    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True).float()
    check_supported(model)
    transformer: Any = model[0].auto_model
    transformer.eval()
    dtype = torch.float16 if fp16 else torch.float32
    transformer.to(dtype)

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return pooled_embedding(self.transformer, input_ids, attention_mask, dtype)

    # Any ids do: the axes are dynamic. Padding in row 1 keeps the mask path in the trace.
    input_ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102], [101, 2023, 102, 0, 0, 0]])
    inputs = (input_ids, (input_ids != 0).to(torch.int64))
    cache_dir.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=cache_dir, suffix=".onnx.tmp")
    os.close(handle)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # transformers' `is_causal = q_length > 1 and ...` is a constant False here.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            # The legacy exporter on purpose (FACTS.md measured it); torch marks it deprecated.
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(
                Pooled().eval(),
                inputs,
                temporary,
                input_names=list(INPUT_NAMES),
                output_names=[OUTPUT_NAME],
                dynamic_axes={
                    "input_ids": {0: "batch", 1: "sequence"},
                    "attention_mask": {0: "batch", 1: "sequence"},
                    OUTPUT_NAME: {0: "batch"},
                },
                opset_version=OPSET,
                dynamo=False,
            )
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target
