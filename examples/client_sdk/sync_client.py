"""OpenAI and Anthropic SDKs doing their own placement, with no gateway in between.

``MeshTransport`` sits inside each SDK's HTTP client: it picks a worker for every
request, rewrites the URL to it and swaps the client's API key for that worker's
own key. The base URL's host is never contacted.

Run it (starts two local mock workers, exits 0)::

    python examples/client_sdk/sync_client.py
"""

from __future__ import annotations

import anthropic
import httpx2
import openai
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam

from meshkit import Mesh, MeshTransport, Worker
from meshkit.mock import MockConfig, MockWorkerThread

MSG = "Say hello."


def show(api: str, headers: httpx2.Headers, text: str | None) -> None:
    # x-mock-worker names the mock that answered; a real engine has no such header.
    print(f"{api:<16} -> {headers.get('x-mock-worker')}: {text}")


def main() -> int:
    # Two workers with their own keys: w0 serves the OpenAI APIs, w1 Anthropic Messages.
    w0 = MockWorkerThread(
        MockConfig(name="w0", api_key="sk-w0", apis=frozenset({"chat", "responses"}))
    )
    w1 = MockWorkerThread(MockConfig(name="w1", api_key="sk-w1", apis=frozenset({"messages"})))
    with w0, w1:
        workers = [
            Worker(w0.url, api_key="sk-w0", labels={"mesh.apis": "chat,responses"}),
            Worker(w1.url, api_key="sk-w1", labels={"mesh.apis": "messages"}),
        ]
        with Mesh(workers=workers, policy="round_robin") as mesh:
            # The SDKs' own keys stay on this side: workers only ever see their own key.
            oa = openai.OpenAI(
                base_url="http://mesh.invalid/v1",
                api_key="client-key",
                http_client=httpx2.Client(transport=MeshTransport(mesh)),
            )
            an = anthropic.Anthropic(
                base_url="http://mesh.invalid",
                api_key="client-key",
                http_client=httpx2.Client(transport=MeshTransport(mesh)),
            )
            with oa, an:
                chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": MSG}]
                user: list[MessageParam] = [{"role": "user", "content": MSG}]

                raw = oa.chat.completions.with_raw_response.create(model="m", messages=chat)
                show("chat", raw.headers, raw.parse().choices[0].message.content)

                chunks = oa.chat.completions.create(model="m", messages=chat, stream=True)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                show("chat stream", chunks.response.headers, text)

                raw_r = oa.responses.with_raw_response.create(model="m", input=MSG)
                show("responses", raw_r.headers, raw_r.parse().output_text)

                raw_m = an.messages.with_raw_response.create(
                    model="m", max_tokens=32, messages=user
                )
                block = raw_m.parse().content[0]
                show("messages", raw_m.headers, block.text if block.type == "text" else "")

                with an.messages.stream(model="m", max_tokens=32, messages=user) as ms:
                    text = "".join(ms.text_stream)
                    show("messages stream", ms.response.headers, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
