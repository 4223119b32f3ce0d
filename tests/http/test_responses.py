"""OpenAI's Responses API through a real `chatd serve` (auth on, two tenants) and the official
openai SDK: whole and streamed responses, a stored response's routes, chains by
previous_response_id and by conversation= that the prefix cache serves, store=false, bad input
that writes nothing, and tenants that cannot reach each other's responses."""

from __future__ import annotations

import random
import re
import sqlite3
import time
import uuid
from array import array

import httpx
import openai
import pytest

from chatd.engine import Tokenizer
from chatd.engine.llm import LLM
from chatd.engine.params import SamplingParams
from tests.http.serving import tenants_server

BLOCK = 16  # KV block size (the default)
MAX_MODEL_LEN = 512
HEARTBEAT = 0.005  # seconds: a stream idle this long gets a keep-alive, so every stream here carries some
EVENTS_BEFORE_TEXT = ["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"]
EVENTS_AFTER_TEXT = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """chatd serve with auth on, a 512-token window, finished streams rebuilt from their rows, and keys
    for alice and bob."""
    with tenants_server(tmp_path_factory.mktemp("responses"),
                        f"[model]\nmax_model_len = {MAX_MODEL_LEN}\n[server]\nheartbeat_seconds = {HEARTBEAT}\n"
                        "[conversations]\nstream_replay_seconds = 0\n") as server:  # events leave memory at once
        yield server


@pytest.fixture(scope="module")
def tokenizer(server) -> Tokenizer:
    return Tokenizer.from_pretrained(server["model_dir"])


def client(server, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=server["keys"][who], max_retries=0)


def create(server, who: str = "alice", **fields):
    """A greedy response of 8 tokens unless told otherwise; ignore_eos so a reply is never empty."""
    fields = {"model": "demo", "max_output_tokens": 8, "temperature": 0, **fields}
    extra = fields.pop("extra_body", {})
    return client(server, who).responses.create(**fields, extra_body={"ignore_eos": True, **extra})


# Seeded: the texts, and so the demo model's random replies to them, are the same every run. (With
# uuid4 the chained-response test's count of replies that go back as ids varied run to run, and
# came out under its bound about one run in twenty.)
_SALTS = random.Random(19)


def unique(text: str) -> str:
    """Text no earlier test sent, so nothing of it is in the prefix cache."""
    return f"{_SALTS.getrandbits(32):08x} {text}"


def count_rows(server) -> tuple[int, int]:
    with sqlite3.connect(server["db"]) as conn:
        return tuple(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] for table in ("responses", "messages"))


def usage_requests(server, who: str = "alice") -> int:
    r = httpx.get(f"{server['url']}/v1/usage", headers={"Authorization": f"Bearer {server['keys'][who]}"})
    assert r.status_code == 200, r.text
    return r.json()["requests"]


def as_item(role: str, text: str) -> dict:
    return {"role": role, "content": text}


# -- one response ---------------------------------------------------------------------------------


def test_a_whole_response(server, tokenizer):
    text = unique("What is a KV block?")
    r = create(server, input=text)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "demo"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.store is True and r.previous_response_id is None and r.instructions is None
    assert r.usage.input_tokens == len(tokenizer.encode_chat([as_item("user", text)]))
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.status in ("completed", "incomplete")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == [] and part.text == r.output_text != ""
    # The same prompt again is served from the prefix cache, in whole blocks.
    again = create(server, input=text)
    assert again.usage.input_tokens_details.cached_tokens == (r.usage.input_tokens - 1) // BLOCK * BLOCK
    assert again.output_text == r.output_text  # greedy


def test_instructions_are_the_system_message_of_one_response_only(server, tokenizer):
    question = unique("Name one scheduler.")
    first = create(server, input=question, instructions="Answer tersely.")
    assert first.instructions == "Answer tersely."
    assert first.usage.input_tokens == len(tokenizer.encode_chat(
        [as_item("system", "Answer tersely."), as_item("user", question)]))
    follow_up = create(server, input="And another?", previous_response_id=first.id)
    assert follow_up.instructions is None and follow_up.previous_response_id == first.id
    assert follow_up.usage.input_tokens == len(tokenizer.encode_chat(
        [as_item("user", question), as_item("assistant", first.output_text), as_item("user", "And another?")],
        reply_ids={1: output_ids(server, first.id)}))


def output_ids(server, response_id: str) -> list[int] | None:
    """The token ids the store kept for a response's output message."""
    with sqlite3.connect(server["db"]) as conn:
        [(blob,)] = conn.execute("SELECT m.token_ids FROM messages m JOIN responses r ON m.id = r.output_message_id "
                                 "WHERE r.id = ?", (response_id,)).fetchall()
    return None if blob is None else list(array("i", blob))


def test_a_chained_response_finds_the_whole_previous_prompt_and_output_in_the_cache(server, tokenizer):
    """previous_response_id puts the earlier output back as the ids the model generated, so every
    full block of the earlier prompt and output (less its last, unfed token) is a cache hit."""
    checked = 0
    # About half of the demo model's random replies spell a special token and go back as their
    # text: try until two have gone back as ids (20 tries: a chance in 50,000 of too few).
    for attempt in range(20):
        first = create(server, input=unique("Describe a paged KV cache."))
        ids = output_ids(server, first.id)
        assert ids is not None and len(ids) == first.usage.output_tokens == 8
        if tokenizer.decode(ids, skip_special_tokens=False).strip() != first.output_text.strip():
            continue  # a random reply that spells a special token goes back as its text
        follow_up = create(server, input="Go on.", previous_response_id=first.id)
        checked += 1
        computed = first.usage.input_tokens + first.usage.output_tokens - 1
        assert follow_up.usage.input_tokens_details.cached_tokens == computed // BLOCK * BLOCK
        if checked == 2:
            break
    assert checked == 2


def test_a_chain_names_its_first_response_as_the_routing_key_and_top_k_minus_one_is_off(server):
    """X-Chatd-Routing-Key is what a gateway hashes on: the same for every response of a chain.
    top_k = -1 (off in vLLM and SGLang; the SGLang Model Gateway sends it) is accepted as off."""
    def routed(**fields):
        raw = client(server).responses.with_raw_response.create(
            model="demo", max_output_tokens=4, temperature=0, **fields, extra_body={"ignore_eos": True, "top_k": -1})
        return raw.parse(), raw.headers["X-Chatd-Routing-Key"]

    first, key = routed(input=unique("Start a chain."))
    second, second_key = routed(input="Go on.", previous_response_id=first.id)
    _, third_key = routed(input="And on.", previous_response_id=second.id)
    assert key == second_key == third_key == first.id


def test_a_retried_response_with_its_idempotency_key_is_the_same_response(server):
    """The SDK's retry with the same Idempotency-Key gets the response it lost, not a second one;
    a store=false response keeps nothing to give back, so its key is not held."""
    def keyed(key, **fields):
        raw = client(server).responses.with_raw_response.create(
            model="demo", input="Say it once.", max_output_tokens=4, temperature=0, **fields,
            extra_headers={"Idempotency-Key": key}, extra_body={"ignore_eos": True})
        return raw.parse(), raw.headers

    key = f"resp-{uuid.uuid4().hex}"
    first, _ = keyed(key)
    again, headers = keyed(key)
    assert headers["Idempotent-Replayed"] == "true"
    assert (again.id, again.output_text, again.usage) == (first.id, first.output_text, first.usage)
    unstored_key = f"unstored-{uuid.uuid4().hex}"
    assert keyed(unstored_key, store=False)[0].id != keyed(unstored_key, store=False)[0].id


def test_a_keyed_response_refused_before_it_starts_leaves_its_key_free(server):
    """A keyed request that continues nothing the tenant has (an unknown response or conversation,
    another tenant's response) is a 404 each time it is retried, never a 409 that holds the key;
    the corrected body with the same key is then served."""
    bobs = create(server, "bob", input=unique("bob's own"))
    alice = client(server)

    def keyed(key, **fields):
        return alice.responses.create(model="demo", input="Continue.", max_output_tokens=4, temperature=0, **fields,
                                      extra_headers={"Idempotency-Key": key}, extra_body={"ignore_eos": True})

    for wrong in ({"previous_response_id": "resp_unknown"}, {"previous_response_id": bobs.id},
                  {"conversation": "conv_unknown"}):
        key = f"refused-{uuid.uuid4().hex}"
        for _ in range(2):
            with pytest.raises(openai.NotFoundError) as error:
                keyed(key, **wrong)
            assert error.value.param == next(iter(wrong))
        served = keyed(key)
        assert served.id.startswith("resp_") and served.output_text
        assert keyed(key).id == served.id  # and now the key holds that response


def test_input_as_a_list_of_items_with_an_earlier_output_passed_back(server, tokenizer):
    earlier = create(server, input=unique("Say something."))
    history = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "system", "content": "Use plain words."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "more."}]},
        *earlier.output,  # the SDK's own output item, ids, statuses and annotations as they came
        {"role": "user", "content": "Thanks."},
    ]
    r = create(server, input=history)
    assert r.status == "incomplete"
    rendered = [as_item("system", "Be brief."), as_item("system", "Use plain words."), as_item("user", "Hi"),
                as_item("assistant", "Hello."), as_item("user", "Say more."), as_item("assistant", earlier.output_text),
                as_item("user", "Thanks.")]
    assert r.usage.input_tokens == len(tokenizer.encode_chat(rendered))
    items = client(server).responses.input_items.list(r.id, order="asc")
    assert [(i.role, i.content[0].type, i.content[0].text) for i in items.data] == [
        ("developer", "input_text", "Be brief."), ("system", "input_text", "Use plain words."),
        ("user", "input_text", "Hi"), ("assistant", "output_text", "Hello."), ("user", "input_text", "Say more."),
        ("assistant", "output_text", earlier.output_text), ("user", "input_text", "Thanks.")]


def test_a_streamed_response_and_its_replay(server):
    events = list(create(server, input=unique("Stream to me."), max_output_tokens=12, stream=True))
    types = [e.type for e in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas >= 1
    assert types == [*EVENTS_BEFORE_TEXT, *["response.output_text.delta"] * num_deltas, *EVENTS_AFTER_TEXT,
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.status == "incomplete" and final.usage.output_tokens == 12
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text == events[-3].part.text == events[-2].item.content[0].text
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {final.output[0].id}

    # The stream idled past HEARTBEAT between events: its keep-alives are lone comment lines (the SDK
    # would take a blank line after one, following an event with an `id:`, for an empty event).
    # 256 tokens: on a quick machine 64 demo steps once ran without a gap of HEARTBEAT between them.
    body = {"model": "demo", "input": unique("Once more."), "max_output_tokens": 256, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server['url']}/v1/responses", json=body,
                      headers={"Authorization": f"Bearer {server['keys']['alice']}"}) as r:
        raw = r.read()
    assert b": keep-alive\n" in raw and b": keep-alive\n\n" not in raw

    stored = client(server).responses.retrieve(final.id)
    assert stored.status == "incomplete" and stored.output_text == text and stored.usage == final.usage
    # Finished, its events have left memory (stream_replay_seconds = 0): a replay is rebuilt from the
    # saved text, in one delta. The opening events keep their numbers; past them nothing can resume.
    rebuilt = list(client(server).responses.retrieve(final.id, stream=True))
    assert [e.type for e in rebuilt] == [*EVENTS_BEFORE_TEXT, "response.output_text.delta", *EVENTS_AFTER_TEXT,
                                         "response.incomplete"]
    assert [e.sequence_number for e in rebuilt] == list(range(len(rebuilt))) and rebuilt[4].delta == text
    resumed = list(client(server).responses.retrieve(final.id, stream=True, starting_after=2))
    assert [(e.type, e.sequence_number) for e in resumed] == [(e.type, e.sequence_number) for e in rebuilt[3:]]
    for k in (len(EVENTS_BEFORE_TEXT), len(events) + 3):
        with pytest.raises(openai.BadRequestError) as error:
            list(client(server).responses.retrieve(final.id, stream=True, starting_after=k))
        assert error.value.param == "starting_after"


@pytest.mark.slow
def test_a_client_that_lost_its_stream_resumes_it_after_the_last_event_it_saw(server):
    stream = create(server, input=unique("Talk for a while."), max_output_tokens=460, stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 7:
            break
    stream.close()  # the response goes on without its client
    k = seen[-1].sequence_number
    rest = list(client(server).responses.retrieve(seen[0].response.id, stream=True, starting_after=k))
    assert [e.sequence_number for e in seen + rest] == list(range(len(seen) + len(rest)))
    types = [e.type for e in seen + rest]
    assert types == [*EVENTS_BEFORE_TEXT, *["response.output_text.delta"] * (len(types) - 8), *EVENTS_AFTER_TEXT,
                     "response.incomplete"]
    final = rest[-1].response
    assert final.usage.output_tokens == 460
    assert "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta") == final.output_text


def test_input_items_delete_and_cancel_of_a_stored_response(server):
    r = create(server, input=[as_item("system", "Be kind."), as_item("user", "one"), as_item("user", "two")])
    sdk = client(server)
    newest_first = sdk.responses.input_items.list(r.id)
    assert [i.content[0].text for i in newest_first.data] == ["two", "one", "Be kind."]
    page = sdk.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["Be kind.", "one"] and page.has_more
    rest = sdk.responses.input_items.list(r.id, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["two"] and not rest.has_more
    assert [i.content[0].text for i in sdk.responses.input_items.list(r.id, order="asc", limit=1)] == [
        "Be kind.", "one", "two"]  # the SDK pages through them all

    finished = sdk.responses.cancel(r.id)  # nothing to stop: the response as saved
    assert finished.status == r.status and finished.output_text == r.output_text

    sdk.responses.delete(r.id)
    for gone in (lambda: sdk.responses.retrieve(r.id), lambda: sdk.responses.input_items.list(r.id),
                 lambda: sdk.responses.delete(r.id), lambda: sdk.responses.cancel(r.id),
                 lambda: create(server, input="more", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            gone()


def test_cancelling_a_response_being_generated(server):
    sdk = client(server)
    stream = create(server, input=unique("Talk for a long time."), max_output_tokens=460, stream=True)
    types = []
    for event in stream:
        types.append(event.type)
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta":
            cancelled = sdk.responses.cancel(response_id)
            break
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 460
    rest = [e for e in stream]  # the stream still ends, with the text that was generated
    assert rest[-1].response.status == "cancelled" and rest[-1].response.output_text == cancelled.output_text
    assert sdk.responses.retrieve(response_id).output_text == cancelled.output_text


# -- chains and the prefix cache ------------------------------------------------------------------


@pytest.mark.slow
def test_six_turn_chains_compute_only_their_new_tokens(server, tokenizer):
    """Each turn of a previous_response_id chain and of a conversation= chain renders its history
    with every earlier output as the ids the model generated (an offline replay of each turn
    gives them), so its prefix-cache hit covers every whole block of the previous turn's prompt
    and generated tokens (less the last, sampled but never fed). An output whose ids spell a
    special token its text does not show goes back as its text, and its hit ends where that
    text's tokens part from the ids."""
    replay = LLM(server["model_dir"], device="cpu", num_blocks=128)
    conversation = client(server).conversations.create()
    spliced = 0
    for chain in ("previous_response_id", "conversation"):
        history, previous, previous_tokens, outputs = [], None, None, {}
        for turn in range(6):
            question = unique(f"Turn {turn}: tell me about block {turn} of the paged cache.")
            link = {"conversation": conversation.id} if chain == "conversation" else {
                "previous_response_id": previous.id if previous else None}
            r = create(server, input=question, max_output_tokens=16, **link)
            assert r.conversation.id == conversation.id if chain == "conversation" else r.conversation is None
            history.append(as_item("user", question))
            prompt = tokenizer.encode_chat(history, reply_ids=outputs)
            assert r.usage.input_tokens == len(prompt), (chain, turn)
            [generated] = replay.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            assert generated.outputs[0].text == r.output_text, (chain, turn)  # the replay is the server's reply
            cached = r.usage.input_tokens_details.cached_tokens
            if previous is not None:
                shared = common_prefix(prompt, previous_tokens)
                assert shared >= previous.usage.input_tokens  # the whole previous prompt, at least
                # (The previous turn's last token was sampled but never computed: it has no KV.)
                assert cached == min(shared, len(previous_tokens) - 1) // BLOCK * BLOCK, (chain, turn)
                computed = min(shared, len(previous_tokens) - 1)  # what the previous turn has KV for
                assert r.usage.input_tokens - cached < r.usage.input_tokens - computed + BLOCK
                if shared >= len(previous_tokens):
                    spliced += 1  # the previous output went back as its ids: all of it is cached
            previous_tokens = prompt + list(generated.outputs[0].token_ids)
            outputs[len(history)] = list(generated.outputs[0].token_ids)
            history.append(as_item("assistant", r.output_text))
            previous = r
        # A client that sends the history itself sends text: the server renders it as text.
        stateless = create(server, input=history[:-1], max_output_tokens=16)
        assert stateless.usage.input_tokens == len(tokenizer.encode_chat(history[:-1]))
    items = client(server).conversations.items.list(conversation.id, order="asc", limit=100)
    assert [(i.role, i.content[0].text) for i in items.data] == [(m["role"], m["content"]) for m in history]
    assert all(i.status == "completed" for i in items.data)
    assert spliced >= 3, "half the demo model's random outputs (5 of 10 here) go back as their ids"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# -- store=false ----------------------------------------------------------------------------------


def test_store_false_keeps_no_text_but_is_billed(server):
    sdk = client(server)
    before = usage_requests(server)
    rows = count_rows(server)
    r = create(server, input=unique("Do not keep this."), store=False)
    assert r.store is False and r.status == "incomplete" and r.output_text != ""
    events = list(create(server, input=unique("Nor this."), store=False, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.store is False
    for response_id in (r.id, events[-1].response.id):
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(response_id)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.input_items.list(response_id)
        with pytest.raises(openai.BadRequestError) as error:
            create(server, input="go on", previous_response_id=response_id)
        assert error.value.param == "previous_response_id" and "store=false" in error.value.message
    # Only the two records, no messages; the usage is billed (the ledger writes it soon after).
    assert count_rows(server) == (rows[0] + 2, rows[1])
    deadline = time.monotonic() + 10
    while usage_requests(server) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert usage_requests(server) == before + 2


def responses_ended(server, reason: str) -> float:
    """How many Responses replies have ended for this reason (`/metrics`, all tenants)."""
    text = httpx.get(f"{server['url']}/metrics", timeout=10).text
    pattern = rf'^chatd:request_success_total{{[^}}]*finished_reason="{reason}"[^}}]*route="responses"[^}}]*}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def test_a_store_false_stream_whose_client_leaves_stops_generating(server):
    """Nobody can come back for it, so its reply is aborted, not generated to its end for no one."""
    aborted, finished = responses_ended(server, "abort"), responses_ended(server, "length")
    body = {"model": "demo", "input": unique("Go on for a long time."), "stream": True, "store": False,
            "max_output_tokens": 400, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {server['keys']['alice']}"}
    with httpx.stream("POST", f"{server['url']}/v1/responses", json=body, headers=headers, timeout=30) as answer:
        for line in answer.iter_lines():
            if "response.output_text.delta" in line:
                break  # it is generating; the client leaves
    deadline = time.monotonic() + 30
    while responses_ended(server, "abort") == aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert responses_ended(server, "abort") == aborted + 1
    assert responses_ended(server, "length") == finished  # not run to its 400 tokens


# -- bad input ------------------------------------------------------------------------------------


def test_bad_input_is_refused_and_writes_nothing(server):
    rows = count_rows(server)
    first = create(server, input="hello")
    rows = (rows[0] + 1, rows[1] + 2)
    cases = [
        (openai.NotFoundError, {"previous_response_id": "resp_000000000000000000000000"}, "previous_response_id"),
        (openai.NotFoundError, {"conversation": "conv_000000000000000000000000"}, "conversation"),
        (openai.BadRequestError, {"previous_response_id": first.id, "conversation": "conv_x"}, "previous_response_id"),
        (openai.BadRequestError, {"conversation": {}}, "conversation"),  # not: no conversation at all
        (openai.BadRequestError, {"conversation": {"id": None}}, "conversation"),
        (openai.BadRequestError, {"conversation": "conv_x", "store": False}, "store"),  # it would add nothing there
        (openai.BadRequestError, {"tools": [{"type": "web_search"}]}, "tools[0].type"),  # chatd runs no built-in tools
        (openai.BadRequestError, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function"),
        (openai.BadRequestError, {"tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
        (openai.BadRequestError, {"tool_choice": "required"}, "tool_choice"),  # no tools to choose from
        (openai.BadRequestError, {"text": {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}}},
         "text.format.name"),
        (openai.BadRequestError, {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
         "text.format.schema"),
        (openai.BadRequestError, {"max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens"),
        (openai.BadRequestError, {"extra_body": {"bogus": 1}}, "bogus"),
        (openai.BadRequestError, {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
         "input[0].call_id"),  # it answers no call
        (openai.BadRequestError, {"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ]
    for kind, fields, param in cases:
        with pytest.raises(kind) as error:
            create(server, **{"input": "hi", **fields})
        assert error.value.param == param, (fields, error.value.body)
        assert count_rows(server) == rows, fields


def test_a_chain_too_long_for_the_window(server, tokenizer):
    words = " ".join(f"word{i}" for i in range(90))
    assert MAX_MODEL_LEN // 2 < len(tokenizer.encode_chat([as_item("user", words)])) < MAX_MODEL_LEN - 16
    first = create(server, input=f"one {words}")
    rows = count_rows(server)
    with pytest.raises(openai.BadRequestError) as error:
        create(server, input=f"two {words}", previous_response_id=first.id)
    assert error.value.code == "context_length_exceeded" and str(MAX_MODEL_LEN) in error.value.message
    assert count_rows(server) == rows
    # truncation="auto": the oldest turn is left out, and the response says so.
    r = create(server, input=f"two {words}", previous_response_id=first.id, truncation="auto")
    assert r.status == "incomplete" and r.truncation == "auto" and r.chatd["items_omitted"] == 2
    assert r.usage.input_tokens == len(tokenizer.encode_chat([as_item("user", f"two {words}")]))
    assert client(server).responses.retrieve(r.id).chatd["items_omitted"] == 2


# -- tenants --------------------------------------------------------------------------------------


def test_another_tenants_responses_and_conversations_do_not_exist(server):
    mine = create(server, input=unique("alice's secret"))
    conversation = client(server).conversations.create(items=[as_item("user", "alice's conversation")])
    bob = client(server, "bob")
    for reach in (lambda: bob.responses.retrieve(mine.id), lambda: bob.responses.input_items.list(mine.id),
                  lambda: bob.responses.delete(mine.id), lambda: bob.responses.cancel(mine.id),
                  lambda: list(bob.responses.retrieve(mine.id, stream=True)),
                  lambda: create(server, "bob", input="hi", previous_response_id=mine.id),
                  lambda: create(server, "bob", input="hi", conversation=conversation.id)):
        with pytest.raises(openai.NotFoundError) as error:
            reach()
        assert error.value.code == "not_found"
    # Alice's are untouched.
    assert client(server).responses.retrieve(mine.id).output_text == mine.output_text
    items = client(server).conversations.items.list(conversation.id)
    assert [i.content[0].text for i in items.data] == ["alice's conversation"]
    # No key, or a wrong one: 401.
    response = httpx.post(f"{server['url']}/v1/responses", json={"model": "demo", "input": "hi"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server['url']}/v1", api_key="wrong", max_retries=0).responses.retrieve(mine.id)


def test_a_response_whose_output_item_was_deleted_has_ended(server):
    """Deleting a response's output from its conversation does not leave it `in_progress` for a client that polls."""
    conversation = client(server).conversations.create()
    response = create(server, input="hi", conversation=conversation.id)
    client(server).conversations.items.delete(response.output[0].id, conversation_id=conversation.id)
    # Its events leave memory at once here (stream_replay_seconds = 0): only the rows speak for it.
    again = client(server).responses.retrieve(response.id)
    assert (again.status, again.output, again.model_extra["chatd"]["output_deleted"]) == ("incomplete", [], True)
