"""A conversation turn's prompt: the stored history and the new message, rendered through the
chat template and trimmed from the oldest turns until it fits the context window.

Plain CPU work on text (the server runs it in its tokenizing threads); it knows nothing of
HTTP streams or the store beyond the records it is given.
"""

from __future__ import annotations

from chatd.http.errors import APIError
from chatd.http.protocol import TurnRequest
from chatd.http.state import ServerState
from chatd.store.records import Conversation, Message


def render_turn(state: ServerState, conversation: Conversation, history: list[Message], turn: TurnRequest) -> tuple[list[int], int]:
    """The prompt for this turn and how many of the oldest messages had to be left out to fit the window.

    Failed replies are left out (their user message stays); a partial reply counts with the text
    it has. Trimming drops whole turns from the front (the first message kept is a user one)
    until the prompt and the reply's room fit the window and at most max_messages remain.
    Runs in a worker thread. One rendering when everything fits; else O(log turns) renderings,
    none longer than what fits, so a long history costs no more than a short one.
    """
    window = state.max_model_len
    room = turn.gen.params.max_tokens or min(1024, window // 4)  # what the reply needs
    state.check_text_size(len(turn.content) + len(conversation.system_prompt or ""), "content")
    system = [{"role": "system", "content": conversation.system_prompt}] if conversation.system_prompt else []
    past = [{"role": m.role, "content": m.content} for m in history
            if m.role == "user" or (m.status != "error" and m.content)]
    new = [{"role": "user", "content": turn.content}]

    def encode(dropped: int) -> list[int]:
        try:
            return state.tokenizer.encode_chat(system + past[dropped:] + new)
        except ValueError as exc:
            raise APIError(400, f"cannot render this conversation with the model's chat template: {exc}", "content") from exc

    def fits(prompt: list[int]) -> bool:
        return len(prompt) + room <= window

    # Where trimming may cut (how many of `past` to drop): before a user message, or all of it.
    max_past = state.config.server.max_messages - len(system) - 1
    cuts = [d for d in range(len(past) + 1) if (d == len(past) or past[d]["role"] == "user") and len(past) - d <= max_past]
    bad = -1  # the highest index into cuts known not to fit (-1: none known)
    if cuts[0] == 0 and sum(len(m["content"]) for m in past) <= state.max_prompt_chars:
        prompt = encode(0)  # the usual case: everything fits
        if fits(prompt):
            return prompt, 0
        bad = 0
    good = len(cuts) - 1
    prompt = encode(cuts[good])
    if not fits(prompt):
        # The message itself is too long, or it fits but not with the room the client asked for.
        param = turn.gen.max_tokens_field if turn.gen.params.max_tokens is not None and len(prompt) < window else "content"
        raise APIError(
            400, f"this message and the system prompt take {len(prompt)} tokens; with {room} tokens for the reply that "
                 f"exceeds the context window of {window} tokens even with every earlier message left out", param)
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
