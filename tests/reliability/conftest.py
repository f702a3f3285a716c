"""Fixtures of the reliability suite (profiles and helpers live in ``faultkit``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

#: loggers through which an exception escaping meshkit into a server would show
_ESCAPE_LOGGERS = ("uvicorn.error", "uvicorn", "werkzeug", "asyncio", "meshkit")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def escaped() -> Iterator[list[logging.LogRecord]]:
    """ERROR records of servers and meshkit (an exception that escaped, a task
    exception nobody retrieved). Several of these loggers do not propagate to the
    root logger, so the handler is attached to each."""
    handler = _Collect()
    loggers = [logging.getLogger(name) for name in _ESCAPE_LOGGERS]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield handler.records
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
