"""POST /v1/embeddings (http/routes/embeddings.py): on a real `chatd serve` with two tenants, driven by
the OpenAI SDK and LangChain, its vectors sentence-transformers' own; each bad request a 400 (or
404) naming its field and limit, checked in-process; a server without an embedding model says how
to turn one on."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from chatd.config_loader import build_config
from chatd.engine import Embedder
from chatd.http.app import create_app
from tests.engine.embedding_models import build_bert
from tests.factories import ScriptedChatEngine, close_server_state, make_server_state
from tests.http.serving import tenants_server

TEXTS = ["the paged attention cache", "a", "query key value vector search embedding server request tenant"]
# carol may send one request a minute of 12 input tokens at most, dave 16 tokens a minute; embeddings
# cost $1 per million tokens.
TIERS = ("[tiers.tiny]\nrequests_per_minute = 1\nmax_embedding_tokens = 12\n[tiers.sip]\ntokens_per_minute = 16\n"
         "[prices.tiny-embed]\ninput = 1.0\n")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def reference(folder):
    """sentence-transformers' own vectors for TEXTS."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(TEXTS)


@pytest.fixture(scope="module")
def server(tmp_path_factory, folder):
    """chatd serve with auth on: alice and bob (paid, unlimited), carol and dave (limited, TIERS)."""
    # Passes of 64 padded tokens: a request of many inputs takes many passes, shared between tenants.
    config = f'[embeddings]\nmodel = "{folder}"\nserved_name = "tiny-embed"\nmax_batch_tokens = 64\n{TIERS}'
    with tenants_server(tmp_path_factory.mktemp("embeddings"), config, ("alice", "bob", "carol", "dave"),
                        {"carol": "tiny", "dave": "sip"}) as s:
        yield s


def client(server, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=server["keys"][name], max_retries=0)


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a), np.asarray(b)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_the_sdk_gets_sentence_transformers_vectors_and_usage(server, reference):
    # The SDK asks for base64 unless told otherwise, and decodes float32 itself.
    reply = client(server, "alice").embeddings.create(model="tiny-embed", input=TEXTS)
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == "tiny-embed"
    assert cosines([d.embedding for d in reply.data], reference).min() >= 0.9999
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(TEXTS)
    floats = client(server, "alice").embeddings.create(model="tiny-embed", input=TEXTS[0], encoding_format="float")
    assert cosines([floats.data[0].embedding], reference[:1])[0] >= 0.9999


def test_base64_is_float32_little_endian(server, reference):
    response = httpx.post(server["url"] + "/v1/embeddings", timeout=30, json={"input": TEXTS, "encoding_format": "base64"},
                          headers={"Authorization": f"Bearer {server['keys']['bob']}"})
    rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in response.json()["data"]]
    assert cosines(rows, reference).min() >= 0.9999


def test_token_ids_and_dimensions(server, reference):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(server_folder(server)))(TEXTS)["input_ids"]
    sdk = client(server, "alice")
    reply = sdk.embeddings.create(model="tiny-embed", input=ids)  # the model's own ids, [CLS] and [SEP] included
    assert cosines([d.embedding for d in reply.data], reference).min() >= 0.9999
    one = sdk.embeddings.create(model="tiny-embed", input=ids[0])  # one input given as a list of ids
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[0])
    short = sdk.embeddings.create(model="tiny-embed", input=TEXTS, dimensions=8)
    expected = reference[:, :8] / np.linalg.norm(reference[:, :8], axis=1, keepdims=True)
    assert all(len(d.embedding) == 8 for d in short.data)
    assert np.allclose([d.embedding for d in short.data], expected, atol=1e-4)


def server_folder(server):
    return server["config"].read_text().split('model = "')[1].split('"')[0]


@pytest.mark.slow  # LangChain is installed for the slow tests only (the `slow` extra)
def test_langchain_openai_embeddings(server, reference):
    OpenAIEmbeddings = pytest.importorskip("langchain_openai").OpenAIEmbeddings

    # check_embedding_ctx_length=False: LangChain then sends the texts; by default it sends
    # tiktoken's ids for them, which mean nothing to another model's vocabulary.
    embeddings = OpenAIEmbeddings(model="tiny-embed", base_url=server["url"] + "/v1", api_key=server["keys"]["bob"],
                                  check_embedding_ctx_length=False, max_retries=0)
    assert cosines(embeddings.embed_documents(TEXTS), reference).min() >= 0.9999
    assert cosines([embeddings.embed_query(TEXTS[1])], reference[1:2])[0] >= 0.9999


def test_each_tenant_sees_only_its_own_usage(server):
    def usage(name: str) -> dict:
        return httpx.get(server["url"] + "/v1/usage", headers={"Authorization": f"Bearer {server['keys'][name]}"}).json()

    before_alice, before_bob = usage("alice"), usage("bob")
    reply = client(server, "alice").embeddings.create(model="tiny-embed", input=TEXTS)
    after_alice = usage("alice")
    for _ in range(50):  # the ledger writes a moment later
        if after_alice["requests"] > before_alice["requests"]:
            break
        after_alice = usage("alice")
    assert after_alice["input_tokens"] - before_alice["input_tokens"] == reply.usage.prompt_tokens
    assert after_alice["output_tokens"] == before_alice["output_tokens"]
    assert after_alice["cost"] - before_alice["cost"] == pytest.approx(reply.usage.prompt_tokens / 1e6)
    assert usage("bob")["input_tokens"] == before_bob["input_tokens"]


def test_a_request_past_its_tier_s_size_is_refused_naming_the_limit_and_costs_nothing(server):
    def remaining() -> int:
        return httpx.get(server["url"] + "/v1/usage",
                         headers={"Authorization": f"Bearer {server['keys']['carol']}"}).json()["limits"]["remaining_requests"]

    before = remaining()
    with pytest.raises(openai.BadRequestError) as refused:
        client(server, "carol").embeddings.create(model="tiny-embed", input=TEXTS)  # 12 input tokens a request
    error = refused.value.body
    assert error["param"] == "input" and error["code"] == "embedding_request_too_large"
    assert "at most 12 (max_embedding_tokens)" in error["message"] and "tier tiny" in error["message"]
    assert remaining() == before == 1  # carol's one request a minute is still hers


def test_a_rate_limited_tenant_gets_429_while_another_is_served(server):
    carol = client(server, "carol")
    carol.embeddings.create(model="tiny-embed", input="a")
    with pytest.raises(openai.RateLimitError) as refused:
        carol.embeddings.create(model="tiny-embed", input="a")
    assert refused.value.response.headers["Retry-After"]
    assert client(server, "alice").embeddings.create(model="tiny-embed", input="a").data


def test_one_tenant_s_one_text_is_answered_while_another_s_thousands_are_embedded(server):
    """Alice's 2,048 texts take hundreds of passes; bob's one text the next pass, not the last."""
    many = [f"{TEXTS[2]} {i}" for i in range(2048)]
    ended: dict[str, float] = {}

    def alice() -> None:
        client(server, "alice").with_options(timeout=300).embeddings.create(model="tiny-embed", input=many)
        ended["alice"] = time.monotonic()

    thread = threading.Thread(target=alice)
    thread.start()
    time.sleep(0.3)  # alice's passes have begun
    started = time.monotonic()
    client(server, "bob").embeddings.create(model="tiny-embed", input=TEXTS[1])
    ended["bob"] = time.monotonic()
    thread.join()
    waited, alice_took = ended["bob"] - started, ended["alice"] - started
    assert waited < alice_took / 2, (waited, alice_took)  # measured: 0.035 s against 0.8


def test_input_tokens_come_from_the_token_bucket(server):
    dave = client(server, "dave")  # 16 tokens a minute
    first = dave.embeddings.create(model="tiny-embed", input=TEXTS[2])
    assert 8 < first.usage.prompt_tokens <= 16  # the second cannot fit what is left
    with pytest.raises(openai.RateLimitError, match="tokens"):
        dave.embeddings.create(model="tiny-embed", input=TEXTS[2])


def test_a_key_is_needed_and_the_model_is_listed(server):
    assert httpx.post(server["url"] + "/v1/embeddings", json={"input": "a"}).status_code == 401
    listed = [m.id for m in client(server, "bob").models.list()]
    assert "tiny-embed" in listed and listed[0] != "tiny-embed"  # the chat model first
    card = client(server, "bob").models.retrieve("tiny-embed")
    assert card.id == "tiny-embed" and card.model_extra["chatd"]["dimensions"] == 32


def test_replies_match_the_documented_schema(server):
    from jsonschema import Draft202012Validator

    document = httpx.get(server["url"] + "/openapi.json").json()
    operation = document["paths"]["/v1/embeddings"]["post"]
    schema = operation["responses"]["200"]["content"]["application/json"]["schema"]
    replies = Draft202012Validator({**schema, "components": document["components"]})
    bodies = Draft202012Validator({**operation["requestBody"]["content"]["application/json"]["schema"],
                                   "components": document["components"]})
    for body in ({"input": TEXTS, "model": "tiny-embed"}, {"input": [[2, 5, 3]], "encoding_format": "base64"},
                 {"input": "a", "dimensions": 4, "user": "u1"}):
        bodies.validate(body)
        response = httpx.post(server["url"] + "/v1/embeddings", json=body, timeout=30,
                              headers={"Authorization": f"Bearer {server['keys']['bob']}"})
        replies.validate(response.json())


# -- in-process: each bad request named ------------------------------------------------------


@pytest.fixture
async def app(tmp_path, folder):
    """A test client of an app whose embedding model is the tiny BERT (served as "tiny-embed")."""
    embedder = Embedder.load(str(folder), device="cpu", name="tiny-embed")
    config = build_config({"embeddings": {"model": str(folder), "max_inputs": 4}})
    state = await make_server_state(ScriptedChatEngine(pause=0.0), tmp_path, config, embedder=embedder)
    test_client = TestClient(TestServer(create_app(state)))
    await test_client.start_server()
    yield test_client
    await test_client.close()
    await close_server_state(state)
    embedder.stop()


@pytest.mark.parametrize("body, param, message", [
    ({"input": ""}, "input", "input[0] is ''; every entry must be a non-empty string"),
    ({"input": []}, "input", "input must be a non-empty string"),
    ({"input": ["a", "b", "c", "d", "e"]}, "input", "input has 5 entries; the limit is 4"),
    ({"input": ["a", 3]}, "input", "input[1] is 3"),
    ({"input": [[2, 5], [2, 10_000]]}, "input", "input[1][1] is 10000; token ids are integers in [0, "),
    ({"input": [[2, 5], []]}, "input", "input[1] is a list; every entry must be a non-empty list of token ids"),
    ({"input": "a " * 70}, "input", "input[0] has 72 tokens; this embedding model reads at most 64"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "encoding_format must be one of float, base64"),
    ({"input": "a", "encoding_format": ""}, "encoding_format", "encoding_format must be one of float, base64, got ''"),
    ({"input": "a", "encoding_format": "FLOAT"}, "encoding_format", "encoding_format must be one of float, base64"),
    ({"input": "a", "dimensions": 33}, "dimensions", "dimensions is 33; this model's vectors have 1 to 32"),
    ({"input": "a", "dimensions": 0}, "dimensions", "dimensions is 0"),
    ({"input": "a", "dimensions": True}, "dimensions", "dimensions must be an integer"),
    ({"input": "a", "colour": "blue"}, "colour", "unknown field 'colour'"),
])
async def test_a_bad_request_is_a_400_naming_its_field_and_limit(app, body, param, message):
    response = await app.post("/v1/embeddings", json=body)
    error = (await response.json())["error"]
    assert response.status == 400, error
    assert error["param"] == param and message in error["message"]


async def test_another_model_is_a_404_saying_which_model_embeds(app):
    for model, says in (("scripted", "is a chat model"), ("gpt-4", "is not served here")):
        response = await app.post("/v1/embeddings", json={"input": "a", "model": model})
        error = (await response.json())["error"]
        assert response.status == 404 and error["code"] == "model_not_found"
        assert says in error["message"] and "'tiny-embed'" in error["message"]


async def test_a_server_without_an_embedding_model_says_how_to_turn_it_on(tmp_path):
    state = await make_server_state(ScriptedChatEngine(pause=0.0), tmp_path)
    async with TestClient(TestServer(create_app(state))) as test_client:
        response = await test_client.post("/v1/embeddings", json={"input": "a", "model": "text-embedding-3-small"})
        error = (await response.json())["error"]
        assert response.status == 404 and error["code"] == "embeddings_not_configured"
        assert "[embeddings]" in error["message"] and "model" in error["message"]
    await close_server_state(state)
