"""``meshkit demo``: mock workers, a gateway and real SDK traffic, all on loopback."""

from __future__ import annotations

from meshkit.demo.run import run_demo

__all__ = ["run_demo"]
