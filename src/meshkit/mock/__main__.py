"""``python -m meshkit.mock``: see :mod:`meshkit.mock.cli`."""

from __future__ import annotations

from meshkit.mock.cli import run_mock_worker

__all__: list[str] = []

raise SystemExit(run_mock_worker())
