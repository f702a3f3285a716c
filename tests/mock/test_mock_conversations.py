"""The mock worker's Conversations API: the store and its bounds, every endpoint over
a real socket (raw HTTP and the openai SDK), and ``POST /v1/responses`` with
``conversation`` (its items prepended to the prompt, the response's items appended)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import httpx2
import openai
import pytest

from harness import wait_until
from meshkit.mock import MockConfig, MockWorkerThread
from meshkit.mock.cli import build_parser, config_from_args
from meshkit.mock.conversations import ConversationStore, StoredConversation


@pytest.fixture
def spawn(mock_factory: Callable[..., MockWorkerThread]) -> Callable[..., MockWorkerThread]:
    """Mock workers from the suite's factory (stopped at teardown)."""
    return mock_factory


@pytest.fixture
def http() -> Iterator[httpx2.Client]:
    with httpx2.Client(timeout=10, trust_env=False) as c:
        yield c


def _conv(cid: str, n: int = 0) -> StoredConversation:
    return StoredConversation(cid, 0, items=[{"id": f"{cid}-{i}"} for i in range(n)])


def _assert_openai_404(r: httpx2.Response, param: str) -> None:
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"]) == ("invalid_request_error", param)


# -- the store ----------------------------------------------------------------------------


def test_the_store_keeps_the_last_used_conversations() -> None:
    store = ConversationStore(capacity=2, max_items=10)
    store.put(_conv("a"))
    store.put(_conv("b"))
    assert store.get("a") is not None  # used: "b" is now the oldest
    store.put(_conv("c"))
    assert len(store) == 2
    assert "b" not in store
    assert store.get("a") is not None
    assert store.get("c") is not None


def test_the_store_keeps_the_last_items_of_a_conversation() -> None:
    store = ConversationStore(capacity=2, max_items=3)
    conv = _conv("a", 5)
    store.put(conv)  # over the bound from the start
    assert [i["id"] for i in conv.items] == ["a-2", "a-3", "a-4"]
    store.append(conv, [{"id": "x"}, {"id": "y"}])
    assert [i["id"] for i in conv.items] == ["a-4", "x", "y"]
    assert store.pop("a") is conv
    assert store.pop("a") is None
    assert len(store) == 0


@pytest.mark.parametrize("field", ["max_conversations", "max_conversation_items", "max_responses"])
def test_the_bounds_are_validated(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MockConfig(**cast("dict[str, Any]", {field: 0}))


def test_the_bounds_have_flags() -> None:
    ns = build_parser().parse_args(
        ["--max-conversations", "3", "--max-conversation-items", "4", "--max-responses", "5"]
    )
    cfg = config_from_args(ns)
    assert (cfg.max_conversations, cfg.max_conversation_items, cfg.max_responses) == (3, 4, 5)


def test_the_worker_keeps_at_most_max_responses(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client
) -> None:
    m = spawn(max_responses=2)
    url = m.url + "/v1/responses"
    ids = [http.post(url, json={"model": "m", "input": f"q{i}"}).json()["id"] for i in range(3)]
    assert http.get(f"{url}/{ids[0]}").status_code == 404  # the oldest went
    assert [http.get(f"{url}/{i}").status_code for i in ids[1:]] == [200, 200]
    follow = http.post(url, json={"model": "m", "input": "again", "previous_response_id": ids[0]})
    assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"


def test_the_worker_keeps_at_most_max_conversations(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client
) -> None:
    m = spawn(max_conversations=2, max_conversation_items=2)
    url = m.url + "/v1/conversations"
    ids = [http.post(url, json={}).json()["id"] for _ in range(3)]
    assert len(m.worker.app.conversations) == 2
    _assert_openai_404(http.get(f"{url}/{ids[0]}"), "conversation_id")  # the oldest went
    assert http.get(f"{url}/{ids[2]}").status_code == 200
    items = [{"role": "user", "content": f"m{i}"} for i in range(3)]
    assert http.post(f"{url}/{ids[2]}/items", json={"items": items}).status_code == 200
    listed = http.get(f"{url}/{ids[2]}/items", params={"order": "asc"}).json()["data"]
    assert [i["content"][0]["text"] for i in listed] == ["m1", "m2"]  # the last two


# -- the endpoints ------------------------------------------------------------------------


def test_every_conversation_endpoint(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client
) -> None:
    m = spawn(name="w0")
    url = m.url + "/v1/conversations"
    created = http.post(
        url, json={"items": [{"role": "user", "content": "hello"}], "metadata": {"k": "v"}}
    )
    assert created.status_code == 200
    assert created.headers["x-mock-worker"] == "w0"
    conv = created.json()
    cid = conv["id"]
    assert cid.startswith("conv_") and all(c in "0123456789abcdef" for c in cid[5:])
    assert conv == {"id": cid, "object": "conversation", "created_at": conv["created_at"]} | {
        "metadata": {"k": "v"}
    }
    assert http.get(f"{url}/{cid}").json() == conv
    updated = http.post(f"{url}/{cid}", json={"metadata": {"k": "w"}}).json()
    assert updated["metadata"] == {"k": "w"}

    added = http.post(
        f"{url}/{cid}/items",
        json={"items": [{"type": "message", "role": "user", "content": "more"}]},
    ).json()
    assert added["object"] == "list" and added["has_more"] is False
    (item,) = added["data"]
    assert added["first_id"] == added["last_id"] == item["id"]
    assert item["content"] == [{"type": "input_text", "text": "more"}]
    newest = http.get(f"{url}/{cid}/items", params={"limit": 1}).json()
    assert newest["data"] == [item]  # newest first by default
    assert newest["has_more"] is True
    assert http.get(f"{url}/{cid}/items/{item['id']}").json() == item
    after = http.delete(f"{url}/{cid}/items/{item['id']}")
    assert after.json()["id"] == cid  # the delete answers the conversation
    _assert_openai_404(http.get(f"{url}/{cid}/items/{item['id']}"), "item_id")
    assert len(http.get(f"{url}/{cid}/items").json()["data"]) == 1

    gone = http.delete(f"{url}/{cid}").json()
    assert gone == {"id": cid, "object": "conversation.deleted", "deleted": True}
    for method, path in [
        ("GET", cid),
        ("POST", cid),
        ("DELETE", cid),
        ("GET", f"{cid}/items"),
        ("POST", f"{cid}/items"),
        ("GET", f"{cid}/items/x"),
        ("DELETE", f"{cid}/items/x"),
    ]:
        body: dict[str, Any] | None = {"metadata": {}, "items": []} if method == "POST" else None
        _assert_openai_404(http.request(method, f"{url}/{path}", json=body), "conversation_id")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        pytest.param("", {"items": "x"}, "items", id="items-not-a-list"),
        pytest.param("", {"items": [{"role": "user"}] * 21}, "items", id="over-20-items"),
        pytest.param("", {"metadata": {"k": 1}}, "metadata", id="metadata-not-strings"),
        pytest.param("/{cid}", {}, "metadata", id="update-without-metadata"),
        pytest.param("/{cid}/items", {}, "items", id="add-without-items"),
    ],
)
def test_bad_bodies_are_400(
    spawn: Callable[..., MockWorkerThread],
    http: httpx2.Client,
    path: str,
    body: Any,
    param: str,
) -> None:
    m = spawn()
    url = m.url + "/v1/conversations"
    cid = http.post(url).json()["id"]  # no body at all: the API allows it
    r = http.post(url + path.format(cid=cid), json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_the_openai_sdk(spawn: Callable[..., MockWorkerThread]) -> None:
    m = spawn()
    client = openai.OpenAI(base_url=m.url + "/v1", api_key="k", max_retries=0)
    conv = client.conversations.create(items=[{"role": "user", "content": "one two three"}])
    assert client.conversations.retrieve(conv.id).id == conv.id
    assert client.conversations.update(conv.id, metadata={"a": "b"}).metadata == {"a": "b"}
    added = client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": "four"}]
    )
    assert added.data[0].id is not None
    got = client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert got.id == added.data[0].id
    assert len(list(client.conversations.items.list(conv.id, limit=1))) == 2  # paged by the SDK
    assert client.conversations.items.delete(got.id, conversation_id=conv.id).id == conv.id
    assert client.conversations.delete(conv.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


# -- responses in a conversation ----------------------------------------------------------


@pytest.mark.parametrize("ref", ["str", "obj"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_response_reads_and_extends_its_conversation(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client, ref: str, stream: bool
) -> None:
    m = spawn(output_tokens=4)
    base = m.url + "/v1"
    cid = http.post(
        base + "/conversations", json={"items": [{"role": "user", "content": "one two three"}]}
    ).json()["id"]
    client = openai.OpenAI(base_url=base, api_key="k", max_retries=0)
    conversation: Any = cid if ref == "str" else {"id": cid}

    def turn(text: str) -> Any:
        if not stream:
            return client.responses.create(model="m", input=text, conversation=conversation)
        with client.responses.stream(model="m", input=text, conversation=conversation) as s:
            return s.get_final_response()

    first = turn("four")
    assert first.conversation is not None and first.conversation.id == cid
    assert first.usage is not None and first.usage.input_tokens == 3 + 1  # items, then input
    second = turn("five")
    # the first turn's input (1) and output (4 tokens) joined the conversation
    assert second.usage is not None and second.usage.input_tokens == 3 + 1 + 4 + 1
    items = http.get(f"{base}/conversations/{cid}/items", params={"order": "asc"}).json()["data"]
    assert [i["role"] for i in items] == ["user", "user", "assistant", "user", "assistant"]
    assert items[-1]["id"] == second.output[0].id


def test_a_conversation_this_worker_does_not_hold_is_404(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client
) -> None:
    m = spawn()
    for ref in ("conv_elsewhere", {"id": "conv_elsewhere"}, {"id": 5}, ""):
        r = http.post(m.url + "/v1/responses", json={"input": "x", "conversation": ref})
        _assert_openai_404(r, "conversation")
    assert len(m.worker.app.responses) == 0


def test_previous_response_id_with_conversation_is_400(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client
) -> None:
    m = spawn()
    cid = http.post(m.url + "/v1/conversations", json={}).json()["id"]
    rid = http.post(m.url + "/v1/responses", json={"input": "x"}).json()["id"]
    body = {"input": "x", "conversation": cid, "previous_response_id": rid}
    r = http.post(m.url + "/v1/responses", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "previous_response_id"


def test_a_background_response_joins_its_conversation_when_it_completes(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client
) -> None:
    m = spawn(first_token_ms=2000)
    base = m.url + "/v1"
    cid = http.post(base + "/conversations", json={}).json()["id"]
    items = f"{base}/conversations/{cid}/items"
    body = {"input": "x", "conversation": cid, "background": True}
    pending = http.post(base + "/responses", json=body).json()
    assert pending["status"] == "queued"
    assert pending["conversation"] == {"id": cid}
    assert http.get(items).json()["data"] == []  # not complete yet
    rid = pending["id"]
    assert wait_until(
        lambda: http.get(f"{base}/responses/{rid}").json()["status"] == "completed", 30
    )
    assert [i["role"] for i in http.get(items, params={"order": "asc"}).json()["data"]] == [
        "user",
        "assistant",
    ]
    # a cancelled one never joins
    cancelled = http.post(base + "/responses", json=body).json()["id"]
    assert http.post(f"{base}/responses/{cancelled}/cancel").json()["status"] == "cancelled"
    assert len(http.get(items).json()["data"]) == 2


def test_a_restart_forgets_the_conversations(
    spawn: Callable[..., MockWorkerThread], http: httpx2.Client
) -> None:
    m = spawn()
    cid = http.post(m.url + "/v1/conversations", json={}).json()["id"]
    m.restart()
    _assert_openai_404(http.get(f"{m.url}/v1/conversations/{cid}"), "conversation_id")
