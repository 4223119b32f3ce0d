"""`POST /v1/embeddings` in OpenAI's shape, from the embedding model loaded beside the chat model.

A request's `input` (a text, a list of texts, a list of token ids, a list of such lists) is
tokenized off the event loop and each input checked against what the model reads (refused by
index, never cut). It is then admitted under the tenant's tier as a generating request is (one
from the request bucket, its input tokens from the token bucket, a concurrency slot; no more
input tokens in all than its tier's max_embedding_tokens), embedded on the model's own thread in
passes shared in turn with other tenants' requests (engine/embedding_queue.py), and billed as
usage under endpoint "embeddings". `dimensions` keeps a vector's first N numbers, renormalized
(as OpenAI's text-embedding-3 models do): meaningful for Matryoshka-trained models.

The server answers 404 here when no embedding model is configured ([embeddings] model).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from chatd.engine import Embedder
from chatd.http.server.auth import TENANT
from chatd.http.errors import APIError, shown
from chatd.http.server.state import STATE, ServerState
from chatd.http.telemetry.tracing import usage_attributes
from chatd.http.server.wire import checked, read_json
from chatd.store.db import Tenant

FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
ENCODINGS = ("float", "base64")
ENDPOINT = "embeddings"  # what usage is filed under


@dataclass(frozen=True)
class EmbeddingRequest:
    """A parsed request: texts or token-id lists (one of the two), and how the vectors are wanted."""

    texts: list[str] | None
    token_ids: list[list[int]] | None
    model: str | None
    encoding_format: str
    dimensions: int | None


async def embeddings(request: web.Request) -> web.Response:
    """OpenAI's embeddings: `{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}`."""
    state = request.app[STATE]
    embedder = _embedder(state)
    tenant = request[TENANT]
    parsed = await checked(request, parse_request, await read_json(request), embedder, state.config.embeddings.max_inputs)
    check_model(state, embedder, parsed.model, tenant)
    stage = state.tracing.stage  # the same stages as a generating request's, where they apply (telemetry/tracing.py)
    with stage("chatd.check"):
        state.check_store_writable()
        priority = state.limits.placement(tenant, 0).priority
        state.limits.precheck(tenant, priority, _drain_rate(state))  # a refused flood costs no tokenizing
    with stage("chatd.render"):
        inputs = parsed.token_ids if parsed.token_ids is not None else await state.off_loop(embedder.encode, parsed.texts)
        check_lengths(inputs, embedder.max_input_tokens)
    num_tokens = sum(map(len, inputs))
    with stage("chatd.admit"):
        check_tier_size(state, tenant, num_tokens)
        lease = await state.limits.admit_async(tenant, num_tokens, num_tokens, priority, _drain_rate(state), "input")
    try:
        with stage(f"embeddings {embedder.name}", {"gen_ai.operation.name": "embeddings", "gen_ai.provider.name": "chatd",
                                                   "gen_ai.request.model": embedder.name,
                                                   "gen_ai.usage.input_tokens": num_tokens}):
            # In the tenant's turn: its passes alternate with other tenants' (engine/embedding_queue.py).
            vectors = await asyncio.wrap_future(embedder.submit(inputs, tenant.id))
    finally:
        lease.release(num_tokens)
    cost = state.config.price(embedder.name).cost(num_tokens, 0, 0)
    written = state.ledger.record_usage(tenant.id, endpoint=ENDPOINT, model=embedder.name, prompt_tokens=num_tokens,
                                        cached_tokens=0, completion_tokens=0, cost=cost)
    state.tracing.until_done("chatd.usage", written, usage_attributes(num_tokens, 0, 0))
    state.metrics.usage(tenant.tier, embedder.name, num_tokens, 0, 0, cost)
    if parsed.dimensions is not None:
        vectors = embedder.shorten(vectors, parsed.dimensions)
    return web.Response(body=orjson.dumps(response_body(vectors, parsed.encoding_format, embedder.name, num_tokens),
                                          option=orjson.OPT_SERIALIZE_NUMPY),
                        content_type="application/json")


def _embedder(state: ServerState) -> Embedder:
    if state.embedder is None:
        raise APIError(404, "embeddings are not configured on this server: its operator turns them on with [embeddings] "
                            "model in config.toml (\"default\" for all-MiniLM-L6-v2, or an embedding model's folder)",
                       None, "embeddings_not_configured")
    return state.embedder


def response_body(vectors: np.ndarray, encoding_format: str, model: str, num_tokens: int) -> dict:
    """OpenAI's list of embeddings; base64 is the float32 little-endian bytes (what the SDKs decode)."""
    if encoding_format == "base64":
        rows: list[Any] = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    else:
        rows = list(np.ascontiguousarray(vectors, dtype=np.float32))
    return {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)],
            "model": model, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def check_model(state: ServerState, embedder: Embedder, model: str | None, tenant: Tenant) -> None:
    """`model` must be the embedding model's name (or left out), and one the tenant's tier may use; 404 otherwise."""
    if model is not None and model != embedder.name:
        what = "a chat model" if model in state.model_names else "not served here"
        raise APIError(404, f"the model {shown(model)} is {what}; embeddings come from {embedder.name!r}", "model",
                       "model_not_found")
    state.limits.check_model(tenant, embedder.name)


def check_tier_size(state: ServerState, tenant: Tenant, num_tokens: int) -> None:
    """The request's input tokens within its tier's max_embedding_tokens; 400 naming the limit and the tier."""
    limit = state.limits.tier(tenant).max_embedding_tokens if state.limits.enabled else 0
    if limit and num_tokens > limit:
        raise APIError(400, f"input has {num_tokens} tokens in all; one embeddings request of tier {tenant.tier} may "
                            f"hold at most {limit} (max_embedding_tokens): send fewer inputs per request", "input",
                       "embedding_request_too_large")


def check_lengths(inputs: list[list[int]], limit: int) -> None:
    """Every input holds 1 to `limit` tokens (the model's input length); 400 naming the first that does not."""
    for i, tokens in enumerate(inputs):
        if len(tokens) > limit:
            raise APIError(400, f"input[{i}] has {len(tokens)} tokens; this embedding model reads at most {limit}",
                           "input", "context_length_exceeded")


def parse_request(body: Any, embedder: Embedder, max_inputs: int) -> EmbeddingRequest:
    """The request's fields, each checked; 400 naming the field and its limit."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise APIError(400, f"unknown field {shown(name)}; known: {', '.join(sorted(FIELDS))}", name)
    model = _optional(body, "model", str, "a string")
    _optional(body, "user", str, "a string")
    encoding = _optional(body, "encoding_format", str, "a string")
    if encoding is None:  # left out or null; an empty string is refused like any other unknown format
        encoding = "float"
    if encoding not in ENCODINGS:
        raise APIError(400, f"encoding_format must be one of {', '.join(ENCODINGS)}, got {shown(encoding)}",
                       "encoding_format")
    dimensions = _optional(body, "dimensions", int, "an integer")
    if dimensions is not None and not 1 <= dimensions <= embedder.dimensions:
        raise APIError(400, f"dimensions is {dimensions}; this model's vectors have 1 to {embedder.dimensions}",
                       "dimensions")
    texts, token_ids = parse_input(body.get("input"), max_inputs, embedder.vocab_size)
    return EmbeddingRequest(texts, token_ids, model, encoding, dimensions)


def parse_input(value: Any, max_inputs: int, vocab_size: int) -> tuple[list[str] | None, list[list[int]] | None]:
    """`input` as (texts, None) or (None, token-id lists): a text, texts, token ids, lists of token ids."""
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list) or not value:
        raise APIError(400, f"input must be a non-empty string, list of strings, list of token ids or list of such "
                            f"lists, got {shown(value)}", "input")
    elif all(_is_int(token) for token in value):
        value = [value]  # one input given as token ids
    if len(value) > max_inputs:
        raise APIError(400, f"input has {len(value)} entries; the limit is {max_inputs}", "input")
    if isinstance(value[0], str):
        for i, text in enumerate(value):
            if not isinstance(text, str) or not text:
                raise APIError(400, f"input[{i}] is {shown(text)}; every entry must be a non-empty string", "input")
        return value, None
    for i, tokens in enumerate(value):
        if not isinstance(tokens, list) or not tokens:
            raise APIError(400, f"input[{i}] is {shown(tokens)}; every entry must be a non-empty list of token ids",
                           "input")
        for j, token in enumerate(tokens):
            if not _is_int(token) or not 0 <= token < vocab_size:
                raise APIError(400, f"input[{i}][{j}] is {shown(token)}; token ids are integers in [0, {vocab_size})",
                               "input")
    return None, value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(body: dict, name: str, kind: type, described: str) -> Any:
    """A field that may be left out or null; 400 naming it when it has another type."""
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise APIError(400, f"{name} must be {described}, got {shown(value)}", name)
    return value


def model_card(embedder: Embedder) -> dict:
    """The embedding model as /v1/models lists it, beside the chat model."""
    return {"id": embedder.name, "object": "model", "created": 0, "owned_by": "chatd", "root": embedder.name,
            "context_length": embedder.max_input_tokens,
            "chatd": {"kind": "embedding", "dimensions": embedder.dimensions, "pooling": embedder.pooling.mode,
                      "normalized": embedder.pooling.normalize}}


def _drain_rate(state: ServerState) -> Callable[[], float | None]:
    """How fast the first chat model's engine drains its queue (the tiers' wait estimate reads it)."""
    first = state.fleet.primary
    return lambda: first.engine.stats().queued_prefill_rate if first.engine is not None else None
