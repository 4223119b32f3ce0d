"""POST /v1/feedback on a real `chatd serve` with two tenants, the official SDK as the client:
each kind of reply (a chat completion, a text completion, a conversation's reply, a response)
is rated by the tenant who was given it, under the model that served it; another tenant's reply
and an unknown id are the same 404; bad fields are 400s naming them; a second rating replaces the
first; /metrics counts them by model and rating, and `chatd feedback list` shows them."""

from __future__ import annotations

import json
import subprocess
import sys

import aiohttp
import openai
import pytest

from tests.http.serving import tenants_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tenants_server(tmp_path_factory.mktemp("feedback")) as running:
        yield running


def client(server, who: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key=server["keys"][who], max_retries=0)


async def rate(who: openai.AsyncOpenAI, **body) -> dict:
    return await who.post("/feedback", cast_to=dict, body=body)


async def test_each_kind_of_reply_is_rated_by_its_own_tenant_under_the_model_that_served_it(server):
    alice, bob = client(server, "alice"), client(server, "bob")
    chat = await alice.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    text = await alice.completions.create(model="demo", prompt="Once", max_tokens=3)
    conversation = await alice.post("/conversations", cast_to=dict, body={})
    turn = await alice.post(f"/conversations/{conversation['id']}/messages", cast_to=dict,
                            body={"content": "hello", "max_tokens": 3})
    response = await alice.responses.create(model="demo", input="hey", max_output_tokens=3)
    for reply_id, kind in ((chat.id, "completion"), (text.id, "completion"), (turn["id"], "message"),
                           (response.id, "response")):
        rated = await rate(alice, id=reply_id, rating="up")
        assert (rated["object"], rated["reply_id"], rated["reply_type"], rated["model"], rated["rating"]) == (
            "feedback", reply_id, kind, "demo", "up")
        with pytest.raises(openai.NotFoundError) as theirs:  # bob cannot rate, or learn of, alice's reply
            await rate(bob, id=reply_id, rating="down")
        assert theirs.value.body["param"] == "id" and reply_id in theirs.value.body["message"]
    again = await rate(alice, id=turn["id"], rating="down", comment="it rambled")
    first = await rate(alice, id=chat.id, rating="up")
    assert (again["rating"], again["comment"]) == ("down", "it rambled")
    assert first["id"] != again["id"]
    with pytest.raises(openai.NotFoundError):
        await rate(alice, id="msg_0123456789abcdef01234567", rating="up")
    with pytest.raises(openai.NotFoundError):  # a conversation is not a reply
        await rate(alice, id=conversation["id"], rating="up")

    async with aiohttp.ClientSession() as session, session.get(f"{server['url']}/metrics") as r:
        metrics = await r.text()
    counted = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("chatd:feedback_total{")}
    assert counted['chatd:feedback_total{model_name="demo",rating="up"}'] == 4  # rating chat's reply up again adds none
    assert counted['chatd:feedback_total{model_name="demo",rating="down"}'] == 1

    listed = subprocess.run([sys.executable, "-m", "chatd", "feedback", "list", "--config", str(server["config"]),
                             "--json"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert {row["reply_id"] for row in rows} == {chat.id, text.id, turn["id"], response.id}
    [down] = [row for row in rows if row["rating"] == "down"]
    assert (down["reply_id"], down["comment"], down["tenant"], down["model"]) == (
        turn["id"], "it rambled", "alice", "demo")
    exported = server["config"].parent / "down.jsonl"
    subprocess.run([sys.executable, "-m", "chatd", "feedback", "export", str(exported), "--rating", "down",
                    "--config", str(server["config"])], check=True, capture_output=True, timeout=60)
    [line] = [json.loads(line) for line in exported.read_text().splitlines()]
    reply_text = turn["choices"][0]["message"]["content"]
    assert (line["reply_id"], line["prompt"], line["reply"]) == (turn["id"], "hello", reply_text)


@pytest.mark.parametrize("body, param", [
    ({"rating": "up"}, "id"),
    ({"id": 7, "rating": "up"}, "id"),
    ({"id": "x" * 129, "rating": "up"}, "id"),
    ({"id": "chatcmpl-x", "rating": "meh"}, "rating"),
    ({"id": "chatcmpl-x"}, "rating"),
    ({"id": "chatcmpl-x", "rating": "up", "comment": "x" * 2001}, "comment"),
    ({"id": "chatcmpl-x", "rating": "up", "stars": 5}, "stars"),
])
async def test_a_bad_rating_is_a_400_naming_its_field(server, body, param):
    with pytest.raises(openai.BadRequestError) as bad:
        await rate(client(server, "alice"), **body)
    assert bad.value.body["param"] == param
