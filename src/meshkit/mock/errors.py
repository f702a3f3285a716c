"""
Error bodies in each API's shape
================================

* OpenAI (and vLLM, SGLang): ``{"error": {"message", "type", "param", "code"}}``.
* Anthropic: ``{"type": "error", "error": {"type", "message"}, "request_id"}``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["anthropic_error", "openai_error"]

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def openai_error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    if status == 401:
        etype, code = "invalid_request_error", code or "invalid_api_key"
    elif status == 429:
        etype = "rate_limit_error"
    elif status >= 500:
        etype = "server_error"
    else:
        etype = "invalid_request_error"
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def anthropic_error(status: int, message: str, request_id: str) -> dict[str, Any]:
    etype = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": etype, "message": message}, "request_id": request_id}
