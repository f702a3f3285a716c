"""
pytest fixtures for real engines
================================

A fleet takes a few seconds to start: share one per module (or session), and
build a fresh :class:`~meshkit.Mesh` per test.

Make a fixture of your own with :func:`engine_fleet_fixture`:

.. code-block:: python

    # conftest.py
    from meshkit.testing.pytest_fixtures import engine_fleet_fixture

    engines = engine_fleet_fixture(n=2, scope="module")

    # test_routing.py
    import pytest
    from meshkit import Mesh

    @pytest.mark.engine
    def test_chat(engines):
        with Mesh(workers=engines.urls, policy="cache_aware") as mesh:
            ...

or load this module as a plugin (``pytest_plugins =
["meshkit.testing.pytest_fixtures"]``) for a ready-made module-scoped
``engine_fleet`` of two engines.

When the engine or the model is not installed, the fixture calls
:func:`pytest.skip` with the install line instead of failing; a fleet that is
installed but fails to start is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

import pytest

from meshkit.testing.engine import EngineUnavailable
from meshkit.testing.fleet import EngineFleet

__all__ = ["engine_fleet", "engine_fleet_fixture", "start_or_skip"]

Scope = Literal["session", "package", "module", "class", "function"]


def start_or_skip(n: int = 2, **kwargs: Any) -> EngineFleet:
    """A started :class:`EngineFleet`, or :func:`pytest.skip` when not installed."""
    try:
        fleet = EngineFleet(n, **kwargs)
    except EngineUnavailable as exc:
        pytest.skip(f"real engines are not installed: {exc}")
    return fleet.start()


def engine_fleet_fixture(
    n: int = 2, *, scope: Scope = "module", name: str | None = None, **kwargs: Any
) -> Callable[..., Any]:
    """A pytest fixture that yields a started :class:`EngineFleet` of ``n`` engines.

    :param scope: the pytest scope; ``"module"`` shares one fleet per test module.
    :param name: the fixture's name (default: the variable you assign it to).
    :param kwargs: :class:`EngineFleet` options (``ctx``, ``parallel``, ``threads`` ...).
    """

    def fixture() -> Iterator[EngineFleet]:
        fleet = start_or_skip(n, **kwargs)
        try:
            yield fleet
        finally:
            fleet.stop()

    if name is not None:
        return pytest.fixture(scope=scope, name=name)(fixture)
    return pytest.fixture(scope=scope)(fixture)


engine_fleet = engine_fleet_fixture(2, scope="module", name="engine_fleet")
