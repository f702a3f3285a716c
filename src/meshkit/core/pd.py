"""
Prefill/decode disaggregation
=============================

A request's prompt is processed on a *prefill* worker and its tokens generated on
a *decode* worker, the KV cache handed over between them. Workers are labelled
``mesh.role=prefill`` (with ``mesh.bootstrap_port``, default 8998) and
``mesh.role=decode``; placement picks a (prefill, decode) pair, each side with its
own policy. Chat, completions and ``/generate`` run disaggregated; Messages and
Responses are refused with 501 ``unsupported_api_topology``.

Two wire protocols:

- **SGLang** (``mini_lb.py``, ``sglang_router --pd-disaggregation``): the body gets
  ``bootstrap_host`` (the prefill host, IPv6 bracketed), ``bootstrap_port`` and a
  random 63-bit ``bootstrap_room`` (lists for batched ``/generate``); the same body
  goes to both workers *concurrently* (:class:`Pair`), and the decode response is
  relayed. With ``return_logprob`` on a non-streamed request the prefill's
  ``meta_info.input_token_logprobs`` are put in front of the decode's.
- **vLLM** (``kv_transfer_params``): sequential. A non-streamed, one-token prefill
  leg asks for ``kv_transfer_params``; the decode leg carries the ones the prefill
  returned.

Body edits append members to the client's bytes (:func:`~meshkit.core.payload.append_fields`)
and never re-serialise the rest. An appended member that repeats a key (``stream``
or ``max_tokens`` on the vLLM prefill leg) wins, as the last duplicate key does in
Python's and msgspec's JSON decoders, which vLLM and SGLang use.

Each leg carries its own worker's credentials (the client's never) and its own
DP rank. Both leases are held for the whole response (:class:`PairLease`); a
failure of either leg ends the request with that leg's error and releases both.
"""

from __future__ import annotations

import random
from typing import Any, Protocol

import msgspec

from meshkit.core.endpoints import Api
from meshkit.core.forward import (
    Attempt,
    AttemptResult,
    Failure,
    ForwardFlow,
    Lease,
    Leaser,
    LocalResponse,
    Pair,
    PairResult,
    build_attempt,
    capture,
    pool_refusal,
)
from meshkit.core.payload import RankBase, append_fields, rank_base
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Worker
from meshkit.errors import UnsupportedApiTopology, UpstreamError

__all__ = [
    "PD_APIS",
    "PairLease",
    "PdFlow",
    "PdPlacer",
    "bootstrap_members",
    "pd_flow",
]

#: the APIs that run disaggregated; others are refused in a PD fleet
PD_APIS = frozenset({Api.CHAT, Api.COMPLETIONS, Api.GENERATE})
_JSON = ((b"content-type", b"application/json"),)
_MAX_ROOM = (1 << 63) - 1


class PairLease:
    """Both legs' leases, released together (the decode side is the one accounted)."""

    __slots__ = ("candidate", "decode", "prefill", "started")

    def __init__(self, prefill: Lease, decode: Lease) -> None:
        self.prefill = prefill
        self.decode = decode
        self.candidate = decode.candidate
        self.started = decode.started

    def release(self, *, ok: bool, status: int | None = None) -> None:
        self.prefill.release(ok=ok, status=status)
        self.decode.release(ok=ok, status=status)

    def abandon(self) -> None:
        """Release both legs without a verdict on either worker."""
        self.prefill.abandon()
        self.decode.abandon()


class PdPlacer(Leaser, Protocol):
    """What the PD flow needs from the router (implemented under its lock)."""

    def place_pair(self, view: RequestView) -> tuple[Candidate, Candidate]: ...

    def pd_event(self, kind: str) -> None:
        """Count a PD event (``request``, ``bootstrap_failure``)."""


PdFlow = ForwardFlow


def _host_literal(worker: Worker) -> str:
    return f"[{worker.host}]" if ":" in worker.host else worker.host


def bootstrap_members(prefill: Worker, room: int, batch: int | None) -> bytes:
    """The SGLang bootstrap members (lists of ``batch`` items for a batched request)."""
    host = msgspec.json.encode(_host_literal(prefill)).decode()
    port = str(prefill.bootstrap_port)
    if batch is None:
        return f'"bootstrap_host":{host},"bootstrap_port":{port},"bootstrap_room":{room}'.encode()
    rooms = ",".join(str((room + i) & _MAX_ROOM) for i in range(batch))
    hosts = ",".join([host] * batch)
    ports = ",".join([port] * batch)
    return (
        f'"bootstrap_host":[{hosts}],"bootstrap_port":[{ports}],"bootstrap_room":[{rooms}]'
    ).encode()


def _leg(
    placer: PdPlacer,
    view: RequestView,
    cand: Candidate,
    client_headers: list[tuple[bytes, bytes]],
    method: str,
    base: RankBase,
    members: bytes,
    number: int,
) -> Attempt:
    rank = cand.rank
    if rank is not None:
        members += b',"data_parallel_rank":' + str(rank).encode()
    body = append_fields(base, members)
    # admission=False: the pair was admitted when placed (a refused second leg
    # would strand the first).
    return build_attempt(
        placer, view, cand, client_headers, method, number, body, rank, admission=False
    )


def _pool_refusal(lease: Lease, *results: AttemptResult | None) -> None:
    """A leg that found no free connection in time: nothing is the workers' fault
    (no breaker verdict); the request is refused with 503 ``overloaded``."""
    if any(r is not None and r.failure is Failure.POOL for r in results):
        lease.abandon()
        raise pool_refusal()


def _failed(result: AttemptResult | None) -> bool:
    return result is None or result.failure is not None or (result.status or 0) >= 400


def _answered_by_prefill(
    p_leg: Attempt, lease: Lease | PairLease, result: AttemptResult | None
) -> Attempt:
    """The prefill worker's error as the request's answer, returned with its attempt
    (holding ``lease``): the caller accounts it (the request's metrics count it as
    any relayed error) and releases the lease, with the error's verdict."""
    if result is None or result.status is None or result.body is None:
        lease.release(ok=False)
        raise UpstreamError("the prefill worker could not be reached")
    p_leg.lease = lease
    p_leg.answer = LocalResponse(result.status, result.headers, result.body)
    return p_leg


def pd_flow(
    placer: PdPlacer,
    view: RequestView,
    client_headers: list[tuple[bytes, bytes]],
    *,
    method: str,
    protocol: str,
    rng: random.Random,
) -> PdFlow:
    """The flow of one disaggregated request."""
    if view.api not in PD_APIS:
        raise UnsupportedApiTopology(
            f"{view.match.endpoint.template} is not supported on a prefill/decode fleet"
        )
    prefill, decode = placer.place_pair(view)
    placer.pd_event("request")
    base = rank_base(view.body, has_rank=view.has_dp_rank)
    if protocol == "vllm":
        return (yield from _vllm(placer, view, client_headers, method, base, prefill, decode))
    room = rng.getrandbits(63)
    members = bootstrap_members(prefill.worker, room, view.batch)
    p_leg = _leg(placer, view, prefill, client_headers, method, base, members, 0)
    d_leg = _leg(placer, view, decode, client_headers, method, base, members, 1)
    lease = PairLease(p_leg.lease, d_leg.lease)
    logprobs = view.return_logprob and not view.stream
    if logprobs:
        capture(d_leg, placer)
    capture(p_leg, placer)
    result = yield Pair(p_leg, d_leg)
    p_result = result.prefill if isinstance(result, PairResult) else None
    _pool_refusal(lease, p_result, result)
    if _failed(p_result):
        placer.pd_event("bootstrap_failure")
        return _answered_by_prefill(p_leg, lease, p_result)
    if result.failure is not None:
        lease.release(ok=False)
        raise UpstreamError("the decode worker could not be reached")
    d_leg.lease = lease
    if logprobs and result.body is not None and (result.status or 0) < 400:
        if result.truncated or (p_result is not None and p_result.truncated):
            raise UpstreamError(
                "a worker's answer with logprobs is over bounds.max_captured_body_bytes "
                f"({placer.capture_limit} bytes); stream it, or raise the bound"
            )
        merged = _merge_logprobs(p_result.body if p_result else None, result.body)
        # Answered with the decode attempt: its worker is accounted, and the
        # caller releases both legs' leases, as for a relayed answer.
        d_leg.answer = LocalResponse(result.status or 200, _JSON, merged)
    return d_leg


def _vllm(
    placer: PdPlacer,
    view: RequestView,
    client_headers: list[tuple[bytes, bytes]],
    method: str,
    base: RankBase,
    prefill: Candidate,
    decode: Candidate,
) -> PdFlow:
    one = b'"max_tokens":1'
    if view.api is Api.CHAT:
        one += b',"max_completion_tokens":1'
    members = (
        b'"stream":false,"stream_options":null,' + one + b',"kv_transfer_params":'
        b'{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,'
        b'"remote_block_ids":null,"remote_host":null,"remote_port":null}'
    )
    p_leg = _leg(placer, view, prefill, client_headers, method, base, members, 0)
    p_result = yield capture(p_leg, placer)
    _pool_refusal(p_leg.lease, p_result)
    params: Any = None
    if not _failed(p_result) and p_result.body:
        try:
            params = msgspec.json.decode(p_result.body).get("kv_transfer_params")
        except (msgspec.DecodeError, AttributeError):
            params = None
    if params is None:
        placer.pd_event("bootstrap_failure")
        if _failed(p_result):
            return _answered_by_prefill(p_leg, p_leg.lease, p_result)
        p_leg.lease.release(ok=False)
        raise UpstreamError("the prefill worker returned no kv_transfer_params")
    d_members = b'"kv_transfer_params":' + msgspec.json.encode(params)
    d_leg = _leg(placer, view, decode, client_headers, method, base, d_members, 1)
    # The decode attempt holds both leases from now on: whoever ends it (the driver
    # on a cancellation, the caller after the answer) releases the prefill's too.
    lease = d_leg.lease = PairLease(p_leg.lease, d_leg.lease)
    d_result = yield d_leg
    _pool_refusal(lease, d_result)
    if d_result.failure is not None:
        lease.release(ok=False)
        raise UpstreamError("the decode worker could not be reached")
    return d_leg


def _merge_logprobs(prefill_body: bytes | None, decode_body: bytes) -> bytes:
    """Put the prefill's input-token logprobs in front of the decode's (SGLang)."""
    try:
        decoded = msgspec.json.decode(decode_body)
        pre = msgspec.json.decode(prefill_body) if prefill_body else None
    except msgspec.DecodeError:
        raise UpstreamError("a worker's answer with logprobs is not JSON") from None
    if isinstance(decoded, list):
        pairs = list(zip(decoded, pre if isinstance(pre, list) else [], strict=False))
    else:
        pairs = [(decoded, pre)]
    for d, p in pairs:
        if not isinstance(d, dict) or not isinstance(p, dict):
            continue
        d_meta, p_meta = d.get("meta_info"), p.get("meta_info")
        if isinstance(d_meta, dict) and isinstance(p_meta, dict):
            head = p_meta.get("input_token_logprobs") or []
            tail = d_meta.get("input_token_logprobs") or []
            if isinstance(head, list) and isinstance(tail, list):
                d_meta["input_token_logprobs"] = head + tail
    return msgspec.json.encode(decoded)
