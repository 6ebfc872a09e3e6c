"""``POST /v1/embeddings``: OpenAI-compatible, served from the cache where it can be."""

from __future__ import annotations

import base64
import re
import time
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, WithJsonSchema

from proxy.body import JSONRoute
from proxy.deps import CallerDep, ServicesDep
from proxy.errors import API_ERRORS, APIError
from proxy.public import public_model
from proxy.responses import FastJSONResponse

router = APIRouter(tags=["embeddings"], route_class=JSONRoute, responses=API_ERRORS)
_PIECES = re.compile(r"\w+|[^\w\s]")


def as_text_list(value: Any) -> list[str]:
    """A string or a list of non-empty strings; token-id arrays are refused by name."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list):
        raise ValueError("input must be a string or a list of strings")
    for i, text in enumerate(texts):
        if isinstance(text, int | list):
            raise ValueError(
                "token-id input is not supported: send strings "
                "(LangChain's OpenAIEmbeddings needs check_embedding_ctx_length=False)"
            )
        if not isinstance(text, str):
            raise ValueError(f"input[{i}] must be a string")
        if not text:
            raise ValueError(f"input[{i}] is an empty string")
    if not texts:
        raise ValueError("input must hold at least one string")
    return texts


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: Annotated[
        list[str],
        BeforeValidator(as_text_list),
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                ],
                "description": "a text or a list of texts (token-id arrays are refused)",
            }
        ),
    ]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


def estimate_tokens(text: str) -> int:
    """Words and punctuation marks: what ``usage`` reports without re-tokenizing hits."""
    return len(_PIECES.findall(text))


def encode_row(row: np.ndarray, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(row.astype("<f4", copy=False).tobytes()).decode("ascii")
    return row


@router.post("/v1/embeddings")
async def create_embeddings(
    body: EmbeddingsRequest, services: ServicesDep, caller: CallerDep
) -> Response:
    started = time.perf_counter()
    texts, settings = body.input, services.settings
    if len(texts) > settings.max_texts_per_request:
        limit = settings.max_texts_per_request
        raise APIError(413, f"at most {limit} texts per request, got {len(texts)}", param="input")
    for i, text in enumerate(texts):
        if len(text) > settings.max_text_chars:
            raise APIError(
                413,
                f"input[{i}] has {len(text)} characters, at most {settings.max_text_chars} "
                "(FLEETCACHE_MAX_TEXT_CHARS)",
                param=f"input[{i}]",
            )
    if body.dimensions is not None and body.dimensions != services.info.dim:
        raise APIError(422, f"this model has {services.info.dim} dimensions", param="dimensions")
    result = await services.embed(texts, caller.label, caller.lane)
    tokens = sum(estimate_tokens(t) for t in texts)
    payload = {
        "object": "list",
        "model": public_model(services.info.model),
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_row(row, body.encoding_format)}
            for i, row in enumerate(result.vectors)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    services.latency.observe("embeddings", result.misses, time.perf_counter() - started)
    headers = {"X-Cache-Hits": str(result.not_sent), "X-Cache-Misses": str(result.misses)}
    return FastJSONResponse(payload, headers=headers)
