"""OpenAI request bodies in, engine inputs out: field types, ranges and the fields chatd refuses.

A field chatd does not implement is refused with a 400 that says so, never silently ignored.
Fields that change nothing chatd computes are accepted and type-checked, as OpenAI checks them:
`user`, `safety_identifier`, `metadata`, `service_tier` (chatd serves every request one way),
`prompt_cache_key` (only logged: chatd's prefix cache finds shared prefixes by itself) and, on
chat, `verbosity` and `store` (chatd keeps no chat completions to retrieve; state lives in
conversations). Range checks on sampling values live in SamplingParams.validate; this module
checks types and OpenAI-specific rules (stop lists, logprobs pairing, stream_options, a
completion's `echo` and `max_tokens: 0`, vLLM's `prompt_logprobs`). A chat body's messages are
checked in chat_messages.py; a conversation's own fields (title, metadata) in
conversation_request.py, with this module's field checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from chatd.engine import MAX_LOGPROBS, SamplingParams, StructuredOutput
from chatd.http.tools import structured
from chatd.http.openai.chat_messages import parse_messages, text_content
from chatd.http.tools.tools import ToolRequest, parse_tools
from chatd.http.errors import APIError, shown

# Fields that change what the model must do; accepting and ignoring them would give wrong answers.
UNSUPPORTED = {
    "functions": "the deprecated function calling; use tools",
    "function_call": "the deprecated function calling; use tool_choice",
    "audio": "audio output",
    "modalities": "modalities other than text",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "reasoning_effort": "reasoning effort",
    "suffix": "suffix (insertion)",
    "best_of": "best_of",
}
SAMPLING_FIELDS = {
    "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    "stream", "stream_options", "user", "top_k", "min_p", "repetition_penalty", "ignore_eos", "priority",
    "min_tokens", "model", "logit_bias", "store", "metadata", "service_tier", "keep_alive",
}
SAMPLING_FIELDS |= structured.EXTRA_FIELDS  # chatd's (vLLM's) structured-output extensions
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                                 "prompt_cache_key", "safety_identifier", "verbosity", "tools", "tool_choice",
                                 "parallel_tool_calls", "prompt_logprobs"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "prompt_logprobs"}
TURN_FIELDS = (SAMPLING_FIELDS - {"store", "metadata"}) | {"content", "role", "max_completion_tokens", "logprobs", "top_logprobs"}
MAX_STOP = 4
# A completion may batch prompts; each is its own engine request (with n choices each).
MAX_PROMPTS = 64
# The values OpenAI's SDK knows; chatd serves each request the same way and says "default".
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast")
VERBOSITIES = ("low", "medium", "high")
# OpenAI's limits on a completion's metadata: tags for the caller, never read by the model.
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


@dataclass
class GenerationRequest:
    """What a view needs to run one request. Parsing never tokenizes: the view does, off the event loop."""

    model: str | None
    prompt: str | list[int] | None  # one prompt's text or token ids; None for chat and completions (`prompts`)
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    user: str | None
    messages: list[dict] | None = None  # chat: the messages to render with the chat template
    max_tokens_field: str = "max_tokens"  # the name the client gave its reply's length, for errors
    # A completion's prompts by the name errors give each: {"prompt": ...}, or {"prompt[0]": ..., ...} for a list.
    prompts: dict[str, str | list[int]] = field(default_factory=dict)
    tools: ToolRequest | None = None  # chat: the functions the model may call
    prompt_cache_key: str | None = None  # logged with the request; chatd's prefix cache needs no hint
    service_tier: str | None = None  # set when the client named one: the reply then says which served it
    # What the reply shows of its prompt: a completion's `echo` (its text, and its tokens' logprobs
    # with `logprobs`) and vLLM's `prompt_logprobs`, as the client asked (params.prompt_logprobs is
    # what the engine computes for both).
    echo: bool = False
    prompt_logprobs: int | None = None
    prompt_only: bool = False  # max_tokens 0 (with echo): the one token the engine generates is dropped


@dataclass
class TurnRequest:
    """A new user message for a conversation; `gen.prompt` is empty until the server renders the history."""

    content: str
    gen: GenerationRequest


def parse_chat(body: Any, max_messages: int, defaults: Mapping[str, float] = MappingProxyType({})) -> GenerationRequest:
    """Validate a /v1/chat/completions body; its messages are rendered later, off the event loop.

    `store` may be true or false: chatd keeps no chat completion to retrieve either way (a
    conversation, /v1/conversations, is where the server keeps state).
    """
    body = _object(body)
    if "echo" in body:  # refused with a pointer, not as an unknown field
        raise APIError(400, "echo is not supported on chat completions; /v1/completions echoes a prompt", "echo")
    _check_fields(body, CHAT_FIELDS)
    verbosity = _get(body, "verbosity", str, None)
    if verbosity is not None and verbosity not in VERBOSITIES:
        raise APIError(400, f"verbosity must be one of {', '.join(VERBOSITIES)}; got {shown(verbosity)}", "verbosity")
    _request_metadata(body)
    check_keep_alive(body)
    output_format = _structured(body, structured.response_format(body.get("response_format")))
    tool_request = parse_tools(body)
    if output_format is not None and tool_request is not None and tool_request.choice in ("required", "function"):
        raise APIError(400, f"tool_choice {tool_request.choice!r} makes the reply a tool call; it cannot also follow "
                            f"{output_format.param.split('.')[0]}", "tool_choice")
    if (output_format is not None and tool_request is not None and tool_request.choice == "auto"
            and output_format.json_schema is None and not output_format.json_object):
        # A reply is then the JSON format or calls; a regex or grammar could spell a call no grammar checked.
        raise APIError(400, f"{output_format.param} cannot be combined with tools that the model may call; use a JSON "
                            "schema (response_format), or tool_choice none", output_format.param)
    messages = _get(body, "messages", list, None)
    if not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    if len(messages) > max_messages:
        raise APIError(400, f"messages has {len(messages)} entries; the limit is {max_messages}", "messages")
    prompt_logprobs = _prompt_logprobs(body)
    gen = _request(body, None, _chat_max_tokens(body), _chat_logprobs(body), defaults, store_allowed=True,
                   output_format=output_format, prompt_logprobs=prompt_logprobs)
    gen.prompt_logprobs = prompt_logprobs
    gen.messages = parse_messages(messages)
    gen.max_tokens_field = _max_tokens_field(body)
    gen.tools = tool_request
    return gen


def parse_turn(body: Any, max_chars: int, defaults: Mapping[str, float] = MappingProxyType({})) -> TurnRequest:
    """Validate a POST /v1/conversations/{id}/messages body: one user message and sampling fields."""
    body = _object(body)
    for name in ("tools", "tool_choice", "parallel_tool_calls", "response_format"):
        if name in body:  # a conversation's replies are text; calls and formats are chat completions' and responses'
            raise APIError(400, f"{name} is not supported on conversation messages; use /v1/chat/completions", name)
    _check_fields(body, TURN_FIELDS)
    check_keep_alive(body)
    role = _get(body, "role", str, "user")
    if role != "user":
        raise APIError(400, f"role must be 'user' (the server writes the assistant's replies), got {role!r}", "role")
    content = text_content(body.get("content"), "content")
    if not content:
        raise APIError(400, "content must be a non-empty string", "content")
    if len(content) > max_chars:
        raise APIError(400, f"content has {len(content)} characters; the limit is {max_chars}", "content")
    gen = _request(body, [], _chat_max_tokens(body), _chat_logprobs(body), defaults, output_format=_structured(body, None))
    gen.max_tokens_field = _max_tokens_field(body)
    if gen.params.n != 1:
        raise APIError(400, f"a conversation takes one reply per message: n must be 1, got {gen.params.n}", "n")
    return TurnRequest(content, gen)


def _max_tokens_field(body: dict) -> str:
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def _chat_max_tokens(body: dict) -> int | None:
    max_tokens = _get(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        return _get(body, "max_tokens", int, None)
    # Checked here so that the error names the field the client sent; validate() knows only max_tokens.
    if max_tokens < 1:
        raise APIError(400, f"max_completion_tokens must be an integer >= 1, got {max_tokens}", "max_completion_tokens")
    return max_tokens


def _chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs: true` + `top_logprobs: k` as the engine's number of alternatives (None: off)."""
    logprobs = _get(body, "logprobs", bool, False)
    top_logprobs = _get(body, "top_logprobs", int, None)
    if top_logprobs is not None and not logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top_logprobs}", "top_logprobs")
    return (top_logprobs or 0) if logprobs else None


def parse_completion(body: Any, max_model_len: int,
                     defaults: Mapping[str, float] = MappingProxyType({})) -> GenerationRequest:
    """Validate a /v1/completions body. A prompt is text or token ids; `prompt` is one, or a list of
    them (OpenAI's batched prompts), each its own engine request.

    `echo` gives each prompt back before its choices' text, and with `logprobs` its tokens' logprobs
    (the engine computes them in the prefill); `max_tokens: 0` with echo scores the prompt alone:
    the engine, which always generates, generates one token that the reply drops."""
    body = _object(body)
    _check_fields(body, COMPLETION_FIELDS)
    prompts = _prompts(body.get("prompt"), max_model_len)
    logprobs = _get(body, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
    echo = _get(body, "echo", bool, False)
    max_tokens = _get(body, "max_tokens", int, 16)
    if max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens must be an integer >= 1; 0 (the prompt alone) needs echo: true", "max_tokens")
    prompt_logprobs = _prompt_logprobs(body)
    echoed_logprobs = logprobs if echo else None  # the echoed tokens' logprobs, with as many alternatives
    computed = max((k for k in (prompt_logprobs, echoed_logprobs) if k is not None), default=None)
    _request_metadata(body)
    check_keep_alive(body)
    gen = _request(body, None, max_tokens or 1, logprobs, defaults, output_format=_structured(body, None),
                   prompt_logprobs=computed)
    if max_tokens == 0 and gen.params.min_tokens > 0:
        raise APIError(400, f"min_tokens must be 0 when max_tokens is 0, got {gen.params.min_tokens}", "min_tokens")
    gen.prompts, gen.echo, gen.prompt_logprobs, gen.prompt_only = prompts, echo, prompt_logprobs, max_tokens == 0
    return gen


def _prompt_logprobs(body: dict) -> int | None:
    """vLLM's `prompt_logprobs: k`: each prompt token's logprob and its k likeliest alternatives."""
    prompt_logprobs = _get(body, "prompt_logprobs", int, None)
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {prompt_logprobs}",
                       "prompt_logprobs")
    return prompt_logprobs


def _prompts(prompt: Any, max_model_len: int) -> dict[str, str | list[int]]:
    """A completion's prompts by the name errors give each: a string or token ids is "prompt"; a
    list of strings or of token-id lists is "prompt[0]", "prompt[1]", ..."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if not isinstance(prompt, list):
        raise APIError(400, "prompt must be a string, a list of token ids, or a list of strings or token-id lists", "prompt")
    if not prompt:
        raise APIError(400, "prompt must not be an empty list", "prompt")
    if isinstance(prompt[0], int) and not isinstance(prompt[0], bool):  # token ids
        return {"prompt": _token_ids(prompt, "prompt", max_model_len)}
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"prompt is a list of {len(prompt)} prompts; the limit is {MAX_PROMPTS}", "prompt")
    prompts = {}
    for i, one in enumerate(prompt):
        where = f"prompt[{i}]"
        if isinstance(one, list):
            prompts[where] = _token_ids(one, where, max_model_len)
        elif isinstance(one, str):
            prompts[where] = one
        else:
            raise APIError(400, f"{where} must be a string or a list of token ids, got {shown(one)}", where)
    return prompts


def _token_ids(prompt: list, where: str, max_model_len: int) -> list[int]:
    """A prompt of token ids, its length checked before its elements."""
    if len(prompt) >= max_model_len:  # before a pass over a list of maybe a million
        raise APIError(400, f"{where} has {len(prompt)} tokens; the context window is {max_model_len} tokens and must "
                            "leave room for at least one generated token", where, "context_length_exceeded")
    for j, token in enumerate(prompt):
        if not isinstance(token, int) or isinstance(token, bool):
            raise APIError(400, f"{where}[{j}] must be a token id (an integer), got {shown(token)}", f"{where}[{j}]")
    return prompt


def check_keep_alive(body: dict) -> None:
    """`keep_alive` (Ollama's) is a duration's text or a number of seconds; what it says is read
    where the model is held (state.take_keep_alive)."""
    value = body.get("keep_alive")
    if value is not None and (isinstance(value, bool) or not isinstance(value, str | int | float)):
        raise APIError(400, f"keep_alive must be a duration like \"5m\" or a number of seconds, got {shown(value)}",
                       "keep_alive")


def _request_metadata(body: dict) -> None:
    """A request's `metadata`, checked as OpenAI checks it: at most 16 string values under short keys."""
    metadata = _get(body, "metadata", dict, {})
    if len(metadata) > MAX_METADATA_KEYS:
        raise APIError(400, f"metadata has {len(metadata)} keys; the limit is {MAX_METADATA_KEYS}", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise APIError(400, f"metadata key {shown(key)} has {len(key)} characters; the limit is {MAX_METADATA_KEY_CHARS}",
                           "metadata")
        if not isinstance(value, str):
            raise APIError(400, f"metadata values must be strings; {shown(key)} is {shown(value)}", "metadata")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise APIError(400, f"metadata value of {shown(key)} has {len(value)} characters; the limit is "
                                f"{MAX_METADATA_VALUE_CHARS}", "metadata")


def _structured(body: dict, output_format: StructuredOutput | None) -> StructuredOutput | None:
    """The request's structured output: its OpenAI format, or chatd's extras, not both."""
    extra = structured.extras(body)
    if extra is not None and output_format is not None:
        raise APIError(400, f"give {output_format.param.split('.')[0]} or {extra.param.split('.')[0]}, not both",
                       extra.param.split(".")[0])
    return extra or output_format


def _request(body: dict, prompt: str | list[int], max_tokens: int | None, logprobs: int | None,
             defaults: Mapping[str, float], store_allowed: bool = False,
             output_format: StructuredOutput | None = None, prompt_logprobs: int | None = None) -> GenerationRequest:
    """The request's generation fields. A sampling field left out takes the model's recommended
    value where it has one (`defaults`, from its generation config), else OpenAI's default.
    `store: true` is refused unless `store_allowed` (chat: keeping no copy changes no answer).
    `output_format` is the grammar the reply must follow, if any; `prompt_logprobs` the alternatives
    the engine computes for each prompt token, if any."""
    stream = _get(body, "stream", bool, False)
    stream_options = _get(body, "stream_options", dict, None)
    if stream_options is not None and not stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    include_usage = bool((stream_options or {}).get("include_usage", False))
    logit_bias = _get(body, "logit_bias", dict, None)
    if logit_bias:
        raise APIError(400, "logit_bias is not supported by chatd", "logit_bias")
    if _get(body, "store", bool, False) and not store_allowed:
        raise APIError(400, "store is not supported by chatd (conversations live in /v1/conversations)", "store")
    service_tier = _get(body, "service_tier", str, None)
    if service_tier is not None and service_tier not in SERVICE_TIERS:
        raise APIError(400, f"service_tier must be one of {', '.join(SERVICE_TIERS)}; got {shown(service_tier)}", "service_tier")
    _get(body, "safety_identifier", str, None)  # checked, then unused: chatd has no abuse detection to feed
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise APIError(400, "stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP:
        raise APIError(400, f"stop takes at most {MAX_STOP} strings, got {len(stop)}", "stop")
    number = (int, float)
    params = SamplingParams(
        n=_get(body, "n", int, 1),
        max_tokens=max_tokens,
        min_tokens=_get(body, "min_tokens", int, 0),
        temperature=float(_get(body, "temperature", number, defaults.get("temperature", 1.0))),
        top_p=float(_get(body, "top_p", number, defaults.get("top_p", 1.0))),
        top_k=_top_k(_get(body, "top_k", int, int(defaults.get("top_k", 0)))),
        min_p=float(_get(body, "min_p", number, defaults.get("min_p", 0.0))),
        presence_penalty=float(_get(body, "presence_penalty", number, 0.0)),
        frequency_penalty=float(_get(body, "frequency_penalty", number, 0.0)),
        repetition_penalty=float(_get(body, "repetition_penalty", number, defaults.get("repetition_penalty", 1.0))),
        seed=_get(body, "seed", int, None),
        stop=tuple(stop),
        ignore_eos=_get(body, "ignore_eos", bool, False),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=output_format,
    )
    params.validate()
    return GenerationRequest(
        model=_get(body, "model", str, None),
        prompt=prompt,
        params=params,
        stream=stream,
        include_usage=include_usage,
        priority=_get(body, "priority", int, 0),
        user=_get(body, "user", str, None),
        prompt_cache_key=_get(body, "prompt_cache_key", str, None),
        service_tier=service_tier,
    )


def json_body(body: Any, allowed: set[str]) -> dict:
    """A request body that must be a JSON object of these fields only (400 naming the first other one)."""
    body = _object(body)
    _check_fields(body, allowed)
    return body


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name in body:
        if name in UNSUPPORTED:
            raise APIError(400, f"{name} is not supported by chatd ({UNSUPPORTED[name]})", name)
        if name not in allowed:
            raise APIError(400, f"unknown field {name!r}", name)


def _top_k(value: int) -> int:
    """-1 is off, as in vLLM and SGLang (the SGLang Model Gateway sends it on every Responses request); chatd's off is 0."""
    return 0 if value == -1 else value


def requested_model(body: Any) -> str | None:
    """The `model` a body names, read before the rest (it decides which model's limits the rest
    is parsed against); None when it names none, or is not an object (its parser says so)."""
    return _get(body, "model", str, None) if isinstance(body, dict) else None


def _get(body: dict, name: str, types, default):
    value = body.get(name)
    if value is None:
        return default
    # bool is an int in Python; a JSON true is never a valid number here.
    if isinstance(value, bool) and types is not bool:
        raise APIError(400, f"{name} must be {_type_name(types)}, got a boolean", name)
    if not isinstance(value, types):
        raise APIError(400, f"{name} must be {_type_name(types)}, got {type(value).__name__}", name)
    return value


def _type_name(types) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", dict: "an object", list: "a list"}
    if isinstance(types, tuple):
        return "a number"
    return names.get(types, types.__name__)
