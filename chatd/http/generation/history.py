"""A turn's prompt: the stored history (a conversation's, or a chain of responses') and the new
messages, rendered through the chat template and trimmed from the oldest turns until it fits the
context window.

Plain CPU work on text (the server runs it in its tokenizing threads); it knows nothing of
HTTP streams or the store beyond the records it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from chatd.http.errors import APIError
from chatd.http.models.served_model import ServedModel
from chatd.http.openai.protocol import GenerationRequest, TurnRequest
from chatd.http.tools.tools import described_in_messages
from chatd.store.records import Conversation, Message


def render_turn(served: ServedModel, conversation: Conversation, history: list[Message],
                turn: TurnRequest) -> tuple[list[int], int]:
    """The prompt for a conversation turn on the model `served`, and how many of the oldest
    messages were left out to fit its window."""
    return render_history(served, conversation.system_prompt, history, [{"role": "user", "content": turn.content}],
                          turn.gen, trim=True, param="content")


def past_messages(history: list[Message]) -> list[Message]:
    """The stored messages a prompt holds: failed replies are left out (their user message
    stays); a partial reply counts with the text it has."""
    return [m for m in history if m.role != "assistant" or (m.status != "error" and m.content)]


def template_messages(items: list[tuple[str, str, dict | None]]) -> tuple[list[dict], list[int]]:
    """Items (role, text, call) as the chat template takes messages: developer is the system role, a
    call joins the assistant message before it (or starts one) as one of its `tool_calls`, an output
    is a `tool` message. Also, for each message, the index of the item it began with."""
    messages: list[dict] = []
    starts: list[int] = []
    for i, (role, text, call) in enumerate(items):
        if call is not None and role == "assistant":
            shaped = {"id": call["call_id"], "type": "function", "function": {"name": call["name"], "arguments": _json(text)}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(shaped)
                continue
            message = {"role": "assistant", "content": "", "tool_calls": [shaped]}
        elif call is not None:
            message = {"role": "tool", "content": text, "tool_call_id": call["call_id"]}
        else:
            message = {"role": "system" if role == "developer" else role, "content": text}
        messages.append(message)
        starts.append(i)
    return messages, starts


def _json(text: str):
    """Call arguments as templates write them (`tojson`): the object where the text parses."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


@dataclass(frozen=True)
class Tools:
    """What a turn renders of its tools: those offered, and whether the template renders them (else
    they, and any calls and outputs in the history, are written into the messages as text)."""

    offered: list[dict]
    template_takes_tools: bool

    def render(self, messages: list[dict]) -> tuple[list[dict], list[dict] | None, int]:
        """The messages and tools to render, and how many messages were put in front."""
        if self.template_takes_tools:
            return messages, self.offered or None, 0
        if self.offered or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            described = described_in_messages(messages, self.offered)
            return described, None, len(described) - len(messages)
        return messages, None, 0


def render_history(served: ServedModel, system_prompt: str | None, history: list[Message], new: list[dict],
                   gen: GenerationRequest, *, trim: bool, param: str, tools: Tools | None = None) -> tuple[list[int], int]:
    """The prompt for `new` messages after a stored history, for the model `served`, and how many
    of the oldest messages had to be left out to fit its window (always 0 when `trim` is off: then
    too long is a 400). The history's token ids must be this model's (the store forgets them when
    a thread moves to another model).

    Trimming drops whole turns from the front (the first message kept is a user one) until the
    prompt and the reply's room fit the window and at most max_messages remain; the system
    prompt always stays. Runs in a worker thread. One rendering when everything fits; else
    O(log turns) renderings, none longer than what fits, so a long history costs no more than a
    short one.
    """
    window = served.max_model_len
    room = gen.params.max_tokens or min(1024, window // 4)  # what the reply needs
    served.check_text_size(sum(len(m["content"]) for m in new) + len(system_prompt or ""), param)
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    kept = past_messages(history)
    past, starts = template_messages([(m.role, m.content, m.call) for m in kept])
    tools = tools or Tools([], served.tokenizer.template_takes_tools)

    def encode(dropped: int) -> list[int]:
        messages, shown, shift = tools.render(system + past[dropped:] + new)
        # Replies go in as the ids the model generated where that is exact: the prompt then
        # starts with the very tokens the last turn left in the prefix cache.
        replies = {shift + len(system) + i: kept[starts[dropped + i]].token_ids
                   for i, m in enumerate(past[dropped:]) if kept[starts[dropped + i]].token_ids and "tool_calls" not in m}
        try:
            return served.tokenizer.encode_chat(messages, tools=shown, reply_ids=replies)
        except ValueError as exc:
            raise APIError(400, f"cannot render this conversation with the model's chat template: {exc}", param) from exc

    def fits(prompt: list[int]) -> bool:
        return len(prompt) + room <= window

    def too_long(prompt: list[int], what: str) -> APIError:
        field = gen.max_tokens_field if gen.params.max_tokens is not None and len(prompt) < window else param
        return APIError(400, f"{what} take {len(prompt)} tokens; with {room} tokens for the reply that exceeds the "
                             f"context window of {window} tokens", field, "context_length_exceeded")

    # Where trimming may cut (how many of `past` to drop): before a user message, or all of it.
    max_messages = served.config.server.max_messages
    max_past = max_messages - len(system) - len(new)
    if not trim:
        if len(past) > max_past:
            raise APIError(400, f"the history and input have {len(past) + len(new) + len(system)} messages; the limit "
                                f"is {max_messages}", param)
        served.check_text_size(sum(len(m["content"]) for m in system + past + new), param)
        prompt = encode(0)
        if not fits(prompt):
            raise too_long(prompt, "the history and input")
        return prompt, 0
    cuts = [d for d in range(len(past) + 1) if (d == len(past) or past[d]["role"] == "user") and len(past) - d <= max_past]
    bad = -1  # the highest index into cuts known not to fit (-1: none known)
    if cuts[0] == 0 and sum(len(m["content"]) for m in past) <= served.max_prompt_chars:
        prompt = encode(0)  # the usual case: everything fits
        if fits(prompt):
            return prompt, 0
        bad = 0
    good = len(cuts) - 1
    prompt = encode(cuts[good])
    if not fits(prompt):
        # The new message itself is too long, or it fits but not with the room the client asked for.
        raise too_long(prompt, "the new input and the system prompt, with every earlier message left out,")
    # Fitting only gets easier as more is dropped: keep 1, 2, 4, ... turns until one does not
    # fit, then bisect between the last cut that fit and the first that did not.
    step, bisecting = 1, False
    while good - bad > 1:
        probe = (good + bad) // 2 if bisecting else max(good - step, bad + 1)
        candidate = encode(cuts[probe])
        if fits(candidate):
            good, prompt, step = probe, candidate, step * 2
        else:
            bad, bisecting = probe, True
    return prompt, cuts[good]
