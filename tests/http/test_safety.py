"""The safety pipeline through a server, with the OpenAI SDK as the client and a real SQLite store:
inputs refused with 400 content_policy_violation and an appeal id, personal data masked before
the model sees it, replies cut mid-stream with finish_reason content_filter, the audit trail and
appeals kept per tenant, /v1/moderations in OpenAI's shape, a failing guard decided by each
policy's failure mode, and /metrics counting it all."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest
from aiohttp.test_utils import TestServer

from chatd.config import DEFAULT_POLICIES
from chatd.config_loader import build_config
from chatd.http.app import create_app
from tests.factories import ScriptedChatEngine, close_server_state, make_server_state
from tests.safety.test_pipeline import FakeGuard

THREAT = "I'm going to kill you tomorrow."  # harassment/threatening: blocked by the shipped policies


@pytest.fixture
async def serve(tmp_path):
    """serve(guard=None, **safety) -> (state, url, keys): an auth-on server with alice and bob."""
    opened = []

    async def serve(guard=None, policies=None, **safety):
        settings = {"auth": {"enabled": True}, "safety": {"check_input": True, "check_output": True, **safety}}
        if policies is not None:
            settings["policies"] = policies
        root = tmp_path / f"server{len(opened)}"
        root.mkdir()
        state = await make_server_state(ScriptedChatEngine(pause=0.001), root, build_config(settings), guard=guard)
        keys = {name: (await state.store.create_key(name, "paid"))[0] for name in ("alice", "bob")}
        server = TestServer(create_app(state), host="127.0.0.1")
        await server.start_server()
        opened.append((state, server))
        return state, str(server.make_url("")), keys

    yield serve
    for state, server in opened:
        await server.close()
        await close_server_state(state)


def client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def chat(url: str, key: str, text: str, **options):
    return await client(url, key).chat.completions.create(model="scripted", messages=[{"role": "user", "content": text}],
                                                          **options)


async def test_a_blocked_input_is_refused_with_its_categories_and_an_appeal_only_its_tenant_can_make(serve):
    state, url, keys = await serve(audit_text="excerpt")
    with pytest.raises(openai.BadRequestError) as refused:
        await chat(url, keys["alice"], THREAT)
    error = refused.value
    assert error.status_code == 400 and error.code == "content_policy_violation"
    assert error.body["categories"] == ["harassment/threatening"]  # (its parent, harassment, is only flagged)
    appeal_id = error.body["appeal_id"]
    assert appeal_id.startswith("modr_") and appeal_id in error.message
    assert state.engine.num_requests == 0  # nothing reached the model
    alice = await state.store.authenticate(keys["alice"])
    event = await state.store.get_moderation_event(appeal_id, alice.id)
    assert (event.stage, event.action, event.endpoint, event.excerpt) == ("input", "blocked", "chat.completions", THREAT)

    async with httpx.AsyncClient(base_url=url) as http:
        as_bob = {"Authorization": f"Bearer {keys['bob']}"}
        as_alice = {"Authorization": f"Bearer {keys['alice']}"}
        # Bob cannot see or appeal Alice's decision: exactly as if it did not exist.
        for answer in (await http.get(f"/v1/appeals/{appeal_id}", headers=as_bob),
                       await http.post("/v1/appeals", json={"appeal_id": appeal_id, "reason": "mine"}, headers=as_bob),
                       await http.get("/v1/appeals/modr_000000000000000000000000", headers=as_alice)):
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"
        seen = await http.get(f"/v1/appeals/{appeal_id}", headers=as_alice)
        assert seen.json()["status"] == "open" and seen.json()["categories"] == ["harassment/threatening"]
        assert "excerpt" not in seen.json()  # the audit's copy of the text is the operator's
        appealed = await http.post("/v1/appeals", json={"appeal_id": appeal_id, "reason": "It was a quote from a film."},
                                   headers=as_alice)
        assert appealed.status_code == 200 and appealed.json()["status"] == "appealed"
        again = await http.post("/v1/appeals", json={"appeal_id": appeal_id, "reason": "again"}, headers=as_alice)
        assert again.status_code == 409 and again.json()["error"]["code"] == "appeal_closed"
        empty = await http.post("/v1/appeals", json={"appeal_id": appeal_id, "reason": " "}, headers=as_alice)
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "reason"
        metrics = (await http.get("/metrics")).text
    assert (await state.store.get_moderation_event(appeal_id)).appeal_reason == "It was a quote from a film."
    # Counted once: bob's attempt, the second appeal and the empty one were refused.
    assert 'chatd:safety_appeals_total{stage="input"} 1.0' in metrics


async def test_personal_data_is_masked_before_the_model_sees_it_and_the_masking_is_recorded(serve):
    state, url, keys = await serve()
    reply = await chat(url, keys["alice"], "Charge 4111 1111 1111 1111 and mail the receipt to jo.ng@example.com please")
    assert reply.choices[0].finish_reason == "stop"
    seen = state.tokenizer.decode(state.engine.prompts[0])
    assert "[card number]" in seen and "[email]" in seen
    assert "4111" not in seen and "example.com" not in seen
    [event] = await state.store.list_moderation_events()
    assert (event.action, event.categories, event.text_sha256 is not None, event.excerpt) == (
        "redacted", ("pii/email", "pii/card"), True, None)  # audit_text "hash": no text kept


async def test_a_reply_is_cut_where_it_breaks_the_policy_and_never_sends_the_match(serve):
    state, url, keys = await serve()
    words = "Fine, here is what I think about that. " * 3 + THREAT + " And then many more words follow here."
    state.engine.replies.append(words)
    stream = await chat(url, keys["alice"], "Tell me a story.", stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "kill" not in text and "tomorrow" not in text
    assert text.startswith("Fine, here is what I think about that.") and text.endswith(state.config.safety.output_notice)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["content_filter"]
    assert "scripted-1" in state.engine.aborted  # the engine request was stopped at the cut
    generated = len(words.split())
    usage = chunks[-1].usage
    assert 0 < usage.completion_tokens < generated  # what was generated before the cut is billed
    [event] = await state.store.list_moderation_events()
    assert (event.stage, event.action, event.categories) == ("output", "blocked", ("harassment/threatening",))


async def test_a_stored_conversation_reply_cut_by_the_policy_keeps_that_finish_reason(serve):
    state, url, keys = await serve()
    state.engine.replies.append("Sure. " + THREAT + " More words.")
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {keys['alice']}"}) as http:
        conversation = (await http.post("/v1/conversations", json={})).json()
        reply = (await http.post(f"/v1/conversations/{conversation['id']}/messages", json={"content": "Go on."})).json()
        assert reply["choices"][0]["finish_reason"] == "content_filter"
        messages = (await http.get(f"/v1/conversations/{conversation['id']}")).json()["messages"]
    assistant = messages[-1]
    assert assistant["finish_reason"] == "content_filter" and "kill" not in assistant["content"]
    assert assistant["content"].endswith(state.config.safety.output_notice)
    [event] = await state.store.list_moderation_events()
    assert event.stage == "output" and event.conversation_id == conversation["id"] and event.message_id == assistant["id"]


async def test_a_blocked_conversation_message_is_not_stored(serve):
    state, url, keys = await serve()
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {keys['alice']}"}) as http:
        conversation = (await http.post("/v1/conversations", json={})).json()
        refused = await http.post(f"/v1/conversations/{conversation['id']}/messages", json={"content": THREAT})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "content_policy_violation"
        messages = (await http.get(f"/v1/conversations/{conversation['id']}")).json()["messages"]
        assert messages == []
        items = await http.post(f"/v1/conversations/{conversation['id']}/items",
                                json={"items": [{"role": "user", "content": THREAT}]})
        assert items.status_code == 400 and (await http.get(f"/v1/conversations/{conversation['id']}")).json()["messages"] == []
        response = await http.post("/v1/responses", json={"input": "Hi", "instructions": THREAT})
        assert response.status_code == 400 and response.json()["error"]["code"] == "content_policy_violation"


async def test_moderations_answer_in_openais_shape(serve):
    state, url, keys = await serve(check_input=False, check_output=False)  # the endpoint works either way
    result = await client(url, keys["alice"]).moderations.create(input=["What a lovely day.", THREAT],
                                                                 model="omni-moderation-latest")
    calm, threat = result.results
    assert not calm.flagged and threat.flagged
    assert threat.categories.harassment_threatening and not threat.categories.sexual
    assert threat.category_scores.harassment_threatening == 1.0 and calm.category_scores.harassment == 0.0
    assert result.model == "omni-moderation-latest"
    with pytest.raises(openai.BadRequestError) as refused:
        await client(url, keys["alice"]).moderations.create(input=[{"type": "image_url", "image_url": {"url": "x"}}])
    assert refused.value.body["param"] == "input[0]"
    limit = state.config.conversations.max_message_chars
    with pytest.raises(openai.BadRequestError) as refused:  # the checks' cost is bounded per request
        await client(url, keys["alice"]).moderations.create(input=["a" * (limit // 2 + 1)] * 2)
    assert refused.value.body["param"] == "input" and str(limit) in refused.value.message
    assert await state.store.list_moderation_events() == []  # asking about a text blocks no one


async def test_a_failed_guard_refuses_what_fails_closed_and_serves_the_rest_with_a_record(serve):
    down = FakeGuard(error=TimeoutError("the guard model did not answer within 10 s"))
    state, url, keys = await serve(guard=down)
    with pytest.raises(openai.APIStatusError) as refused:
        await chat(url, keys["alice"], "Hello there.")
    assert refused.value.status_code == 503 and refused.value.code == "safety_check_unavailable"
    assert "illicit/violent, sexual/minors" in refused.value.message
    open_only = {name: {**dataclasses.asdict(policy), "failure": "open"} for name, policy in DEFAULT_POLICIES.items()}
    state, url, keys = await serve(guard=down, policies=open_only)
    reply = await chat(url, keys["alice"], "Hello there.")
    assert reply.choices[0].message.content
    [event] = await state.store.list_moderation_events()
    assert event.action == "guard_failed" and event.categories == ()
    async with httpx.AsyncClient(base_url=url) as http:
        metrics = (await http.get("/metrics")).text
    assert 'chatd:safety_guard_failures_total{model_name="scripted"} 1.0' in metrics


async def test_the_guards_verdict_blocks_through_the_server_and_is_counted(serve):
    state, url, keys = await serve(guard=FakeGuard(codes=("S10",)))
    with pytest.raises(openai.BadRequestError) as refused:
        await chat(url, keys["bob"], "A sentence no rule flags.")
    assert refused.value.body["categories"] == ["hate"]
    async with httpx.AsyncClient(base_url=url) as http:
        metrics = (await http.get("/metrics")).text
    assert 'chatd:safety_actions_total{action="block",category="hate",model_name="scripted",stage="input"} 1.0' in metrics
    assert 'chatd:safety_check_seconds_count{check="guard",model_name="scripted"} 1.0' in metrics


async def test_a_response_cut_by_the_policy_is_incomplete_for_content_filter(serve):
    state, url, keys = await serve()
    state.engine.replies.append("Well. " + THREAT + " The end.")
    response = await client(url, keys["alice"]).responses.create(model="scripted", input="Go on.")
    assert response.status == "incomplete" and response.incomplete_details.reason == "content_filter"
    assert "kill" not in response.output_text and response.output_text.endswith(state.config.safety.output_notice)


def _logprob_tokens(logprobs) -> str:
    """Every token a chat logprobs object shows (chosen and alternatives), joined."""
    return "".join(t.token + "".join(top.token for top in t.top_logprobs) for t in logprobs.content or [])


async def test_a_cut_reply_sends_no_token_of_the_match_in_its_logprobs(serve):
    """The blocked phrase's tokens are held back with its text: not in logprobs, top_logprobs or
    /v1/completions' tokens, streamed or whole, nor in a conversation turn's chunks."""
    state, url, keys = await serve()
    state.engine.tokenizer = state.tokenizer
    words = "Fine, here is what I think about that. " * 3 + THREAT + " And then many more words follow here."
    api = client(url, keys["alice"])
    state.engine.replies.append(words)
    stream = await chat(url, keys["alice"], "Tell me a story.", stream=True, logprobs=True, top_logprobs=1)
    chunks = [chunk async for chunk in stream]
    shown = "".join(_logprob_tokens(c.choices[0].logprobs) for c in chunks if c.choices and c.choices[0].logprobs)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "content_filter" and "kill" not in text
    assert "Fine" in shown and "kill" not in shown and "tomorrow" not in shown.replace(" ", "")
    state.engine.replies.append(words)
    whole = await chat(url, keys["alice"], "Tell me a story.", logprobs=True, top_logprobs=1)
    assert whole.choices[0].finish_reason == "content_filter"
    assert "Fine" in _logprob_tokens(whole.choices[0].logprobs) and "kill" not in _logprob_tokens(whole.choices[0].logprobs)
    state.engine.replies.append(words)
    completion = await api.completions.create(model="scripted", prompt="Once upon a time", logprobs=1, max_tokens=50)
    tokens = "".join(completion.choices[0].logprobs.tokens) + "".join(
        "".join(top) for top in completion.choices[0].logprobs.top_logprobs)
    assert completion.choices[0].finish_reason == "content_filter" and "Fine" in tokens and "kill" not in tokens
    state.engine.replies.append(words)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {keys['alice']}"}) as http:
        conversation = (await http.post("/v1/conversations", json={})).json()
        reply = (await http.post(f"/v1/conversations/{conversation['id']}/messages",
                                 json={"content": "Go on.", "logprobs": True, "stream": True})).text
    assert "content_filter" in reply and "Fine" in reply and "kill" not in reply


async def test_logprob_alternatives_that_would_complete_a_blocked_phrase_are_left_out():
    from chatd.engine import CompletionOutput, Logprob, RequestOutput
    from chatd.http.server.safety import WatchedReply
    from chatd.safety.pipeline import SafetyPipeline

    settings = build_config({"safety": {"check_output": True}})
    pipeline = SafetyPipeline.build(settings.safety, settings.policies)
    texts = {1: "People at the rally shouted sieg ", 2: "nothing", 3: "heil", 4: " at all, then went home " * 4}

    class Handle:
        request_id = "r"

        async def __aiter__(self):
            for token_id in (1, 2, 4):
                yield RequestOutput("r", [5], [CompletionOutput(0, text=texts[token_id], token_ids=[token_id],
                                                                logprobs=[Logprob(token_id, -0.1, {token_id: -0.1, 3: -2.0})],
                                                                finish_reason="stop" if token_id == 4 else None)],
                                    finished=token_id == 4)

        def abort(self):
            pass

    async def on_end(window):
        pass

    watched = WatchedReply(Handle(), lambda: pipeline.output_window(None), 1, "", on_end, texts.get)
    shown = [lp for out in [out async for out in watched] for lp in (out.outputs[0].logprobs or [])]
    assert [lp.token_id for lp in shown] == [1, 2, 4]  # every token leaves once its text has
    assert shown[0].top == {1: -0.1, 3: -2.0}  # "heil" in place of the first token completes nothing
    assert shown[1].top == {2: -0.1}  # after "... sieg ", "heil" would be blocked: not shown
    assert shown[2].top == {4: -0.1, 3: -2.0}


async def test_every_string_of_a_chat_request_that_reaches_the_model_is_checked(serve):
    """Tool descriptions, parameter schemas (an enum value, a property name), and an assistant
    message's tool call arguments are input too: a blocked phrase in any is refused, personal data
    in any is masked before the model sees it."""
    state, url, keys = await serve()
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}

    def tool(description="Get the weather.", parameters=weather):
        return {"type": "function", "function": {"name": "get_weather", "description": description, "parameters": parameters}}

    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}]}
    refused_bodies = [
        dict(tools=[tool(description=THREAT)]),
        dict(tools=[tool(parameters={"type": "object", "properties": {"city": {"enum": ["Paris", THREAT]}}})]),
        dict(tools=[tool()], messages=[{"role": "user", "content": "Weather?"},
                                       {**call, "tool_calls": [{**call["tool_calls"][0], "function": {
                                           "name": "get_weather", "arguments": '{"city": "' + THREAT + '"}'}}]},
                                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]),
    ]
    for body in refused_bodies:
        messages = body.pop("messages", [{"role": "user", "content": "Weather in Paris?"}])
        with pytest.raises(openai.BadRequestError) as refused:
            await client(url, keys["alice"]).chat.completions.create(model="scripted", messages=messages, **body)
        assert refused.value.code == "content_policy_violation", body
    masked = tool(description="Ask jo.ng@example.com for the forecast.")
    await client(url, keys["alice"]).chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[masked], max_tokens=5)
    seen = state.tokenizer.decode(state.engine.prompts[-1])
    assert "[email]" in seen and "example.com" not in seen


async def test_a_disguised_threat_is_refused_as_written_plainly_would_be(serve):
    """Issue 36: Cyrillic look-alikes, fullwidth letters, a zero-width space or a soft hyphen inside a
    word, or a combining accent, passed the rules (which only lower-cased)."""
    state, url, keys = await serve()
    disguises = [
        THREAT.replace("o", "\u043e").replace("i", "\u0456"),  # Cyrillic о and і
        THREAT.replace("kill", "\uff4b\uff49\uff4c\uff4c"),  # fullwidth
        THREAT.replace("kill", "ki\u200bll"),  # a zero-width space
        THREAT.replace("kill", "ki\u00adll"),  # a soft hyphen
        THREAT.replace("kill", "ki\u0301ll"),  # a combining accent
    ]
    for text in disguises:
        with pytest.raises(openai.BadRequestError) as refused:
            await chat(url, keys["alice"], text)
        assert refused.value.code == "content_policy_violation", text
        assert refused.value.body["categories"] == ["harassment/threatening"], text
