"""OpenAI's response shapes, built from the engine's outputs: streamed chunks, whole responses,
usage, logprobs and finish reasons.

Pure shaping of dicts (and, for a stream's every token, of their JSON from prepared parts): it
knows nothing of HTTP, SSE framing (wire.py) or the store. The serving model's name and its
token texts (for logprobs) are given.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

from chatd.engine import FinishReason, RequestOutput
from chatd.http.tool_calls import ToolCall, ToolCallDelta, ToolCallStream, ToolParser


def merged_with(merged: RequestOutput | None, out: RequestOutput) -> RequestOutput:
    """The deltas so far with `out` folded in; the first delta starts them."""
    if merged is None:
        return out
    merged.merge(out)
    return merged


class ChunkFormat:
    """Builds one response's OpenAI chunks (`chat.completion.chunk` or `text_completion`) from deltas."""

    def __init__(self, model: str, token_text: Callable[[int], str], response_id: str, created: int, chat: bool,
                 include_usage: bool, extra: dict | None = None, tool_parser: ToolParser | None = None) -> None:
        """model: the name of the model that serves it; token_text: that model's token texts."""
        self.model, self.token_text = model, token_text
        self.response_id, self.created, self.chat = response_id, created, chat
        self.include_usage, self.extra = include_usage, extra or {}
        self.tool_parser = tool_parser  # set when the model may call tools: its text is read for calls
        self._tool_streams: dict[int, ToolCallStream] = {}  # per choice
        self._text_parts: dict[int, tuple[bytes, bytes]] = {}  # per choice: a text delta's JSON around its text

    def role_chunks(self, n: int) -> list[dict]:
        """Chat streams open each choice with a chunk that carries the role."""
        if not self.chat:
            return []
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
                for i in range(n)]

    def delta_chunk(self, out: RequestOutput) -> dict | None:
        """The chunk for one (merged) delta; None when it carries nothing to send."""
        # A token with no text yet (half a UTF-8 character) still sends its logprobs.
        choices = [self._choice(c) for c in out.outputs if c.text or c.finish_reason or c.logprobs]
        # Text held back by a tool-call parser (a marker may be starting) leaves nothing to send.
        choices = [c for c in choices if not self.chat or c["delta"] or c["finish_reason"] or c["logprobs"]]
        return self.chunk(choices) if choices else None

    def delta_json(self, out: RequestOutput) -> bytes | None:
        """`delta_chunk`'s JSON. A delta of one choice that is only text (most of a stream's tokens)
        is the choice's prepared bytes around its text: the same bytes, without building the dicts."""
        if len(out.outputs) == 1 and (not self.chat or self.tool_parser is None):
            c = out.outputs[0]
            if c.text and c.finish_reason is None and not c.logprobs:
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

    def _choice(self, c) -> dict:
        finish = finish_reason(c.finish_reason)
        logprobs = _logprobs(self.token_text, c.logprobs, self.chat) if c.logprobs else None
        if self.chat and self.tool_parser is not None:
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
        if self.chat:
            delta = {"content": c.text} if c.text else {}
            return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": finish}

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
                   created: int, chat: bool, extra: dict | None = None, tool_parser: ToolParser | None = None) -> dict:
    """A finished request as one `chat.completion` or `text_completion`: the choices of each of its
    engine requests (a completion has one per prompt, its choices already numbered), usage summed.
    With a `tool_parser`, a chat reply's tool calls become the message's `tool_calls`."""
    choices = []
    for c in (c for out in outputs for c in out.outputs):
        logprobs = _logprobs(token_text, c.logprobs, chat) if c.logprobs else None
        finish = finish_reason(c.finish_reason)
        if chat:
            message = {"role": "assistant", "content": c.text}
            if tool_parser is not None:
                content, calls = tool_parser.parse(c.text, cut=finish in CUT_SHORT)
                message["content"] = content if calls else content or ""  # a cut reply's half call is no content
                if calls:
                    message["tool_calls"] = [tool_call_json(call) for call in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        else:
            choices.append({"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": finish})
    return {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        **(extra or {}),
        "choices": choices,
        "usage": output_usage(*outputs),
    }


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


def _logprobs(token: Callable[[int], str], logprobs, chat: bool) -> dict:
    if chat:
        return {"content": [
            {
                "token": token(lp.token_id),
                "logprob": lp.logprob,
                "bytes": list(token(lp.token_id).encode()),
                "top_logprobs": [{"token": token(t), "logprob": v, "bytes": list(token(t).encode())} for t, v in lp.top.items()],
            }
            for lp in logprobs
        ]}
    return {
        "tokens": [token(lp.token_id) for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token(t): v for t, v in lp.top.items()} for lp in logprobs],
    }
