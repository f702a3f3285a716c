"""
meshkit standalone: uvicorn (uvloop + httptools) and ``MeshMiddleware`` around an
ASGI app that only answers 404 (every inference path is the middleware's).

``MESHBENCH_WORKERS=... uvicorn --app-dir benchmarks/frontends meshkit_standalone:app``
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from _env import mesh_kwargs

from meshkit import Mesh
from meshkit.frontends.asgi import MeshMiddleware

Message = MutableMapping[str, Any]

_NOT_FOUND = b'{"error":{"message":"not found","type":"not_found"}}'


async def not_found(
    scope: MutableMapping[str, Any],
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    """The wrapped app: lifespan, and 404 for any path meshkit does not own."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(_NOT_FOUND)).encode()),
    ]
    await send({"type": "http.response.start", "status": 404, "headers": headers})
    await send({"type": "http.response.body", "body": _NOT_FOUND})


app = MeshMiddleware(not_found, mesh=Mesh(**mesh_kwargs()))
