"""Text in, token ids out, and back: the model's tokenizer, its chat template, and the
incremental detokenizer that turns a stream of sampled ids into UTF-8-safe text deltas.

The tokenizer itself is Hugging Face's (transformers.AutoTokenizer); this file adds only what a
server needs around it. Message text that spells a control token is tokenized as plain text
(chat_tokens.py) unless the operator opts out. It knows nothing of the engine, the scheduler or HTTP.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

from tokenizers.decoders import DecodeStream

from chatd.engine.chat_tokens import ControlTokenGuard, StoredReplies

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character

# How many prompt tokens seed a detokenizer's window: enough context for the first output
# token's leading space, few enough that a step stays cheap (vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5
_MAX_UTF8_CONTINUATION_BYTES = 3  # a UTF-8 character is at most 4 bytes: a lead byte and 3 more


class Tokenizer:
    """Wraps a Hugging Face tokenizer (transformers.AutoTokenizer) loaded from a model folder."""

    def __init__(
        self,
        hf,
        extra_eos_token_ids: tuple[int, ...] | list[int] = (),
        special_tokens_in_messages: bool = False,
    ) -> None:
        """special_tokens_in_messages: tokenize control-token strings in messages as control tokens
        (any client can then forge turns); the default reads them as plain text."""
        self.hf = hf
        eos = set(extra_eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size: int = len(hf)
        # Pieces are what tokens decode to: a byte-level BPE piece spells each byte with one
        # character, a SentencePiece piece is its text with "▁" for the space. Byte-fallback
        # pieces (<0xE2>) over-count, which only loosens the bound.
        self.max_token_chars: int = max((len(piece) for piece in hf.get_vocab()), default=1)
        self._control_token_guard: ControlTokenGuard | None = None
        if not special_tokens_in_messages:
            backend = getattr(hf, "backend_tokenizer", None)
            if backend is None:
                raise ValueError(
                    "this tokenizer has no Rust backend, which reading control tokens in messages as text "
                    "needs; set model.special_tokens_in_messages = true to serve it anyway"
                )
            self._control_token_guard = ControlTokenGuard(backend, _template_source(hf))
        backend = getattr(hf, "backend_tokenizer", None)
        self._stored_replies = StoredReplies(backend, self._decode_all) if backend is not None else None
        # The Rust tokenizer's own decode, where transformers' decode adds nothing to it (with no
        # clean-up of spaces, as here): 3.4 us a call against 7.3 us through transformers'
        # wrapper. Streaming calls it twice a token, 512 times a step at 256 sequences.
        wrapper = getattr(type(hf), "_decode", None)
        plain = getattr(wrapper, "__qualname__", "") in ("TokenizersBackend._decode", "PreTrainedTokenizerFast._decode")
        self._backend_decode = backend.decode if backend is not None and plain else None
        self._backend = backend if backend is not None and plain else None

    @classmethod
    def from_pretrained(cls, path: str | Path, special_tokens_in_messages: bool = False) -> Tokenizer:
        """Load the tokenizer in a model folder, with the EOS ids its generation_config.json adds."""
        from transformers import AutoTokenizer  # imported here: importing transformers takes seconds

        path = Path(path)
        hf = AutoTokenizer.from_pretrained(str(path))
        return cls(
            hf,
            extra_eos_token_ids=_generation_config_eos_ids(path),
            special_tokens_in_messages=special_tokens_in_messages,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for text; add_special_tokens adds what the tokenizer adds (usually BOS)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text for token ids, exactly as the detokenizer would stream it from an empty prompt."""
        # No clean-up of spaces before punctuation: it depends on the neighbouring tokens, so
        # streamed deltas could not reproduce it.
        if self._backend_decode is not None:
            return self._backend_decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def decode_stream(self, context: list[int], skip_special_tokens: bool = True) -> RustDecodeStream | None:
        """Tokenizers' own incremental decoder, having read `context` (the prompt's tail, for a first
        token's leading space); None where transformers' decode adds to the Rust one."""
        if self._backend is None:
            return None
        return RustDecodeStream(self._backend, context, skip_special_tokens)

    def _decode_all(self, token_ids: list[int]) -> str:
        return self.decode(token_ids, skip_special_tokens=False)

    @property
    def chat_template(self) -> str:
        """The chat template's source text ("" for none)."""
        return _template_source(self.hf)

    @functools.cached_property
    def added_token_ids(self) -> dict[str, int]:
        """The tokenizer's added tokens (chat markers, tool-call tags) by their text."""
        return {token.content: token_id for token_id, token in self.hf.added_tokens_decoder.items()}

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (else tools must be described in a message)."""
        return "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render messages (and the tools the model may call) with the model's own chat template;
        ValueError if it has none or refuses them."""
        from jinja2 import TemplateError  # transformers' own dependency, imported with it

        if not getattr(self.hf, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template; use /v1/completions with a plain prompt"
            )
        try:
            return self.hf.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except TemplateError as exc:
            # Templates refuse what their model was not trained on (roles that do not alternate,
            # a system turn where none is allowed) with raise_exception: the client's mistake.
            raise ValueError(f"the chat template refused these messages: {exc}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, reply_ids: dict[int, list[int]] | None = None) -> list[int]:
        """Render messages (and tools) and tokenize them; control tokens come from the template alone
        (unless the operator opted out), and the template writes BOS itself, so none is added.

        reply_ids: for stored assistant messages (by index), the token ids the model generated;
        each is put in the prompt as those ids wherever that is exact (chat_tokens.StoredReplies),
        so a conversation's next prompt starts with the tokens its last turn left in the cache.
        Only the server's own records may fill it: a client's ids could spell any control token."""
        chat = {"messages": messages, "tools": tools}  # a tool's description is client text too

        def render(chat: dict) -> str:
            return self.apply_chat_template(chat["messages"], add_generation_prompt, chat["tools"])

        guard = self._control_token_guard
        if guard is not None and guard.finds_control_text(chat):
            return guard.encode(chat, render)
        if reply_ids and self._stored_replies is not None:
            spliced = self._stored_replies.encode(chat, reply_ids, self.chat_template, render)
            if spliced is not None:
                return spliced
        # No control token spelled in any message: the whole rendered text, exactly as always.
        return self.encode(render(chat), add_special_tokens=False)

    def is_continuation_byte(self, token_id: int) -> bool:
        """Whether a token is a byte-fallback token holding a UTF-8 continuation byte (0x80-0xBF)."""
        return token_id in self._continuation_byte_ids  # (asked at every request's start: a set, not a lookup by name)

    @functools.cached_property
    def _continuation_byte_ids(self) -> frozenset[int]:
        # Byte-fallback tokens are named <0xHH>; continuation bytes are 10xxxxxx: <0x80> to <0xBF>.
        pieces = [f"<0x{byte:02X}>" for byte in range(0x80, 0xC0)]
        ids = self.hf.convert_tokens_to_ids(pieces)
        return frozenset(i for i, piece in zip(ids, pieces) if i is not None and self.hf.convert_ids_to_tokens(i) == piece)


def _template_source(hf) -> str:
    """The chat template's source text ("" for none); a dict of named templates gives them all."""
    template = getattr(hf, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def _generation_config_eos_ids(path: Path) -> list[int]:
    # Chat models often end a turn with a token other than the tokenizer's EOS (<|im_end|>,
    # <|eot_id|>); generation_config.json is where the model folder says so.
    file = path / "generation_config.json"
    if not file.is_file():
        return []
    eos = json.loads(file.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(i) for i in eos]


class RustDecodeStream:
    """New text for new token ids, from tokenizers' DecodeStream: 1.3 us a token, where decoding a
    window twice costs ~10 us. "" while a character is incomplete."""

    def __init__(self, backend, context: list[int], skip_special_tokens: bool) -> None:
        self._backend, self._skip = backend, skip_special_tokens
        self._stream = self._primed(context)
        self._unsent: list[int] = []  # tokens read since the last text (an unfinished character's bytes)

    def _primed(self, context: list[int]) -> DecodeStream:
        stream = DecodeStream(skip_special_tokens=self._skip)
        if context:
            stream.step(self._backend, list(context))
        return stream

    def __call__(self, token_ids: list[int]) -> str:
        if len(token_ids) != 1:
            return "".join(self.one(t) for t in token_ids)
        return self.one(token_ids[0])  # a decode step's one token: the common case

    def one(self, token_id: int) -> str:
        """The new text of one more token."""
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception here
            return self._restart(token_id)
        if text is None:
            self._unsent.append(token_id)
            return ""
        self._unsent.clear()
        return text

    def _restart(self, token_id: int) -> str:
        """A token that rewrites what was sent (after a stray byte, DecodeStream raises "Invalid
        prefix"): what was sent stays sent, the tokens since are decoded on their own, and a fresh
        stream reads on from them."""
        tokens, self._unsent = [*self._unsent, token_id], []
        self._stream = self._primed(tokens)
        return self._backend.decode(tokens, skip_special_tokens=self._skip)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas for one sequence.

    With a Rust tokenizer, tokenizers' own incremental decoder (`Tokenizer.decode_stream`), primed
    with the prompt's tail, does it: one call a token. Otherwise each step decodes a short window of
    recent tokens twice, with and without the unread ones, and emits the difference: the cost of a
    step does not grow with the sequence, and a SentencePiece token's leading space is kept because
    the window gives it a left neighbour.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self._texts: list[str] = []  # everything emitted so far (`text`), in pieces: not copied a token
        self.stop_string: str | None = None  # the stop string that ended the text, once one has
        self._max_held = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""  # decoded text kept back because it could begin a stop string
        self._finished = False

        # The window: window[:read_offset] was emitted, window[read_offset:] is not yet read.
        start = max(len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS, 0)
        # Start the window on a character boundary: a window opening with the tail of a
        # multi-byte character would make its whole run of byte tokens decode as U+FFFD.
        lowest = max(start - _MAX_UTF8_CONTINUATION_BYTES, 0)
        while start > lowest and tokenizer.is_continuation_byte(prompt_token_ids[start]):
            start -= 1
        self._stream = tokenizer.decode_stream(prompt_token_ids[start:], skip_special_tokens)
        self._window: list[int] = [] if self._stream is not None else list(prompt_token_ids[start:])
        self._read_offset = len(self._window)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._texts)

    @property
    def plain(self) -> bool:
        """Whether the next token's text goes out whole (`step_plain`): Rust's decoder, no stop
        strings, nothing held back, not finished."""
        return self._stream is not None and not self.stop and not self._held and not self._finished

    def step_plain(self, token_id: int) -> str:
        """`step` of one token when `plain`: its new text ("" while a character is incomplete)."""
        new_text = self._stream.one(token_id)
        self._texts.append(new_text)
        return new_text

    def step(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Add tokens; return (new text, the stop string if one was hit). Tokens after a stop are ignored."""
        if self._finished:
            return "", None
        if self._stream is not None:
            new_text = self._stream(new_token_ids)
            if not new_text:  # a skipped special token, or a character not complete yet
                return "", None
            return self._emit(new_text, final=False) if self.stop or self._held else self._emit_plain(new_text)
        self._window.extend(int(t) for t in new_token_ids)
        new_text = self._unread_text()
        if not new_text or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token), or the end of a multi-byte character
            # has not arrived: read these tokens again with the next ones (a stop string among
            # them is found then, one step late, or at flush).
            return "", None
        # Slide the window: the tokens just read become the left context of the next step.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return self._emit(new_text, final=False)

    def flush(self) -> str:
        """Release held-back text at a finish without a stop string (never a dangling U+FFFD)."""
        if self._finished:
            return ""
        # The stream may end inside a character (a length limit mid-emoji): release the most
        # text that some prefix of the unread tokens decodes to, less a dangling U+FFFD. With
        # byte fallback, dropping the unfinished character's byte tokens also brings back the
        # whole characters before it in the same run of bytes. (The Rust decoder holds only an
        # unfinished character's bytes: they are dropped.)
        num_unread = len(self._window) - self._read_offset
        drops = range(min(num_unread, _MAX_UTF8_CONTINUATION_BYTES) + 1)
        tail = max((self._unread_text(drop).rstrip(REPLACEMENT_CHAR) for drop in drops), key=len)
        self._window.clear()
        self._read_offset = 0
        delta, _ = self._emit(tail, final=True)
        self._finished = True
        return delta

    def _emit_plain(self, new_text: str) -> tuple[str, None]:
        """`_emit` where there are no stop strings and nothing is held: all of it goes out."""
        self._texts.append(new_text)
        return new_text, None

    def _unread_text(self, drop: int = 0) -> str:
        """The text of the unread tokens (less the last `drop`), with the read tokens as context."""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        end = len(self._window) - drop
        read_text = decode(self._window[: self._read_offset], skip_special_tokens=skip)
        full_text = decode(self._window[:end], skip_special_tokens=skip)
        if full_text.startswith(read_text):
            return full_text[len(read_text) :]
        # Byte fallback decodes a whole run of byte tokens as U+FFFD when any byte in it is
        # invalid, so a new byte token can rewrite text already sent (while a character is
        # incomplete, or after a stray byte). What was sent stays sent: decode the new tokens
        # on their own.
        return decode(self._window[self._read_offset : end], skip_special_tokens=skip)

    def _emit(self, new_text: str, final: bool) -> tuple[str, str | None]:
        """Pass new text through the stop-string check; return (delta, stop string hit)."""
        text = self._held + new_text
        self._held = ""
        hit = _earliest_stop(text, self.stop)
        if hit is not None:
            index, stop_string = hit
            delta = text[:index]
            self.stop_string = stop_string
            self._finished = True
        else:
            stop_string = None
            keep = 0 if final else _longest_stop_prefix_suffix(text, self.stop, self._max_held)
            delta = text[: len(text) - keep]
            self._held = text[len(text) - keep :]
        self._texts.append(delta)
        return delta, stop_string


def _earliest_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The first place in text where any stop string begins, and that stop string."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...], max_len: int) -> int:
    """Length of the longest end of text that could still grow into a stop string."""
    # Held text never contains a whole stop (that is found first), so every stop occurrence
    # lies in held + new text: emitted text can never be the start of one.
    for length in range(min(len(text), max_len), 0, -1):
        tail = text[-length:]
        if any(stop.startswith(tail) for stop in stops):
            return length
    return 0
