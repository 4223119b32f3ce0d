"""When an escalating alias ([aliases.NAME] small = "s", large = "l", escalate_when = { ... })
sends a request to its large model: the rules an operator reads in config.toml, and the one that
asks the small model itself.

The declared rules read a request's body as it came (`RequestTraits`): its text's length, its
thread's messages, tools, a response format, its tenant's tier. They cost nothing and are tried
first, in ESCALATION_RULES' order; the first that holds is the one counted in /metrics.

`min_confidence` is tried only when none of them holds: the small model answers the request's
own messages greedily for `confidence_tokens` tokens, and when the geometric mean of those
tokens' probabilities is under the bound, the large model serves instead. The probe's tokens are
never shown or billed (they are the operator's choice of rule); its prompt lands in the small
model's prefix cache under the tenant's own scope, so a request that stays small reads it back.
It reads the request's new messages only, not a thread's stored history: a thread that went up
stays up, and one that stayed small is probed again on its next turn.

pipeline.pick runs it; fleet.py's Fleet applies the declared rules.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from chatd.config import AliasConfig
from chatd.engine import CacheScope, EngineUnavailable, ParamError, Placement, SamplingParams
from chatd.http.errors import APIError
from chatd.http.models.served_model import ServedModel

# The escalation rules in the order they are tried: the first that holds is the one counted.
ESCALATION_RULES = ("tiers", "tools", "response_format", "prompt_chars", "messages")
PROBE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class RequestTraits:
    """What an escalation rule reads of a request, before it is parsed (`request_traits`)."""

    prompt_chars: int = 0  # the text of its messages, prompt or input items
    messages: int = 0  # its messages (or input items), and its thread's stored ones once counted
    tools: bool = False
    response_format: bool = False
    # What the confidence probe reads: its messages as (role, text), or a completion's prompt.
    said: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    prompt: str | None = field(default=None, compare=False, repr=False)

    def with_history(self, num_stored: int) -> RequestTraits:
        return dataclasses.replace(self, messages=self.messages + num_stored)


def request_traits(body) -> RequestTraits:
    """A body's traits as it came: chat `messages`, a completion's `prompt`, a conversation
    message's `content`, a response's `input`; its parser refuses what is malformed."""
    if not isinstance(body, dict):
        return RequestTraits()
    given = body.get("messages") if "messages" in body else body.get("input", body.get("prompt", body.get("content")))
    items = given if isinstance(given, list) else [given]
    chars = sum(_text_length(item) for item in items)
    text = body.get("text")
    structured = body.get("response_format") or (text.get("format") if isinstance(text, dict) else None)
    wants_format = isinstance(structured, dict) and structured.get("type") not in (None, "text")
    prompt = body.get("prompt") if "messages" not in body and isinstance(body.get("prompt"), str) else None
    # A completion is probed with its prompt as text (one, not a batch), chat with a list of messages.
    said = () if "prompt" in body or "messages" in body and not isinstance(given, list) else _said(items)
    return RequestTraits(chars, len(items), bool(body.get("tools")), wants_format, said, prompt)


def _text(item) -> str | None:
    """The text of a message or item: its content as a string, or its parts' texts (one level: a
    body nested deeper is refused by its parser, and must not cost a recursion here)."""
    content = item.get("content", item.get("text", item.get("output"))) if isinstance(item, dict) else item
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part if isinstance(part, str) else part["text"]
                       if isinstance(part, dict) and isinstance(part.get("text"), str) else "" for part in content)
    return None


def _text_length(item) -> int:
    text = _text(item)
    return len(text) if text is not None else 0


def _said(items: list) -> tuple[tuple[str, str], ...]:
    """The messages a probe renders: each item's role (a bare string is the user's) and text;
    tool calls and their outputs are left out (a template may not render them alone)."""
    said = []
    for item in items:
        given = item.get("role") if isinstance(item, dict) else None
        role = "user" if isinstance(item, str) else PROBE_ROLES.get(given) if isinstance(given, str) else None
        text = _text(item)
        if role is not None and text:
            said.append((role, text))
    return tuple(said)


def escalation(alias: AliasConfig, tier_name: str, traits: RequestTraits) -> str | None:
    """The first of the alias's declared rules that holds of a request, or None: it stays on the
    small model (unless its confidence says otherwise: `confidence`)."""
    rules = alias.escalate_when
    holds = {"tiers": tier_name in rules.tiers, "tools": rules.tools and traits.tools,
             "response_format": rules.response_format and traits.response_format,
             "prompt_chars": 0 < rules.prompt_chars < traits.prompt_chars,
             "messages": 0 < rules.messages < traits.messages}
    return next((rule for rule in ESCALATION_RULES if holds[rule]), None)


async def confidence(small: ServedModel, traits: RequestTraits, num_tokens: int, placement: Placement,
                     scope: Callable[[list[int]], CacheScope]) -> float | None:
    """The small model's confidence in its reply to the request: the geometric mean probability
    of its first `num_tokens` greedy tokens, in (0, 1]. None when there is nothing to measure: no
    text, a text its template or context window refuses (the request's own parsing says so, on
    the model chosen), an engine that refuses or stops. The caller holds `small` in use."""
    try:
        if traits.prompt is not None:
            prompt = await small.encode_prompt(traits.prompt)
        elif traits.said:
            prompt = await small.encode_chat([{"role": role, "content": text} for role, text in traits.said])
        else:
            return None
    except APIError:
        return None
    room = small.max_model_len - num_tokens
    if not prompt or room < 1:
        return None
    prompt = prompt[-room:]  # its end: what the reply follows
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, logprobs=0)
    try:
        handle = small.engine.generate(prompt, params, placement, scope(prompt))
    except (ParamError, EngineUnavailable):
        return None
    logprobs: list[float] = []
    try:
        async for out in handle:
            for choice in out.outputs:
                logprobs.extend(lp.logprob for lp in choice.logprobs or ())
            if out.error:
                return None
    finally:
        handle.abort()  # a no-op once it finished; frees it if this task is cancelled
    return math.exp(sum(logprobs) / len(logprobs)) if logprobs else None
