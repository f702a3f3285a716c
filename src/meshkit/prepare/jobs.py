"""
Preparation jobs
================

What the Mesh runs inside the :class:`~meshkit.prepare.pool.PreparePool` for the
tokenizer endpoints. Each helper is a plain function of a parsed JSON body; the
Mesh wraps it in a lambda for :meth:`~meshkit.prepare.pool.PreparePool.run_async`.

``/v1/tokenize`` (:func:`tokenize_job`) answers in vLLM's shape::

    {"count": 3, "max_model_len": 131072, "tokens": [9707, 1879, 0], "token_strs": null}

in its two forms:

- **prompt** — ``{"prompt": "...", "add_special_tokens": true}``;
- **chat** — ``{"messages": [...], "add_generation_prompt": true,
  "continue_final_message": false, "tools": [...], "chat_template_kwargs": {...},
  "add_special_tokens": false}``: the model's chat template is rendered (see
  :mod:`meshkit.prepare.templates`), then tokenized without special tokens
  (the template wrote them). Text content parts are joined with newlines, as
  vLLM does for string-content templates.

``/v1/detokenize`` (:func:`detokenize_job`) turns ``{"tokens": [...]}`` into
``{"prompt": "..."}``.

Bounds: an input over ``max_tokenize_bytes`` (UTF-8 bytes of the prompt, or of
every string in the messages and tools, and of the rendered chat) is refused with
:class:`~meshkit.errors.RequestTooLarge` (413); detokenization accepts up to
``max_tokenize_bytes // 4`` ids (about that many bytes of text). A
request-supplied ``chat_template`` is refused (400), as vLLM does unless told to
trust it: a template is code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from meshkit.errors import InvalidRequest, RequestTooLarge, UnsupportedApi
from meshkit.metrics import PrepareMetrics
from meshkit.prepare.templates import RenderBudget
from meshkit.prepare.tokenizers import LoadedTokenizer, TokenizerRegistry

__all__ = [
    "DEFAULT_MAX_TOKENIZE_BYTES",
    "detokenize_job",
    "prompt_ids",
    "text_bytes",
    "tokenize_job",
]

DEFAULT_MAX_TOKENIZE_BYTES: Final = 4 * 1024 * 1024


def text_bytes(value: Any, limit: int | None = None) -> int:
    """UTF-8 bytes of every string inside ``value`` (dicts, lists, strings).

    Stops counting once past ``limit``: the answer is then just "over".
    """
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            # Every character is at least one byte: skip the encode when that is enough.
            total += len(item) if item.isascii() else len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        if limit is not None and total > limit:
            break
    return total


def _too_large(size: int, limit: int, what: str) -> RequestTooLarge:
    return RequestTooLarge(f"the {what} is larger than the {limit} bytes tokenization allows")


def _tokenizer(registry: TokenizerRegistry, model: str | None) -> LoadedTokenizer:
    tok = registry.get(model)
    if tok is None:
        name = repr(model) if model is not None else "the default model"
        raise UnsupportedApi(f"tokenization is not available: no tokenizer for {name}")
    return tok


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{key} must be a boolean", param=key)
    return value


def _stage(metrics: PrepareMetrics | None, name: str) -> contextlib.AbstractContextManager[None]:
    return metrics.stage(name) if metrics is not None else contextlib.nullcontext()


def _content_text(content: Any, index: int) -> Any:
    """A message's content for a string-content template: text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidRequest(
                        f"messages[{index}]: a text part needs a string text", param="messages"
                    )
                texts.append(text)
            else:
                raise InvalidRequest(
                    f"messages[{index}]: only text content can be tokenized", param="messages"
                )
        return "\n".join(texts)
    raise InvalidRequest(
        f"messages[{index}].content must be a string or a list of parts", param="messages"
    )


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(raw):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] needs a string role", param="messages")
        copy = dict(message)
        copy["content"] = _content_text(message.get("content"), i)
        out.append(copy)
    return out


def _continue_final(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """Cut the render after the final message's text (HF ``continue_final_message``)."""
    final = messages[-1].get("content")
    if not isinstance(final, str) or final.strip() not in rendered:
        raise InvalidRequest(
            "continue_final_message is set but the final message does not appear in the "
            "rendered chat",
            param="continue_final_message",
        )
    at = rendered.rindex(final.strip())
    if rendered[at : at + len(final.lstrip())] == final:
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]


def _render(
    tok: LoadedTokenizer,
    body: Mapping[str, Any],
    max_bytes: int,
    budget: RenderBudget | None,
) -> str:
    if body.get("chat_template") is not None:
        raise InvalidRequest(
            "a request-supplied chat_template is not accepted", param="chat_template"
        )
    messages = _messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", param="tools")
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, Mapping):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    size = text_bytes([messages, tools], max_bytes)
    if size > max_bytes:
        raise _too_large(size, max_bytes, "conversation")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message", False)
    if add_generation_prompt and continue_final and "add_generation_prompt" in body:
        raise InvalidRequest(
            "add_generation_prompt and continue_final_message cannot both be set",
            param="continue_final_message",
        )
    if continue_final:
        add_generation_prompt = False
    if budget is None:
        # Room for the template around a conversation at the size limit, and steps
        # for templates that loop over the messages a few times.
        budget = RenderBudget(
            max_steps=1_000_000 + 50 * len(messages),
            max_output_chars=2 * max_bytes + 1024 * 1024,
        )
    rendered = tok.render_chat(
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        extra=extra,
        budget=budget,
    )
    if continue_final:
        rendered = _continue_final(rendered, messages)
    return rendered


def _engine_text(
    tok: LoadedTokenizer,
    body: Mapping[str, Any],
    max_tokenize_bytes: int,
    metrics: PrepareMetrics | None,
    budget: RenderBudget | None,
) -> tuple[str, bool]:
    """The text an engine tokenizes for ``body`` and whether it adds special tokens:
    a chat's rendered template (the template wrote them: off unless asked), or a
    prompt (on unless asked off), as vLLM's request models default them."""
    if "messages" in body and body["messages"] is not None:
        with _stage(metrics, "template"):
            text = _render(tok, body, max_tokenize_bytes, budget)
        add_special_tokens = _flag(body, "add_special_tokens", False)
        what = "rendered conversation"
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt (a string) or messages is required", param="prompt")
        text = prompt
        add_special_tokens = _flag(body, "add_special_tokens", True)
        what = "prompt"
    size = text_bytes(text, max_tokenize_bytes)
    if size > max_tokenize_bytes:
        raise _too_large(size, max_tokenize_bytes, what)
    return text, add_special_tokens


def prompt_ids(
    tok: LoadedTokenizer,
    body: Mapping[str, Any],
    *,
    max_tokenize_bytes: int = DEFAULT_MAX_TOKENIZE_BYTES,
    metrics: PrepareMetrics | None = None,
    budget: RenderBudget | None = None,
) -> list[int]:
    """The token ids an engine computes for a chat or completion request's prompt:
    what KV-cache events name (``BlockStored.token_ids``) and ``/tokenize`` answers.
    A completion prompt given as ids is taken as it is (the first of a batch).

    :raises RequestTooLarge: (413) over ``max_tokenize_bytes``.
    :raises InvalidRequest: (400) for a malformed body or a failing chat template.
    """
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and "messages" not in body:
        first = prompt[0]
        if isinstance(first, str):
            body = {**body, "prompt": first}
        else:
            ids = first if isinstance(first, list) else prompt
            if not all(type(x) is int for x in ids):
                raise InvalidRequest("prompt must be text or token ids", param="prompt")
            return list(ids)
    text, add_special_tokens = _engine_text(tok, body, max_tokenize_bytes, metrics, budget)
    with _stage(metrics, "tokenize"):
        return tok.encode(text, add_special_tokens=add_special_tokens)


def tokenize_job(
    registry: TokenizerRegistry,
    model: str | None,
    body: Mapping[str, Any],
    *,
    max_tokenize_bytes: int = DEFAULT_MAX_TOKENIZE_BYTES,
    metrics: PrepareMetrics | None = None,
    budget: RenderBudget | None = None,
) -> dict[str, Any]:
    """Answer ``/v1/tokenize`` for ``model`` (prompt or chat form).

    :raises RequestTooLarge: (413) over ``max_tokenize_bytes``.
    :raises InvalidRequest: (400) for a malformed body or a failing chat template.
    :raises UnsupportedApi: (501) when no tokenizer serves ``model``.
    """
    tok = _tokenizer(registry, model)
    text, add_special_tokens = _engine_text(tok, body, max_tokenize_bytes, metrics, budget)
    return_strs = _flag(body, "return_token_strs", False)
    with _stage(metrics, "tokenize"):
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        strs = tok.token_strs(ids) if return_strs else None
    return {
        "count": len(ids),
        "max_model_len": tok.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def _token_ids(raw: Any, vocab_size: int, limit: int) -> Iterator[int]:
    if not isinstance(raw, list):
        raise InvalidRequest("tokens must be a list of token ids", param="tokens")
    if len(raw) > limit:
        raise RequestTooLarge(f"more than {limit} token ids to detokenize")
    for i, value in enumerate(raw):
        if type(value) is not int or not 0 <= value < vocab_size:
            raise InvalidRequest(
                f"tokens[{i}] is not a token id of this tokenizer (0 to {vocab_size - 1})",
                param="tokens",
            )
        yield value


def detokenize_job(
    registry: TokenizerRegistry,
    model: str | None,
    body: Mapping[str, Any],
    *,
    max_tokenize_bytes: int = DEFAULT_MAX_TOKENIZE_BYTES,
    metrics: PrepareMetrics | None = None,
) -> dict[str, Any]:
    """Answer ``/v1/detokenize``: ``{"prompt": text}``.

    :raises RequestTooLarge: (413) over ``max_tokenize_bytes // 4`` ids.
    :raises InvalidRequest: (400) for ids that are not this tokenizer's.
    :raises UnsupportedApi: (501) when no tokenizer serves ``model``.
    """
    tok = _tokenizer(registry, model)
    ids = list(_token_ids(body.get("tokens"), tok.vocab_size, max(1, max_tokenize_bytes // 4)))
    with _stage(metrics, "detokenize"):
        text = tok.decode(ids)
    return {"prompt": text}
