"""The real openai and anthropic SDKs through every mode, against mock workers."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from harness import AsyncTransportMode, wait_until
from meshkit import Mesh, MeshTransport, Worker

#: a message list both SDKs take (Any: each SDK types it with TypedDicts of its own)
MSG: Any = [{"role": "user", "content": "say hello"}]


@pytest.fixture
def fleet(mock_factory: Any, mesh_factory: Any) -> Mesh:
    mocks = [mock_factory(name=f"w{i}", api_key="wk", output_tokens=6) for i in range(3)]
    return mesh_factory(workers=[Worker(m.url, api_key="wk") for m in mocks])  # type: ignore[no-any-return]


@pytest.fixture(params=["asgi", "wsgi", "transport"])
def mode_name(request: pytest.FixtureRequest) -> str:
    """The sync SDK clients; the async transport has its own async test below."""
    return str(request.param)


def test_openai_sdk(fleet: Mesh, run_mode: Any) -> None:
    client = run_mode(fleet).openai(max_retries=0)
    chat = client.chat.completions.create(model="m", messages=MSG)
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 6

    stream = client.chat.completions.create(
        model="m", messages=MSG, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).split()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6

    comp = client.completions.create(model="m", prompt="once upon a time")
    assert comp.choices[0].text

    resp = client.responses.create(model="m", input="hi")
    assert resp.output_text
    again = client.responses.retrieve(resp.id)
    assert again.id == resp.id

    with client.responses.stream(model="m", input="stream please") as rs:
        events = [e.type for e in rs]
        final = rs.get_final_response()
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert final.usage is not None and final.usage.output_tokens == 6
    assert wait_until(lambda: fleet.total_load() == 0)


def test_anthropic_sdk(fleet: Mesh, run_mode: Any) -> None:
    client = run_mode(fleet).anthropic(max_retries=0)
    msg = client.messages.create(model="m", max_tokens=16, messages=MSG)
    assert msg.content[0].type == "text"
    with client.messages.stream(model="m", max_tokens=16, messages=MSG) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text.split() == [f"tok{i}" for i in range(6)]
    assert final.usage.output_tokens == 6
    assert wait_until(lambda: fleet.total_load() == 0)


def test_openai_sdk_with_a_legacy_httpx_client(fleet: Mesh) -> None:
    client = openai.OpenAI(
        base_url="http://mesh.invalid/v1",
        api_key="client",
        # (ignore: the legacy httpx client, on purpose; the SDK is typed for httpx2's)
        http_client=httpx.Client(transport=MeshTransport(fleet)),  # type: ignore[arg-type]
        max_retries=0,
    )
    chat = client.chat.completions.create(model="m", messages=MSG)
    assert chat.choices[0].message.content
    stream = client.chat.completions.create(model="m", messages=MSG, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert fleet.total_load() == 0


def test_async_sdks_through_the_async_transport(fleet: Mesh) -> None:
    mode = AsyncTransportMode(fleet)
    try:
        oa = mode.async_openai(max_retries=0)
        an = mode.async_anthropic(max_retries=0)

        async def scenario() -> tuple[str, str, str, int]:
            chat = await oa.chat.completions.create(model="m", messages=MSG)
            resp = await oa.responses.create(model="m", input="hi")
            got = await oa.responses.retrieve(resp.id)
            parts = []
            async with an.messages.stream(model="m", max_tokens=16, messages=MSG) as s:
                async for t in s.text_stream:
                    parts.append(t)
                final = await s.get_final_message()
            return (
                chat.choices[0].message.content or "",
                got.id,
                "".join(parts),
                final.usage.output_tokens,
            )

        content, rid, text, out = mode.run(scenario)
        assert content and rid.startswith("resp_")
        assert text.split() == [f"tok{i}" for i in range(6)]
        assert out == 6
        assert fleet.total_load() == 0
    finally:
        mode.close()


def test_worker_key_is_required_and_client_key_never_forwarded(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    mock = mock_factory(name="k", api_key="wk")
    mesh = mesh_factory(workers=[Worker(mock.url, api_key="wk")])
    # api-key: what Azure OpenAI clients send instead of Authorization
    client = run_mode(mesh).openai(
        api_key="client-secret", default_headers={"api-key": "azure-secret"}, max_retries=0
    )
    client.chat.completions.create(model="m", messages=MSG)
    assert mock.worker.stats.last_header("authorization") == "Bearer wk"
    assert mock.worker.stats.last_header("api-key") is None
    assert "client-secret" not in repr(mock.worker.stats.last_headers)
    assert "azure-secret" not in repr(mock.worker.stats.last_headers)

    unkeyed = mesh_factory(workers=[Worker(mock.url)])
    client2 = run_mode(unkeyed).openai(api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client2.chat.completions.create(model="m", messages=MSG)
    assert anthropic is not None
