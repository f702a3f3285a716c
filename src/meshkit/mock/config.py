"""
Mock worker configuration and statistics
========================================

:class:`MockConfig` describes how a mock worker behaves (which APIs it serves,
latencies, injected faults, the prefix-cache model and its KV events, sleep mode,
the bounds of the Conversations store).

:class:`MockStats` records what the worker saw, so tests can assert what a router
forwarded. The ``last_*`` fields describe the last request to an *API* endpoint
(chat, completions, messages, responses, generate, tokenize families; not
``/v1/models``, health, metrics, probes or sleep endpoints, which routers poll in
the background). They are decoded lazily from the raw request, which keeps the
worker's hot path cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

if TYPE_CHECKING:
    from meshkit.mock.wire import Request

__all__ = ["API_NAMES", "MockConfig", "MockStats"]

#: The API families a worker can serve (``MockConfig.apis``).
API_NAMES = frozenset(
    {"chat", "completions", "messages", "responses", "generate", "tokenize", "models"}
    | {"embeddings", "rerank", "score", "pooling", "classify"}
)


@dataclass
class MockConfig:
    """How a mock worker behaves. All latencies are in milliseconds."""

    model: str = "mock-model"
    #: LoRA adapters listed after the model at ``GET /v1/models``, in vLLM's card
    #: shape (``parent``, ``root``, a ``permission`` entry: ~420 bytes each). A
    #: request naming one is cached as vLLM caches it: in blocks of its own (no hit
    #: on the base model's), published with ``lora_name`` and ``extra_keys``.
    #: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change it.
    lora_adapters: tuple[str, ...] = ()
    #: When set, API requests need ``Authorization: Bearer <key>`` or ``x-api-key: <key>``.
    api_key: str | None = None
    #: Subset of :data:`API_NAMES`; the other families answer 404. ``None`` = all.
    apis: frozenset[str] | None = None
    first_token_ms: float = 0.0
    per_token_ms: float = 0.0
    #: Tokens per completion (each token is a word ``"tok<i> "``), capped by the request's max.
    output_tokens: int = 8
    #: Accepted data-parallel ranks (body ``data_parallel_rank`` or header
    #: ``X-data-parallel-rank``); a rank outside ``[0, dp_size)`` answers 400.
    dp_size: int = 1
    #: Fraction of inference requests answered ``fail_status`` (seeded by ``seed``).
    error_rate: float = 0.0
    fail_status: int = 500
    #: Streaming: abort the connection after this many chunks (events).
    crash_after_chunks: int | None = None
    #: Prefix-cache capacity in tokens (0 = no cache).
    cache_tokens: int = 0
    #: Tokens per prefix-cache block (vLLM's ``--block-size``).
    block_size: int = 16
    #: Running requests hold their blocks (prompt and output) for their simulated
    #: generation time, as in vLLM, so that many requests in flight push cached
    #: blocks out, and a request that does not fit waits for room, first come first
    #: served, as in vLLM's waiting queue (see ``mock/cache.py``). Off: a request's
    #: blocks are only cached and every request starts at once.
    cache_holds_running: bool = False
    #: A request's output joins the cache when it ends (its full blocks, chained on the
    #: prompt's), as vLLM caches what it generated: the next turn of a conversation,
    #: whose prompt repeats the answer, hits it. With ``tokenizer``, the output's ids
    #: are the tokenizer's for the generated text.
    cache_outputs: bool = False
    #: Prefill delay per *uncached* prompt token.
    prefill_ms_per_token: float = 0.0
    #: Serve vLLM's ``/sleep``, ``/wake_up`` and ``/is_sleeping``.
    sleep_mode: bool = False
    #: How long ``POST /wake_up`` takes.
    wake_ms: float = 0.0
    #: How long ``POST /sleep`` takes (vLLM offloads or drops the weights first).
    sleep_ms: float = 0.0
    #: Shows in ``x-mock-worker``, ``system_fingerprint`` and chat/completion ids.
    name: str = ""
    seed: int = 0
    #: Prefill/decode disaggregation: "prefill" or "decode" (see ``mock/pd.py``).
    pd_role: str | None = None
    #: "sglang" (bootstrap fields, concurrent legs) or "vllm" (kv_transfer_params).
    pd_protocol: str = "sglang"
    #: Publish the prefix-cache model's KV events as vLLM does (see
    #: ``mock/kv_publisher.py``): the ZeroMQ PUB endpoint to bind, e.g.
    #: ``"tcp://127.0.0.1:5557"`` (port 0 = any free port). ``None`` = off. Needs
    #: ``cache_tokens > 0`` and pyzmq (``meshkit[kv]``).
    kv_events: str | None = None
    #: The ZeroMQ ROUTER endpoint answering replay requests (``None`` = no replay).
    kv_replay: str | None = None
    #: The topic frame of every published batch.
    kv_topic: str = ""
    #: "map" (current vLLM: events as ``{"type": ...}`` maps) or "array" (older vLLM,
    #: SGLang: ``array_like`` structs).
    kv_events_format: str = "map"
    #: Batches kept for replay.
    kv_replay_buffer: int = 10_000
    #: A HuggingFace ``tokenizer.json`` (or its directory): chat and completions
    #: prompts are then tokenized as an engine does (chat template, special tokens)
    #: for the token counts and the cache model. ``None`` = whitespace words.
    tokenizer: str | None = None
    #: Responses kept (``/v1/responses``, for ``previous_response_id`` and
    #: ``GET /v1/responses/{id}``); the oldest goes first.
    max_responses: int = 1000
    #: Conversations kept (``/v1/conversations``); the least recently used goes first.
    max_conversations: int = 1000
    #: Items kept per conversation; the oldest go first.
    max_conversation_items: int = 1000

    def __post_init__(self) -> None:
        if self.apis is not None:
            apis = frozenset(self.apis)
            unknown = apis - API_NAMES
            if unknown:
                raise ValueError(f"unknown apis: {sorted(unknown)}; known: {sorted(API_NAMES)}")
            self.apis = apis
        if self.dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        if self.output_tokens < 0:
            raise ValueError("output_tokens must be >= 0")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be within [0, 1]")
        if self.pd_role not in (None, "prefill", "decode"):
            raise ValueError("pd_role must be 'prefill' or 'decode'")
        if self.pd_protocol not in ("sglang", "vllm"):
            raise ValueError("pd_protocol must be 'sglang' or 'vllm'")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.kv_events_format not in ("map", "array"):
            raise ValueError("kv_events_format must be 'map' or 'array'")
        if self.kv_replay_buffer < 1:
            raise ValueError("kv_replay_buffer must be >= 1")
        if self.max_conversations < 1 or self.max_conversation_items < 1:
            raise ValueError("max_conversations and max_conversation_items must be >= 1")
        if self.max_responses < 1:
            raise ValueError("max_responses must be >= 1")
        if self.kv_events is not None and self.cache_tokens <= 0:
            raise ValueError(
                "kv_events needs the prefix-cache model: set cache_tokens > 0 "
                "(the events report its blocks)"
            )
        if self.kv_replay is not None and self.kv_events is None:
            raise ValueError("kv_replay needs kv_events (the endpoint the batches go to)")


class MockStats:
    """What a mock worker saw. Plain counters; read them from any thread."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Zero every counter and forget the last request."""
        #: Requests per path (every request, including health and metrics).
        self.requests_total: dict[str, int] = {}
        #: Streams currently being written.
        self.active_streams = 0
        #: Requests being answered after a delay or as a stream.
        self.in_flight = 0
        #: Requests whose client went away before the response was complete.
        self.disconnects = 0
        #: Streams the worker aborted on purpose (``crash_after_chunks``).
        self.crashes = 0
        #: Inference requests answered with an injected ``fail_status``.
        self.injected_errors = 0
        self.sleep_calls = 0
        self.wake_calls = 0
        #: ``level`` and ``mode`` query parameters of the last ``POST /sleep``.
        self.last_sleep_level: int | None = None
        self.last_sleep_mode: str | None = None
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        #: Data-parallel rank of the last inference request (``None`` = not given).
        self.last_dp_rank: int | None = None
        #: PD mode: (host, port, room) of the last request, and its kv_transfer_params.
        self.last_bootstrap: tuple[Any, Any, Any] | None = None
        self.last_kv_params: dict[str, Any] | None = None
        #: KV-event batches sent on the PUB socket, and those it refused (``zmq.Again``;
        #: still numbered and kept for replay).
        self.kv_batches_published = 0
        self.kv_batches_dropped = 0
        self._last: Request | None = None

    def record(self, req: Request) -> None:
        """Remember ``req`` as the last API request (decoded lazily)."""
        self._last = req

    @property
    def requests(self) -> int:
        """All requests, every path."""
        return sum(self.requests_total.values())

    @property
    def last_headers(self) -> list[tuple[str, str]]:
        """Headers of the last API request, names lower-cased, in arrival order."""
        if self._last is None:
            return []
        return [(n.decode("latin-1").lower(), v.decode("latin-1")) for n, v in self._last.headers]

    def last_header(self, name: str) -> str | None:
        """The last API request's header ``name`` (case-insensitive), or ``None``."""
        name = name.lower()
        for n, v in self.last_headers:
            if n == name:
                return v
        return None

    @property
    def last_body(self) -> bytes:
        """Body of the last API request."""
        return b"" if self._last is None else self._last.body

    @property
    def last_path(self) -> str | None:
        """Path (without the query) of the last API request."""
        return None if self._last is None else self._last.path.decode("latin-1")

    @property
    def last_query(self) -> str:
        """Raw query string of the last API request (``""`` when none)."""
        return "" if self._last is None else self._last.query.decode("latin-1")

    @property
    def last_query_params(self) -> dict[str, list[str]]:
        """The last query string, parsed (``include[]=a&include[]=b`` → ``{"include[]": [..]}``)."""
        return parse_qs(self.last_query, keep_blank_values=True)
