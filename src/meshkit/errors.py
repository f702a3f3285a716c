"""
Errors
======

Every refusal meshkit makes is a :class:`MeshError` with an HTTP status, a stable
machine-readable ``code``, a message and an optional retry hint. The adapter that
caught it renders it in the shape of the API the client called, so an OpenAI SDK
sees an OpenAI error and an Anthropic SDK an Anthropic one::

    MeshError
     ├── InvalidRequest                 400 invalid_request
     ├── UnknownEndpoint                404 unknown_endpoint
     ├── ModelNotFound                  404 model_not_found
     ├── MethodNotAllowed               405 method_not_allowed
     ├── RequestTooLarge                413 request_too_large
     ├── UnsupportedMediaType           415 unsupported_media_type
     ├── HeadersTooLarge                431 request_header_fields_too_large
     ├── UnsupportedApi                 501 unsupported_api
     ├── UnsupportedApiTopology         501 unsupported_api_topology
     ├── StatefulRoutingUnsupported     501 stateful_routing_unsupported
     ├── UpstreamError                  502 upstream_error
     │    └── UpstreamTlsError          502 upstream_tls_error
     ├── Unavailable (Retry-After)
     │    ├── PrepareQueueFull          503 prepare_queue_full
     │    ├── NoAvailableWorkers        503 no_available_workers
     │    │    └── Overloaded           503 overloaded
     │    ├── WorkerWaking              503 worker_waking
     │    └── PoolUnavailable           503 prepare_pool_unavailable
     ├── PrepareTimeout                 504 prepare_timeout
     └── UpstreamTimeout                504 upstream_timeout

Security: a message is built by meshkit from what it knows; it never quotes a
worker's credentials, and never echoes a request body.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import msgspec

__all__ = [
    "ConfigError",
    "ErrorShape",
    "HeadersTooLarge",
    "InvalidRequest",
    "MeshError",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoAvailableWorkers",
    "Overloaded",
    "PoolUnavailable",
    "PrepareQueueFull",
    "PrepareTimeout",
    "RequestTooLarge",
    "StatefulRoutingUnsupported",
    "Unavailable",
    "UnknownEndpoint",
    "UnsupportedApi",
    "UnsupportedApiTopology",
    "UnsupportedInExtProc",
    "UnsupportedMediaType",
    "UpstreamError",
    "UpstreamTimeout",
    "UpstreamTlsError",
    "WorkerWaking",
    "body_over",
]

ErrorShape = Literal["openai", "anthropic"]

#: Retry hints above this are clamped: openai < 2.52 and anthropic ignore a longer
#: Retry-After, and openai >= 2.52 refuses to retry at all past 120 s
#: (openai-python ``_base_client._calculate_retry_timeout``).
MAX_RETRY_AFTER_S = 60.0


class ConfigError(ValueError):
    """A configuration value is missing or invalid. ``key`` names the key at fault."""

    def __init__(self, key: str, message: str, *, source: str | None = None) -> None:
        self.key = key
        self.message = message
        self.source = source
        where = f" ({source})" if source else ""
        super().__init__(f"config key {key!r}{where}: {message}")


class MeshError(Exception):
    """Base of every refusal meshkit answers itself."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"
    openai_type: ClassVar[str] = "server_error"
    anthropic_type: ClassVar[str] = "api_error"
    #: the retry hint when the raiser gives none (None: no Retry-After)
    default_retry_after_s: ClassVar[float | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if retry_after_s is None:
            retry_after_s = self.default_retry_after_s
        if retry_after_s is not None:
            if retry_after_s != retry_after_s:  # NaN: keep the header renderable
                retry_after_s = 1.0
            retry_after_s = min(max(retry_after_s, 0.001), MAX_RETRY_AFTER_S)
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.code!r}, {self.message!r})"

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed later: every 5xx but 501 (what meshkit
        cannot do now it will not do on a retry either)."""
        return self.status >= 500 and self.status != 501

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers that go with the error body: the media type and the retry
        signals. Both SDKs obey ``x-should-retry`` before their own status rules
        (openai-python and anthropic-sdk-python ``_base_client._should_retry``), so a
        permanent refusal is not sent three times."""
        out = [
            (b"content-type", b"application/json"),
            (b"x-should-retry", b"true" if self.retryable else b"false"),
        ]
        if self.retry_after_s is not None:
            # Retry-After takes whole seconds (>= 1); retry-after-ms is read first by
            # both SDKs and carries the precise hint.
            out.append((b"retry-after", str(max(1, math.ceil(self.retry_after_s))).encode()))
            out.append((b"retry-after-ms", str(max(1, round(self.retry_after_s * 1000))).encode()))
        return out

    def body(self, shape: ErrorShape = "openai") -> bytes:
        """The JSON error body in the called API's own shape."""
        if shape == "anthropic":
            # Anthropic's error object has no code of its own; meshkit's rides along so
            # a client can tell `overloaded` from `worker_waking` in either shape.
            error = {"type": self.anthropic_type, "message": self.message, "code": self.code}
            return msgspec.json.encode({"type": "error", "error": error})
        return msgspec.json.encode(
            {
                "error": {
                    "message": self.message,
                    "type": self.openai_type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


class InvalidRequest(MeshError):
    status = 400
    code = "invalid_request"
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class UnknownEndpoint(MeshError):
    status = 404
    code = "unknown_endpoint"
    openai_type = "invalid_request_error"
    anthropic_type = "not_found_error"


class ModelNotFound(MeshError):
    """``GET /v1/models/{model}`` for a model no worker lists (OpenAI's own code)."""

    status = 404
    code = "model_not_found"
    openai_type = "invalid_request_error"
    anthropic_type = "not_found_error"


class MethodNotAllowed(MeshError):
    status = 405
    code = "method_not_allowed"
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"

    def __init__(self, message: str, *, allowed: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.allowed = allowed

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = super().headers()
        if self.allowed:
            out.append((b"allow", ", ".join(self.allowed).encode()))
        return out


class RequestTooLarge(MeshError):
    status = 413
    code = "request_too_large"
    openai_type = "invalid_request_error"
    anthropic_type = "request_too_large"


def body_over(limit: int) -> RequestTooLarge:
    """The 413 for a request body over ``limit`` bytes (``bounds.max_body_bytes``),
    declared or arrived: one message in every mode."""
    return RequestTooLarge(f"request body is over {limit} bytes")


class UnsupportedMediaType(MeshError):
    status = 415
    code = "unsupported_media_type"
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class HeadersTooLarge(MeshError):
    status = 431
    code = "request_header_fields_too_large"
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class UnsupportedApi(MeshError):
    status = 501
    code = "unsupported_api"
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class UnsupportedApiTopology(UnsupportedApi):
    code = "unsupported_api_topology"


class UnsupportedInExtProc(UnsupportedApi):
    """What a picker cannot do: the proxy sends the request to one worker, so
    operations that need meshkit to call workers itself (Responses resources,
    prefill/decode legs) are refused."""

    code = "unsupported_in_ext_proc"


class StatefulRoutingUnsupported(MeshError):
    status = 501
    code = "stateful_routing_unsupported"
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class UpstreamError(MeshError):
    status = 502
    code = "upstream_error"
    openai_type = "server_error"
    anthropic_type = "api_error"


class UpstreamTlsError(UpstreamError):
    """The worker's TLS handshake failed: its certificate did not verify, or it
    refused ours (``tls_verify``, ``tls_ca_file``, ``tls_client_cert``)."""

    code = "upstream_tls_error"


class Unavailable(MeshError):
    """A 503: the request may succeed later; always carries a retry hint."""

    status = 503
    code = "unavailable"
    openai_type = "server_error"
    anthropic_type = "overloaded_error"
    default_retry_after_s = 1.0


class PrepareQueueFull(Unavailable):
    code = "prepare_queue_full"


class NoAvailableWorkers(Unavailable):
    code = "no_available_workers"


class Overloaded(NoAvailableWorkers):
    """Every worker that could take the request is at its admission limit
    (``upstream.max_in_flight_per_worker``), the fleet is at ``upstream.max_in_flight``,
    or no pooled connection to the worker became free in time. Refused before any
    byte went upstream; the worker is not blamed.

    A subclass of :class:`NoAvailableWorkers`: the lifecycle treats it as "nobody can
    take it now" (it may wake a sleeping worker, and tries unverified ones).
    """

    code = "overloaded"


class WorkerWaking(Unavailable):
    code = "worker_waking"


class PoolUnavailable(Unavailable):
    code = "prepare_pool_unavailable"


class PrepareTimeout(MeshError):
    status = 504
    code = "prepare_timeout"
    openai_type = "server_error"
    anthropic_type = "timeout_error"
    default_retry_after_s = 1.0


class UpstreamTimeout(MeshError):
    status = 504
    code = "upstream_timeout"
    openai_type = "server_error"
    anthropic_type = "timeout_error"
    default_retry_after_s = 1.0
