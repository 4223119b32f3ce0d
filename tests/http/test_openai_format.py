"""OpenAI's chunk shapes (http/openai/openai_format.py): a stream's text deltas built from prepared parts
are the very bytes the dicts give, for chat and text completions, any choice and any text; other
deltas (a finish, logprobs, several choices, a tool parser's) go the dicts' way."""

from __future__ import annotations

import orjson
import pytest

from chatd.engine import CompletionOutput, FinishReason, RequestOutput
from chatd.http.openai.openai_format import ChunkFormat
from chatd.http.tools.tool_calls import PARSERS
from tests.factories import ScriptedChatEngine, close_server_state, make_server_state

TEXTS = ["Hello", " world", "\"quoted\" \\ back\\slash", "tab\tnew\nline", "é ü 中文 🙂", "\x00\x1f", "</script>"]


@pytest.fixture
async def state(tmp_path):
    state = await make_server_state(ScriptedChatEngine(pause=0.0), tmp_path)
    yield state
    await close_server_state(state)


def delta(*choices: CompletionOutput) -> RequestOutput:
    return RequestOutput("r1", [1, 2, 3], list(choices))


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "text"])
@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no-usage"])
async def test_a_text_delta_from_prepared_parts_is_the_dicts_bytes(state, chat, usage):
    extra = {"service_tier": "default"} if chat else None
    chunks = ChunkFormat(state.model_name, state.fleet.primary.token_text, "chatcmpl-abc", 1_700_000_000, chat, usage, extra)
    for index in (0, 3):
        for text in TEXTS:
            out = delta(CompletionOutput(index, text=text, token_ids=[7]))
            assert chunks.delta_json(out) == orjson.dumps(chunks.delta_chunk(out)), (index, text)


async def test_other_deltas_are_built_from_dicts(state):
    chunks = ChunkFormat(state.model_name, state.fleet.primary.token_text, "chatcmpl-abc", 1, True, True)
    others = [
        delta(CompletionOutput(0, text="end", token_ids=[7], finish_reason=FinishReason.STOP)),
        delta(CompletionOutput(0, text="a", token_ids=[7]), CompletionOutput(1, text="b", token_ids=[8])),
        delta(CompletionOutput(0, text="", token_ids=[7])),  # half a character: nothing to send
    ]
    for out in others:
        chunk = chunks.delta_chunk(out)
        assert chunks.delta_json(out) == (None if chunk is None else orjson.dumps(chunk))
    assert b'"finish_reason":"stop"' in chunks.delta_json(others[0])
    parsed = ChunkFormat(state.model_name, state.fleet.primary.token_text, "chatcmpl-abc", 1, True, False, tool_parser=PARSERS["hermes"])
    held = delta(CompletionOutput(0, text="<tool_call>", token_ids=[7]))  # a call may be starting: held back
    assert parsed.delta_json(held) is None
