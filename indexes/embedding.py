"""A LlamaIndex embedding over any LangChain-style ``Embeddings``, one call per batch.

The stock ``LangchainEmbedding`` sends one text per call on its async path (FACTS.md: 1,000
nodes became 1,000 calls). This adapter hands LlamaIndex's whole batch to ``embed_documents`` /
``aembed_documents`` at once, so the cached embedder (cache/, which this package must not
import) sees every batch whole and can coalesce and batch on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from pydantic import Field, PrivateAttr

# BaseEmbedding caps embed_batch_size at 2048 (the same as API.md's per-request limit).
MAX_BATCH = 2048


class EmbeddingsLike(Protocol):
    """What we use of ``langchain_core.embeddings.Embeddings`` (duck-typed)."""

    def embed_documents(self, texts: list[str]) -> Sequence[Sequence[float]]: ...

    async def aembed_documents(self, texts: list[str]) -> Sequence[Sequence[float]]: ...

    def embed_query(self, text: str) -> Sequence[float]: ...

    async def aembed_query(self, text: str) -> Sequence[float]: ...


class BatchingEmbedding(BaseEmbedding):
    """``BaseEmbedding`` whose batches (up to ``embed_batch_size`` texts) are one call each."""

    embed_batch_size: int = Field(default=MAX_BATCH, gt=0, le=MAX_BATCH)
    _inner: EmbeddingsLike = PrivateAttr()

    def __init__(self, embeddings: EmbeddingsLike, **kwargs: Any) -> None:
        kwargs.setdefault("model_name", type(embeddings).__name__)
        super().__init__(**kwargs)
        self._inner = embeddings

    @classmethod
    def class_name(cls) -> str:
        return "BatchingEmbedding"

    def _get_query_embedding(self, query: str) -> Embedding:
        return _vector(self._inner.embed_query(query))

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return _vector(await self._inner.aembed_query(query))

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._get_text_embeddings([text])[0]

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return (await self._aget_text_embeddings([text]))[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return _vectors(texts, self._inner.embed_documents(list(texts)))

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return _vectors(texts, await self._inner.aembed_documents(list(texts)))


def _vector(values: Sequence[float]) -> Embedding:
    tolist = getattr(values, "tolist", None)  # numpy rows become plain floats
    return list(tolist()) if tolist is not None else list(values)


def _vectors(texts: list[str], vectors: Sequence[Sequence[float]]) -> list[Embedding]:
    if len(vectors) != len(texts):
        raise ValueError(f"embeddings returned {len(vectors)} vectors for {len(texts)} texts")
    return [_vector(v) for v in vectors]
