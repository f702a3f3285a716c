"""Strategies and in-process drivers for the adapter fuzz suite.

Each example is a :class:`Req` (method, raw request target, headers, body). The
drivers hand it to an adapter the way a server or a client library would, in
process: the ASGI middleware with a hand-built scope/receive/send, the WSGI
middleware with a werkzeug ``EnvironBuilder`` environ, the sync transport through
``httpx2.Client(transport=MeshTransport(mesh))``. Each returns a :class:`Got`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import string
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import unquote

import httpx2
from hypothesis import settings
from hypothesis import strategies as st
from werkzeug.test import EnvironBuilder

from meshkit import MeshMiddleware, MeshTransport, MeshWSGIMiddleware


def fuzz_settings() -> settings:
    """The profile registered in ``tests/fuzz/conftest.py`` for ``MESHKIT_PROFILE``."""
    full = os.environ.get("MESHKIT_PROFILE", "").strip().lower() == "full"
    return settings.get_profile("meshkit-fuzz-full" if full else "meshkit-fuzz-ci")


# -- the oracle (written independently of meshkit's registry) ---------------------------------

STATIC = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/conversations",
    "/generate",
    "/v1/tokenize",
    "/tokenize",
    "/v1/detokenize",
    "/detokenize",
    "/v1/models",
)
_RID = r"[A-Za-z0-9_-]{1,256}"
RESOURCE = re.compile(
    rf"/v1/responses/{_RID}(/cancel|/input_items)?|/v1/conversations/{_RID}(/items(/{_RID})?)?"
)
#: GET /v1/models/{model}: answered by meshkit from the listing (forwards /v1/models)
MODEL_PATH = "/v1/models/"
PREFIXES = (
    "/v1/chat",
    "/v1/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1/conversations",
    "/generate",
    "/v1/tokenize",
    "/tokenize",
    "/v1/detokenize",
    "/detokenize",
    "/v1/models",
)


def in_registry(path: str) -> bool:
    """A path meshkit may forward: a template, or a resource path with a valid id."""
    return path in STATIC or RESOURCE.fullmatch(path) is not None


def under_prefix(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PREFIXES)


def anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


# -- examples ---------------------------------------------------------------------------------


@dataclass
class Req:
    method: str
    path: str  # raw, as it would be on the request line (may hold %XX and non-ASCII)
    query: str
    headers: list[tuple[str, str]]
    body: bytes

    @property
    def raw_path(self) -> bytes:
        return self.path.encode("utf-8")


@dataclass
class Got:
    status: int
    headers: dict[str, str]
    body: bytes
    host_app: bool = False  # the wrapped app answered (pass-through in a middleware)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def from_worker(self) -> bool:
        return "x-mock-worker" in self.headers


_TOKEN = string.ascii_lowercase + string.digits + "-"
_VALUE = "".join(c for c in string.printable if c not in "\r\n\x0b\x0c") + "\x00\x7f\xe9 \t"

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=16,
)
_roles = st.sampled_from(["user", "system", "assistant", "developer", "tool", "", "x"])
_messages = st.lists(
    st.fixed_dictionaries({"role": _roles, "content": st.text(max_size=40) | json_values}),
    max_size=3,
)
_optional = {
    "stream": st.booleans() | json_values,
    "max_tokens": st.integers(-3, 40) | json_values,
    "temperature": st.floats(allow_nan=False, allow_infinity=False) | json_values,
    "user": st.text(max_size=10) | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "data_parallel_rank": st.integers(-2, 4) | json_values,
    "extra": json_values,
}
_model = st.text(max_size=12) | json_values
valid_bodies = st.one_of(
    st.fixed_dictionaries({"model": _model, "messages": _messages}, optional=_optional),
    st.fixed_dictionaries(
        {"model": _model, "max_tokens": st.integers(1, 20), "messages": _messages},
        optional={"system": st.text(max_size=20) | json_values, "stream": st.booleans()},
    ),
    st.fixed_dictionaries(
        {
            "model": _model,
            "prompt": st.text(max_size=30) | st.lists(st.integers(0, 99), max_size=5),
        },
        optional=_optional,
    ),
    st.fixed_dictionaries(
        {"model": _model, "input": st.text(max_size=30) | st.lists(json_values, max_size=3)},
        optional={
            "previous_response_id": st.text(max_size=12) | json_values,
            "conversation": st.text(max_size=12) | json_values,
            "instructions": st.text(max_size=12) | json_values,
            "stream": st.booleans(),
        },
    ),
    st.fixed_dictionaries(
        {"text": st.text(max_size=30) | json_values},
        optional={"input_ids": json_values, "rid": json_values, "stream": st.booleans()},
    ),
    st.dictionaries(st.text(max_size=10), json_values, max_size=6),
)


def _encode(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _nested(depth: int, open_: str) -> bytes:
    close = "]" if open_ == "[" else "}"
    if open_ == "{":
        inner = "1"
        for _ in range(depth):
            inner = '{"a":' + inner + "}"
        return ('{"model":"m","messages":[],"x":' + inner + "}").encode()
    return ('{"model":"m","messages":' + open_ * depth + close * depth + "}").encode()


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(
        st.sampled_from(
            [
                "valid",
                "valid",
                "valid",
                "truncated",
                "nested",
                "huge",
                "wrong_types",
                "duplicate_keys",
                "invalid_utf8",
                "nan",
                "non_object",
                "binary",
                "blank",
            ]
        )
    )
    if kind == "valid":
        return _encode(draw(valid_bodies))
    if kind == "truncated":
        raw = _encode(draw(valid_bodies))
        return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    if kind == "nested":
        return _nested(draw(st.integers(1, 3000)), draw(st.sampled_from(["[", "{"])))
    if kind == "huge":
        n = draw(st.sampled_from([1_000, 60_000, 65_400, 70_000, 200_000]))
        return _encode({"model": "m", "messages": [{"role": "user", "content": "x" * n}]})
    if kind == "wrong_types":
        keys = ["model", "messages", "stream", "prompt", "input", "stream_options", "tools"]
        return _encode(draw(st.dictionaries(st.sampled_from(keys), json_values, min_size=1)))
    if kind == "duplicate_keys":
        a, b = draw(json_values), draw(json_values)
        key = draw(st.sampled_from(["model", "messages", "stream", "previous_response_id"]))
        return (
            b'{"'
            + key.encode()
            + b'":'
            + _encode(a)
            + b',"messages":[],"'
            + key.encode()
            + b'":'
            + _encode(b)
            + b"}"
        )
    if kind == "invalid_utf8":
        junk = draw(
            st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
        )
        return b'{"model":"m' + junk + b'","messages":[{"role":"user","content":"' + junk + b'"}]}'
    if kind == "nan":
        token = draw(
            st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-0", b"1e-999"])
        )
        return b'{"model":"m","messages":[],"temperature":' + token + b"}"
    if kind == "non_object":
        return _encode(draw(json_values.filter(lambda v: not isinstance(v, dict))))
    if kind == "binary":
        return draw(st.binary(max_size=300))
    return draw(st.sampled_from([b"", b" ", b"\n\t ", b"\xef\xbb\xbf{}", b"{}", b"null"]))


_IDS = st.one_of(
    st.from_regex(r"[A-Za-z0-9_-]{1,40}", fullmatch=True),
    st.integers(250, 1200).map(lambda n: "r" * n),
    st.sampled_from(
        [
            "..",
            ".",
            "%2e%2e",
            "%2F",
            "a%2Fb",
            "..%2f..%2fadmin",
            "a%00b",
            "%C3%BC",
            "\u00fc",
            "\u2603",
            "",
            "a b",
            "resp_1%3Fx=1",
            "%252F",
        ]
    ),
)
_MODELS = st.sampled_from(
    ["mock-model", "m", "org%2Fmodel", "org/model", "%2Fdata%2Fm", "nope", "%00", "x" * 600]
)
_PASS = ["/", "/health", "/metrics", "/admin", "/v1", "/v2/chat/completions", "/v1/files", "/x"]


@st.composite
def paths(draw: st.DrawFn) -> str:
    base = draw(
        st.sampled_from(
            [
                *STATIC,
                "/v1/responses/{id}",
                "/v1/responses/{id}/cancel",
                "/v1/responses/{id}/input_items",
                "/v1/conversations/{id}",
                "/v1/conversations/{id}/items",
                "/v1/conversations/{id}/items/{item_id}",
                "/v1/models/{model}",
                *_PASS,
            ]
        )
    )
    path = base.replace("{item_id}", draw(_IDS)).replace("{id}", draw(_IDS))
    path = path.replace("{model}", draw(_MODELS))
    mutation = draw(
        st.sampled_from(
            [
                "none",
                "none",
                "trailing_slash",
                "double_slash",
                "leading_double",
                "dot",
                "dotdot",
                "encode_char",
                "encode_slash",
                "upper",
                "unicode",
                "overlong",
                "suffix",
            ]
        )
    )
    if mutation == "trailing_slash":
        path += "/"
    elif mutation == "double_slash":
        i = path.find("/", 1)
        path = path[:i] + "/" + path[i:] if i > 0 else path + "//"
    elif mutation == "leading_double":
        path = "/" + path
    elif mutation == "dot":
        path = path.replace("/", "/./", 1)
    elif mutation == "dotdot":
        path = "/v1/responses/../" + path.lstrip("/")
    elif mutation == "encode_char" and len(path) > 1:
        i = draw(st.integers(1, len(path) - 1))
        path = path[:i] + "%" + format(ord(path[i]) % 256, "02X") + path[i + 1 :]
    elif mutation == "encode_slash":
        path = path.replace("/", "%2F", draw(st.integers(1, 3)))
        if not path.startswith("/"):
            path = "/" + path
    elif mutation == "upper":
        path = path.upper()
    elif mutation == "unicode":
        path += draw(st.sampled_from(["\u00e9", "%C3%A9", "\u202e", "%FF", "\U0001f600"]))
    elif mutation == "overlong":
        path += "/" + "a" * draw(st.integers(100, 5000))
    elif mutation == "suffix":
        path += draw(st.sampled_from([";x", "%00", "#frag", "~", "..", "/."]))
    return path


queries = st.one_of(
    st.just(""),
    st.text(alphabet=string.ascii_letters + string.digits + "=&[]%+._-", max_size=80),
    st.text(alphabet=string.printable + "\x00\xe9\u2603", max_size=40).map(
        lambda q: q.replace("#", "")
    ),
    st.sampled_from(["include[]=a&include[]=b", "limit=5&order=asc", "a=%00", "a=%ZZ", "x" * 3000]),
)

_CTYPES = [
    None,
    "application/json",
    "application/json; charset=utf-8",
    "APPLICATION/JSON",
    "application/vnd.api+json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "",
    "json",
    "application/json;;;",
    "*/*",
]
_ENCODINGS = [None, "identity", "IDENTITY", "gzip", "br", "deflate", "gzip, identity", "", "x-y"]


@st.composite
def header_lists(draw: st.DrawFn) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    ctype = draw(st.sampled_from(_CTYPES))
    if ctype is not None:
        out.append(("content-type", ctype))
    enc = draw(st.sampled_from(_ENCODINGS))
    if enc is not None:
        out.append(("content-encoding", enc))
    if draw(st.booleans()):  # a duplicated content-type with another value
        out.append(("content-type", draw(st.sampled_from([c for c in _CTYPES if c is not None]))))
    names = st.from_regex(r"x-[a-z0-9][a-z0-9-]{0,20}", fullmatch=True)
    values = st.text(alphabet=_VALUE, max_size=60)
    out += draw(st.lists(st.tuples(names, values), max_size=6))
    shape = draw(st.sampled_from(["plain", "plain", "many", "oversized", "auth", "session"]))
    if shape == "many":
        out += [(f"x-h{i}", "v") for i in range(draw(st.integers(20, 110)))]
    elif shape == "oversized":
        out.append(("x-big", "b" * draw(st.sampled_from([1000, 8000, 8192, 9000, 20000]))))
    elif shape == "auth":
        out.append(("authorization", "Bearer " + draw(st.text(alphabet=_TOKEN, max_size=20))))
        out.append(("x-api-key", draw(st.text(alphabet=_TOKEN, max_size=20))))
    elif shape == "session":
        out.append(("x-session-id", draw(values)))
    return out


@st.composite
def wild_requests(draw: st.DrawFn) -> Req:
    method = draw(st.sampled_from(["POST"] * 6 + ["GET", "GET", "DELETE", "PUT", "PATCH", "HEAD"]))
    return Req(method, draw(paths()), draw(queries), draw(header_lists()), draw(bodies()))


_PLAUSIBLE_PATHS = [p for p in STATIC if p != "/v1/models"]


@st.composite
def plausible_requests(draw: st.DrawFn) -> Req:
    """Well-formed requests to real endpoints (so the forwarding side is exercised
    as much as the refusals), with odd field values."""
    path = draw(
        st.sampled_from(
            [*_PLAUSIBLE_PATHS, "/v1/models", "/v1/models/{model}", "/v1/responses/{id}"]
        )
    )
    method = "POST"
    if path == "/v1/models":
        method = "GET"
    elif path == "/v1/models/{model}":
        method = "GET"
        path = path.replace("{model}", draw(_MODELS))
    elif path == "/v1/responses/{id}":
        method = draw(st.sampled_from(["GET", "DELETE"]))
        path = path.replace("{id}", draw(st.from_regex(r"resp_[A-Za-z0-9]{1,12}", fullmatch=True)))
    headers = [("content-type", cast(str, draw(st.sampled_from(_CTYPES[1:5]))))]  # (no None)
    if draw(st.booleans()):
        headers.append(("x-session-id", draw(st.text(alphabet=_TOKEN, max_size=12))))
    body = _encode(draw(valid_bodies)) if method == "POST" else b""
    if method == "POST" and draw(st.integers(0, 9)) == 0:
        # around the fuzz mesh's 64 KiB body bound, on both sides
        size = draw(st.sampled_from([60_000, 65_400, 65_470, 65_480, 65_500, 70_000]))
        body = _encode({"model": "m", "messages": [{"role": "user", "content": "y" * size}]})
    query = draw(st.sampled_from(["", "", "limit=5&order=asc", "include[]=a"]))
    return Req(method, path, query, headers, body)


def requests() -> st.SearchStrategy[Req]:
    return st.one_of(plausible_requests(), wild_requests())


# -- drivers ----------------------------------------------------------------------------------

HOST_MARK = "x-host-app"


async def host_asgi(scope: Any, receive: Any, send: Any) -> None:
    """The wrapped ASGI app: answers every request it gets (pass-through)."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-host-app", b"1")]})
    await send({"type": "http.response.body", "body": b"host"})


def host_wsgi(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("x-host-app", "1")])
    return [b"host"]


class AsgiDriver:
    """MeshMiddleware called in process, on one long-lived event loop."""

    def __init__(self, mesh: Any) -> None:
        self.runner = asyncio.Runner()
        self.app = MeshMiddleware(host_asgi, mesh=mesh)

    def __call__(self, req: Req) -> Got:
        return self.runner.run(asyncio.wait_for(self._call(req), 60))

    async def _call(self, req: Req) -> Got:
        pieces = [req.body[i : i + 16384] for i in range(0, len(req.body), 16384)] or [b""]
        messages = [
            {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
            for i, p in enumerate(pieces)
        ]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await asyncio.Event().wait()  # no disconnect: wait to be cancelled
            raise AssertionError("unreachable")

        sent: list[MutableMapping[str, Any]] = []

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in req.headers]
        headers.append((b"host", b"mesh.test"))
        if req.body:
            headers.append((b"content-length", str(len(req.body)).encode()))
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": req.method,
            "scheme": "http",
            "path": unquote(req.path, errors="replace"),
            "raw_path": req.raw_path,
            "query_string": req.query.encode("utf-8"),
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 5000),
            "server": ("mesh.test", 80),
        }
        await self.app(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in start["headers"]}
        return Got(start["status"], hdrs, out, host_app=HOST_MARK in hdrs)

    def close(self) -> None:
        self.runner.run(self.app.aclose())
        self.runner.close()


class WsgiDriver:
    """MeshWSGIMiddleware called with an environ built by werkzeug."""

    def __init__(self, mesh: Any) -> None:
        self.app = MeshWSGIMiddleware(host_wsgi, mesh=mesh)

    def __call__(self, req: Req) -> Got:
        headers = [(k, v) for k, v in req.headers if k.lower() != "content-type"]
        ctype = next((v for k, v in reversed(req.headers) if k.lower() == "content-type"), None)
        builder = EnvironBuilder(
            path="/",
            method=req.method,
            headers=headers,
            data=req.body,
            content_type=ctype,
            query_string=req.query.encode("utf-8").decode("latin-1"),
        )
        env = builder.get_environ()
        # PATH_INFO as a server sets it: percent-decoded, bytes as latin-1 (set
        # here: EnvironBuilder would read a decoded "?" as the query's start)
        env["PATH_INFO"] = unquote(req.path, errors="replace").encode("utf-8").decode("latin-1")
        query = req.query.encode("utf-8").decode("latin-1")
        target = req.raw_path.decode("latin-1") + ("?" + query if query else "")
        env["REQUEST_URI"] = env["RAW_URI"] = target
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc: Any = None) -> Any:
            started.append((status, headers))
            return lambda data: None

        result = self.app(env, start_response)
        try:
            body = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        status, hdrs = started[0]
        hmap = {k.lower(): v for k, v in hdrs}
        return Got(int(status.split()[0]), hmap, body, host_app=HOST_MARK in hmap)

    def close(self) -> None:
        self.app.close()


class Unsendable(Exception):
    """The client library itself refuses the request (meshkit never sees it)."""


class TransportDriver:
    """An httpx2 client over MeshTransport (the sync transport)."""

    def __init__(self, mesh: Any) -> None:
        self.client = httpx2.Client(transport=MeshTransport(mesh), base_url="http://mesh.test")

    def __call__(self, req: Req) -> Got:
        try:
            url = httpx2.URL("http://mesh.test" + req.path + ("?" + req.query if req.query else ""))
            request = self.client.build_request(
                req.method, url, headers=req.headers, content=req.body or None
            )
        except (httpx2.InvalidURL, UnicodeError, ValueError, TypeError) as exc:
            raise Unsendable(str(exc)) from exc
        resp = self.client.send(request)
        try:
            body = resp.read()
        finally:
            resp.close()
        hdrs = {k.lower(): v for k, v in resp.headers.items()}
        return Got(
            resp.status_code,
            hdrs,
            body,
            extra={"sent_path": request.url.raw_path.decode("ascii").partition("?")[0]},
        )

    def close(self) -> None:
        self.client.close()


class Seen:
    """Every path a mock worker was sent (wraps its request handling)."""

    def __init__(self, mock: Any) -> None:
        self.paths: list[str] = []
        app = mock.worker.app
        inner = app.handle

        def handle(req: Any) -> Any:
            self.paths.append(req.path.decode("latin-1"))
            return inner(req)

        app.handle = handle
