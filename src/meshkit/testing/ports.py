"""A loopback port to hand to a process the caller starts (an engine, Envoy, a
test's upstream): the one copy that meshkit's tests and this package share."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago.

    Another process may take it before the caller's process binds it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
