"""`POST /tokenize` and `POST /detokenize`: the served model's own tokenizer, in vLLM's shapes.

Clients count tokens before they send (does this fit the context window? what will it cost?)
with exactly what the server uses: a `prompt` is tokenized as /v1/completions tokenizes it, and
`messages` are rendered by the chat template as /v1/chat/completions renders them, so `count`
equals that request's `usage.prompt_tokens`. Nothing is generated, stored or billed.

Tokenizing and decoding run in ServerState's tokenizing threads, never on the event loop, and
what they take is bounded first: text by the context window (check_text_size), token lists by
max_model_len entries. The routes sit at the root, as in vLLM, under the same auth as /v1/ (server/auth.py).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from chatd.http.server.auth import TENANT
from chatd.http.errors import APIError
from chatd.http.models.served_model import ServedModel
from chatd.http.openai.protocol import parse_chat, shown
from chatd.http.server.state import STATE, ServerState
from chatd.http.server.wire import checked, json_response, read_json

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_generation_prompt", "tools"}
DETOKENIZE_FIELDS = {"model", "tokens"}


async def tokenize(request: web.Request) -> web.Response:
    """`{"prompt": str}` or `{"messages": [...], "add_generation_prompt": bool}` -> `{"tokens", "count", "max_model_len"}`."""
    state = request.app[STATE]
    body = _body(await read_json(request), TOKENIZE_FIELDS)
    async with state.pick_model(_optional(body, "model", str), request[TENANT]).in_use() as served:
        return await _tokenize(request, state, served, body)


async def _tokenize(request: web.Request, state: ServerState, served: ServedModel, body: dict) -> web.Response:
    add_generation_prompt = _optional(body, "add_generation_prompt", bool)
    if ("prompt" in body) == ("messages" in body):
        raise APIError(400, "give either prompt (text) or messages (a chat to render with the chat template)",
                       "messages" if "prompt" in body else "prompt")
    if "prompt" in body:
        if add_generation_prompt is not None:
            raise APIError(400, "add_generation_prompt applies to messages, not to prompt", "add_generation_prompt")
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise APIError(400, f"prompt must be a string, got {shown(prompt)}", "prompt")
        tokens = await served.encode_prompt(prompt)
    else:
        chat = {name: body[name] for name in ("messages", "tools") if name in body}
        gen = await checked(request, parse_chat, chat, state.config.server.max_messages)
        tools = await served.off_loop(served.tool_use, gen.tools, gen.messages)
        tokens = await served.encode_chat(tools.messages, add_generation_prompt=add_generation_prompt is not False,
                                          tools=tools.shown)
    return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": served.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    """`{"tokens": [ids]}` -> `{"prompt": str}`, special tokens included (what the model reads)."""
    state = request.app[STATE]
    body = _body(await read_json(request), DETOKENIZE_FIELDS)
    async with state.pick_model(_optional(body, "model", str), request[TENANT]).in_use() as served:
        tokens = await checked(request, _token_ids, served, body.get("tokens"))
        text = await served.off_loop(served.tokenizer.decode, tokens, False) if tokens else ""
    return json_response({"prompt": text})


def _token_ids(served: ServedModel, tokens: Any) -> list[int]:
    """Token ids the model knows, no more than its context window holds; 400 naming the first that is not."""
    if not isinstance(tokens, list):
        raise APIError(400, f"tokens must be a list of token ids, got {shown(tokens)}", "tokens")
    if len(tokens) > served.max_model_len:  # before a pass over a list of maybe a million
        raise APIError(400, f"tokens has {len(tokens)} entries; the limit is max_model_len, {served.max_model_len}",
                       "tokens", "context_length_exceeded")
    vocab_size = served.info.vocab_size
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise APIError(400, f"tokens[{i}] is {shown(token)}; token ids are integers in [0, {vocab_size})", "tokens")
    return tokens


def _body(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name in body:
        if name not in allowed:
            raise APIError(400, f"unknown field {shown(name)}; known: {', '.join(sorted(allowed))}", name)
    return body


def _optional(body: dict, name: str, kind: type) -> Any:
    """A field that may be left out or null; 400 naming it when it has another type."""
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise APIError(400, f"{name} must be {'a boolean' if kind is bool else 'a string'}, got {shown(value)}", name)
    return value
