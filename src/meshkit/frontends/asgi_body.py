"""Reading an ASGI request body under a bound.

One loop for the inference middleware and the admin apps (``/workers`` and its
``serve --processes`` fan-out): each maps the outcome to its own error shape.
"""

from __future__ import annotations

from meshkit.errors import body_over
from meshkit.types import Receive

__all__ = ["receive_body"]


async def receive_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or ``None`` when the client left before its end.

    Raises :class:`~meshkit.errors.RequestTooLarge` as soon as more than
    ``limit`` bytes have arrived, so an oversized body is never all buffered.
    """
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        if chunk:
            total += len(chunk)
            if total > limit:
                raise body_over(limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
