"""Chat prompts in which message text stays text: a `<|im_end|>` typed into a message is tokenized
as the characters it is spelled with, so a client cannot forge a turn, a system prompt or an end of
turn. Only the chat template writes control tokens.

A prompt whose messages spell no control token is tokenized as it always was: render, then
tokenize the whole text. Otherwise each control-token string in the messages is swapped for a
private-use character before rendering (templates that trim or slice text keep it), the rendered
text is tokenized once with offsets, and each stretch between two of the template's control tokens
that holds a swapped string is tokenized again, with the strings put back, by a copy of the Rust
tokenizer that reads control-token strings as plain text.

The copies are private and set up once: the model's own tokenizer is shared by worker threads, and
transformers' split_special_tokens flips a flag on it (and leaves it flipped until the next call).

A stored reply is put back into a later prompt as the token ids the model generated, not as
its text tokenized again (StoredReplies): the prompt of turn N+1 then begins with exactly the
tokens whose KV blocks turn N left in the prefix cache.

ChatEncoder is what Tokenizer.encode_chat runs: the two above around the model's chat template.
This file knows the `tokenizers` library and its JSON format; it knows nothing of transformers,
the engine or HTTP.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

# Private-use code points mean nothing in Unicode, so templates do not write them; a message that
# does use some only moves the choice of stand-ins on to others.
_PRIVATE_USE_RANGES = ((0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD))
_PRIVATE_USE_CHAR = re.compile("[\ue000-\uf8ff\U000f0000-\U000ffffd\U00100000-\U0010fffd]")


class ChatEncoder:
    """Renders a chat with the model's template and tokenizes it: control tokens come from the
    template alone (unless the operator opted out), stored replies go in as their generated ids."""

    def __init__(self, tokenizer: Any, special_tokens_in_messages: bool) -> None:
        """tokenizer: chatd's Tokenizer (tokenizer.py), which holds this encoder;
        special_tokens_in_messages: read control-token strings in messages as control tokens."""
        self._tokenizer = tokenizer
        backend = getattr(tokenizer.hf, "backend_tokenizer", None)
        self._guard: ControlTokenGuard | None = None
        if not special_tokens_in_messages:
            if backend is None:
                raise ValueError(
                    "this tokenizer has no Rust backend, which reading control tokens in messages as text "
                    "needs; set model.special_tokens_in_messages = true to serve it anyway"
                )
            self._guard = ControlTokenGuard(backend, tokenizer.chat_template)
        decode_all = functools.partial(tokenizer.decode, skip_special_tokens=False)
        self._stored_replies = StoredReplies(backend, decode_all) if backend is not None else None

    def encode(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
               reply_ids: dict[int, list[int]] | None) -> list[int]:
        """Token ids of the rendered chat (Tokenizer.encode_chat)."""
        tokenizer = self._tokenizer
        chat = {"messages": messages, "tools": tools}  # a tool's description is client text too

        def render(chat: dict) -> str:
            return tokenizer.apply_chat_template(chat["messages"], add_generation_prompt, chat["tools"])

        if self._guard is not None and self._guard.finds_control_text(chat):
            return self._guard.encode(chat, render)
        if reply_ids and self._stored_replies is not None:
            spliced = self._stored_replies.encode(chat, reply_ids, tokenizer.chat_template, render)
            if spliced is not None:
                return spliced
        # No control token spelled in any message: the whole rendered text, exactly as always.
        return tokenizer.encode(render(chat), add_special_tokens=False)


class ControlTokenGuard:
    """Tokenizes rendered chats so that control tokens come from the chat template, never from message text."""

    def __init__(self, backend: Any, chat_template: str = "") -> None:
        """backend: the model's Rust tokenizer (`tokenizers.Tokenizer`), copied here and not used after;
        chat_template: the template's source, whose non-special added tokens are control tokens too."""
        spec = dict(json.loads(backend.to_str()), truncation=None, padding=None)
        control = {
            token["id"]: token["content"]
            for token in spec.get("added_tokens") or []
            if token["special"] or _written_by_template(token["content"], chat_template)
        }
        self._whole_text = _tokenizer_from_spec(spec, plain_text=False)
        self._control_ids = frozenset(control)
        # Longest first, so a marker wins over a shorter one it contains, as in the tokenizer itself.
        markers = sorted(set(control.values()), key=len, reverse=True)
        self._control_text = re.compile("|".join(map(re.escape, markers))) if markers else None
        self._taken_chars = set(_PRIVATE_USE_CHAR.findall("".join(markers) + chat_template))
        self._plain_at_start, self._plain_after_control = _plain_text_tokenizers(spec, set(markers))

    def finds_control_text(self, messages: Any) -> bool:
        """Whether any string in messages (content, role, text parts; any structure of them, tools
        included) spells a control token."""
        pattern = self._control_text
        return pattern is not None and any(pattern.search(text) for text in _strings(messages))

    def encode(self, messages: Any, render: Callable[[Any], str]) -> list[int]:
        """Token ids of render(messages), with every control token spelled in messages read as plain text."""
        pattern = self._control_text
        texts = list(_strings(messages))
        spelled = sorted({marker for text in texts for marker in pattern.findall(text)}) if pattern else []
        if not spelled:
            return self._whole_text.encode(render(messages), add_special_tokens=False).ids
        taken = self._taken_chars | set(_PRIVATE_USE_CHAR.findall("".join(texts)))
        stand_ins = dict(zip(spelled, _free_private_use_chars(taken)))
        if len(stand_ins) < len(spelled):
            raise ValueError("message text uses every private-use character and also spells control tokens")
        escaped = _map_strings(messages, lambda text: pattern.sub(lambda match: stand_ins[match.group()], text))
        restore = {ord(char): marker for marker, char in stand_ins.items()}
        return self._encode_rendered(render(escaped), restore)

    def _encode_rendered(self, text: str, restore: dict[int, str]) -> list[int]:
        """Tokenize rendered text; stretches holding stand-ins are re-tokenized as plain text with the markers back."""
        encoding = self._whole_text.encode(text, add_special_tokens=False)
        ids, offsets = encoding.ids, encoding.offsets  # offsets: character spans in text
        holds_stand_in = re.compile("[" + "".join(map(chr, restore)) + "]")
        token_ids: list[int] = []
        start_token = start_char = 0
        # The tokenizer splits text at control tokens and tokenizes each stretch between them on
        # its own, so a stretch can be replaced without touching its neighbours.
        ends = [i for i, token_id in enumerate(ids) if token_id in self._control_ids] + [len(ids)]
        for end_token in ends:
            end_char = offsets[end_token][0] if end_token < len(ids) else len(text)
            stretch = text[start_char:end_char]
            if holds_stand_in.search(stretch):
                plain = self._plain_after_control if start_char else self._plain_at_start
                token_ids += plain.encode(stretch.translate(restore), add_special_tokens=False).ids
            else:
                token_ids += ids[start_token:end_token]
            if end_token < len(ids):
                token_ids.append(ids[end_token])
                start_token, start_char = end_token + 1, offsets[end_token][1]
        return token_ids


class StoredReplies:
    """Renders a chat in which some assistant messages are given as the token ids the model
    generated for them: each such message's text is swapped for a private-use stand-in before
    rendering, the rendered text is tokenized once with offsets, and the tokens of each stand-in
    are replaced by the stored ids. The template still writes everything around a reply (its
    role marker, its end-of-turn token), so the prompt reads as the template means it to.

    A message is spliced only where that is exact: its ids decode to its text, the template
    rendered its stand-in once, and no token of the rendering straddles the stand-in's edge (a
    tokenizer that would merge the reply with its neighbours). Otherwise None: tokenize the
    text as always.
    """

    def __init__(self, backend: Any, decode: Callable[[list[int]], str]) -> None:
        """backend: the model's Rust tokenizer, copied; decode: ids to text, special tokens kept."""
        spec = dict(json.loads(backend.to_str()), truncation=None, padding=None)
        self._tokenizer = _tokenizer_from_spec(spec, plain_text=False)
        self._decode = decode

    def encode(self, chat: dict, reply_ids: dict[int, list[int]], taken: str,
               render: Callable[[dict], str]) -> list[int] | None:
        """Token ids of render(chat) with messages[i] as reply_ids[i]; None where that is not exact.
        taken: text whose private-use characters must not be stand-ins (the template's source)."""
        messages = chat["messages"]
        # Cheap first: ids that do not decode to the text even alone (a reply cut by a stop
        # string, say) keep their text. Alone, a decoder may drop a leading space it keeps in place.
        spliced = {i: list(ids) for i, ids in reply_ids.items()
                   if ids and self._decode(ids).strip() == messages[i]["content"].strip()}
        while spliced:
            result = self._splice(chat, spliced, taken, render)
            if not isinstance(result, int):
                return result
            del spliced[result]  # its ids read differently in place (a leading space): its text it is
        return None

    def _splice(self, chat: dict, spliced: dict[int, list[int]], taken: str,
                render: Callable[[dict], str]) -> list[int] | int | None:
        """The spliced prompt; or the index of a message whose ids do not decode to its text in
        place; or None when splicing cannot be exact at all."""
        used = set(_PRIVATE_USE_CHAR.findall("".join(_strings(chat)) + taken))
        stand_ins = dict(zip(spliced, _free_private_use_chars(used)))
        messages = [dict(m, content=stand_ins[i]) if i in stand_ins else m for i, m in enumerate(chat["messages"])]
        text = render(dict(chat, messages=messages))
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        ids, offsets = encoding.ids, encoding.offsets
        token_ids: list[int] = []
        done = 0  # tokens of `ids` already in token_ids
        for at, message in sorted((text.find(char), i) for i, char in stand_ins.items()):
            if at < 0 or text.count(stand_ins[message]) != 1:
                return None  # the template dropped or repeated a message
            covering = [i for i, (start, end) in enumerate(offsets) if start < at + 1 and end > at]
            if not covering or any(offsets[i][0] < at or offsets[i][1] > at + 1 for i in covering):
                return None  # a token straddles the stand-in: this tokenizer merges a reply with its neighbours
            token_ids += ids[done : covering[0]]
            context = token_ids[-4:]  # a reply's first token may read differently after others (a leading space)
            before = self._decode(context)
            if self._decode(context + spliced[message]) != before + chat["messages"][message]["content"]:
                return message
            token_ids += spliced[message]
            done = covering[-1] + 1
        return token_ids + ids[done:]


def _written_by_template(content: str, chat_template: str) -> bool:
    """Whether a non-special added token is one the template writes (Qwen's `<think>`, `<tool_call>`)."""
    # Whitespace tokens (Gemma's "\n" runs) appear in every template as ordinary text.
    return bool(chat_template) and not content.isspace() and content in chat_template


def _plain_text_tokenizers(spec: dict, control: set[str]) -> tuple[Any, Any]:
    """Private copies of the tokenizer that read control-token strings as plain text: one for a
    stretch at the very start of the text, one for a stretch after a control token."""
    # encode_special_tokens skips only special added tokens; mark the template's other ones special.
    spec["added_tokens"] = [
        dict(token, special=token["special"] or token["content"] in control) for token in spec.get("added_tokens") or []
    ]
    at_start = _tokenizer_from_spec(spec, plain_text=True)
    pre_tokenizer = spec.get("pre_tokenizer")
    after_control = _without_start_marker(pre_tokenizer)
    if after_control == pre_tokenizer:
        return at_start, at_start
    return at_start, _tokenizer_from_spec(dict(spec, pre_tokenizer=after_control), plain_text=True)


def _tokenizer_from_spec(spec: dict, plain_text: bool) -> Any:
    """A Rust tokenizer built from spec; with plain_text, one that matches no special token."""
    from tokenizers import Tokenizer  # transformers' own dependency

    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.encode_special_tokens = plain_text  # set once, on a copy no other code sees
    return tokenizer


def _without_start_marker(pre_tokenizer: Any) -> Any:
    """The pre-tokenizer spec with every Metaspace prepend_scheme "first" turned into "never"."""
    # "first" writes "▁" before text that begins at offset 0 of the whole input, and only there
    # (tokenizers' Metaspace checks offsets_original().0 == 0): a stretch after a control token
    # never gets it, but tokenized alone it would.
    if isinstance(pre_tokenizer, dict):
        if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
            return dict(pre_tokenizer, prepend_scheme="never")
        return {key: _without_start_marker(value) for key, value in pre_tokenizer.items()}
    if isinstance(pre_tokenizer, list):
        return [_without_start_marker(value) for value in pre_tokenizer]
    return pre_tokenizer


def _free_private_use_chars(taken: set[str]) -> Iterator[str]:
    """Private-use characters not in taken, in code point order."""
    for first, last in _PRIVATE_USE_RANGES:
        for code in range(first, last + 1):
            if chr(code) not in taken:
                yield chr(code)


def _strings(value: Any) -> Iterator[str]:
    """Every string in a message structure: contents, roles, names, text parts."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """A copy of a message structure with change applied to every string in it."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {key: _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(item, change) for item in value]
    return value
