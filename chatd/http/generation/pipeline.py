"""The stages every generating route runs, in one order: chat and text completions
(routes/completions.py), conversation messages and Responses (turns.py).

  pick     the model (`pick`: models/fleet.py's choice, and an escalating alias's small model asked
           how sure it is, models/escalation.py), before the route parses the body against its limits
  check    a store that can bill it, and what its tier refuses whatever the prompt (a refused
           flood costs no tokenizing)
  screen   the safety pipeline's input check on the texts the model will read (http/server/safety.py)
  render   the route's own prompts, tokenized: a chat template, a text prompt, a history
  grammar  a structured output compiled for its tenant (errors name the field)
  admit    the tier's buckets and ceilings (admission/limits.py): the reply's length decided, a lease on
           the buckets, a place among the engine's requests
  launch   one engine request per prompt; a refusal names the client's own fields

With [tracing] on, each stage that runs is a span (telemetry/tracing.py): chatd.pick, chatd.check, and so on.

A route says what differs (a `Generation`: its texts and its prompts); `start` runs the stages
and hands back a `Started`: the request as admitted, passed whole from here on. What follows is
the route's own: rows (a turn), the output watch, streaming, billing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from chatd.engine import (CacheScope, EngineUnavailable, LimitError, ParamError, Placement, RequestHandle, SamplingParams,
                          StructuredOutput)
from chatd.http.models import escalation
from chatd.http.errors import APIError
from chatd.http.models.escalation import RequestTraits
from chatd.http.models.fleet import Choice
from chatd.http.models.served_model import ServedModel
from chatd.http.admission.limits import Lease
from chatd.http.openai.protocol import GenerationRequest
from chatd.http.server.state import ServerState
from chatd.store.db import Tenant


class Generation(Protocol):
    """What one generating route gives the pipeline."""

    gen: GenerationRequest
    endpoint: str  # what its usage and safety records are filed under

    async def input_texts(self) -> list[str]:
        """What the client sent that the model will read, as texts for the input check."""

    def use_input_texts(self, texts: list[str]) -> None:
        """The checked texts (masked where a policy redacts) in place of what was sent."""

    async def prompts(self) -> dict[str, list[int]]:
        """Its prompts rendered and tokenized, each under the name of the field it came from."""


@dataclass(frozen=True)
class Admitted:
    """A request admitted under its tenant's tier: what the engine gets, decided once."""

    tenant: Tenant
    params: SamplingParams  # the request's, with the reply's length as the tier allows it
    placement: Placement
    lease: Lease  # released with the tokens used when generation ends (Lease.release)
    max_tokens_field: str  # the name the client gave the reply's length, for errors


@dataclass(frozen=True)
class Started:
    """A request the pipeline started: its admission, its prompts and one engine request each."""

    admitted: Admitted
    prompts: dict[str, list[int]]
    handles: list[RequestHandle]


async def start(state: ServerState, served: ServedModel, tenant: Tenant, route: Generation, request_id: str | None,
                arrived_at: float | None = None, conversation_id: str | None = None) -> Started:
    """Run every stage for one request on the model `served`; an error (APIError, ParamError)
    leaves nothing held."""
    stage = state.tracing.stage  # each stage's span (telemetry/tracing.py); off, a null context
    with stage("chatd.check"):
        check(state, served, tenant, route.gen)
    if state.safety.config.check_input:
        with stage("chatd.screen"):
            texts = await route.input_texts()
            route.use_input_texts(await state.safety.check_input(tenant, route.endpoint, texts, request_id,
                                                                 conversation_id, served.name))
    with stage("chatd.render") as span:
        prompts = await route.prompts()
        if span is not None:
            span.set_attribute("gen_ai.usage.input_tokens", sum(map(len, prompts.values())))
    if route.gen.params.structured is not None:
        with stage("chatd.grammar"):
            await check_structured(served, route.gen.params.structured, tenant)
    with stage("chatd.admit"):
        admitted = await admit(state, served, tenant, route.gen, list(prompts.values()), arrived_at)
    try:
        handles = launch(state, served, admitted, prompts)
    except BaseException:
        admitted.lease.release(0)
        raise
    return Started(admitted, prompts, handles)


async def pick(state: ServerState, requested: str | None, tenant: Tenant, thread_model: str | None = None,
               traits: RequestTraits = RequestTraits()) -> ServedModel:
    """The chat model that serves a generating request (ServerState.choose_model; 404 and 403 for
    names it may not use). When an escalating alias keeps it on the small model and the alias has
    a `min_confidence`, the small model answers the request's own messages for a few tokens first
    (models/escalation.py), under the tenant's limits as they stand (a refused flood costs no probe), its
    priority and its prefix-cache scope; too unsure, and the large model serves it."""
    with state.tracing.stage("chatd.pick") as span:
        served = await _pick(state, requested, tenant, thread_model, traits)
        if span is not None:
            span.set_attribute("gen_ai.request.model", served.name)
        return served


async def _pick(state: ServerState, requested: str | None, tenant: Tenant, thread_model: str | None,
                traits: RequestTraits) -> ServedModel:
    choice = state.choose_model(requested, tenant, thread_model, traits)
    alias = state.fleet.aliases.get(choice.alias) if choice.alias is not None else None
    rules = alias.escalate_when if alias is not None and alias.small else None
    if rules is not None and rules.min_confidence and choice.why == "none" and (traits.said or traits.prompt):
        small = choice.model
        placement = state.limits.placement(tenant, 0)
        state.limits.precheck(tenant, placement.priority, _drain_rate(small), small.name)
        async with small.in_use():
            sure = await escalation.confidence(small, traits, rules.confidence_tokens, placement,
                                               lambda prompt: cache_scope(state, small, tenant, prompt))
        if sure is not None and sure < rules.min_confidence:
            choice = Choice(state.fleet.by_name(alias.large), choice.alias, "confidence")
    state.fleet.told(choice)
    return choice.model


def check(state: ServerState, served: ServedModel, tenant: Tenant, gen: GenerationRequest) -> None:
    """Refuse now what would be refused whatever the prompt: a store that cannot bill (503), the
    tier's own limits (429, 503)."""
    state.check_store_writable()
    priority = state.limits.placement(tenant, gen.priority).priority
    state.limits.precheck(tenant, priority, _drain_rate(served), served.name)


async def check_structured(served: ServedModel, spec: StructuredOutput | None, tenant: Tenant) -> None:
    """Compile a tenant's structured output for the model's vocabulary before its request is
    queued, off the event loop (a big schema takes a while); ParamError naming the field if it
    cannot be compiled."""
    if spec is not None:
        await served.off_loop(served.engine.check_structured, spec, tenant.id)


async def admit(state: ServerState, served: ServedModel, tenant: Tenant, gen: GenerationRequest,
                prompts: list[list[int]], arrived_at: float | None = None) -> Admitted:
    """Admit tokenized prompts under the tenant's tier, or refuse them (429, 503, 400: admission/limits.py).
    The reply's length is decided here and only here: the client's, within the tier's ceiling (the
    ceiling, within the context window, when the client names none)."""
    max_tokens = state.limits.max_tokens(tenant, gen.params.max_tokens, gen.max_tokens_field)
    longest = max(map(len, prompts))
    if gen.params.max_tokens is None and max_tokens is not None:
        max_tokens = max(1, min(max_tokens, served.max_model_len - longest))
    params = gen.params if max_tokens == gen.params.max_tokens else dataclasses.replace(gen.params, max_tokens=max_tokens)
    n = params.n
    window = served.max_model_len
    reserved = sum(len(p) + n * (max_tokens if max_tokens is not None else window - len(p)) for p in prompts)
    placement = state.limits.placement(tenant, gen.priority)
    lease = await state.limits.admit_async(tenant, sum(map(len, prompts)), reserved, placement.priority,
                                           _drain_rate(served), gen.max_tokens_field, arrived_at, served.name)
    return Admitted(tenant, params, placement, lease, gen.max_tokens_field)


def launch(state: ServerState, served: ServedModel, admitted: Admitted,
           prompts: dict[str, list[int]]) -> list[RequestHandle]:
    """Queue one engine request per prompt. One the engine refuses ends those queued before it,
    and the error names the prompt's field and the reply length's as the client sent them."""
    handles: list[RequestHandle] = []
    for name, prompt in prompts.items():
        try:
            handles.append(served.engine.generate(prompt, admitted.params, admitted.placement,
                                                  cache_scope(state, served, admitted.tenant, prompt)))
        except (ParamError, EngineUnavailable) as exc:
            for handle in handles:
                handle.abort()
            if isinstance(exc, ParamError):
                raise refusal(exc, name, admitted.max_tokens_field) from None
            if not served.reloads:
                raise  # one model alone: 503 engine_unavailable, as /health says (errors.py)
            # One of several, dead since it was picked: the next request for it loads it again.
            raise APIError(503, f"the model {served.name!r} stopped ({exc}); it is loaded again on the next request",
                           "model", "model_unavailable", headers={"Retry-After": "5"}) from None
    return handles


def refusal(exc: ParamError, prompt_name: str, max_tokens_field: str) -> APIError:
    """The engine's refusal in the client's terms: a limit names the client's fields (chat sent
    `messages`, a batch `prompt[3]`, the reply's length may be `max_completion_tokens`)."""
    if not isinstance(exc, LimitError):
        return APIError(400, str(exc), exc.param)
    param = prompt_name if exc.param == "prompt" else max_tokens_field
    return APIError(400, exc.says(prompt_name, max_tokens_field), param,
                     "context_length_exceeded" if exc.context_exceeded else None)


def cache_scope(state: ServerState, served: ServedModel, tenant: Tenant, prompt: list[int]) -> CacheScope:
    """The prefix-cache scope of a tenant's prompt (within the model's own cache: each model's
    engine has its own).

    With auth on and scope "tenant", blocks are salted by tenant: nobody can learn from
    cached_tokens or timing what another tenant sent. A prompt that begins with a shared
    system prompt leaves those blocks unsalted, so everyone shares them on purpose.
    """
    if not state.config.auth.enabled or state.config.cache.prefix_cache_scope == "global":
        return CacheScope()
    shared = 0
    for prefix in served.shared_prefixes:
        common = _common_prefix_length(prefix, prompt)
        if common >= len(prefix) - 1:  # the last token may merge with what follows it
            shared = max(shared, common)
    return CacheScope(tenant.id, shared)


def _drain_rate(served: ServedModel) -> Callable[[], float | None]:
    """How fast the model's engine drains its queue of prompt tokens (the tiers' expected-wait estimate)."""
    return lambda: served.engine.stats().queued_prefill_rate if served.engine is not None else None


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
