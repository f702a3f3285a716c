"""
The prepare pipeline
====================

:class:`Preparer` turns a request meshkit owns into a
:class:`~meshkit.core.requests.RequestView`: one pass over its headers (the media
check, 415; the session, ``Idempotency-Key`` and ``x-mesh-wait`` values), one
parse of its body (400 on unusable JSON), and what the policy declared it needs:
nothing, the routing text, or the first N token ids. Large bodies and
``/v1/tokenize`` run on the bounded prepare pool; prefix ids run on the calling
thread when tiktoken covers them (tens of µs for a few hundred ids, less than the
hop to a pool thread and back), on the pool otherwise.

The sync and async entry points share every step; they differ only in how they
wait for the pool (:meth:`PreparePool.run` or ``await`` :meth:`PreparePool.run_async`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final

import msgspec

from meshkit.core.endpoints import Api, Match, Op
from meshkit.core.kv_index import ROOT, chain
from meshkit.core.requests import (
    LocalResponse,
    RequestView,
    check_media,
    parse_request,
    query_streams,
)
from meshkit.core.unbound import lower
from meshkit.errors import InvalidRequest, RequestTooLarge

if TYPE_CHECKING:
    from meshkit.config import MeshConfig
    from meshkit.core.policies.base import Needs
    from meshkit.prepare.pool import PreparePool
    from meshkit.prepare.tokenizers import TokenizerRegistry

__all__ = ["Preparer"]

#: Idempotency-Key values longer than this are ignored (the lease table is bounded).
_MAX_IDEMPOTENCY_KEY: Final = 256
_JSON: Final = ((b"content-type", b"application/json"),)
_TOKENIZE: Final = Api.TOKENIZE
#: the APIs whose prompts are matched against KV events (SGLang's /generate by its ids)
_KV_APIS: Final = frozenset({Api.CHAT, Api.COMPLETIONS, Api.GENERATE})
#: request headers prepare reads (besides routing.session_header)
_WANTED_HEADERS: Final = (b"content-type", b"content-encoding", b"idempotency-key", b"x-mesh-wait")

Job = Callable[[], RequestView | None]
#: the values of the session, Idempotency-Key and x-mesh-wait headers (raw)
_Heads = tuple[bytes | None, bytes | None, bytes | None]


class _Wants:
    """What a policy's :class:`Needs` asks of preparation, read once per change of
    policy: ``Needs`` is an interpreted dataclass, whose every field read is a
    lookup by name."""

    __slots__ = ("kv", "needs", "text", "tokens")

    def __init__(self, needs: Needs) -> None:
        self.needs = needs
        #: the routing text (the policy reads it, or tokenizes it)
        self.text = needs.text or needs.prefix_tokens is not None
        #: the leading token ids the policy reads (0: none)
        self.tokens = needs.prefix_tokens or 0
        self.kv = needs.kv_events


class Preparer:
    """Prepares requests for one Mesh.

    :param needs: what the current placement policies read from a request (they
        may be replaced at runtime, so this is asked per request).
    """

    def __init__(
        self,
        config: MeshConfig,
        pool: PreparePool,
        tokenizers: TokenizerRegistry,
        needs: Callable[[], Needs],
        kv_sizes: Callable[[], frozenset[int]] = frozenset,
        kv_root: Callable[[str | None], int] = lambda model: ROOT,
        kv_unmatched: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.pool = pool
        self._kv_sizes = kv_sizes
        self._kv_root = kv_root
        #: told why a request KV events could have placed gets no keys
        self._kv_unmatched = kv_unmatched
        self._match_tokens = config.kv.match_tokens
        self.tokenizers = tokenizers
        self._needs = needs
        self._wants: _Wants | None = None
        self._inline_bytes = config.prepare.inline_threshold_bytes
        self._max_tokenize = config.prepare.max_tokenize_bytes
        self._depth = config.bounds.max_json_depth
        header = config.routing.session_header
        self._session_header = header.lower().encode() if header else None
        self._header_lens = frozenset(
            len(n) for n in (*_WANTED_HEADERS, self._session_header) if n is not None
        )

    # -- the entry points ---------------------------------------------------------------

    def prepare(
        self,
        match: Match,
        body: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        query: str = "",
        within_s: float | None = None,
    ) -> RequestView:
        """Parse and prepare a request, blocking only the calling thread; ``within_s``:
        the client's own bound on the pool's part (see :meth:`PreparePool.submit`)."""
        heads, view, job = self._start(match, body, headers)
        if job is not None:
            view = self.pool.run(job, within_s) or view
        assert view is not None
        return self._finish(view, heads, query)

    async def prepare_async(
        self,
        match: Match,
        body: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        query: str = "",
        within_s: float | None = None,
    ) -> RequestView:
        """Parse and prepare a request without blocking the event loop."""
        heads, view, job = self._start(match, body, headers)
        if job is not None:
            view = await self.pool.run_async(job, within_s) or view
        assert view is not None
        return self._finish(view, heads, query)

    # -- the steps ----------------------------------------------------------------------

    def _start(
        self, match: Match, body: bytes, headers: Iterable[tuple[bytes, bytes]]
    ) -> tuple[_Heads, RequestView | None, Job | None]:
        """What can be done on the calling thread, and the job the pool must run (the
        view it returns, or None when the job completed the view given)."""
        heads = self._read_headers(match, headers)
        if match.endpoint.api is _TOKENIZE and self.tokenizers.has_any():
            return heads, None, lambda: self._tokenize(match, body)
        if len(body) > self._inline_bytes:
            return heads, None, lambda: self._whole(match, body)
        wants = self._wanted()
        view = self._parse(match, body, wants)
        sizes = self._kv_wanted(view, wants)
        if self._prefix(view, wants, fast_only=True) and not sizes:
            return heads, view, None
        return heads, view, lambda: self._slow_prefix(view, wants, sizes)

    def _wanted(self) -> _Wants:
        """What the policies read, asked once per request (a call through the router)."""
        needs = self._needs()
        wants = self._wants
        if wants is None or wants.needs is not needs:
            wants = self._wants = _Wants(needs)
        return wants

    def _slow_prefix(self, view: RequestView, wants: _Wants, sizes: frozenset[int]) -> None:
        self._prefix(view, wants, fast_only=False)
        if sizes:
            self._engine_ids(view, sizes)

    def _whole(self, match: Match, body: bytes) -> RequestView:
        wants = self._wanted()
        view = self._parse(match, body, wants)
        self._slow_prefix(view, wants, self._kv_wanted(view, wants))
        return view

    def _kv_wanted(self, view: RequestView, wants: _Wants) -> frozenset[int]:
        """The block sizes to compute ``view``'s KV keys for (empty: none wanted):
        the policy matches KV events, some worker sends them, and a tokenizer
        renders this model's prompts as its engine does (or the request gives its
        token ids)."""
        if not wants.kv or view.match.endpoint.api not in _KV_APIS:
            return frozenset()
        sizes = self._kv_sizes()
        if not sizes:
            return frozenset()
        if self.tokenizers.get(view.model) is None and not (
            view.match.endpoint.api is Api.GENERATE and view.token_ids is not None
        ):  # SGLang's /generate given input_ids needs none
            self._kv_unmatched("no_tokenizer")
            return frozenset()
        return sizes

    def _engine_ids(self, view: RequestView, sizes: frozenset[int]) -> None:
        """The prompt's token ids as the engine computes them, and their block keys.
        A prompt meshkit cannot render (the worker will say why) is matched by text."""
        ids = view.token_ids if view.match.endpoint.api is Api.GENERATE else None
        if ids is None:
            tok = self.tokenizers.get(view.model)
            if tok is None:
                return
            if len(view.body) > self._max_tokenize:
                self._kv_unmatched("too_large")
                return
            from meshkit.prepare.jobs import prompt_ids  # templates: on first use

            try:
                body = msgspec.json.decode(view.body)
                if not isinstance(body, dict):
                    self._kv_unmatched("unrendered")
                    return
                ids = prompt_ids(tok, body, max_tokenize_bytes=self._max_tokenize)
            except RequestTooLarge:
                self._kv_unmatched("too_large")
                return
            except (msgspec.DecodeError, RecursionError, InvalidRequest):
                self._kv_unmatched("unrendered")
                return
        ids = ids[: self._match_tokens]
        view.prompt_ids = ids
        root = self._kv_root(view.model)  # a LoRA adapter's blocks chain from its own
        view.kv_keys = {size: chain(ids, size, root) for size in sizes}

    def _parse(self, match: Match, body: bytes, wants: _Wants) -> RequestView:
        return parse_request(match, body, want_text=wants.text, max_depth=self._depth)

    def _prefix(self, view: RequestView, wants: _Wants, *, fast_only: bool) -> bool:
        """The prefix token ids the policy reads, when it reads some.

        :param fast_only: only through tiktoken (``prefix_ids_fast``), as on the
            calling thread; False when a piece needs ``tokenizers`` (slower): then
            the caller runs this on the pool.
        :returns: False when the fast path declined (the pool must run it).
        """
        n = wants.tokens
        if not n or view.token_ids is not None or not view.routing_text:
            return True
        tok = self.tokenizers.get(view.model)
        if tok is None:
            return True
        if len(view.body) > self._max_tokenize and self._text_over(view.routing_text):
            raise RequestTooLarge("the prompt is larger than prepare.max_tokenize_bytes allows")
        if not fast_only:
            view.token_ids = tok.prefix_ids(view.routing_text, n)
            return True
        ids = tok.prefix_ids_fast(view.routing_text, n)
        if ids is None:
            return False
        view.token_ids = ids
        return True

    def _text_over(self, text: str) -> bool:
        """Whether ``text`` is over ``prepare.max_tokenize_bytes``: what is tokenized,
        not the body (a base64 image is a placeholder in the text)."""
        from meshkit.prepare.jobs import text_bytes  # a big body only: off the hot path

        return text_bytes(text, self._max_tokenize) > self._max_tokenize

    def _tokenize(self, match: Match, body: bytes) -> RequestView:
        """/v1/tokenize and /v1/detokenize answered by the mesh in the vLLM shapes."""
        view = parse_request(match, body, max_depth=self._depth)
        if self.tokenizers.get(view.model) is None:
            return view  # no tokenizer for this model: a worker answers
        try:
            obj = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError):
            raise InvalidRequest("request body is not valid JSON") from None
        if not isinstance(obj, dict):
            raise InvalidRequest("request body must be a JSON object")
        from meshkit.prepare.jobs import detokenize_job, tokenize_job  # templates: on first use

        job = tokenize_job if match.endpoint.op is Op.TOKENIZE else detokenize_job
        out = job(
            self.tokenizers,
            view.model,
            obj,
            max_tokenize_bytes=self._max_tokenize,
            metrics=self.pool.metrics,
        )
        view.local = LocalResponse(200, _JSON, msgspec.json.encode(out))
        return view

    def _read_headers(self, match: Match, headers: Iterable[tuple[bytes, bytes]]) -> _Heads:
        """One pass over the request headers: the media check (415) now, the
        values the view takes later. A name is lower-cased only when its length
        is that of a wanted name (ASGI's are lower-case already, httpx's not)."""
        ctype = cenc = got_session = idempotency = wait = None
        session = self._session_header
        lens = self._header_lens
        for k, v in headers:
            if len(k) not in lens:
                continue
            lk = lower(k)
            if lk == b"content-type":
                ctype = v
            elif lk == b"content-encoding":
                cenc = v
            if lk == session and v:
                got_session = v
                session = None  # the first one counts
            elif lk == b"idempotency-key" and 0 < len(v) <= _MAX_IDEMPOTENCY_KEY:
                idempotency = v
            elif lk == b"x-mesh-wait":
                wait = v
        ep = match.endpoint
        # The usual JSON content type needs no parsing.
        if (cenc is not None or (ctype is not None and ctype != b"application/json")) and (
            ep.has_body and ep.op is not Op.CANCEL
        ):
            check_media(
                None if ctype is None else ctype.decode("latin-1"),
                None if cenc is None else cenc.decode("latin-1"),
            )
        return got_session, idempotency, wait

    @staticmethod
    def _finish(view: RequestView, heads: _Heads, query: str) -> RequestView:
        view.query = query
        if query and query_streams(view.match, query):
            view.stream = True  # GET /v1/responses/{id}?stream=true
        session, idempotency, wait = heads
        if session is not None:
            view.routing_key = session.decode("latin-1")
        if idempotency is not None:
            # Scoped by path: the same key on two endpoints is two requests.
            view.idempotency_key = view.match.path + " " + idempotency.decode("latin-1")
        if wait is not None:
            view.no_wait = wait.strip().lower() in (b"false", b"0", b"no")
        return view
