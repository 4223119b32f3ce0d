"""Text in, token ids out, and back: the model's tokenizer, its chat template, and the
incremental detokenizer that turns a stream of sampled ids into UTF-8-safe text deltas.

The tokenizer itself is Hugging Face's (transformers.AutoTokenizer); this file adds only what a
server needs around it. Message text that spells a control token is tokenized as plain text
(chat_tokens.py) unless the operator opts out; tokenizers without a Rust decoder stream through
window_detokenizer.py. It knows nothing of the engine, the scheduler or HTTP.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers.decoders import DecodeStream

from chatd.engine.chat_tokens import ChatEncoder
from chatd.engine.window_detokenizer import WindowDecodeStream, continuation_byte_ids, prompt_context


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
        backend = getattr(hf, "backend_tokenizer", None)
        # The Rust tokenizer's own decode, where transformers' decode adds nothing to it (with no
        # clean-up of spaces, as here): 3.4 us a call against 7.3 us through transformers'
        # wrapper. Streaming calls it twice a token, 512 times a step at 256 sequences.
        wrapper = getattr(type(hf), "_decode", None)
        plain = getattr(wrapper, "__qualname__", "") in ("TokenizersBackend._decode", "PreTrainedTokenizerFast._decode")
        self._backend_decode = backend.decode if backend is not None and plain else None
        self._backend = backend if backend is not None and plain else None
        self._chat_encoder = ChatEncoder(self, special_tokens_in_messages)

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

    def decode_stream(self, prompt_token_ids: list[int],
                      skip_special_tokens: bool = True) -> RustDecodeStream | WindowDecodeStream:
        """New text for each token after the prompt, whose tail it reads first (for a first token's
        leading space): tokenizers' own incremental decoder, or, where transformers' decode adds to
        the Rust one, a window decoded twice."""
        context = prompt_context(prompt_token_ids, self._continuation_byte_ids)
        if self._backend is None:
            return WindowDecodeStream(self.decode, context, skip_special_tokens)
        return RustDecodeStream(self._backend, context, skip_special_tokens)

    @functools.cached_property
    def _continuation_byte_ids(self) -> frozenset[int]:
        return continuation_byte_ids(self.hf)  # a set, asked at every request's start

    @property
    def chat_template(self) -> str:
        """The chat template's source text ("" for none); a dict of named templates gives them all."""
        template = getattr(self.hf, "chat_template", None) or ""
        return "\n".join(template.values()) if isinstance(template, dict) else template

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
        return self._chat_encoder.encode(messages, add_generation_prompt, tools, reply_ids)


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

    def tail(self) -> str:
        """At a finish: "" (the stream holds only an unfinished character's bytes, which are dropped)."""
        return ""

    def _restart(self, token_id: int) -> str:
        """A token that rewrites what was sent (after a stray byte, DecodeStream raises "Invalid
        prefix"): what was sent stays sent, the tokens since are decoded on their own, and a fresh
        stream reads on from them."""
        tokens, self._unsent = [*self._unsent, token_id], []
        self._stream = self._primed(tokens)
        return self._backend.decode(tokens, skip_special_tokens=self._skip)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas for one sequence: a decode stream
    (`Tokenizer.decode_stream`, primed with the prompt's tail) gives the text, and this holds back
    what could begin a stop string."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.stop = tuple(stop)
        self._texts: list[str] = []  # everything emitted so far (`text`), in pieces: not copied a token
        self.stop_string: str | None = None  # the stop string that ended the text, once one has
        self._max_held = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""  # decoded text kept back because it could begin a stop string
        self._finished = False
        self._stream = tokenizer.decode_stream(prompt_token_ids, skip_special_tokens)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._texts)

    @property
    def plain(self) -> bool:
        """Whether the next token's text goes out whole (`step_plain`): no stop strings, nothing
        held back, not finished."""
        return not self.stop and not self._held and not self._finished

    def step_plain(self, token_id: int) -> str:
        """`step` of one token when `plain`: its new text ("" while a character is incomplete)."""
        new_text = self._stream.one(token_id)
        self._texts.append(new_text)
        return new_text

    def step(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Add tokens; return (new text, the stop string if one was hit). Tokens after a stop are ignored."""
        if self._finished:
            return "", None
        new_text = self._stream(new_token_ids)
        if not new_text:  # a skipped special token, or a character not complete yet
            return "", None
        return self._emit(new_text, final=False) if self.stop or self._held else self._emit_plain(new_text)

    def flush(self) -> str:
        """Release held-back text at a finish without a stop string (never a dangling U+FFFD)."""
        if self._finished:
            return ""
        delta, _ = self._emit(self._stream.tail(), final=True)
        self._finished = True
        return delta

    def _emit_plain(self, new_text: str) -> tuple[str, None]:
        """`_emit` where there are no stop strings and nothing is held: all of it goes out."""
        self._texts.append(new_text)
        return new_text, None

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
