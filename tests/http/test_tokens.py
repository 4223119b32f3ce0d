"""POST /tokenize and /detokenize on a real `chatd serve` (tokens.py): the server's tokenizer and
chat template, compared with the same model folder's tokenizer loaded here; each bad input is a
400 naming its field."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from chatd.engine import Tokenizer
from chatd.engine.models.demo import build_demo_model
from tests.http.serving import start_server, stop_server

MAX_MODEL_LEN = 256
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about paged attention."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """chatd serve on the demo model with a 256-token context; yields (url, model folder)."""
    root = tmp_path_factory.mktemp("tokens")
    model_dir = build_demo_model(root / "demo")
    proc, url, _ = start_server(root, model_dir, f"[model]\nmax_model_len = {MAX_MODEL_LEN}\n[cache]\nnum_blocks = 256\n")
    yield url, model_dir
    stop_server(proc)


@pytest.fixture(scope="module")
def hf(server):
    """The model folder's tokenizer as transformers loads it: what the server must agree with."""
    return AutoTokenizer.from_pretrained(str(server[1]))


def chat_ids(hf, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    return list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                       return_dict=False))


def post(server, path: str, body) -> tuple[int, dict]:
    response = httpx.post(server[0] + path, json=body, timeout=30)
    return response.status_code, response.json()


def test_tokenize_a_prompt_as_the_model_folders_tokenizer_does(server, hf):
    for prompt in ("The paged KV cache", "naïve café ☕ — 東京", ""):
        status, body = post(server, "/tokenize", {"prompt": prompt, "model": "demo"})
        assert status == 200
        expected = hf.encode(prompt) if prompt else []  # an empty prompt is no tokens, as /v1/completions reads it
        assert body == {"tokens": expected, "count": len(expected), "max_model_len": MAX_MODEL_LEN}


def test_tokenize_messages_counts_what_a_chat_completion_is_billed(server, hf):
    status, body = post(server, "/tokenize", {"messages": MESSAGES})
    assert status == 200
    assert body["tokens"] == chat_ids(hf, MESSAGES)
    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=1)
    assert body["count"] == reply.usage.prompt_tokens
    status, without = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert without["tokens"] == chat_ids(hf, MESSAGES, add_generation_prompt=False)
    assert body["tokens"][:without["count"]] == without["tokens"] and without["count"] < body["count"]


def test_detokenize_gives_back_the_text_special_tokens_included(server, hf):
    for path_body in ({"prompt": "naïve café ☕"}, {"messages": MESSAGES}):
        _, tokenized = post(server, "/tokenize", path_body)
        status, body = post(server, "/detokenize", {"tokens": tokenized["tokens"]})
        assert status == 200
        assert body == {"prompt": hf.decode(tokenized["tokens"], skip_special_tokens=False,
                                            clean_up_tokenization_spaces=False)}
    _, chat = post(server, "/detokenize", {"tokens": chat_ids(hf, MESSAGES)})
    assert chat["prompt"] == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert post(server, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


def too_long_prompt(server) -> str:
    """One character more than the context window can hold, by the server's own bound."""
    return "x" * (MAX_MODEL_LEN * Tokenizer.from_pretrained(server[1]).max_token_chars + 1)


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/tokenize", ["hello"], None, "must be a JSON object"),
    ("/tokenize", {"text": "hello"}, "text", "unknown field 'text'"),
    ("/tokenize", {}, "prompt", "give either prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "messages", "give either prompt"),
    ("/tokenize", {"prompt": 42}, "prompt", "prompt must be a string"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt", "prompt must be a string"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", "applies to messages"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": "yes"}, "add_generation_prompt", "must be a boolean"),
    ("/tokenize", {"messages": []}, "messages", "non-empty list"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "must be one of"),
    ("/tokenize", {"messages": [{"role": "user", "content": 7}]}, "messages[0].content", "must be a string"),
    ("/tokenize", {"prompt": "a", "model": 3}, "model", "model must be a string"),
    ("/detokenize", {"tokens": "1 2 3"}, "tokens", "must be a list of token ids"),
    ("/detokenize", {}, "tokens", "must be a list of token ids"),
    ("/detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)}, "tokens", f"{MAX_MODEL_LEN + 1} entries; the limit is max_model_len, {MAX_MODEL_LEN}"),
    ("/detokenize", {"tokens": [1, 1000]}, "tokens", "tokens[1] is 1000; token ids are integers in [0, 1000)"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "tokens[0] is -1"),
    ("/detokenize", {"tokens": [1, True]}, "tokens", "tokens[1] is true"),
    ("/detokenize", {"tokens": [2.5]}, "tokens", "tokens[0] is 2.5"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt", "unknown field 'prompt'"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param, words):
    status, answer = post(server, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"


def test_text_longer_than_the_context_window_can_hold_is_refused_before_tokenizing(server):
    text = too_long_prompt(server)
    for body, param in (({"prompt": text}, "prompt"), ({"messages": [{"role": "user", "content": text}]}, "messages")):
        status, answer = post(server, "/tokenize", body)
        assert status == 400
        assert answer["error"]["param"] == param and answer["error"]["code"] == "context_length_exceeded"
        assert f"{len(text)} characters" in answer["error"]["message"]


def test_an_unknown_model_is_a_404(server):
    for path, body in (("/tokenize", {"prompt": "hi", "model": "gpt-4"}), ("/detokenize", {"tokens": [1], "model": "gpt-4"})):
        status, answer = post(server, path, body)
        assert status == 404
        assert (answer["error"]["param"], answer["error"]["code"]) == ("model", "model_not_found")
