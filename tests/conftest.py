"""Shared fixtures: mock workers on 127.0.0.1 and the four embedding modes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

import meshkit
from harness import MODE_CLASSES, MODES, Mode, wait_until
from meshkit import Mesh
from meshkit.mock import MockConfig, MockWorkerThread
from meshkit.testing.build import stale_files
from reliability.faultkit import settled, state_of

SRC = Path(__file__).resolve().parents[1] / "src" / "meshkit"


def pytest_configure(config: pytest.Config) -> None:
    stale = stale_files(SRC)
    if stale:
        pytest.exit(
            f"the installed meshkit is not this tree's ({len(stale)} files differ, e.g. "
            f"{stale[0]}): run scripts/install-test-deps again, or install it editable "
            "for development (scripts/install-test-deps --editable)",
            returncode=4,
        )


def pytest_report_header(config: pytest.Config) -> str:
    build = "compiled (mypyc)" if meshkit.compiled() else "interpreted"
    return f"meshkit: {build}, from {Path(meshkit.__file__).parent}"


@pytest.fixture
def mock_factory() -> Iterator[Callable[..., MockWorkerThread]]:
    """Start mock workers (``mock_factory(name="w0", ...)``); all stop at teardown."""
    started: list[MockWorkerThread] = []

    def make(**kw: Any) -> MockWorkerThread:
        t = MockWorkerThread(MockConfig(**kw))
        t.start()
        started.append(t)
        return t

    yield make
    for t in started:
        t.stop()


@pytest.fixture
def mesh_factory() -> Iterator[Callable[..., Mesh]]:
    """``mesh_factory(**config)``: a Mesh, closed after the test. Every mesh must be
    settled by then (``faultkit.settled``: no load, lease or prepare job held): a
    flow that forgets one fails its test here."""
    made: list[Mesh] = []

    def make(*args: Any, **kw: Any) -> Mesh:
        kw.setdefault("routing", {"seed": 7})
        m = Mesh(*args, **kw)
        made.append(m)
        return m

    yield make
    try:
        for m in made:
            assert wait_until(cast(Callable[[], bool], lambda m=m: settled(m)), timeout=3.0), (
                f"not settled after the test (a lease or a prepare job held): {state_of(m)}"
            )
    finally:
        for m in made:
            m.close()


def pytest_runtest_setup(item: pytest.Item) -> None:
    # What Envoy carries, meshkit cannot do there: each such test says why.
    marker = item.get_closest_marker("not_in_extproc")
    callspec = getattr(item, "callspec", None)
    if marker is not None and callspec is not None and "extproc" in callspec.params.values():
        pytest.skip(f"ext-proc: {marker.args[0]}")


@pytest.fixture(params=MODES)
def mode_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def run_mode(mode_name: str) -> Iterator[Callable[[Mesh], Mode]]:
    """``run_mode(mesh)`` embeds ``mesh`` the way this test's mode does."""
    opened: list[Mode] = []

    def start(mesh: Mesh) -> Mode:
        m = MODE_CLASSES[mode_name](mesh)
        opened.append(m)
        return m

    yield start
    for m in opened:
        m.close()
