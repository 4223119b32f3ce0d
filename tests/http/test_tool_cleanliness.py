"""Tool calls are clean, as a client receives them (whole and streamed, through a server whose model
writes scripted text, in each family's format): a reply cut by max_tokens shows no call markup in its
content and returns no half call, a reply holds no two identical calls, and `parallel_tool_calls:
false` gives at most one call. What the grammars allow is test_tool_parsers.py's; here the model
writes what a grammar would not stop (a repeat) or what max_tokens cuts."""

from __future__ import annotations

import json

import openai
import pytest
from aiohttp.test_utils import TestServer

from chatd.config_loader import build_config
from chatd.engine import FinishReason
from chatd.http.app import create_app
from tests.factories import ScriptedChatEngine, ScriptedReply, close_server_state, make_server_state
from tests.http.test_tool_calling import TOOLS

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = {"city": "Paris", "unit": "celsius"}
OSLO = {"city": "Oslo", "unit": "celsius"}
UTC = {"zone": "UTC"}


def written(family: str, calls: list[tuple[str, dict]]) -> str:
    """Calls as each family's model writes them."""
    if family == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if family == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


class EndingReply(ScriptedReply):
    """A scripted reply whose last output ends as its engine's `finish_reason` says."""

    async def __aiter__(self):
        async for out in super().__aiter__():
            if out.finished:
                out.outputs[0].finish_reason = self.engine.finish_reason
            yield out


class EndingEngine(ScriptedChatEngine):
    """ScriptedChatEngine whose replies end with `finish_reason` (LENGTH: max_tokens cut them)."""

    def __init__(self) -> None:
        super().__init__(pause=0.0)
        self.finish_reason = FinishReason.STOP

    def generate(self, prompt, params, placement=None, cache=None) -> EndingReply:
        reply = super().generate(prompt, params, placement, cache)
        return EndingReply(self, reply.request_id, reply.prompt, reply.text, reply.params)


@pytest.fixture
async def serve(tmp_path):
    """serve(family) -> (engine, client): a server reading calls in that family's format."""
    opened = []

    async def serve(family: str):
        root = tmp_path / f"server{len(opened)}"
        root.mkdir()
        state = await make_server_state(EndingEngine(), root, build_config({"model": {"tool_parser": family}}))
        server = TestServer(create_app(state), host="127.0.0.1")
        await server.start_server()
        client = openai.AsyncOpenAI(base_url=f"{server.make_url('')}/v1", api_key="unused", max_retries=0)
        opened.append((state, server, client))
        return state.engine, client

    yield serve
    for state, server, client in opened:
        await client.close()
        await server.close()
        await close_server_state(state)


async def reply(client, stream: bool, **options) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) as the client receives them, whole or assembled
    from a stream (each call named once, its arguments joined)."""
    kwargs = dict(model="scripted", messages=ASK, tools=TOOLS, max_tokens=50, **options)
    if not stream:
        choice = (await client.chat.completions.create(**kwargs)).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.id:
                    assert delta.index not in calls, "a call is named once"
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


# (family, what the model wrote when max_tokens cut it, the content the client gets, its calls)
CUT = {
    "hermes marker's start": ("hermes", "Let me check. <tool", "Let me check.", []),
    "hermes marker's start alone": ("hermes", "<", "", []),
    "hermes half a head": ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "argu', "Let me check.", []),
    "hermes half a close": ("hermes", written("hermes", [("get_weather", PARIS)])[:-2], None, [("get_weather", PARIS)]),
    "hermes second call's head": ("hermes", written("hermes", [("get_weather", PARIS)]) + '\n<tool_call>\n{"name": "get_ti',
                                  None, [("get_weather", PARIS)]),
    "llama3 half a head": ("llama3_json", '{"name": "get_weather", "param', "", []),
    "llama3 python tag's start": ("llama3_json", "Checking. <|python", "Checking.", []),
    "llama3 second call's head": ("llama3_json", written("llama3_json", [("get_weather", PARIS)]) + '; {"name": "get_ti',
                                  None, [("get_weather", PARIS)]),
    "mistral marker's start": ("mistral", "Sure. [TOOL_CA", "Sure.", []),
    "mistral second call's head": ("mistral", written("mistral", [("get_weather", PARIS), ("get_time", UTC)])[:-30],
                                   None, [("get_weather", PARIS)]),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("cut_by", [FinishReason.LENGTH, FinishReason.CONTENT_FILTER], ids=["max_tokens", "output check"])
@pytest.mark.parametrize("case", CUT)
async def test_a_reply_cut_short_shows_no_call_markup(serve, case, cut_by, stream):
    family, text, content, calls = CUT[case]
    engine, client = await serve(family)
    engine.replies.append(text)
    engine.finish_reason = cut_by
    got_content, got_calls, finish = await reply(client, stream)
    assert finish == cut_by.value
    assert got_content == ((content or "") if stream else content)  # a stream's content is its deltas joined
    assert [(name, json.loads(arguments)) for name, arguments in got_calls] == calls


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
async def test_a_call_cut_in_its_arguments_is_no_call_and_no_content(serve, family):
    """A cut call whose arguments had begun: the whole reply leaves it out. A stream had sent its name
    and arguments so far (as on OpenAI: nothing sent is taken back), and finish_reason length says so."""
    engine, client = await serve(family)
    text = written(family, [("get_weather", PARIS), ("get_time", UTC)])
    engine.replies += [text[:text.rindex("UTC") + 1]] * 2
    engine.finish_reason = FinishReason.LENGTH
    whole = ("get_weather", json.dumps(PARIS))
    assert await reply(client, stream=False) == (None, [whole], "length")
    assert await reply(client, stream=True) == ("", [whole, ("get_time", '{"zone": "U')], "length")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
async def test_a_reply_that_repeats_a_call_gives_it_once(serve, family, stream):
    engine, client = await serve(family)
    engine.replies.append(written(family, [("get_weather", PARIS), ("get_weather", PARIS), ("get_weather", OSLO),
                                           ("get_time", UTC), ("get_weather", OSLO), ("get_time", UTC)]))
    content, calls, finish = await reply(client, stream, tool_choice="required")
    assert finish == "tool_calls" and not content
    assert calls == [("get_weather", json.dumps(PARIS)), ("get_weather", json.dumps(OSLO)), ("get_time", json.dumps(UTC))]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["auto", "required", "named"])
async def test_one_call_when_parallel_calls_are_off_or_a_function_is_named(serve, family, stream, choice):
    engine, client = await serve(family)
    engine.replies.append(written(family, [("get_weather", PARIS), ("get_weather", OSLO), ("get_weather", PARIS)]))
    parallel = {} if isinstance(choice, dict) else {"parallel_tool_calls": False}
    content, calls, finish = await reply(client, stream, tool_choice=choice, **parallel)
    assert finish == "tool_calls" and not content
    assert calls == [("get_weather", json.dumps(PARIS))]
