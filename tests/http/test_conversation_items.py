"""OpenAI's Conversations API (a conversation and its items) through a real `chatd serve` (auth on,
two tenants) and the official openai SDK: create with items and metadata, retrieve, update,
delete; items created, listed page by page, retrieved and deleted; the shapes of items; bad
items refused by field with nothing written; chatd's `/messages` turns seen as items; and a
tenant that cannot reach another's conversation."""

from __future__ import annotations

import json
import sqlite3

import httpx
import openai
import pytest

from tests.http.serving import tenants_server

MAX_MESSAGE_CHARS = 2000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """chatd serve with auth on and keys for alice and bob."""
    with tenants_server(tmp_path_factory.mktemp("conversation_items"),
                        f"[conversations]\nmax_message_chars = {MAX_MESSAGE_CHARS}\nsave_interval_seconds = 0.05\n"
                        "[server]\nheartbeat_seconds = 0.5\n") as server:
        yield server


def client(server, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=server["keys"][who], max_retries=0)


def auth(server, who: str = "alice") -> dict:
    return {"Authorization": f"Bearer {server['keys'][who]}"}


def message(role: str, text: str, part: str | None = None) -> dict:
    """A message item; its content a plain string, or one part of type `part`."""
    content = text if part is None else [{"type": part, "text": text}]
    return {"type": "message", "role": role, "content": content}


def shapes(items) -> list[tuple[str, str, str, str]]:
    """(role, status, part type, text) of each item, as a client reads them."""
    out = []
    for item in items:
        assert item.type == "message" and item.id.startswith("msg_") and len(item.content) == 1
        out.append((item.role, item.status, item.content[0].type, item.content[0].text))
    return out


def count_rows(server) -> tuple[int, int]:
    with sqlite3.connect(server["db"]) as conn:
        return tuple(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] for table in ("conversations", "messages"))


def test_a_conversation_from_creation_to_deletion(server):
    sdk = client(server)
    conversation = sdk.conversations.create(
        items=[message("developer", "Be brief.", "input_text"), message("system", "Plain words."),
               message("user", "What is a KV block?"),
               message("assistant", "A fixed run of tokens' keys and values.", "output_text")],
        metadata={"topic": "kv"})
    assert conversation.object == "conversation" and conversation.id.startswith("conv_")
    assert conversation.metadata == {"topic": "kv"} and conversation.created_at > 0
    items = sdk.conversations.items.list(conversation.id, order="asc")
    assert shapes(items.data) == [
        ("developer", "completed", "input_text", "Be brief."), ("system", "completed", "input_text", "Plain words."),
        ("user", "completed", "input_text", "What is a KV block?"),
        ("assistant", "completed", "output_text", "A fixed run of tokens' keys and values.")]
    assert items.data[-1].content[0].annotations == []

    got = sdk.conversations.retrieve(conversation.id)
    assert got.id == conversation.id and got.metadata == {"topic": "kv"}
    updated = sdk.conversations.update(conversation.id, metadata={"topic": "paging", "n": "2"})
    assert updated.metadata == {"topic": "paging", "n": "2"}
    assert sdk.conversations.retrieve(conversation.id).metadata == {"topic": "paging", "n": "2"}

    deleted = sdk.conversations.delete(conversation.id)
    assert deleted.deleted is True and deleted.id == conversation.id and deleted.object == "conversation.deleted"
    for gone in (lambda: sdk.conversations.retrieve(conversation.id), lambda: sdk.conversations.delete(conversation.id),
                 lambda: sdk.conversations.update(conversation.id, metadata={}),
                 lambda: sdk.conversations.items.list(conversation.id),
                 lambda: sdk.conversations.items.create(conversation.id, items=[message("user", "hi")]),
                 lambda: sdk.conversations.items.retrieve(items.data[0].id, conversation_id=conversation.id)):
        with pytest.raises(openai.NotFoundError):
            gone()


def test_items_are_added_and_listed_page_by_page(server):
    sdk = client(server)
    conversation = sdk.conversations.create()
    assert sdk.conversations.items.list(conversation.id).data == []
    texts = [f"item {i}" for i in range(5)]
    added = sdk.conversations.items.create(
        conversation.id, items=[message("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(texts)])
    assert [i.content[0].text for i in added.data] == texts and added.has_more is False
    assert added.first_id == added.data[0].id and added.last_id == added.data[-1].id
    assert [i.content[0].type for i in added.data] == ["input_text", "output_text"] * 2 + ["input_text"]
    ids = [i.id for i in added.data]

    pages, after = [], None
    while True:
        page = sdk.conversations.items.list(conversation.id, order="asc", limit=2, **({"after": after} if after else {}))
        pages.append([i.id for i in page.data])
        assert page.last_id == page.data[-1].id
        if not page.has_more:
            break
        after = page.last_id
    assert pages == [ids[0:2], ids[2:4], ids[4:]]
    newest_first = sdk.conversations.items.list(conversation.id, limit=3)  # desc is the default
    assert [i.id for i in newest_first.data] == ids[::-1][:3] and newest_first.has_more
    rest = sdk.conversations.items.list(conversation.id, limit=3, after=newest_first.last_id)
    assert [i.id for i in rest.data] == ids[::-1][3:] and not rest.has_more
    assert [i.id for i in sdk.conversations.items.list(conversation.id, order="asc", limit=2)] == ids  # the SDK pages

    more = sdk.conversations.items.create(conversation.id, items=[message("user", "after the five", "input_text")])
    assert [i.id for i in sdk.conversations.items.list(conversation.id, order="asc", limit=100)] == ids + [more.data[0].id]
    for bad, param in (({"after": "msg_000000000000000000000000"}, "after"), ({"limit": 0}, "limit"),
                       ({"limit": 101}, "limit")):
        with pytest.raises(openai.BadRequestError) as error:
            sdk.conversations.items.list(conversation.id, **bad)
        assert error.value.param == param


def test_an_item_is_retrieved_and_deleted(server):
    sdk = client(server)
    conversation = sdk.conversations.create(items=[message("user", "keep"), message("user", "drop")])
    keep, drop = sdk.conversations.items.list(conversation.id, order="asc").data
    got = sdk.conversations.items.retrieve(drop.id, conversation_id=conversation.id)
    assert shapes([got]) == [("user", "completed", "input_text", "drop")] and got.id == drop.id
    after = sdk.conversations.items.delete(drop.id, conversation_id=conversation.id)
    assert after.object == "conversation" and after.id == conversation.id
    assert [i.id for i in sdk.conversations.items.list(conversation.id).data] == [keep.id]
    for gone in (lambda: sdk.conversations.items.retrieve(drop.id, conversation_id=conversation.id),
                 lambda: sdk.conversations.items.delete(drop.id, conversation_id=conversation.id)):
        with pytest.raises(openai.NotFoundError) as error:
            gone()
        assert error.value.param == "item_id"
    # An item of another conversation is not this one's.
    other = sdk.conversations.create()
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.items.retrieve(keep.id, conversation_id=other.id)


def test_bad_items_are_refused_by_field_and_write_nothing(server):
    sdk = client(server)
    conversation = sdk.conversations.create(items=[message("user", "only me")])
    rows = count_rows(server)
    cases = [
        ([{"type": "function_call", "call_id": "c1", "name": "f", "arguments": 5}], "items[0].arguments", "string"),
        ([{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}], "items[0].call_id", "non-empty"),
        ([{"type": "function_call_output", "call_id": "c1", "output": {"x": 1}}], "items[0].output", "string"),
        ([{"type": "function_call_output", "call_id": "c" * 300, "output": "1"}], "items[0].call_id", "256"),
        ([{"type": "custom_tool_call", "call_id": "c1", "name": "f", "input": ""}], "items[0].type", "custom tools"),
        ([message("user", "ok"), {"type": "reasoning", "id": "rs_1", "summary": []}], "items[1].type", "reasoning"),
        ([{"type": "message", "role": "user",
           "content": [{"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"}]}],
         "items[0].content[0].type", "input_image"),
        ([{"type": "message", "role": "user", "content": [{"type": "input_text", "text": 5}]}],
         "items[0].content[0].text", "string"),
        ([message("tool", "hi")], "items[0].role", "tool"),
        ([message("user", "x" * (MAX_MESSAGE_CHARS + 1))], "items[0].content", str(MAX_MESSAGE_CHARS)),
        ([message("user", f"{i}") for i in range(21)], "items", "20"),
        ([], "items", "at least one"),
    ]
    for items, param, words in cases:
        for create in (lambda: sdk.conversations.items.create(conversation.id, items=items),
                       lambda: sdk.conversations.create(items=items)):
            with pytest.raises(openai.BadRequestError) as error:
                create()
            assert error.value.param == param and words in error.value.message, (param, error.value.body)
    for create in (lambda: sdk.conversations.items.create(conversation.id, items=[message("user", "hi")],
                                                           extra_body={"bogus": 1}),
                   lambda: sdk.conversations.create(items=[message("user", "hi")], extra_body={"bogus": 1})):
        with pytest.raises(openai.BadRequestError) as error:
            create()
        assert error.value.param == "bogus" and "unknown field" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        sdk.conversations.create(metadata="not an object")
    assert error.value.param == "metadata"
    with pytest.raises(openai.BadRequestError) as error:  # the SDK sends include in the query: not ignored
        sdk.conversations.items.create(conversation.id, items=[message("user", "hi")],
                                       include=["message.output_text.logprobs"])
    assert error.value.param == "include"
    assert count_rows(server) == rows
    assert [i.content[0].text for i in sdk.conversations.items.list(conversation.id).data] == ["only me"]


def test_messages_turns_and_responses_appear_as_items(server):
    """chatd's own `/messages` turns and Responses with conversation= are items of the conversation,
    and a reply still being generated is an item `in_progress` that cannot be deleted."""
    sdk = client(server)
    conversation = sdk.conversations.create(items=[message("system", "Be brief.")])
    turn = httpx.post(f"{server['url']}/v1/conversations/{conversation.id}/messages", headers=auth(server),
                      json={"content": "What is paging?", "max_tokens": 6, "ignore_eos": True}, timeout=60).json()
    reply = turn["choices"][0]["message"]["content"]
    response = sdk.responses.create(model="demo", conversation=conversation.id, input="And a block?",
                                    max_output_tokens=6, extra_body={"ignore_eos": True})
    items = sdk.conversations.items.list(conversation.id, order="asc")
    assert shapes(items.data) == [
        ("system", "completed", "input_text", "Be brief."), ("user", "completed", "input_text", "What is paging?"),
        ("assistant", "completed", "output_text", reply), ("user", "completed", "input_text", "And a block?"),
        ("assistant", "completed", "output_text", response.output_text)]
    assert items.data[2].id == turn["id"] and items.data[4].id == response.output[0].id

    # A long reply being generated: in_progress, not deletable (409) until it is cancelled.
    url = f"{server['url']}/v1/conversations/{conversation.id}/messages"
    with httpx.stream("POST", url, headers=auth(server), timeout=60,
                      json={"content": "Talk at length.", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        message_id = json.loads(first[6:])["id"]
        live = sdk.conversations.items.retrieve(message_id, conversation_id=conversation.id)
        assert live.status == "in_progress" and live.role == "assistant"
        with pytest.raises(openai.ConflictError) as error:
            sdk.conversations.items.delete(message_id, conversation_id=conversation.id)
        assert error.value.code == "reply_in_progress"
        cancelled = httpx.post(f"{url}/{message_id}/cancel", headers=auth(server), timeout=60).json()
        assert cancelled["status"] == "partial"
    stopped = sdk.conversations.items.retrieve(message_id, conversation_id=conversation.id)
    assert stopped.status == "incomplete" and stopped.content[0].text == cancelled["content"]
    sdk.conversations.items.delete(message_id, conversation_id=conversation.id)


def test_another_tenants_conversation_does_not_exist(server):
    alice = client(server)
    conversation = alice.conversations.create(items=[message("user", "alice's secret")], metadata={"owner": "alice"})
    [item] = alice.conversations.items.list(conversation.id).data
    bob = client(server, "bob")
    for reach in (lambda: bob.conversations.retrieve(conversation.id),
                  lambda: bob.conversations.update(conversation.id, metadata={"owner": "bob"}),
                  lambda: bob.conversations.delete(conversation.id),
                  lambda: bob.conversations.items.list(conversation.id),
                  lambda: bob.conversations.items.create(conversation.id, items=[message("user", "bob was here")]),
                  lambda: bob.conversations.items.retrieve(item.id, conversation_id=conversation.id),
                  lambda: bob.conversations.items.delete(item.id, conversation_id=conversation.id)):
        with pytest.raises(openai.NotFoundError) as error:
            reach()
        assert error.value.code == "not_found"
    assert alice.conversations.retrieve(conversation.id).metadata == {"owner": "alice"}
    assert [i.content[0].text for i in alice.conversations.items.list(conversation.id).data] == ["alice's secret"]
    for method, path in (("GET", f"/v1/conversations/{conversation.id}/items"),
                         ("POST", f"/v1/conversations/{conversation.id}/items"),
                         ("DELETE", f"/v1/conversations/{conversation.id}/items/{item.id}")):
        body = {"items": [message("user", "x")]} if method == "POST" else None
        r = httpx.request(method, f"{server['url']}{path}", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
