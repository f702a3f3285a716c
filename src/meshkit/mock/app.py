"""
The mock worker's request handling (no I/O)
===========================================

:class:`MockApp` routes a parsed :class:`~meshkit.mock.wire.Request` and answers with
a :data:`~meshkit.mock.wire.Reply`. It owns the worker's state: the prefix cache, the
Responses and Conversations stores, sleep state, the error RNG and the pre-built response templates.

Order of checks for an API request: family enabled (``apis``, else 404) → API key
(401) → for inference, sleeping (503) → JSON body (400) → data-parallel rank (400)
→ injected error (``error_rate``) → the answer.

With ``MockConfig.tokenizer``, chat and completions prompts are the token ids an
engine computes (:func:`meshkit.prepare.jobs.prompt_ids`: chat template, special
tokens); a body it refuses answers 400 (413 when too large). Other APIs keep the
whitespace words of :mod:`meshkit.mock.tokens`.

Non-stream chat/completions answers are rendered once per distinct
(model, token counts, rank, keep-alive) into a template; each request only splices
a fresh fixed-width id into the pre-built bytes.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from meshkit.mock import anthropic_api, openai_api, sglang_api
from meshkit.mock.admin import AdminHandlers
from meshkit.mock.cache import PrefixCache
from meshkit.mock.config import MockConfig, MockStats
from meshkit.mock.conversations import ConversationHandlers, ConversationStore
from meshkit.mock.errors import anthropic_error, openai_error
from meshkit.mock.pd import check_pd, logprobs_for, vllm_prefill_params
from meshkit.mock.pooling_api import PoolingHandlers
from meshkit.mock.responses_api import ResponseStore
from meshkit.mock.responses_handlers import ResponsesHandlers
from meshkit.mock.tokens import Token, Vocab, prompt_size, prompt_tokens
from meshkit.mock.turn import Event, Turn, max_tokens
from meshkit.mock.wire import Delayed, Reply, Request, Stream, encode, head, response

__all__ = ["MockApp"]

Handler = Callable[[Request], Reply]
#: path → (stats name, API family or None, Anthropic error shape, {method: handler})
Route = tuple[str, str | None, bool, dict[bytes, Handler]]

_decode = msgspec.json.Decoder().decode
_ID_MARK = "@@MOCKID@@"
_ID_MARK_B = _ID_MARK.encode()
_ID_HEX = 12
_RESP_PREFIX = b"/v1/responses/"
_CONV_PREFIX = b"/v1/conversations/"


def _safe_tag(name: str) -> str:
    tag = "".join(c for c in name if c.isalnum() or c in "-_")
    return f"{tag}-" if tag else ""


class MockApp:
    """Routing, policy and per-API rendering for one mock worker."""

    def __init__(self, config: MockConfig, stats: MockStats) -> None:
        self.config = config
        self.stats = stats
        self.sleeping_tags: set[str] = set()
        self.vocab = Vocab()
        self.responses = ResponseStore(config.max_responses)
        self.conversations = ConversationStore(
            config.max_conversations, config.max_conversation_items
        )
        self.cache = (
            PrefixCache(config.cache_tokens, config.block_size) if config.cache_tokens > 0 else None
        )
        self._prompt_ids: Callable[[dict[str, Any]], list[int]] | None = None
        self._text_ids: Callable[[str], list[int]] | None = None
        if config.tokenizer is not None:
            self._prompt_ids, self._text_ids = _engine_tokenizer(config.tokenizer)
        self._rng = random.Random(config.seed)
        self._memo: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}
        self._counter = 0
        self._tag = _safe_tag(config.name)
        self._fingerprint = f"fp_mock_{config.name}" if config.name else "fp_mock"
        self._id_salt = os.urandom(3).hex()
        name_hdr = "".join(c for c in config.name if c.isprintable()).encode("latin-1", "replace")
        self._hdr = b"x-mock-worker: " + name_hdr + b"\r\nserver: meshkit-mock\r\n"
        #: Header lines every response carries.
        self.headers = self._hdr
        key = config.api_key
        self._keys = None if key is None else {b"Bearer " + key.encode(), key.encode()}
        self._routes: dict[bytes, Route] = {}
        self._responses = ResponsesHandlers(self)
        self._conversations = ConversationHandlers(self)
        self._add_routes()

    def reset_state(self) -> None:
        """Forget volatile state (a crashed process loses it): cache (and its engine-hash
        seed), responses and conversations, sleep."""
        if self.cache is not None:
            self.cache.clear()
            self.cache.reseed()
        self.responses.clear()
        self.conversations.clear()
        self.sleeping_tags.clear()

    # -- routing -----------------------------------------------------------------

    def route(self, path: str, family: str | None, anthropic: bool, **methods: Handler) -> None:
        """Register ``path`` (``family`` None = not an API endpoint: no gate)."""
        table = {m.encode(): fn for m, fn in methods.items()}
        self._routes[path.encode()] = (path, family, anthropic, table)

    def _add_routes(self) -> None:
        r = self.route
        r("/v1/chat/completions", "chat", False, POST=self._chat)
        r("/v1/completions", "completions", False, POST=self._completions)
        r("/v1/messages", "messages", True, POST=self._messages)
        r("/v1/messages/count_tokens", "messages", True, POST=self._count_tokens)
        r("/v1/responses", "responses", False, POST=self._responses.create)
        r("/v1/conversations", "responses", False, POST=self._conversations.create)
        r("/generate", "generate", False, POST=self._generate)
        PoolingHandlers(self).register()
        AdminHandlers(self).register()

    def handle(self, req: Request) -> Reply:
        """Answer one request."""
        route = self._routes.get(req.path)
        counts = self.stats.requests_total
        if route is None:
            name = req.path.decode("latin-1")
            counts[name] = counts.get(name, 0) + 1
            if req.path.startswith(_RESP_PREFIX):
                gate = self._gate(req, "responses", False)
                return gate if gate is not None else self._responses.resource(req)
            if req.path.startswith(_CONV_PREFIX):
                gate = self._gate(req, "responses", False)
                return gate if gate is not None else self._conversations.resource(req)
            return self.error(req, 404, f"Not found: {name}")
        name, family, anthropic, methods = route
        counts[name] = counts.get(name, 0) + 1
        if family is not None:
            gate = self._gate(req, family, anthropic)
            if gate is not None:
                return gate
        fn = methods.get(req.method)
        if fn is None:
            return self.error(req, 405, "Method not allowed", anthropic=anthropic)
        return fn(req)

    def _gate(self, req: Request, family: str, anthropic: bool) -> bytes | None:
        if family != "models":
            self.stats.record(req)
        apis = self.config.apis
        if apis is not None and family not in apis:
            return self.error(req, 404, f"this worker does not serve {family}", anthropic=anthropic)
        if self._keys is not None:
            given = req.header(b"authorization")
            if given is None or given not in self._keys:
                given = req.header(b"x-api-key")
            if given is None or given not in self._keys:
                return self.error(req, 401, "Invalid API key", anthropic=anthropic)
        return None

    # -- rendering helpers -------------------------------------------------------

    def error(
        self,
        req: Request,
        status: int,
        message: str,
        *,
        anthropic: bool = False,
        param: str | None = None,
        code: str | None = None,
    ) -> bytes:
        """An error response in the API's shape."""
        if anthropic:
            body = anthropic_error(status, message, self.new_id("req_"))
        else:
            body = openai_error(status, message, param=param, code=code)
        return response(status, encode(body), self._hdr, req.keep_alive)

    def json(self, req: Request, obj: Any, status: int = 200, rank: int | None = None) -> bytes:
        """A JSON response with the worker's headers."""
        return response(status, encode(obj), self._extra(rank), req.keep_alive)

    def plain(
        self, req: Request, status: int = 200, body: bytes = b"", ctype: bytes = b"text/plain"
    ) -> bytes:
        """A non-JSON response (empty body = no content type)."""
        return response(status, body, self._hdr, req.keep_alive, ctype)

    def new_id(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}{self._id_salt}{self._counter:0{_ID_HEX}x}"

    def _extra(self, rank: int | None) -> bytes:
        if rank is None:
            return self._hdr
        return self._hdr + b"x-mock-dp-rank: %d\r\n" % rank

    def parse(self, req: Request) -> dict[str, Any] | None:
        """The JSON object body, or ``None`` when it is not one."""
        try:
            body = _decode(req.body)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return None
        return body if isinstance(body, dict) else None

    # -- inference common path ---------------------------------------------------

    def prelude(self, req: Request, anthropic: bool) -> tuple[dict[str, Any], int | None] | bytes:
        cfg = self.config
        if self.sleeping_tags:
            return self.error(req, 503, "The worker is sleeping", anthropic=anthropic)
        body = self.parse(req)
        if body is None:
            return self.error(
                req, 400, "The request body is not a JSON object", anthropic=anthropic
            )
        rank: int | None = None
        raw = body.get("data_parallel_rank")
        if raw is None:
            raw = body.get("routed_dp_rank")
        if raw is not None:
            if not isinstance(raw, int) or isinstance(raw, bool):
                return self.error(
                    req, 400, "data_parallel_rank must be an integer", anthropic=anthropic
                )
            rank = raw
        else:
            hdr = req.header(b"x-data-parallel-rank")
            if hdr is not None:
                try:
                    rank = int(hdr)
                except ValueError:
                    rank = None
        if rank is not None and not 0 <= rank < cfg.dp_size:
            msg = f"data parallel rank {rank} out of range [0, {cfg.dp_size})"
            return self.error(req, 400, msg, anthropic=anthropic, param="data_parallel_rank")
        self.stats.last_dp_rank = rank
        if cfg.pd_role is not None:
            problem = check_pd(cfg.pd_role, cfg.pd_protocol, body)
            if problem is not None:
                return self.error(req, 400, problem, anthropic=anthropic)
            self.stats.last_bootstrap = (
                body.get("bootstrap_host"),
                body.get("bootstrap_port"),
                body.get("bootstrap_room"),
            )
            kv = body.get("kv_transfer_params")
            self.stats.last_kv_params = kv if isinstance(kv, dict) else None
        if cfg.error_rate > 0.0 and self._rng.random() < cfg.error_rate:
            self.stats.injected_errors += 1
            return self.error(req, cfg.fail_status, "Injected failure", anthropic=anthropic)
        return body, rank

    def prompt(self, *values: Any) -> list[Token] | int:
        """The prompt's tokens when the cache model needs them, else just their count."""
        return prompt_tokens(*values) if self.cache is not None else prompt_size(*values)

    def engine_prompt(self, req: Request, body: dict[str, Any]) -> list[int] | bytes | None:
        """With ``MockConfig.tokenizer``: the engine's prompt ids for a chat or completion
        ``body`` (or the error answer); without: ``None``."""
        encode_ids = self._prompt_ids
        if encode_ids is None:
            return None
        from meshkit.errors import MeshError

        try:
            return encode_ids(body)
        except MeshError as exc:
            return self.error(req, exc.status, exc.message, param=exc.param)

    def turn(
        self,
        body: dict[str, Any],
        prompt: Sequence[Token] | int,
        max_out: int | None,
        rank: int | None,
    ) -> Turn:
        """Account a generation: prompt size, prefix-cache hit, output length."""
        p = prompt if isinstance(prompt, int) else len(prompt)
        n = self.config.output_tokens
        truncated = max_out is not None and max_out < n
        if truncated:
            n = max(max_out or 0, 0)
        model = body.get("model")
        t = Turn(
            model=model if isinstance(model, str) else self.config.model,
            prompt_tokens=p,
            cached_tokens=0,
            output_tokens=n,
            truncated=truncated,
            rank=rank,
            fingerprint=self._fingerprint,
            created=int(time.time()),
        )
        cache = self.cache
        if cache is not None and not isinstance(prompt, int):
            lora = t.model if t.model in self.config.lora_adapters else None
            hashes = cache.block_hashes(prompt, lora)
            t.cached_tokens = cache.lookup(hashes, p)
            self._remember(cache, prompt, hashes, t, lora)
        stats = self.stats
        stats.prompt_tokens_total += p
        stats.cached_tokens_total += t.cached_tokens
        return t

    def _remember(
        self,
        cache: PrefixCache,
        prompt: Sequence[Token],
        hashes: list[int],
        t: Turn,
        lora: str | None,
    ) -> None:
        """The turn's blocks into the cache as an engine's would go: held while it
        runs (``cache_holds_running``), and the answer's with them (``cache_outputs``)."""
        cfg = self.config
        keys, tokens = hashes, prompt
        if cfg.cache_outputs and t.output_tokens > 0:
            tokens = [*prompt, *self._output_tokens(t)]
            keys = cache.block_hashes(tokens, lora)
        if not cfg.cache_holds_running:
            cache.insert(keys, tokens, lora)
            return
        then = (keys, tokens) if keys is not hashes else None  # stored when the hold ends
        n_tokens = t.prompt_tokens + t.output_tokens
        run_s = self.total_delay(t)  # (before the wait is known: the run alone)
        t.queued_s = cache.admit(hashes, prompt, n_tokens, run_s, then=then, lora=lora)

    def _output_tokens(self, t: Turn) -> list[Token]:
        """The generated text as the next turn's prompt will hold it: the engine
        tokenizer's ids of it, or its words."""
        if self._text_ids is not None:
            return list(self._text_ids(t.text))
        return [w.strip() for w in t.pieces]

    def first_delay(self, t: Turn) -> float:
        cfg = self.config
        run = (cfg.prefill_ms_per_token * t.uncached_tokens + cfg.first_token_ms) / 1000.0
        return t.queued_s + run

    def total_delay(self, t: Turn) -> float:
        """Seconds until the last token: prefill + first token + per-token gaps."""
        return self.first_delay(t) + self.config.per_token_ms * max(t.output_tokens - 1, 0) / 1000.0

    def _complete(self, req: Request, data: bytes, t: Turn) -> Reply:
        """A non-stream answer, delayed by the simulated generation time."""
        delay = self.total_delay(t)
        return Delayed(delay, data, req.keep_alive) if delay > 0.0 else data

    def complete_json(self, req: Request, obj: Any, t: Turn) -> Reply:
        return self._complete(
            req, response(200, encode(obj), self._extra(t.rank), req.keep_alive), t
        )

    def stream(self, req: Request, events: list[Event], t: Turn | None) -> Stream:
        """A chunked SSE answer; token events carry the generation delays."""
        first = 0.0 if t is None else self.first_delay(t)
        per = self.config.per_token_ms / 1000.0
        out: list[tuple[float, bytes]] = []
        seen = False
        for is_token, data in events:
            delay = 0.0
            if is_token:
                delay = per if seen else first
                seen = True
            out.append((delay, data))
        if not seen and first > 0.0 and out:
            out[-1] = (first, out[-1][1])
        extra = self._extra(None if t is None else t.rank)
        hd = head(200, b"text/event-stream", extra, req.keep_alive, None)
        return Stream(hd, out, req.keep_alive, self.config.crash_after_chunks)

    def _openai_fast(self, req: Request, t: Turn, chat: bool) -> bytes:
        """Pre-built non-stream chat/completions bytes with a fresh id spliced in."""
        key = (
            chat,
            t.model,
            t.prompt_tokens,
            t.cached_tokens,
            t.output_tokens,
            t.truncated,
            t.rank,
            req.keep_alive,
        )
        tpl = self._memo.get(key)
        if tpl is None:
            prefix = ("chatcmpl-" if chat else "cmpl-") + self._tag + self._id_salt
            render = openai_api.chat_body if chat else openai_api.completion_body
            body = encode(render(t, prefix + _ID_MARK))
            pre, _, post = body.partition(_ID_MARK_B)
            length = len(pre) + _ID_HEX + len(post)
            tpl = (
                head(200, b"application/json", self._extra(t.rank), req.keep_alive, length) + pre,
                post,
            )
            if len(self._memo) >= 4096:
                self._memo.clear()
            self._memo[key] = tpl
        self._counter += 1
        return tpl[0] + b"%012x" % self._counter + tpl[1]

    # -- OpenAI ------------------------------------------------------------------

    def _chat(self, req: Request) -> Reply:
        pre = self.prelude(req, False)
        if isinstance(pre, bytes):
            return pre
        body, rank = pre
        messages = body.get("messages")
        if not isinstance(messages, list):
            return self.error(req, 400, "'messages' must be a list", param="messages")
        ids = self.engine_prompt(req, body)
        if isinstance(ids, bytes):
            return ids
        t = self.turn(
            body,
            self.prompt(messages) if ids is None else ids,
            max_tokens(body, "max_completion_tokens", "max_tokens"),
            rank,
        )
        if self._vllm_prefill():
            return self._prefill_answer(req, t, "chat.completion")
        if body.get("stream") is True:
            rid = "chatcmpl-" + self._tag + self.new_id("")
            return self.stream(req, openai_api.chat_events(t, rid, _include_usage(body)), t)
        return self._complete(req, self._openai_fast(req, t, True), t)

    def _completions(self, req: Request) -> Reply:
        pre = self.prelude(req, False)
        if isinstance(pre, bytes):
            return pre
        body, rank = pre
        prompt = body.get("prompt")
        if prompt is None:
            return self.error(req, 400, "'prompt' is required", param="prompt")
        ids = self.engine_prompt(req, body)
        if isinstance(ids, bytes):
            return ids
        tokens = self.prompt(prompt) if ids is None else ids
        t = self.turn(body, tokens, max_tokens(body, "max_tokens"), rank)
        if self._vllm_prefill():
            return self._prefill_answer(req, t, "text_completion")
        if body.get("stream") is True:
            rid = "cmpl-" + self._tag + self.new_id("")
            return self.stream(req, openai_api.completion_events(t, rid, _include_usage(body)), t)
        return self._complete(req, self._openai_fast(req, t, False), t)

    # -- Anthropic ---------------------------------------------------------------

    def _messages(self, req: Request) -> Reply:
        pre = self.prelude(req, True)
        if isinstance(pre, bytes):
            return pre
        body, rank = pre
        messages = body.get("messages")
        if not isinstance(messages, list):
            return self.error(req, 400, "messages: Field required", anthropic=True)
        tokens = self.prompt(body.get("system"), messages)
        t = self.turn(body, tokens, max_tokens(body, "max_tokens"), rank)
        mid = self.new_id("msg_")
        if body.get("stream") is True:
            return self.stream(req, anthropic_api.message_events(t, mid), t)
        return self.complete_json(req, anthropic_api.message_body(t, mid), t)

    def _count_tokens(self, req: Request) -> Reply:
        body = self.parse(req)
        if body is None:
            return self.error(req, 400, "The request body is not a JSON object", anthropic=True)
        size = prompt_size(body.get("system"), body.get("messages"))
        return self.json(req, {"input_tokens": size})

    # -- SGLang / vLLM extras ----------------------------------------------------

    def _generate(self, req: Request) -> Reply:
        pre = self.prelude(req, False)
        if isinstance(pre, bytes):
            return pre
        body, rank = pre
        max_out = max_tokens(body.get("sampling_params"), "max_new_tokens")
        text, ids, rid = body.get("text"), body.get("input_ids"), body.get("rid")
        batch: list[Any] | None = None
        if isinstance(text, list):
            batch = text
        elif isinstance(ids, list) and ids and isinstance(ids[0], list):
            batch = ids
        if batch is None:
            t = self.turn(body, self.prompt(text if text is not None else ids), max_out, rank)
            gid = rid if isinstance(rid, str) else self.new_id("")
            if body.get("stream") is True:
                return self.stream(req, sglang_api.generate_events(t, gid, self.vocab), t)
            return self.complete_json(req, self._with_logprobs(body, t, gid), t)
        if body.get("stream") is True:
            return self.error(req, 400, "the mock worker does not stream batched /generate")
        rids = rid if isinstance(rid, list) else [None] * len(batch)
        results: list[dict[str, Any]] = []
        longest: Turn | None = None
        for item, item_rid in zip(batch, rids, strict=False):
            t = self.turn(body, self.prompt(item), max_out, rank)
            gid = item_rid if isinstance(item_rid, str) else self.new_id("")
            results.append(self._with_logprobs(body, t, gid))
            if longest is None or t.uncached_tokens > longest.uncached_tokens:
                longest = t
        if longest is None:
            return self.error(req, 400, "empty batch")
        return self.complete_json(req, results, longest)

    # -- prefill/decode roles (mock/pd.py) ---------------------------------------

    def _vllm_prefill(self) -> bool:
        cfg = self.config
        return cfg.pd_role == "prefill" and cfg.pd_protocol == "vllm"

    def _prefill_answer(self, req: Request, t: Turn, obj: str) -> Reply:
        port = int(self.config.name.rsplit(":", 1)[-1]) if ":" in self.config.name else 0
        answer = {
            "id": self.new_id("pd-"),
            "object": obj,
            "model": self.config.model,
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {"prompt_tokens": t.prompt_tokens, "completion_tokens": 1},
            "kv_transfer_params": vllm_prefill_params(self.config.name, port),
        }
        return self.complete_json(req, answer, t)

    def _with_logprobs(self, body: dict[str, Any], t: Turn, gid: str) -> dict[str, Any]:
        out = sglang_api.generate_body(t, gid, self.vocab)
        role = self.config.pd_role
        if role is not None and body.get("return_logprob") is True:
            n = 2 if role == "prefill" else 1
            out["meta_info"]["input_token_logprobs"] = logprobs_for(role, n)
        return out


def _engine_tokenizer(
    path: str,
) -> tuple[Callable[[dict[str, Any]], list[int]], Callable[[str], list[int]]]:
    """Load the tokenizer at ``path`` once: functions of a request body to its prompt
    ids, and of a generated text to its ids."""
    from meshkit.prepare.jobs import prompt_ids
    from meshkit.prepare.tokenizers import TokenizerSpec

    tok = TokenizerSpec(path).load()
    return (
        lambda body: prompt_ids(tok, body),
        lambda text: tok.encode(text, add_special_tokens=False),
    )


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True
