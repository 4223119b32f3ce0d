"""Function tools on the Responses API, through the official SDK (whole, and its stream helper) and
LangChain against a real `chatd serve`: calls come back as `function_call` output items (streamed
with OpenAI's event types), a `function_call_output` continues the response by
`previous_response_id` or `conversation` and is kept as an item, and two tenants never reach each
other's calls.

The demo model's template takes no tools (chatd describes them in its system message); `required`
and a named function make its random weights call, and the grammar keeps each call's arguments
valid against the tool's schema.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest

from tests.http.serving import tenants_server
from tests.http.test_tool_calling import real_model  # noqa: F401 (the default model's server, a fixture)

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
                          "required": ["city"], "additionalProperties": False}}
CLOCK = {"type": "function", "name": "get_time", "description": "The time now in a time zone",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
                        "required": ["zone"], "additionalProperties": False}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["name"]: tool["parameters"] for tool in TOOLS}
ASK = "What is the weather in Paris?"
# One call per reply: a random model ends a list of parallel calls only when it picks EOS.
ONE_CALL = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """chatd serve (demo model, auth on, keys for alice and bob); finished streams rebuilt from their rows."""
    with tenants_server(tmp_path_factory.mktemp("responses_tools"),
                        "[conversations]\nstream_replay_seconds = 0\n") as server:
        yield server


def client(server, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=server["keys"][who], max_retries=0)


def create(server, who: str = "alice", **fields):
    fields = {"model": "demo", "max_output_tokens": 120, "temperature": 0, **fields}
    return client(server, who).responses.create(**fields)


def calls_of(response) -> list:
    """The response's function_call items, each checked: an offered name, arguments valid for its schema."""
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert call.call_id and call.id and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def shapes(items) -> list[dict]:
    """Output items as sent (the stream helper's parsed copies add `parsed_arguments`)."""
    return [{k: v for k, v in item.to_dict().items() if k != "parsed_arguments"} for item in items]


def test_a_required_call_is_a_function_call_item_and_its_output_continues_the_response(server):
    first = create(server, input=ASK, **ONE_CALL)
    [call] = calls_of(first)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    assert [t.name for t in first.tools] == ["get_weather", "get_time"] and first.tool_choice == "required"
    assert first.parallel_tool_calls is False
    again = client(server).responses.retrieve(first.id)
    assert again.output == first.output

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": "18 C"}'}
    second = create(server, input=[result], previous_response_id=first.id, tools=TOOLS, max_output_tokens=8,
                    extra_body={"ignore_eos": True})
    assert second.status == "incomplete" and second.output[0].type == "message"  # cut at 8 tokens, as asked
    # The chain's history renders to the same tokens as last time, up to the call: the cache serves them.
    assert second.usage.input_tokens_details.cached_tokens >= 16
    [given] = client(server).responses.input_items.list(second.id).data
    assert (given.type, given.call_id, given.output) == ("function_call_output", call.call_id, result["output"])


def test_a_named_function_gets_exactly_that_call(server):
    response = create(server, input=ASK, tools=TOOLS, tool_choice={"type": "function", "name": "get_time"})
    [call] = calls_of(response)
    assert call.name == "get_time" and response.tool_choice.name == "get_time"


def test_the_stream_helper_reads_the_call_as_it_streams(server):
    with client(server).responses.stream(model="demo", input=ASK, max_output_tokens=120, temperature=0,
                                         **ONE_CALL) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [call] = calls_of(final)
    assert deltas and "".join(deltas) == call.arguments
    assert events[2].item.id == call.id and events[2].item.name == call.name
    assert shapes(client(server).responses.retrieve(final.id).output) == shapes(final.output)

    # Its events left memory at once (stream_replay_seconds = 0): rebuilt from the rows, the same items.
    replay = list(client(server).responses.retrieve(final.id, stream=True))
    assert [e.type for e in replay] == [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and kinds[i - 1] == k)]
    assert shapes(replay[-1].response.output) == shapes(final.output)


def test_a_call_cut_by_max_output_tokens_is_not_kept(server):
    # Its argument cannot close within the budget: the reply is cut in the middle of the call.
    note = {"type": "function", "name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 200}}, "required": ["text"]}}
    fields = dict(input=ASK, tools=[note], tool_choice={"type": "function", "name": "note"}, max_output_tokens=40)
    whole = create(server, **fields)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"] and whole.output[0].content[0].text == ""
    with client(server).responses.stream(model="demo", temperature=0, **fields) as stream:
        events = list(stream)
    # The call had begun streaming: it is closed as incomplete, and the response holds no call.
    [begun] = [e.item for e in events if e.type == "response.output_item.done"]
    assert (begun.type, begun.status) == ("function_call", "incomplete")
    assert events[-1].type == "response.incomplete"
    assert [item.type for item in events[-1].response.output] == ["message"]


def test_without_store_a_client_sends_the_call_back_itself(server):
    first = create(server, input=ASK, store=False, **ONE_CALL)
    [call] = calls_of(first)
    history = [{"role": "user", "content": ASK},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
    second = create(server, input=history, store=False, tools=TOOLS, max_output_tokens=8)
    assert second.output[0].type == "message"


def test_in_a_conversation_calls_and_outputs_are_items(server):
    sdk = client(server)
    conversation = sdk.conversations.create()
    first = create(server, input=ASK, conversation=conversation.id, **ONE_CALL)
    [call] = calls_of(first)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    second = create(server, input=[result], conversation=conversation.id, tools=TOOLS, max_output_tokens=8)
    items = sdk.conversations.items.list(conversation.id, order="asc").data
    assert [item.type for item in items] == ["message", "function_call", "function_call_output", "message"]
    assert items[1].id == call.id and items[2].call_id == call.call_id and items[3].id == second.output[0].id
    assert sdk.conversations.items.retrieve(call.id, conversation_id=conversation.id).arguments == call.arguments

    # Items added by hand: a call and its output, as a client that ran a tool on its own keeps them.
    added = sdk.conversations.items.create(conversation.id, items=[
        {"type": "function_call", "call_id": "call_by_hand", "name": "get_time", "arguments": '{"zone": "UTC"}'},
        {"type": "function_call_output", "call_id": "call_by_hand", "output": "12:00"}]).data
    assert [(a.type, a.call_id) for a in added] == [("function_call", "call_by_hand"),
                                                   ("function_call_output", "call_by_hand")]
    third = create(server, input="And now?", conversation=conversation.id, max_output_tokens=4)
    assert third.status in ("completed", "incomplete")


def test_two_tenants_never_reach_each_others_calls(server):
    first = create(server, input=ASK, **ONE_CALL)
    [call] = calls_of(first)
    conversation = client(server).conversations.create()
    in_conversation = create(server, input=ASK, conversation=conversation.id, **ONE_CALL)
    bob = client(server, "bob")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model="demo", input=[result], previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError) as error:  # alice's call id means nothing in bob's requests
        bob.responses.create(model="demo", input=[result])
    assert error.value.param == "input[0].call_id"
    with pytest.raises(openai.NotFoundError):
        bob.responses.input_items.list(first.id)
    with pytest.raises(openai.NotFoundError):
        bob.conversations.items.retrieve(calls_of(in_conversation)[0].id, conversation_id=conversation.id)
    with pytest.raises(openai.NotFoundError):
        bob.conversations.items.list(conversation.id)


def test_bad_tools_are_refused_by_their_responses_field(server):
    cases = [
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
        ({"tools": [{**WEATHER, "parameters": "an object"}]}, "tools[0].parameters"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 100 + "]" * 100}]},
         "input[0].arguments"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as error:
            create(server, **{"input": ASK, **fields})
        assert error.value.param == param, (fields, error.value.body)


@pytest.mark.slow  # LangChain is installed for the slow tests only (the `slow` extra)
def test_langchain_binds_tools_on_the_responses_api_and_gets_the_round_trip(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage  # langchain-openai's own dependency

    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather now in a city."""
        return "18 C"

    chat = langchain_openai.ChatOpenAI(model="demo", base_url=f"{server['url']}/v1", api_key=server["keys"]["alice"],
                                       use_responses_api=True, temperature=0, max_tokens=120, max_retries=0)
    bound = chat.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    asked = HumanMessage(ASK)
    reply = bound.invoke([asked])
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo", "Lima")
    answer = chat.bind(max_tokens=8).invoke([asked, reply, ToolMessage("18 C", tool_call_id=call["id"])])
    assert answer.content and not answer.tool_calls


@pytest.mark.slow
def test_the_real_default_model_round_trips_a_call_with_the_sdk_its_stream_and_langchain(real_model):
    """SmolLM2-135M-Instruct (its template takes no tools: they are described to it), under required."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    sdk = openai.OpenAI(base_url=f"{real_model}/v1", api_key="unused", max_retries=0)
    model = sdk.models.list().data[0].id
    first = sdk.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=60, **ONE_CALL)
    [call] = calls_of(first)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 18, "sky": "sunny"}'}
    answer = sdk.responses.create(model=model, input=[result], previous_response_id=first.id, tools=TOOLS,
                                  temperature=0, max_output_tokens=40)
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.usage.input_tokens_details.cached_tokens > 0

    with sdk.responses.stream(model=model, input=ASK, temperature=0, max_output_tokens=60, **ONE_CALL) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    [streamed] = calls_of(final)
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)  # greedy: the same call

    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather now in a city."""
        return "18 C"

    chat = langchain_openai.ChatOpenAI(model=model, base_url=f"{real_model}/v1", api_key="unused",
                                       use_responses_api=True, temperature=0, max_tokens=60, max_retries=0)
    asked = HumanMessage(ASK)
    reply = chat.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke([asked])
    [made] = reply.tool_calls
    assert made["name"] == "get_weather" and made["args"]["city"] in ("Paris", "Oslo", "Lima")
    final_answer = chat.bind(max_tokens=40).invoke([asked, reply, ToolMessage("18 C", tool_call_id=made["id"])])
    assert final_answer.content and not final_answer.tool_calls
