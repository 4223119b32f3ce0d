"""A model served under several names ([server] model_name as a list, `--served-model-name A B`)
and a shorter context window ([model] max_model_len, `--max-model-len`), on a real `chatd serve`
driven by the official openai SDK (state.py's check_model, status.py's /v1/models)."""

from __future__ import annotations

import httpx
import openai
import pytest

from chatd.engine.models.demo import build_demo_model
from tests.http.serving import start_server, stop_server

NAMES = ["demo-chat", "gpt-4o-mini", "org/demo-v1"]  # an id with a slash, as hub ids have
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("names")
    model_dir = build_demo_model(root / "demo")
    config = f"[server]\nmodel_name = {NAMES!r}\n[model]\nmax_model_len = 300\n[cache]\nnum_blocks = 256\n".replace("'", '"')
    proc, url, log_path = start_server(root, model_dir, config)
    yield url, log_path
    stop_server(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_models_lists_a_card_per_name_with_the_context_window(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == NAMES
    assert all(m.model_extra["root"] == NAMES[0] for m in models)  # one model behind every name
    assert all(m.model_extra["context_length"] == 300 for m in models)
    assert "model demo-chat is also served as gpt-4o-mini, org/demo-v1" in server[1].read_text()


def test_retrieve_finds_every_name_and_404s_any_other(client, server):
    for name in NAMES:
        card = client.models.retrieve(name)
        assert (card.id, card.model_extra["context_length"]) == (name, 300)
    assert httpx.get(f"{server[0]}/v1/models/org/demo-v1").json()["id"] == "org/demo-v1"  # an SDK that does not quote
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert (err.value.code, err.value.param) == ("model_not_found", "model")
    assert "'gpt-4' does not exist" in err.value.message and "'org/demo-v1'" in err.value.message


def test_a_request_may_name_any_alias_and_the_reply_names_the_first(client):
    for name in NAMES:
        reply = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
        assert reply.model == NAMES[0]
    completion = client.completions.create(model="gpt-4o-mini", prompt="The cache", max_tokens=2)
    assert completion.model == NAMES[0]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2)  # the folder's name is not one
    assert err.value.code == "model_not_found"


def test_the_context_window_is_the_configured_one(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=299)
    assert err.value.param == "max_tokens" and "299" in err.value.message and "300 tokens" in err.value.message
