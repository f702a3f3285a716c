"""``python -m meshkit.server``: the same as ``meshkit`` (:mod:`meshkit.server.cli`)."""

from __future__ import annotations

from meshkit.server.cli import main

__all__: list[str] = []

raise SystemExit(main())
