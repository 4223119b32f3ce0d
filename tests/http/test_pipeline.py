"""The stages every generating route runs (chatd/http/generation/pipeline.py), each alone: a limit the engine
finds names the fields the client sent, the reply's length is decided once at admission, the
prefix-cache scope keeps tenants apart, and a refused prompt frees what was started and held."""

from __future__ import annotations

import pytest

from chatd.config_loader import build_config
from chatd.engine import CacheScope, LimitError, ParamError, SamplingParams
from chatd.engine.request import checked_params
from chatd.http.generation import pipeline
from chatd.http.errors import APIError
from chatd.http.openai.protocol import parse_chat
from chatd.store.db import Tenant
from tests.factories import ScriptedChatEngine, close_server_state, make_scheduler, make_server_state

ALICE = Tenant("t-alice", "alice", "free")
BOB = Tenant("t-bob", "bob", "free")
TIERS = {"auth": {"enabled": True}, "tiers": {"free": {"max_tokens": 8, "priority": 20}}}


def chat(max_tokens: int | None = None, field: str = "max_completion_tokens"):
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        body[field] = max_tokens
    return parse_chat(body, 100, {})


@pytest.fixture
async def state(tmp_path):
    state = await make_server_state(ScriptedChatEngine(pause=0.0), tmp_path, build_config(TIERS))
    yield state
    await close_server_state(state)


def limit(prompt_len: int, max_tokens: int | None, max_model_len: int = 64, num_blocks: int = 64) -> LimitError:
    """What the engine's own admission check raises for this prompt and reply length."""
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4)
    with pytest.raises(LimitError) as raised:
        checked_params([1] * prompt_len, SamplingParams(max_tokens=max_tokens), max_model_len, 1000, scheduler)
    return raised.value


def test_a_limit_names_the_fields_the_client_sent():
    too_long = pipeline.refusal(limit(70, None), "messages", "max_completion_tokens")
    assert (too_long.status, too_long.param, too_long.code) == (400, "messages", "context_length_exceeded")
    assert too_long.message.startswith("messages has 70 tokens; the context window is 64 tokens")

    reply_too_long = pipeline.refusal(limit(20, 60), "prompt[3]", "max_completion_tokens")
    assert (reply_too_long.param, reply_too_long.code) == ("max_completion_tokens", None)
    assert reply_too_long.message == ("prompt[3] (20 tokens) + max_completion_tokens (60) = 80 exceeds the context "
                                      "window of 64 tokens")

    pool_too_small = pipeline.refusal(limit(20, 30, max_model_len=4096, num_blocks=8), "input", "max_output_tokens")
    assert pool_too_small.param == "max_output_tokens"
    assert pool_too_small.message == ("input + max_output_tokens = 50 tokens need 13 KV blocks, but the KV cache holds "
                                      "only 8 blocks")
    # The engine's own callers (offline use) read its own names.
    assert str(limit(20, 60)).startswith("prompt (20 tokens) + max_tokens (60)")
    # Any other refusal passes through with its field.
    other = pipeline.refusal(ParamError("stop_token_ids", "stop token id 5000 is out of range [0, 1000)"), "messages", "x")
    assert (other.param, other.message) == ("stop_token_ids", "stop token id 5000 is out of range [0, 1000)")


async def test_admission_decides_the_reply_length_once_and_leaves_the_request_as_sent(state):
    unnamed = chat()
    admitted = await pipeline.admit(state, state.fleet.primary, ALICE, unnamed, [[1, 2, 3]])
    assert admitted.params.max_tokens == 8  # the tier's ceiling
    assert unnamed.params.max_tokens is None  # the parsed request is not rewritten
    admitted.lease.release(0)

    within = chat(5)
    admitted = await pipeline.admit(state, state.fleet.primary, ALICE, within, [[1, 2, 3]])
    assert admitted.params is within.params and admitted.params.max_tokens == 5
    assert admitted.placement.priority == 20 and admitted.placement.tenant == ALICE.id
    admitted.lease.release(0)

    with pytest.raises(APIError) as refused:
        await pipeline.admit(state, state.fleet.primary, ALICE, chat(100), [[1, 2, 3]])
    assert refused.value.param == "max_completion_tokens" and "over the limit of 8" in refused.value.message


async def test_two_tenants_never_share_a_cache_scope_but_do_share_a_shared_system_prompt(state):
    prompt = [5, 6, 7, 8, 9]
    served = state.fleet.primary
    alice, bob = pipeline.cache_scope(state, served, ALICE, prompt), pipeline.cache_scope(state, served, BOB, prompt)
    assert alice.salt != bob.salt and alice.shared_prefix_tokens == bob.shared_prefix_tokens == 0
    served.shared_prefixes = [[5, 6, 7]]
    assert pipeline.cache_scope(state, served, ALICE, prompt) == CacheScope(ALICE.id, 3)
    state.config = build_config({**TIERS, "cache": {"prefix_cache_scope": "global"}})
    assert pipeline.cache_scope(state, served, ALICE, prompt) == CacheScope()


class RefusesSecond(ScriptedChatEngine):
    """Takes the first prompt of a request and refuses the second, as the engine refuses a prompt over the window."""

    def generate(self, prompt, params, placement=None, cache=None):
        if self.num_requests == 1:
            raise limit(70, None)
        return super().generate(prompt, params, placement, cache)


class Batch:
    """A two-prompt text completion, as the pipeline sees a route."""

    endpoint = "completions"

    def __init__(self) -> None:
        self.gen = chat(4)
        self.screened: list[str] = []

    async def input_texts(self) -> list[str]:
        return ["first", "second"]

    def use_input_texts(self, texts: list[str]) -> None:
        self.screened = texts

    async def prompts(self) -> dict[str, list[int]]:
        return {"prompt[0]": [1, 2, 3], "prompt[1]": [4, 5, 6]}


async def test_a_refused_prompt_ends_the_started_ones_and_frees_the_lease(tmp_path):
    engine = RefusesSecond(pause=0.0)
    state = await make_server_state(engine, tmp_path, build_config({**TIERS, "tiers": {"free": {
        "max_concurrent_requests": 1, "priority": 20}}}))
    try:
        with pytest.raises(APIError) as refused:
            await pipeline.start(state, state.fleet.primary, ALICE, Batch(), "req-1")
        assert (refused.value.param, refused.value.code) == ("prompt[1]", "context_length_exceeded")
        assert engine.aborted == {"scripted-1"}  # the first prompt's request, ended
        # Its concurrency slot came back: the same tenant is admitted again at once.
        engine.generate = ScriptedChatEngine.generate.__get__(engine)
        started = await pipeline.start(state, state.fleet.primary, ALICE, Batch(), "req-2")
        assert [len(p) for p in started.prompts.values()] == [3, 3] and len(started.handles) == 2
        assert started.admitted.params.max_tokens == 4
        started.admitted.lease.release(0)
    finally:
        await close_server_state(state)
