"""The real OpenAI SDK against a sleeping worker in no-wait mode: 503s, retries, success."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pytest

from harness import AsyncTransportMode
from lifecycle.conftest import asleep_worker

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "say hello"}]
NO_WAIT = {"x-mesh-wait": "false"}


@pytest.fixture(params=["asgi", "wsgi", "transport"])
def mode_name(request: pytest.FixtureRequest) -> str:
    """Modes with a sync SDK client; the async transport has its own test."""
    return str(request.param)


def test_sdk_retries_worker_waking_until_the_wake_is_done(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    # Five retries 300 ms apart outlast a 400 ms wake with room to spare.
    mock, mesh, _ = asleep_worker(
        mock_factory, mesh_factory, wake_ms=400, lifecycle={"wake_retry_after_s": 0.3}
    )
    client = run_mode(mesh).openai(max_retries=5, default_headers=NO_WAIT)
    with ThreadPoolExecutor(10) as pool:
        chats = list(
            pool.map(lambda _: client.chat.completions.create(model="m", messages=MSG), range(10))
        )
    assert all(c.choices[0].message.content for c in chats)
    assert mock.worker.stats.wake_calls == 1
    rendered = mesh.metrics.render().decode()
    assert 'mesh_router_rejections_total{code="worker_waking"}' in rendered


def test_async_sdk_through_the_async_transport(mock_factory: Any, mesh_factory: Any) -> None:
    mock, mesh, _ = asleep_worker(
        mock_factory, mesh_factory, wake_ms=400, lifecycle={"wake_retry_after_s": 0.3}
    )
    mode = AsyncTransportMode(mesh)
    try:
        client = mode.async_openai(max_retries=5, default_headers=NO_WAIT)

        async def go() -> list[str]:
            import asyncio

            chats = await asyncio.gather(
                *(client.chat.completions.create(model="m", messages=MSG) for _ in range(10))
            )
            return [c.choices[0].message.content or "" for c in chats]

        assert all(mode.run(go))
        assert mock.worker.stats.wake_calls == 1
    finally:
        mode.close()
