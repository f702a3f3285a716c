"""Prefix tokens on the calling thread where tiktoken covers them, on the pool otherwise."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from meshkit import Mesh
from meshkit.core.policies.registry import create_policy
from meshkit.errors import RequestTooLarge
from meshkit.prepare.tokenizers import LoadedTokenizer

pytest.importorskip("tiktoken")

N = 64
HEADERS = [(b"content-type", b"application/json")]


def _mesh(qwen_path: Path, **config: Any) -> Mesh:
    return Mesh(
        workers=["http://127.0.0.1:9"],
        policy="prefix_hash",
        tokenizer=str(qwen_path),
        policies={"prefix_hash": {"prefix_token_count": N}},
        lifecycle={"probe": False},
        **config,
    )


@pytest.fixture
def mesh(qwen_path: Path) -> Any:
    m = _mesh(qwen_path)
    yield m
    m.close()


def _body(prompt: str) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt}).encode()


def _threads_that_tokenized(mesh: Mesh, prepare: Any) -> set[str]:
    """Run ``prepare`` and name the threads that called prefix_ids / prefix_ids_fast."""
    seen: set[str] = set()
    base = mesh.tokenizers.get(None)
    assert base is not None
    calls: list[tuple[str, str]] = []
    real_fast, real_full = LoadedTokenizer.prefix_ids_fast, LoadedTokenizer.prefix_ids

    def fast(self: LoadedTokenizer, text: str, n: int) -> list[int] | None:
        calls.append(("fast", threading.current_thread().name))
        return real_fast(self, text, n)

    def full(self: LoadedTokenizer, text: str, n: int, **kw: Any) -> list[int]:
        calls.append(("full", threading.current_thread().name))
        return real_full(self, text, n, **kw)

    LoadedTokenizer.prefix_ids_fast = fast  # type: ignore[method-assign]
    LoadedTokenizer.prefix_ids = full  # type: ignore[method-assign]
    try:
        prepare()
    finally:
        LoadedTokenizer.prefix_ids_fast = real_fast  # type: ignore[method-assign]
        LoadedTokenizer.prefix_ids = real_full  # type: ignore[method-assign]
    for kind, name in calls:
        seen.add(f"{kind}@{'caller' if name == threading.current_thread().name else 'pool'}")
    return seen


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(
    ("prompt", "where"),
    [
        ("Every word here is plain ASCII text. " * 40, {"fast@caller"}),
        # a decomposed accent: not NFC, so tiktoken declines the piece
        ("cafe\u0301 is not NFC. " + "more words " * 40, {"fast@caller", "full@pool"}),
    ],
)
def test_prefix_ids_where_tiktoken_covers_them_else_on_the_pool(
    mesh: Mesh, qwen: LoadedTokenizer, mode: str, prompt: str, where: set[str]
) -> None:
    match = mesh.resolve("POST", "/v1/completions")
    assert match is not None
    views: list[Any] = []

    def prepare() -> None:
        if mode == "sync":
            views.append(mesh.prepare(match, _body(prompt), HEADERS))
        else:
            views.append(asyncio.run(mesh.prepare_async(match, _body(prompt), HEADERS)))

    assert _threads_that_tokenized(mesh, prepare) == where
    assert views[0].token_ids == qwen.encode(prompt, add_special_tokens=False)[:N]


def test_without_the_fast_path_prefix_tokens_stay_on_the_pool(qwen_path: Path) -> None:
    mesh = _mesh(qwen_path, prepare={"fast_tokenizer": False})
    try:
        match = mesh.resolve("POST", "/v1/completions")
        assert match is not None
        body = _body("plain words " * 40)
        seen = _threads_that_tokenized(mesh, lambda: mesh.prepare(match, body, HEADERS))
        assert seen == {"fast@caller", "full@pool"}
    finally:
        mesh.close()


def test_a_body_over_the_inline_threshold_is_parsed_on_the_pool() -> None:
    """``prepare.inline_threshold_bytes``: at the bound on the calling thread, one
    byte over on the pool (the pool counts the jobs it ran)."""
    mesh = Mesh(
        workers=["http://127.0.0.1:9"], prepare={"workers": 1, "inline_threshold_bytes": 100}
    )
    try:
        match = mesh.resolve("POST", "/v1/completions")
        assert match is not None
        at = json.dumps({"model": "m", "prompt": "x"}).encode()
        at = at[:-1] + b" " * (100 - len(at)) + b"}"
        assert len(at) == 100
        mesh.prepare(match, at, HEADERS)
        assert sum(mesh.pool.outcomes.values()) == 0
        mesh.prepare(match, at[:-1] + b" }", HEADERS)
        assert sum(mesh.pool.outcomes.values()) == 1
    finally:
        mesh.close()


def test_a_prompt_over_max_tokenize_bytes_is_413_before_tokenizing(qwen_path: Path) -> None:
    mesh = _mesh(qwen_path, prepare={"max_tokenize_bytes": 1000, "workers": 1})
    try:
        match = mesh.resolve("POST", "/v1/completions")
        assert match is not None
        with pytest.raises(RequestTooLarge) as info:
            mesh.prepare(match, _body("word " * 300), HEADERS)
        assert info.value.status == 413
        assert mesh.prepare(match, _body("word " * 150), HEADERS).token_ids
    finally:
        mesh.close()


def test_the_tokenize_bound_counts_the_text_not_an_image_beside_it(qwen_path: Path) -> None:
    """``prepare.max_tokenize_bytes`` bounds what is tokenized: a short question
    with a base64 image larger than the bound is routed by its text (the image is
    a placeholder there), not refused; a text over the bound still is."""
    mesh = _mesh(qwen_path, prepare={"max_tokenize_bytes": 1000, "workers": 1})
    try:
        match = mesh.resolve("POST", "/v1/chat/completions")
        assert match is not None
        image = "data:image/png;base64," + "QUJD" * 2000
        parts = [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": image}},
        ]
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]})
        assert len(body) > 8000
        view = mesh.prepare(match, body.encode(), HEADERS)
        assert view.token_ids
        long = [{"role": "user", "content": "word " * 300}]
        with pytest.raises(RequestTooLarge):
            mesh.prepare(match, json.dumps({"model": "m", "messages": long}).encode(), HEADERS)
    finally:
        mesh.close()


def test_a_policy_swapped_at_runtime_changes_what_is_prepared() -> None:
    """What the policy needs is summarized once per policy (``pipeline._Wants``):
    a new policy's needs apply from the next request, both ways."""
    mesh = Mesh(workers=["http://127.0.0.1:9"], policy="round_robin")
    try:
        match = mesh.resolve("POST", "/v1/chat/completions")
        assert match is not None
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        before = mesh.policy
        assert mesh.prepare(match, body.encode(), HEADERS).routing_text == ""
        mesh.policy = create_policy("cache_aware")  # reads the routing text
        assert mesh.prepare(match, body.encode(), HEADERS).routing_text == "user\nhi"
        mesh.policy = before
        assert mesh.prepare(match, body.encode(), HEADERS).routing_text == ""
    finally:
        mesh.close()
