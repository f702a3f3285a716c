"""
Prefill/decode roles of the mock worker
=======================================

With ``MockConfig.pd_role`` set, a worker checks what a PD router must send it:

- ``pd_protocol="sglang"``: ``bootstrap_host``, ``bootstrap_port`` and
  ``bootstrap_room`` on every inference request (lists of equal length for a
  batched ``/generate``); the last ones seen are in ``stats.last_bootstrap`` so a
  test can check both legs shared one room. With ``return_logprob`` each role adds
  its own ``meta_info.input_token_logprobs`` (prefill: ``-1.0`` entries, decode:
  ``-2.0``), so a test can check the router put the prefill's first.
- ``pd_protocol="vllm"``: the prefill leg must ask ``kv_transfer_params.do_remote_decode``
  and is answered (non-streamed) with ``kv_transfer_params`` naming this worker;
  the decode leg must carry ``kv_transfer_params.remote_block_ids``.

A request missing its fields is answered 400, as the engines do.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_pd", "logprobs_for", "vllm_prefill_params"]


def _same_shape(values: list[Any]) -> bool:
    lists = [v for v in values if isinstance(v, list)]
    if not lists:
        return all(v is not None for v in values)
    return len(lists) == len(values) and len({len(v) for v in lists}) == 1


def check_pd(role: str, protocol: str, body: dict[str, Any]) -> str | None:
    """An error message when ``body`` lacks what this role needs, else None."""
    if protocol == "vllm":
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            return "kv_transfer_params is required on a disaggregated worker"
        if role == "prefill" and params.get("do_remote_decode") is not True:
            return "the prefill leg must set kv_transfer_params.do_remote_decode"
        if role == "decode" and not params.get("remote_block_ids"):
            return "the decode leg must carry the prefill's kv_transfer_params"
        return None
    fields = [body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")]
    if not _same_shape(fields):
        return "bootstrap_host, bootstrap_port and bootstrap_room are required"
    return None


def vllm_prefill_params(name: str, port: int) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": name or "mock-prefill",
        "remote_block_ids": [1, 2, 3],
        "remote_host": "127.0.0.1",
        "remote_port": port,
    }


def logprobs_for(role: str, n: int) -> list[list[Any]]:
    value = -1.0 if role == "prefill" else -2.0
    return [[value, i, None] for i in range(n)]
