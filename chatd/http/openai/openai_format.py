"""OpenAI's response shapes, built from the engine's outputs: streamed chunks, whole responses,
usage, logprobs, finish reasons, and what a reply shows of its prompt (`echo`, vLLM's
`prompt_logprobs`).

Pure shaping of dicts (and, for a stream's every token, of their JSON from prepared parts): it
knows nothing of HTTP, SSE framing (server/wire.py) or the store. The serving model's name and its
token texts (for logprobs) are given.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from chatd.engine import CompletionOutput, FinishReason, Logprob, RequestOutput
from chatd.http.tools.tool_calls import ToolCall, ToolCallDelta, ToolCallStream, ToolParser


def merged_with(merged: RequestOutput | None, out: RequestOutput) -> RequestOutput:
    """The deltas so far with `out` folded in; the first delta starts them."""
    if merged is None:
        return out
    merged.merge(out)
    return merged


@dataclass(frozen=True)
class PromptShown:
    """What a reply shows of its prompts besides the model's tokens: a completion's `echo` (each
    prompt's text before its choices' text, and with `logprobs` its tokens' logprobs before theirs)
    and vLLM's `prompt_logprobs` (on a completion's choices; at the top of a chat reply, on a chat
    stream's first chunk). Prompt p's choices are numbered p * n to p * n + n - 1."""

    n: int = 1
    texts: tuple[str, ...] | None = None  # echo: each prompt's text, as the model read it
    logprobs: int | None = None  # echo with logprobs: the alternatives each echoed token shows
    prompt_logprobs: int | None = None  # vLLM's field: the alternatives each prompt token shows

    @property
    def on_choices(self) -> bool:
        """A completion's choices open with it (a chat's prompt_logprobs are the reply's own)."""
        return self.texts is not None or self.prompt_logprobs is not None

    def text(self, index: int) -> str:
        """The echoed text that choice `index` opens with ("" without echo)."""
        return self.texts[index // self.n] if self.texts is not None else ""


class ChunkFormat:
    """Builds one response's OpenAI chunks (`chat.completion.chunk` or `text_completion`) from deltas."""

    def __init__(self, model: str, token_text: Callable[[int], str], response_id: str, created: int, chat: bool,
                 include_usage: bool, extra: dict | None = None, tool_parser: ToolParser | None = None,
                 shown: PromptShown | None = None) -> None:
        """model: the name of the model that serves it; token_text: that model's token texts; shown:
        what the reply shows of its prompts."""
        self.model, self.token_text = model, token_text
        self.response_id, self.created, self.chat = response_id, created, chat
        self.include_usage, self.extra = include_usage, extra or {}
        self.tool_parser = tool_parser  # set when the model may call tools: its text is read for calls
        self.shown = shown
        self._tool_streams: dict[int, ToolCallStream] = {}  # per choice
        self._text_parts: dict[int, tuple[bytes, bytes]] = {}  # per choice: a text delta's JSON around its text
        self._opened: set[int] = set()  # choices whose first chunk (with the prompt shown) has gone out
        self._text_offsets: dict[int, int] = {}  # per choice: the next token's text_offset
        self._prompts: dict[int, RequestOutput] = {}  # per prompt: a delta of its request, with its prompt_logprobs

    @property
    def opens_after_prefill(self) -> bool:
        """A chat stream whose first chunk carries the prompt's logprobs waits for them to open."""
        return self.chat and self.shown is not None and self.shown.prompt_logprobs is not None

    def role_chunks(self, n: int, first: RequestOutput | None = None) -> list[dict]:
        """Chat streams open each choice with a chunk that carries the role; the first carries the
        prompt's logprobs when asked (`first`: the request's first delta, which has them)."""
        if not self.chat:
            return []
        chunks = [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}]) for i in range(n)]
        if first is not None and self.opens_after_prefill:
            chunks[0]["prompt_logprobs"] = _prompt_logprobs_json(self.token_text, first, self.shown.prompt_logprobs)
        return chunks

    def delta_chunk(self, out: RequestOutput) -> dict | None:
        """The chunk for one (merged) delta; None when it carries nothing to send."""
        if self._opens_choices() and out.outputs:  # kept for the prompt's choices that open later
            prompt = out.outputs[0].index // self.shown.n
            if prompt not in self._prompts or out.prompt_logprobs is not None:
                self._prompts[prompt] = out
        # A token with no text yet (half a UTF-8 character) still sends its logprobs; a choice's first
        # chunk shows its prompt.
        choices = [self._choice(c) for c in out.outputs
                   if c.text or c.finish_reason or c.logprobs or self._unopened(c.index)]
        # Text held back by a tool-call parser (a marker may be starting) leaves nothing to send.
        choices = [c for c in choices if not self.chat or c["delta"] or c["finish_reason"] or c["logprobs"]]
        return self.chunk(choices) if choices else None

    def delta_json(self, out: RequestOutput) -> bytes | None:
        """`delta_chunk`'s JSON. A delta of one choice that is only text (most of a stream's tokens)
        is the choice's prepared bytes around its text: the same bytes, without building the dicts."""
        if len(out.outputs) == 1 and (not self.chat or self.tool_parser is None):
            c = out.outputs[0]
            if c.text and c.finish_reason is None and not c.logprobs and not self._unopened(c.index):
                parts = self._text_parts.get(c.index)
                if parts is None:
                    parts = self._text_parts[c.index] = self._text_delta_parts(c.index)
                return parts[0] + orjson.dumps(c.text) + parts[1]
        chunk = self.delta_chunk(out)
        return None if chunk is None else orjson.dumps(chunk)

    def _text_delta_parts(self, index: int) -> tuple[bytes, bytes]:
        """A text delta's chunk as JSON, cut where its text goes."""
        marker = "\x00text\x00"  # a string no envelope field holds
        choice = {"index": index, "delta": {"content": marker}} if self.chat else {"index": index, "text": marker}
        whole = orjson.dumps(self.chunk([{**choice, "logprobs": None, "finish_reason": None}]))
        before, after = whole.split(orjson.dumps(marker))
        return before, after

    def usage_chunk(self, *merged: RequestOutput) -> dict:
        """The last chunk of a stream that asked for `include_usage`: no choices, the whole usage
        (of every prompt's request, when a completion had several)."""
        return {**self._envelope([]), "usage": output_usage(*merged)}

    def chunk(self, choices: list[dict]) -> dict:
        """A chunk around the given choices (with `usage: null` when the stream asked for usage)."""
        return {**self._envelope(choices), "usage": None} if self.include_usage else self._envelope(choices)

    def _opens_choices(self) -> bool:
        return not self.chat and self.shown is not None and self.shown.on_choices

    def _unopened(self, index: int) -> bool:
        """Choice `index` has a prompt to show in a first chunk that has not gone out."""
        return self._opens_choices() and index not in self._opened

    def _choice(self, c: CompletionOutput) -> dict:
        finish = finish_reason(c.finish_reason)
        if not self.chat:
            return self._text_choice(c, finish)
        logprobs = _chat_logprobs(self.token_text, c.logprobs) if c.logprobs else None
        if self.tool_parser is not None:
            stream = self._tool_streams.setdefault(c.index, self.tool_parser.stream())
            content, calls = stream.feed(c.text) if c.text else ("", [])
            if c.finish_reason is not None:
                rest, more = stream.finish(cut=finish in CUT_SHORT)
                content, calls = content + rest, calls + more
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [_tool_call_delta(call) for call in calls]
            if finish == "stop" and stream.calls:
                finish = "tool_calls"
            return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        delta = {"content": c.text} if c.text else {}
        return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _text_choice(self, c: CompletionOutput, finish: str | None) -> dict:
        """A completion choice's delta. Its first shows its prompt before it (echo, prompt_logprobs);
        text_offset runs on from chunk to chunk, as in the whole reply."""
        shown, text, prompt = self.shown, c.text, None
        opening = self._unopened(c.index)
        if opening:
            self._opened.add(c.index)
            prompt = self._prompts.get(c.index // shown.n)
            text = shown.text(c.index) + c.text
        offset, logprobs = self._text_offsets.get(c.index, 0), None
        if opening and shown.texts is not None and shown.logprobs is not None:
            logprobs = _echoed_logprobs(self.token_text, prompt, c, shown.logprobs)
        elif c.logprobs:
            logprobs = _completion_logprobs(self.token_text, [lp.token_id for lp in c.logprobs], c.logprobs, offset=offset)
        if logprobs is not None:
            self._text_offsets[c.index] = _end_offset(logprobs, offset)
        choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if opening and shown.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _prompt_logprobs_json(self.token_text, prompt, shown.prompt_logprobs)
        return choice

    def _envelope(self, choices: list[dict]) -> dict:
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            **self.extra,
            "choices": choices,
        }


def whole_response(model: str, token_text: Callable[[int], str], outputs: list[RequestOutput], response_id: str,
                   created: int, chat: bool, extra: dict | None = None, tool_parser: ToolParser | None = None,
                   shown: PromptShown | None = None) -> dict:
    """A finished request as one `chat.completion` or `text_completion`: the choices of each of its
    engine requests (a completion has one per prompt, its choices already numbered), usage summed.
    With a `tool_parser`, a chat reply's tool calls become the message's `tool_calls`; `shown`:
    what it shows of its prompts."""
    choices = []
    for out, c in ((out, c) for out in outputs for c in out.outputs):
        finish = finish_reason(c.finish_reason)
        if chat:
            logprobs = _chat_logprobs(token_text, c.logprobs) if c.logprobs else None
            message = {"role": "assistant", "content": c.text}
            if tool_parser is not None:
                content, calls = tool_parser.parse(c.text, cut=finish in CUT_SHORT)
                message["content"] = content if calls else content or ""  # a cut reply's half call is no content
                if calls:
                    message["tool_calls"] = [tool_call_json(call) for call in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        else:
            choices.append(_whole_text_choice(token_text, out, c, finish, shown))
    whole = {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        **(extra or {}),
        "choices": choices,
        "usage": output_usage(*outputs),
    }
    if chat and shown is not None and shown.prompt_logprobs is not None and outputs:
        whole["prompt_logprobs"] = _prompt_logprobs_json(token_text, outputs[0], shown.prompt_logprobs)
    return whole


def _whole_text_choice(token_text: Callable[[int], str], out: RequestOutput, c: CompletionOutput, finish: str | None,
                       shown: PromptShown | None) -> dict:
    """A whole completion choice, its prompt's text and logprobs before its own when echoed."""
    if shown is not None and shown.texts is not None and shown.logprobs is not None:
        logprobs = _echoed_logprobs(token_text, out, c, shown.logprobs)
    else:
        logprobs = _completion_logprobs(token_text, [lp.token_id for lp in c.logprobs], c.logprobs) if c.logprobs else None
    choice = {"index": c.index, "text": (shown.text(c.index) if shown else "") + c.text, "logprobs": logprobs,
              "finish_reason": finish}
    if shown is not None and shown.prompt_logprobs is not None:
        choice["prompt_logprobs"] = _prompt_logprobs_json(token_text, out, shown.prompt_logprobs)
    return choice


def tool_call_json(call: ToolCall) -> dict:
    """A whole tool call as OpenAI writes it in a message."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tool_call_delta(delta: ToolCallDelta) -> dict:
    # A call's first delta names it; the rest carry pieces of its arguments.
    if delta.id is not None:
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": delta.arguments}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


# Finish reasons of a reply stopped by something other than the model: the token budget, or the
# output check. A tool call it was writing is half written; its markup never reaches `content`.
CUT_SHORT = ("length", "content_filter")


def finish_reason(reason: FinishReason | None) -> str | None:
    """The engine's finish reason as OpenAI names it: "length", "content_filter" (the output check
    cut it), "stop", or None while unfinished."""
    if reason is None:
        return None
    if reason in (FinishReason.LENGTH, FinishReason.CONTENT_FILTER):
        return reason.value
    return "stop"


def token_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's `usage` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def output_usage(*outputs: RequestOutput) -> dict:
    """The `usage` of (merged) outputs, every choice's tokens counted: one request's, or the sum
    over a completion's prompts."""
    return token_usage(sum(len(out.prompt_token_ids) for out in outputs),
                       sum(len(c.token_ids) for out in outputs for c in out.outputs),
                       sum(out.num_cached_tokens for out in outputs))


def _chat_logprobs(token: Callable[[int], str], logprobs: list[Logprob]) -> dict:
    return {"content": [
        {
            "token": token(lp.token_id),
            "logprob": lp.logprob,
            "bytes": list(token(lp.token_id).encode()),
            "top_logprobs": [{"token": token(t), "logprob": v, "bytes": list(token(t).encode())} for t, v in lp.top.items()],
        }
        for lp in logprobs
    ]}


def _completion_logprobs(token: Callable[[int], str], token_ids: list[int], logprobs: list[Logprob | None],
                        top: int | None = None, offset: int = 0) -> dict:
    """OpenAI's legacy `logprobs` object over tokens: null where a token has none (a prompt's
    first), each token's `top` likeliest alternatives (None: all the engine gave). text_offset
    counts from `offset` as vLLM counts it: the length of the token texts before it, which is the
    token's place in the text wherever the token texts spell it (byte-level BPE, as OpenAI's)."""
    tokens = [token(t) for t in token_ids]
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
        "top_logprobs": [None if lp is None else {token(t): v for t, v in _likeliest(lp.top, top)}
                         for lp in logprobs],
        "text_offset": list(itertools.accumulate(map(len, tokens[:-1]), initial=offset)) if tokens else [],
    }


def _echoed_logprobs(token: Callable[[int], str], out: RequestOutput | None, c: CompletionOutput, top: int) -> dict:
    """An echoed choice's legacy logprobs: its prompt's tokens (the first without a logprob; each
    with its `top` likeliest of the alternatives computed), then its own."""
    prompt_ids = out.prompt_token_ids if out is not None else []
    entries = (out.prompt_logprobs if out is not None else None) or [None] * len(prompt_ids)
    prompt = _completion_logprobs(token, prompt_ids, entries, top)
    own = c.logprobs or []
    reply = _completion_logprobs(token, [lp.token_id for lp in own], own, offset=_end_offset(prompt, 0))
    return {key: prompt[key] + reply[key] for key in prompt}


def _end_offset(logprobs: dict, offset: int) -> int:
    """The text_offset of the token after those of a legacy logprobs object."""
    if not logprobs["tokens"]:
        return offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def _prompt_logprobs_json(token: Callable[[int], str], out: RequestOutput | None, top: int) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (the first null), {token id: {logprob, rank,
    decoded_token}} for the token itself and its `top` likeliest alternatives (ranked 1 to top)."""
    if out is None or out.prompt_logprobs is None:
        return None
    shown = []
    for lp in out.prompt_logprobs:
        if lp is None:
            shown.append(None)
            continue
        position = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": token(lp.token_id)}}
        for rank, (t, v) in enumerate(_likeliest(lp.top, top), 1):
            position.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": token(t)})
        shown.append(position)
    return shown


def _likeliest(top: dict[int, float], k: int | None) -> list[tuple[int, float]]:
    """The k likeliest alternatives (all for None), likeliest first."""
    return sorted(top.items(), key=lambda item: -item[1])[:k]
