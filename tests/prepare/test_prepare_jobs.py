"""/v1/tokenize and /v1/detokenize jobs: vLLM's shapes, and their bounds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from meshkit.errors import InvalidRequest, RequestTooLarge, UnsupportedApi
from meshkit.metrics import PrepareMetrics
from meshkit.prepare.jobs import detokenize_job, text_bytes, tokenize_job
from meshkit.prepare.pool import PreparePool
from meshkit.prepare.tokenizers import LoadedTokenizer, TokenizerRegistry


@pytest.fixture
def registry(tiny_dir: Path) -> TokenizerRegistry:
    reg = TokenizerRegistry()
    reg.register(None, tiny_dir)
    return reg


def test_tokenize_prompt_shape(registry: TokenizerRegistry, tiny: LoadedTokenizer) -> None:
    out = tokenize_job(registry, "m", {"model": "m", "prompt": "the quick brown fox"})
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["tokens"] == tiny.encode("the quick brown fox", add_special_tokens=True)
    assert out["tokens"][0] == tiny.tokenizer.token_to_id("<s>")  # special tokens by default
    assert out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 2048
    assert out["token_strs"] is None
    plain = tokenize_job(registry, None, {"prompt": "the quick", "add_special_tokens": False})
    assert plain["tokens"] == tiny.encode("the quick", add_special_tokens=False)


def test_tokenize_token_strs(registry: TokenizerRegistry) -> None:
    out = tokenize_job(registry, None, {"prompt": "the fox", "return_token_strs": True})
    assert out["token_strs"][0] == "<s>"
    assert len(out["token_strs"]) == out["count"]


def test_tokenize_chat_shape(registry: TokenizerRegistry, tiny: LoadedTokenizer) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "you"}],
        },
    ]
    out = tokenize_job(registry, None, {"messages": messages})
    rendered = "<s><|system|>\nbe brief<|end|>\n<|user|>\nhello\nyou<|end|>\n<|assistant|>\n"
    # Rendered, then tokenized without special tokens: the template wrote the BOS.
    assert out["tokens"] == tiny.encode(rendered, add_special_tokens=False)
    assert out["count"] == len(out["tokens"])
    no_prompt = tokenize_job(registry, None, {"messages": messages, "add_generation_prompt": False})
    assert no_prompt["count"] < out["count"]


def test_tokenize_chat_continue_final_message(
    registry: TokenizerRegistry, tiny: LoadedTokenizer
) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "the answer is"},
    ]
    out = tokenize_job(registry, None, {"messages": messages, "continue_final_message": True})
    expected = "<s><|user|>\nhi<|end|>\n<|assistant|>\nthe answer is"
    assert out["tokens"] == tiny.encode(expected, add_special_tokens=False)
    with pytest.raises(InvalidRequest):
        tokenize_job(
            registry,
            None,
            {"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
        )


def test_tokenize_chat_with_qwen(qwen_path: Path) -> None:
    reg = TokenizerRegistry()
    reg.register("qwen", qwen_path)
    out = tokenize_job(reg, "qwen", {"messages": [{"role": "user", "content": "hi"}]})
    assert out["max_model_len"] == 131072
    tok = reg.get("qwen")
    assert tok is not None
    assert tok.decode(out["tokens"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": "nope"}, "tools"),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
            "chat_template",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]},
            "chat_template_kwargs",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, None),  # raise_exception
    ],
)
def test_tokenize_rejects_malformed_bodies(
    registry: TokenizerRegistry, body: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(InvalidRequest) as info:
        tokenize_job(registry, None, body)
    assert info.value.status == 400
    assert info.value.param == param


def test_tokenize_over_the_limit_is_413(registry: TokenizerRegistry) -> None:
    limit = 1000
    tokenize_job(registry, None, {"prompt": "a" * limit}, max_tokenize_bytes=limit)
    with pytest.raises(RequestTooLarge) as info:
        tokenize_job(registry, None, {"prompt": "a" * (limit + 1)}, max_tokenize_bytes=limit)
    assert info.value.status == 413
    # Bytes, not characters: 334 three-byte characters are 1002 bytes.
    with pytest.raises(RequestTooLarge):
        tokenize_job(registry, None, {"prompt": "的" * 334}, max_tokenize_bytes=limit)
    big = [{"role": "user", "content": "b" * (limit + 1)}]
    with pytest.raises(RequestTooLarge):
        tokenize_job(registry, None, {"messages": big}, max_tokenize_bytes=limit)


def test_text_bytes() -> None:
    assert text_bytes("abc") == 3
    assert text_bytes("é") == 2
    assert text_bytes([{"role": "user", "content": "的"}, None, 5]) == 4 + 4 + 7 + 3
    assert text_bytes(["a" * 100] * 100, limit=150) <= 200  # stops early


def test_detokenize_shape(registry: TokenizerRegistry, tiny: LoadedTokenizer) -> None:
    ids = tiny.encode("the quick brown fox", add_special_tokens=True)
    assert detokenize_job(registry, None, {"tokens": ids}) == {"prompt": "<s>the quick brown fox"}
    assert detokenize_job(registry, None, {"tokens": []}) == {"prompt": ""}


@pytest.mark.parametrize("tokens", [None, "1 2", [1, "2"], [True], [-1], [10**9]])
def test_detokenize_rejects_invalid_ids(registry: TokenizerRegistry, tokens: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        detokenize_job(registry, None, {"tokens": tokens})
    assert info.value.param == "tokens"


def test_detokenize_over_the_limit_is_413(registry: TokenizerRegistry) -> None:
    with pytest.raises(RequestTooLarge):
        detokenize_job(registry, None, {"tokens": [1] * 251}, max_tokenize_bytes=1000)
    assert detokenize_job(registry, None, {"tokens": [1] * 250}, max_tokenize_bytes=1000)


def test_no_tokenizer_is_501() -> None:
    with pytest.raises(UnsupportedApi) as info:
        tokenize_job(TokenizerRegistry(), "m", {"prompt": "x"})
    assert info.value.status == 501
    with pytest.raises(UnsupportedApi):
        detokenize_job(TokenizerRegistry(), None, {"tokens": [1]})


def test_jobs_in_the_pool_record_stages_and_outcomes(
    registry: TokenizerRegistry, make_pool: Callable[..., PreparePool]
) -> None:
    pool = make_pool(workers=2, max_tokenize_bytes=1000)
    metrics: PrepareMetrics = pool.metrics
    limit = pool.config.max_tokenize_bytes

    def job(body: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        return lambda: tokenize_job(registry, None, body, max_tokenize_bytes=limit, metrics=metrics)

    out = pool.run(job({"messages": [{"role": "user", "content": "hi"}]}))
    assert out["count"] > 0
    with pytest.raises(RequestTooLarge):
        pool.run(job({"prompt": "x" * 1001}))
    for stage in ("template", "tokenize"):
        count = metrics.registry.get_sample_value(
            "mesh_prepare_stage_seconds_count", {"stage": stage}
        )
        assert count == 1
    assert pool.outcomes["success"] == 1 and pool.outcomes["failed"] == 1
    assert metrics.error_count("too_large") == 1
