"""LangChain's OpenAI classes against a real `chatd serve` on the demo model: `OpenAI` (legacy
completions, which always sends a list of prompts) and `ChatOpenAI`, whole, streamed and batched.

Nothing here reaches the internet: langchain-openai asks tiktoken for an encoding only to count
tokens itself (`get_num_tokens`, or `max_tokens=-1`), which these calls never do.
"""

from __future__ import annotations

import pytest

from chatd.engine.models.demo import build_demo_model
from tests.http.serving import start_server, stop_server

# Slow: LangChain is installed for the slow tests only (the `slow` extra); chatd's OpenAI shapes are
# the SDK tests' in the fast suite.
pytestmark = pytest.mark.slow

langchain_openai = pytest.importorskip("langchain_openai")

SETTINGS = dict(model="demo", api_key="unused", max_tokens=8, temperature=0, max_retries=0)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("langchain")
    proc, url, _ = start_server(root, build_demo_model(root / "demo"), "[cache]\nnum_blocks = 1024\n")
    yield f"{url}/v1"
    stop_server(proc)


def test_openai_llm_invokes_streams_and_batches(base_url):
    llm = langchain_openai.OpenAI(base_url=base_url, **SETTINGS)
    text = llm.invoke("The cache holds")
    assert isinstance(text, str) and text
    assert "".join(llm.stream("The cache holds")) == text  # greedy: the same words, in pieces
    prompts = ["The cache holds", "A block of keys", "Paged attention is"]
    assert llm.batch(prompts) == [llm.invoke(p) for p in prompts]
    result = llm.generate(prompts)  # one request with a list of three prompts
    assert [g[0].text for g in result.generations] == llm.batch(prompts)
    usage = result.llm_output["token_usage"]
    assert usage["completion_tokens"] <= 3 * 8 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_openai_invokes_and_streams_with_usage(base_url):
    chat = langchain_openai.ChatOpenAI(base_url=base_url, stream_usage=True, **SETTINGS)
    messages = [("system", "You are terse."), ("user", "Tell me about paged attention.")]
    reply = chat.invoke(messages)
    assert reply.content and reply.usage_metadata["output_tokens"] <= 8
    assert reply.usage_metadata["total_tokens"] == reply.usage_metadata["input_tokens"] + reply.usage_metadata["output_tokens"]
    chunks = list(chat.stream(messages))
    assert "".join(chunk.content for chunk in chunks) == reply.content
    streamed = sum(chunks[1:], chunks[0]).usage_metadata
    counts = ("input_tokens", "output_tokens", "total_tokens")
    assert [streamed[k] for k in counts] == [reply.usage_metadata[k] for k in counts]
    assert streamed["input_token_details"]["cache_read"] > 0  # the same prompt again: its blocks were cached


def test_chat_openai_through_the_responses_api(base_url):
    """`use_responses_api=True` sends the chat as Responses input items; the reply and its stream agree."""
    chat = langchain_openai.ChatOpenAI(base_url=base_url, use_responses_api=True, **SETTINGS)
    messages = [("system", "You are terse."), ("user", "Tell me about the prefix cache.")]
    reply = chat.invoke(messages)
    assert reply.text and reply.usage_metadata["output_tokens"] <= 8
    assert reply.response_metadata["id"].startswith("resp_")
    chunks = list(chat.stream(messages))
    assert "".join(chunk.text for chunk in chunks) == reply.text
    assert sum(chunks[1:], chunks[0]).usage_metadata["input_token_details"]["cache_read"] > 0


def test_with_structured_output_gives_a_validated_model(base_url):
    """`with_structured_output(PydanticModel)` (OpenAI's json_schema response format): the random
    demo model's reply is still a valid instance, because the server enforces the schema."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        answer: Literal["yes", "no", "unsure"]
        confidence: int = Field(ge=0, le=100)

    chat = langchain_openai.ChatOpenAI(base_url=base_url, **{**SETTINGS, "max_tokens": 60})
    for method in ("json_schema", "function_calling"):  # a schema, or a forced tool call
        verdict = chat.with_structured_output(Verdict, method=method).invoke("Is a KV block 16 tokens?")
        assert isinstance(verdict, Verdict)


def test_bind_tools_gives_tool_calls_and_takes_their_results(base_url):
    """`bind_tools` with a forced choice: the AIMessage carries a parsed call; its result goes back
    as a ToolMessage and the chat goes on. (Bounded arguments: a random model writes digits until cut.)"""
    from langchain_core.messages import HumanMessage, ToolMessage
    from pydantic import BaseModel, Field

    class Multiply(BaseModel):
        """Multiply two integers."""

        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    chat = langchain_openai.ChatOpenAI(base_url=base_url, **{**SETTINGS, "max_tokens": 60})
    bound = chat.bind_tools([Multiply], tool_choice="Multiply")
    question = HumanMessage("What is 6 times 7?")
    reply = bound.invoke([question])
    [call] = reply.tool_calls
    assert call["name"] == "Multiply"
    args = Multiply.model_validate(call["args"])
    result = ToolMessage(str(args.a * args.b), tool_call_id=call["id"])
    answer = chat.bind_tools([Multiply]).invoke([question, reply, result])
    assert answer.content or answer.tool_calls
