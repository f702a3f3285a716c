"""Type aliases shared by every module: header lists and the ASGI callables."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["ASGIApp", "Headers", "Message", "Receive", "Scope", "Send"]

#: header (name, value) pairs as bytes, in order (ASGI's, httptools', httpx's raw)
Headers = list[tuple[bytes, bytes]]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
