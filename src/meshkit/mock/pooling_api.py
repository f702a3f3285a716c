"""
Pooling endpoints of the mock worker
====================================

vLLM's pooling-model endpoints, answered with deterministic numbers (a hash of the
text, so the same input gives the same vector on every worker) and a usage object
counting the input's tokens the way the rest of the mock does. The shapes follow
vLLM's protocol classes (``vllm/entrypoints/pooling/<task>/protocol.py``; in older
releases all in ``vllm/entrypoints/openai/protocol.py``): ``EmbeddingResponse``,
``RerankResponse`` (the same for ``/rerank``, ``/v1/rerank`` and ``/v2/rerank``),
``ScoreResponse``, ``PoolingResponse`` and ``ClassificationResponse``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshkit.mock.tokens import prompt_size
from meshkit.mock.wire import Reply, Request

if TYPE_CHECKING:
    from meshkit.mock.app import MockApp

__all__ = ["PoolingHandlers"]

#: the length of the mock's embeddings and pooled vectors
DIM = 8


def _unit(text: str, salt: str = "") -> list[float]:
    digest = hashlib.blake2b((salt + text).encode(), digest_size=DIM).digest()
    return [round(b / 255.0, 6) for b in digest]


def _texts(value: Any) -> list[str]:
    """The inputs of a request field: a string, a list of strings, token ids (as text)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if value and all(isinstance(x, int) for x in value):
            return [" ".join(map(str, value))]
        return [x if isinstance(x, str) else str(x) for x in value]
    return []


def _listed(value: Any) -> list[Any] | None:
    """A list of documents: a list, or vLLM's multimodal ``{"content": [...]}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, list) else None


def _doc_text(doc: Any) -> str:
    if isinstance(doc, dict):
        text = doc.get("text")
        return text if isinstance(text, str) else ""
    return doc if isinstance(doc, str) else str(doc)


class PoolingHandlers:
    """Routes ``/v1/embeddings``, the rerank, score, ``/pooling`` and ``/classify``
    endpoints onto one :class:`~meshkit.mock.app.MockApp`."""

    def __init__(self, app: MockApp) -> None:
        self.app = app

    def register(self) -> None:
        r = self.app.route
        r("/v1/embeddings", "embeddings", False, POST=self._wrap(self._embeddings, "input"))
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r(path, "rerank", False, POST=self._wrap(self._rerank, "query", "documents"))
        for path in ("/score", "/v1/score"):
            r(path, "score", False, POST=self._wrap(self._score, "text_1"))
        r("/pooling", "pooling", False, POST=self._wrap(self._pooling, "input"))
        r("/classify", "classify", False, POST=self._wrap(self._classify, "input"))

    def _wrap(
        self,
        build: Callable[[dict[str, Any], str], dict[str, Any]],
        required: str,
        listed: str | None = None,
    ) -> Callable[[Request], Reply]:
        app = self.app

        def handle(req: Request) -> Reply:
            pre = app.prelude(req, False)
            if isinstance(pre, bytes):
                return pre
            body, rank = pre
            if body.get(required) is None:
                return app.error(req, 400, f"'{required}' is required", param=required)
            if listed is not None and _listed(body.get(listed, [])) is None:
                # vLLM's request model refuses it (a 400), it does not fail on it
                return app.error(req, 400, f"'{listed}' must be a list", param=listed)
            model = body.get("model")
            name = model if isinstance(model, str) else app.config.model
            return app.json(req, build(body, name), rank=rank)

        return handle

    def _head(self, prefix: str, model: str, tokens: int) -> dict[str, Any]:
        return {
            "id": self.app.new_id(prefix),
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }

    def _vectors(
        self, body: dict[str, Any], model: str, prefix: str, kind: str, field: str
    ) -> dict[str, Any]:
        texts = _texts(body.get("input"))
        out = self._head(prefix, model, prompt_size(texts))
        out["data"] = [{"index": i, "object": kind, field: _unit(t)} for i, t in enumerate(texts)]
        return out

    def _embeddings(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        return self._vectors(body, model, "embd-", "embedding", "embedding")

    def _pooling(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        return self._vectors(body, model, "pool-", "pooling", "data")

    def _classify(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        texts = _texts(body.get("input"))
        out = self._head("classify-", model, prompt_size(texts))
        rows = []
        for i, t in enumerate(texts):
            p = _unit(t)[0]
            probs = [round(1.0 - p, 6), p]
            rows.append(
                {"index": i, "label": f"LABEL_{int(p >= 0.5)}", "probs": probs, "num_classes": 2}
            )
        out["data"] = rows
        return out

    def _score(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        left, right = _texts(body.get("text_1")), _texts(body.get("text_2"))
        if len(left) == 1:
            left = left * len(right)
        pairs = list(zip(left, right, strict=False))
        out = self._head("score-", model, prompt_size(left, right))
        out["data"] = [
            {"index": i, "object": "score", "score": _unit(b, a)[0]}
            for i, (a, b) in enumerate(pairs)
        ]
        return out

    def _rerank(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        query = _texts(body.get("query"))
        docs = [_doc_text(d) for d in _listed(body.get("documents", [])) or []]
        q = query[0] if query else ""
        ranked = sorted(((i, d, _unit(d, q)[0]) for i, d in enumerate(docs)), key=lambda r: -r[2])
        top = body.get("top_n")
        if isinstance(top, int) and top > 0:
            ranked = ranked[:top]
        tokens = prompt_size(query, docs)
        return {
            "id": self.app.new_id("rerank-"),
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": [
                {"index": i, "document": {"text": d}, "relevance_score": s} for i, d, s in ranked
            ],
        }
