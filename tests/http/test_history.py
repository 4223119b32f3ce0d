"""Conversation trimming: the fewest oldest turns are left out, found with few renderings however
long the history is (a 100-turn conversation re-rendered its history once per dropped turn)."""

from __future__ import annotations

import math

import pytest

from chatd.config_loader import build_config
from chatd.engine.models.demo import build_tokenizer
from chatd.engine import Tokenizer
from chatd.http.generation.history import render_turn
from chatd.http.errors import APIError
from chatd.http.openai.protocol import parse_turn
from chatd.http.models.served_model import ServedModel
from chatd.http.server.state import ServerState
from chatd.store.records import Conversation, Message
from tests.factories import make_model_info


class CountingTokenizer(Tokenizer):
    """The demo tokenizer, counting how often a whole conversation is rendered."""

    renders = 0

    def encode_chat(self, messages, add_generation_prompt=True, tools=None, reply_ids=None):
        self.renders += 1
        return super().encode_chat(messages, add_generation_prompt, tools, reply_ids)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> CountingTokenizer:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return CountingTokenizer(Tokenizer.from_pretrained(path).hf)


def make_state(tokenizer: Tokenizer, window: int, max_messages: int = 2048) -> ServedModel:
    """Only what rendering reads: the model's tokenizer and window, and the limits (no engine, no store)."""
    state = ServerState(engine=None, tokenizer=tokenizer, model=make_model_info(window), model_name="m", store=None,
                        local_tenant=None, ledger=None, config=build_config({"server": {"max_messages": max_messages}}))
    return state.fleet.primary


def history(turns: int) -> list[Message]:
    messages = []
    for i in range(turns):
        for role, text in (("user", f"question {i}: " + "why is the sky blue " * (1 + i % 3)),
                           ("assistant", f"answer {i}: " + "because of scattering " * (1 + i % 5))):
            messages.append(Message(f"msg_{len(messages)}", "conv", role, text, "complete", None, 0, 0, 0, 0.0, 0.0, 0.0))
    return messages


def fewest_dropped(tokenizer, system, past, new, room, window) -> int:
    """The reference: drop one turn more at a time, as the server used to."""
    dropped = 0
    while len(tokenizer.encode_chat(system + past[dropped:] + new)) + room > window:
        dropped += 1
        while dropped < len(past) and past[dropped]["role"] != "user":
            dropped += 1
    return dropped


@pytest.mark.parametrize("turns, window", [(100, 2048), (100, 512), (37, 1024), (3, 2048), (100, 160)])
def test_the_fewest_turns_are_dropped_with_logarithmically_few_renderings(tokenizer, turns, window):
    conversation = Conversation("conv", "t", "m", None, "Be brief.", {}, 0.0, 0.0)
    turn = parse_turn({"content": "and now, the last question", "max_tokens": 64}, 10_000)
    stored = history(turns)
    tokenizer.renders = 0
    prompt, dropped = render_turn(make_state(tokenizer, window), conversation, stored, turn)
    renders = tokenizer.renders

    system = [{"role": "system", "content": "Be brief."}]
    past = [{"role": m.role, "content": m.content} for m in stored]
    new = [{"role": "user", "content": "and now, the last question"}]
    assert dropped == fewest_dropped(tokenizer, system, past, new, 64, window)
    assert prompt == tokenizer.encode_chat(system + past[dropped:] + new)
    assert renders <= 2 * math.log2(turns + 1) + 3, f"{renders} renderings for {turns} turns"


def test_a_history_longer_than_max_messages_keeps_only_the_newest(tokenizer):
    conversation = Conversation("conv", "t", "m", None, None, {}, 0.0, 0.0)
    turn = parse_turn({"content": "last", "max_tokens": 8}, 10_000)
    _, dropped = render_turn(make_state(tokenizer, 100_000, max_messages=11), conversation, history(20), turn)
    assert dropped == 40 - 10  # 10 of the past messages and the new one


def test_a_message_that_cannot_fit_alone_names_the_window(tokenizer):
    conversation = Conversation("conv", "t", "m", None, None, {}, 0.0, 0.0)
    turn = parse_turn({"content": "word " * 400, "max_tokens": 8}, 10_000)
    with pytest.raises(APIError) as err:
        render_turn(make_state(tokenizer, 256), conversation, history(5), turn)
    assert err.value.status == 400 and "context window of 256 tokens" in err.value.message
