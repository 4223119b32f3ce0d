"""Handler-level cases through aiohttp's test client, with a scripted engine in place of the model."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from chatd.config_loader import build_config
from chatd.engine.models.demo import build_tokenizer
from chatd.engine import CompletionOutput, FinishReason, RequestOutput, Tokenizer
from chatd.http.app import create_app
from chatd.http.server.state import STATE, ServerState
from chatd.store.db import Store
from chatd.store.ledger import Ledger
from tests.factories import make_model_info

BODY = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


class ScriptedEngine:
    """Stands in for AsyncEngine: yields the given outputs, with a pause before each."""

    def __init__(self, script: list[RequestOutput | Exception], pause: float = 0.0) -> None:
        self.script, self.pause = script, pause
        self.error = None
        self.is_running = True
        self.aborted: list[str] = []
        self.prompts: list = []
        self.params: list = []

    def generate(self, prompt, params, placement=None, cache=None):
        self.prompts.append(prompt)
        self.params.append(params)
        return ScriptedStream(self, f"scripted-{len(self.prompts)}")

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self):
        raise AssertionError("not used here")

    def health(self) -> str | None:
        return None if self.error is None and self.is_running else f"engine stopped: {self.error!r}"

    def compile_state(self) -> str:
        return "off"


class ScriptedStream:
    """What ScriptedEngine.generate returns: the script's outputs, with AsyncEngine's RequestStream interface."""

    def __init__(self, engine: ScriptedEngine, request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self.items = iter(engine.script)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        await asyncio.sleep(self.engine.pause)
        item = next(self.items, None)
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    def abort(self) -> None:
        self.engine.aborted.append(self.request_id)


def delta(text: str, finish: FinishReason | None = None, error: str | None = None) -> RequestOutput:
    out = CompletionOutput(0, text=text, token_ids=[7] if text else [], finish_reason=finish)
    return RequestOutput("r", [1, 2, 3], [out], finished=finish is not None or error is not None, error=error)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return Tokenizer.from_pretrained(path)


@pytest.fixture
async def store(tmp_path):
    store = await Store.open(tmp_path / "chatd.db")
    yield store
    await store.close()


async def client_for(engine: ScriptedEngine, tokenizer: Tokenizer, store: Store, heartbeat: float = 15.0,
                     sampling_defaults: dict | None = None) -> TestClient:
    config = build_config({"server": {"heartbeat_seconds": heartbeat}})
    ledger = Ledger(store, retry_seconds=1.0)
    ledger.start()
    model = make_model_info(64, sampling_defaults=sampling_defaults or {})
    state = ServerState(engine=engine, tokenizer=tokenizer, model=model, model_name="m", store=store,
                        local_tenant=await store.local_tenant("paid"), ledger=ledger, config=config)
    client = TestClient(TestServer(create_app(state)))
    await client.start_server()
    return client


async def read_events(response) -> list[str]:
    text = (await response.read()).decode()
    return [block for block in text.split("\n\n") if block]


async def test_an_error_after_the_stream_began_is_an_sse_error_event(tokenizer, store):
    engine = ScriptedEngine([delta("Hel"), delta("", error="device lost")])
    client = await client_for(engine, tokenizer, store)
    try:
        response = await client.post("/v1/chat/completions", json=BODY)
        assert response.status == 200
        events = await read_events(response)
        assert events[-1].startswith('data: {"error"') and "device lost" in events[-1]
        assert "[DONE]" not in events[-1]
    finally:
        await client.close()


async def test_an_internal_error_is_a_500_without_a_traceback(tokenizer, store, caplog):
    engine = ScriptedEngine([RuntimeError("secret internals")])
    client = await client_for(engine, tokenizer, store)
    try:
        response = await client.post("/v1/chat/completions", json={**BODY, "stream": False}, headers={"X-Request-Id": "req-9"})
        body = await response.json()
        assert response.status == 500 and body["error"]["type"] == "server_error"
        assert "secret" not in body["error"]["message"] and "Traceback" not in body["error"]["message"]
        assert "req-9" in body["error"]["message"]
        assert "req-9" in caplog.text and "secret internals" in caplog.text  # the traceback goes to the log
        assert engine.aborted == ["scripted-1"]  # the engine's own id, not the client's
    finally:
        await client.close()


async def test_an_idle_stream_gets_heartbeat_comments(tokenizer, store):
    engine = ScriptedEngine([delta("a"), delta("b", FinishReason.STOP)], pause=0.35)
    client = await client_for(engine, tokenizer, store, heartbeat=0.1)
    try:
        events = await read_events(await client.post("/v1/chat/completions", json=BODY))
        assert any(e.startswith(":") for e in events), "an SSE comment keeps an idle stream open"
        assert events[-1] == "data: [DONE]"
    finally:
        await client.close()


async def test_concurrent_idle_streams_each_get_comments_from_one_timer_that_ends_with_them(tokenizer, store):
    """The keep-alive comments of every stream come from the server's one timer: each idle stream
    gets its own, with its own reply intact, and the timer stops once no stream is open."""
    engine = ScriptedEngine([delta("a"), delta("b", FinishReason.STOP)], pause=0.35)
    client = await client_for(engine, tokenizer, store, heartbeat=0.1)
    try:
        async def one() -> list[str]:
            return await read_events(await client.post("/v1/chat/completions", json=BODY))

        first, second = await asyncio.gather(one(), one())
        for events in (first, second):
            assert sum(e.startswith(":") for e in events) >= 2, "each idle stream hears comments"
            data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
            assert "".join(d["choices"][0]["delta"].get("content", "") for d in data) == "ab"
            assert events[-1] == "data: [DONE]"
        await asyncio.sleep(0)  # (the cancelled timer's last turn)
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "heartbeats"]
    finally:
        await client.close()


async def test_health_is_200_only_while_it_can_take_traffic(tokenizer, store):
    """A gateway probing /health sends traffic only on a 200: not while warming up or draining
    (503, the phase, Retry-After), nor once the engine died (503 and why)."""
    engine = ScriptedEngine([])
    client = await client_for(engine, tokenizer, store)
    state = client.server.app[STATE]
    try:
        assert (await client.get("/live")).status == 200  # a supervisor keeps it: the process runs
        response = await client.get("/health")
        assert response.status == 503 and (await response.json())["phase"] == "warming up"
        assert int(response.headers["Retry-After"]) > 0
        state.ready = True
        assert (await client.get("/health")).status == 200
        state.draining_until = asyncio.get_running_loop().time() + 10
        response = await client.get("/health")
        assert response.status == 503 and (await response.json())["phase"] == "draining"
        live = await client.get("/live")
        assert live.status == 200 and (await live.json())["phase"] == "draining"
        assert 1 <= int(response.headers["Retry-After"]) <= 10
        state.draining_until = None
        engine.error, engine.is_running = RuntimeError("CUDA error"), False
        response = await client.get("/health")
        assert response.status == 503 and "CUDA error" in (await response.json())["error"]
    finally:
        await client.close()


async def test_a_request_that_leaves_sampling_out_gets_the_models_recommendation(tokenizer, store):
    engine = ScriptedEngine([delta("Hi", FinishReason.STOP)])
    client = await client_for(engine, tokenizer, store, sampling_defaults={"temperature": 0.2, "top_p": 0.9, "top_k": 40})
    try:
        chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        for body in (chat, {**chat, "temperature": 0.7, "top_k": 0}):
            assert (await client.post("/v1/chat/completions", json=body)).status == 200
        assert (await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})).status == 200
        conversation = (await (await client.post("/v1/conversations", json={})).json())["id"]
        turn = await client.post(f"/v1/conversations/{conversation}/messages", json={"content": "hello"})
        assert turn.status == 200
        got = [(p.temperature, p.top_p, p.top_k) for p in engine.params]
        assert got == [(0.2, 0.9, 40), (0.7, 0.9, 0), (0.2, 0.9, 40), (0.2, 0.9, 40)]
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["chatd"]["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9, "top_k": 40}
    finally:
        await client.close()


async def test_a_failed_reply_is_saved_as_error_and_left_out_of_the_next_prompt(tokenizer, store):
    engine = ScriptedEngine([delta("Hel"), delta("", error="device lost")])
    client = await client_for(engine, tokenizer, store)
    try:
        conversation = (await (await client.post("/v1/conversations", json={})).json())["id"]
        response = await client.post(f"/v1/conversations/{conversation}/messages", json={"content": "hi"})
        assert response.status == 500 and "generation failed" in (await response.json())["error"]["message"]
        await client.app[STATE].ledger.drained()
        messages = (await (await client.get(f"/v1/conversations/{conversation}")).json())["messages"]
        assert [(m["role"], m["status"], m["content"]) for m in messages] == [
            ("user", "complete", "hi"), ("assistant", "error", "Hel")]
        engine.script = [delta("fine", finish=FinishReason.STOP)]
        response = await client.post(f"/v1/conversations/{conversation}/messages", json={"content": "again"})
        assert response.status == 200 and (await response.json())["choices"][0]["message"]["content"] == "fine"
        # The failed reply is not part of the history the model sees next.
        assert engine.prompts[-1] == tokenizer.encode_chat([{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}])
    finally:
        await client.close()


async def test_a_reply_whose_conversation_is_purged_mid_way_still_ends_its_stream(tokenizer, store):
    engine = ScriptedEngine([delta("a"), delta("b", finish=FinishReason.STOP)], pause=0.2)
    client = await client_for(engine, tokenizer, store)
    try:
        conversation = (await (await client.post("/v1/conversations", json={})).json())["id"]
        response = await client.post(f"/v1/conversations/{conversation}/messages", json={"content": "hi", "stream": True})
        await client.delete(f"/v1/conversations/{conversation}")
        assert await store.purge_deleted(time.time() + 1) == 1  # gone before the reply ends
        events = await asyncio.wait_for(read_events(response), timeout=10)
        assert events[-1].endswith("data: [DONE]")
        await client.app[STATE].ledger.drained()
        assert (await store.usage("local", 0, time.time() + 1)).requests == 1  # still billed
    finally:
        await client.close()
