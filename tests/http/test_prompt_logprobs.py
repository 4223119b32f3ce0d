"""What a reply shows of its prompt, with the OpenAI SDK as the client (completions.py, openai_format.py):
`echo` on /v1/completions gives the prompt's text back before the reply and, with `logprobs`, its
tokens' logprobs before the reply's (as lm-evaluation-harness scores choices, `max_tokens: 0`
included); vLLM's `prompt_logprobs` on completions and chat; and the refusals, the output check's
among them. The engine is scripted: its prompt logprobs are made up (tests/factories.py)."""

from __future__ import annotations

import time

import openai
import pytest
from aiohttp.test_utils import TestServer

from chatd.config_loader import build_config
from chatd.engine import MAX_LOGPROBS
from chatd.http.app import create_app
from tests.factories import ScriptedChatEngine, close_server_state, make_server_state

PROMPT = "The cat sat on the"
REPLY = "mat and slept."
# Each prompt token's alternatives are these words' first tokens ("M", "P": in no prompt), likeliest first.
ALTERNATIVES = ["Mountain", "Paris"]
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture
async def serve(tmp_path):
    """serve(**settings) -> (state, client): a server around a scripted engine that knows the demo
    tokenizer, and an AsyncOpenAI client for it."""
    opened = []

    async def serve(**settings):
        root = tmp_path / f"server{len(opened)}"
        root.mkdir()
        engine = ScriptedChatEngine(pause=0.0)
        state = await make_server_state(engine, root, build_config(settings) if settings else None)
        engine.tokenizer, engine.alternatives = state.fleet.primary.tokenizer, ALTERNATIVES
        engine.replies = [REPLY] * 8
        server = TestServer(create_app(state), host="127.0.0.1")
        await server.start_server()
        client = openai.AsyncOpenAI(base_url=f"{server.make_url('')}/v1", api_key="unused", max_retries=0)
        opened.append((state, server, client))
        return state, client

    yield serve
    for state, server, client in opened:
        await client.close()
        await server.close()
        await close_server_state(state)


def assert_legacy_logprobs(logprobs, prompt_ids: list[int], num_generated: int, token_text) -> None:
    """The echoed prompt's tokens come first (the first with null logprobs), then the reply's; each
    text_offset is the length of the token texts before it."""
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset)
    assert len(logprobs.tokens) == len(prompt_ids) + num_generated
    assert logprobs.tokens[:len(prompt_ids)] == [token_text(t) for t in prompt_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:len(prompt_ids)] == [-0.5 - i / 100 for i in range(1, len(prompt_ids))]
    assert all(isinstance(v, float) for v in logprobs.token_logprobs[1:])
    assert logprobs.text_offset[0] == 0
    for i in range(1, len(logprobs.tokens)):
        assert logprobs.text_offset[i] == logprobs.text_offset[i - 1] + len(logprobs.tokens[i - 1])


async def test_echo_gives_the_prompt_and_its_logprobs_before_the_reply(serve):
    state, client = await serve()
    served = state.fleet.primary
    reply = await client.completions.create(model="scripted", prompt=PROMPT, echo=True, logprobs=1, max_tokens=16)
    [choice] = reply.choices
    assert choice.text == PROMPT + REPLY and choice.finish_reason == "stop"
    prompt_ids = served.tokenizer.encode(PROMPT)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert_legacy_logprobs(choice.logprobs, prompt_ids, reply.usage.completion_tokens, served.token_text)
    # logprobs: 1 shows each prompt token's likeliest alternative.
    likeliest = served.token_text(served.tokenizer.encode(ALTERNATIVES[0], add_special_tokens=False)[0])
    assert choice.logprobs.top_logprobs[1] == {likeliest: -0.25}
    assert "prompt_logprobs" not in choice.model_extra  # only when asked for


async def test_max_tokens_0_scores_the_prompt_alone_and_bills_no_completion_tokens(serve):
    state, client = await serve()
    reply = await client.completions.create(model="scripted", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    [choice] = reply.choices
    prompt_ids = state.fleet.primary.tokenizer.encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), 0)
    assert_legacy_logprobs(choice.logprobs, prompt_ids, 0, state.fleet.primary.token_text)
    await state.ledger.drained()
    billed = await state.store.usage(state.local_tenant.id, 0, time.time() + 1)
    assert (billed.requests, billed.input_tokens, billed.output_tokens) == (1, len(prompt_ids), 0)


async def test_a_prompt_of_token_ids_is_echoed_as_the_text_they_spell(serve):
    state, client = await serve()
    tokenizer = state.fleet.primary.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    reply = await client.completions.create(model="scripted", prompt=prompt_ids, echo=True, max_tokens=0)
    assert reply.choices[0].text == tokenizer.decode(prompt_ids, skip_special_tokens=False)
    assert reply.choices[0].logprobs is None  # echo alone shows no logprobs


async def test_each_prompt_of_a_batch_shows_its_own_prompt_logprobs_in_vllms_shape(serve):
    state, client = await serve()
    served = state.fleet.primary
    prompts = [PROMPT, "A dog"]
    reply = await client.completions.create(model="scripted", prompt=prompts, max_tokens=4,
                                            extra_body={"prompt_logprobs": 2})
    assert [c.index for c in reply.choices] == [0, 1]
    alternatives = [served.tokenizer.encode(alt, add_special_tokens=False)[0] for alt in ALTERNATIVES]
    for choice, prompt in zip(reply.choices, prompts):
        assert choice.text == REPLY  # prompt_logprobs alone echoes nothing
        prompt_ids = served.tokenizer.encode(prompt)
        shown = choice.model_extra["prompt_logprobs"]
        assert len(shown) == len(prompt_ids) and shown[0] is None
        for position, (token, entry) in enumerate(zip(prompt_ids[1:], shown[1:]), 1):
            assert entry[str(token)] == {"logprob": -0.5 - position / 100, "rank": 3, "decoded_token": served.token_text(token)}
            for rank, alternative in enumerate(alternatives, 1):
                assert entry[str(alternative)]["rank"] == rank
            assert len(entry) == 3


async def test_a_streamed_echo_opens_with_the_prompt_and_matches_the_whole_reply(serve):
    state, client = await serve()
    whole = await client.completions.create(model="scripted", prompt=PROMPT, echo=True, logprobs=1, max_tokens=16,
                                            extra_body={"prompt_logprobs": 0})
    stream = await client.completions.create(model="scripted", prompt=PROMPT, echo=True, logprobs=1, max_tokens=16,
                                             stream=True, extra_body={"prompt_logprobs": 0})
    chunks = [chunk async for chunk in stream]
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and len(first.text) > len(PROMPT)  # the prompt, then the first token's text
    prompt_ids = state.fleet.primary.tokenizer.encode(PROMPT)
    assert first.logprobs.token_logprobs[0] is None and len(first.logprobs.tokens) > len(prompt_ids)
    assert first.model_extra["prompt_logprobs"] == whole.choices[0].model_extra["prompt_logprobs"]
    assert all("prompt_logprobs" not in c.choices[0].model_extra for c in chunks[1:])
    streamed = {key: [v for c in chunks for v in getattr(c.choices[0].logprobs, key)]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed == {key: getattr(whole.choices[0].logprobs, key) for key in streamed}
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text == PROMPT + REPLY


async def test_a_streamed_max_tokens_0_sends_the_prompt_then_length(serve):
    _, client = await serve()
    stream = await client.completions.create(model="scripted", prompt=PROMPT, echo=True, max_tokens=0, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == PROMPT and "".join(texts) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0


async def test_chat_shows_the_rendered_prompts_logprobs_at_the_top_and_on_a_streams_first_chunk(serve):
    state, client = await serve()
    reply = await client.chat.completions.create(model="scripted", messages=MESSAGES, extra_body={"prompt_logprobs": 1})
    shown = reply.model_extra["prompt_logprobs"]
    prompt_ids = state.fleet.primary.tokenizer.encode_chat(MESSAGES)
    assert len(shown) == reply.usage.prompt_tokens == len(prompt_ids) and shown[0] is None
    assert all(str(token) in entry and len(entry) == 2 for token, entry in zip(prompt_ids[1:], shown[1:]))
    stream = await client.chat.completions.create(model="scripted", messages=MESSAGES, stream=True,
                                                  extra_body={"prompt_logprobs": 1})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["prompt_logprobs"] == shown
    assert all("prompt_logprobs" not in c.model_extra for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content


REFUSED = [
    ("completions", {"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs", f"[0, {MAX_LOGPROBS}]"),
    ("completions", {"prompt_logprobs": -1}, "prompt_logprobs", f"[0, {MAX_LOGPROBS}]"),
    ("completions", {"prompt_logprobs": True}, "prompt_logprobs", "integer"),
    ("chat", {"prompt_logprobs": 2.5}, "prompt_logprobs", "integer"),
    ("chat", {"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs", f"[0, {MAX_LOGPROBS}]"),
    ("completions", {"echo": "yes"}, "echo", "boolean"),
    ("completions", {"max_tokens": 0}, "max_tokens", "echo"),
    ("completions", {"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens", "max_tokens is 0"),
    ("chat", {"echo": True}, "echo", "/v1/completions"),
]


@pytest.mark.parametrize(("route", "fields", "param", "says"), REFUSED, ids=[f"{r[0]}-{r[2]}-{r[1][r[2]]}" for r in REFUSED])
async def test_a_bad_value_is_refused_naming_its_field_and_limit(serve, route, fields, param, says):
    state, client = await serve()
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "chat":
            await client.chat.completions.create(model="scripted", messages=MESSAGES, extra_body=fields)
        else:
            await client.completions.create(model="scripted", prompt=PROMPT, extra_body=fields)
    assert refused.value.status_code == 400 and refused.value.param == param
    assert says in refused.value.message
    assert state.engine.num_requests == 0


async def test_with_the_output_check_on_no_prompt_alternative_is_shown(serve):
    state, client = await serve(safety={"check_output": True})
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="scripted", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1})
    assert refused.value.param == "prompt_logprobs" and "output check" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="scripted", messages=MESSAGES, extra_body={"prompt_logprobs": 1})
    assert refused.value.param == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="scripted", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    assert refused.value.param == "logprobs" and "output check" in refused.value.message
    assert state.engine.num_requests == 0
    # The prompt's own tokens, which the input check read, may be shown.
    reply = await client.completions.create(model="scripted", prompt=PROMPT, echo=True, logprobs=0, max_tokens=0,
                                            extra_body={"prompt_logprobs": 0})
    assert reply.choices[0].text == PROMPT and reply.choices[0].logprobs.top_logprobs[1] == {}
    assert len(reply.choices[0].model_extra["prompt_logprobs"][1]) == 1
    reply = await client.chat.completions.create(model="scripted", messages=MESSAGES, extra_body={"prompt_logprobs": 0})
    assert reply.model_extra["prompt_logprobs"][0] is None
