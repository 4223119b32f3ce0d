"""The decode stream for tokenizers without a Rust one (WindowDecodeStream), and the prompt tokens
any decode stream reads first (prompt_context).

Each step decodes a short window of recent tokens twice, with and without the unread ones, and
emits the difference: the cost of a step does not grow with the sequence, and a SentencePiece
token's leading space is kept because the window gives it a left neighbour. It knows the
tokenizer only through a decode function; stop strings are tokenizer.py's IncrementalDetokenizer.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character

# How many prompt tokens a decode stream reads first: enough context for the first output
# token's leading space, few enough that a step stays cheap (vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5
_MAX_UTF8_CONTINUATION_BYTES = 3  # a UTF-8 character is at most 4 bytes: a lead byte and 3 more


def prompt_context(prompt_token_ids: list[int], continuation_byte_ids: frozenset[int]) -> list[int]:
    """The prompt's last PROMPT_CONTEXT_TOKENS tokens, or a few more to start on a character boundary."""
    start = max(len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS, 0)
    # A context opening with the tail of a multi-byte character would make its whole run of
    # byte tokens decode as U+FFFD, the next character's bytes included.
    lowest = max(start - _MAX_UTF8_CONTINUATION_BYTES, 0)
    while start > lowest and prompt_token_ids[start] in continuation_byte_ids:
        start -= 1
    return list(prompt_token_ids[start:])


def continuation_byte_ids(hf) -> frozenset[int]:
    """The byte-fallback tokens of a transformers tokenizer that hold a UTF-8 continuation byte."""
    # Byte-fallback tokens are named <0xHH>; continuation bytes are 10xxxxxx: <0x80> to <0xBF>.
    pieces = [f"<0x{byte:02X}>" for byte in range(0x80, 0xC0)]
    ids = hf.convert_tokens_to_ids(pieces)
    return frozenset(i for i, piece in zip(ids, pieces) if i is not None and hf.convert_ids_to_tokens(i) == piece)


class WindowDecodeStream:
    """New text for new token ids, from a window decoded twice; "" while a character is incomplete."""

    def __init__(self, decode: Callable[..., str], context: list[int], skip_special_tokens: bool) -> None:
        """decode: Tokenizer.decode; context: prompt tokens read, not emitted (prompt_context)."""
        self._decode, self._skip = decode, skip_special_tokens
        # The window: window[:read_offset] was emitted, window[read_offset:] is not yet read.
        self._window: list[int] = list(context)
        self._read_offset = len(self._window)

    def __call__(self, token_ids: list[int]) -> str:
        self._window.extend(int(t) for t in token_ids)
        new_text = self._unread_text()
        if not new_text or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token), or the end of a multi-byte character
            # has not arrived: read these tokens again with the next ones (a stop string among
            # them is found then, one step late, or at flush).
            return ""
        # Slide the window: the tokens just read become the left context of the next step.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return new_text

    def one(self, token_id: int) -> str:
        """The new text of one more token."""
        return self([token_id])

    def tail(self) -> str:
        """At a finish: the text of tokens still unread, never a dangling U+FFFD; the stream ends."""
        # The stream may end inside a character (a length limit mid-emoji): release the most
        # text that some prefix of the unread tokens decodes to, less a dangling U+FFFD. With
        # byte fallback, dropping the unfinished character's byte tokens also brings back the
        # whole characters before it in the same run of bytes.
        num_unread = len(self._window) - self._read_offset
        drops = range(min(num_unread, _MAX_UTF8_CONTINUATION_BYTES) + 1)
        text = max((self._unread_text(drop).rstrip(REPLACEMENT_CHAR) for drop in drops), key=len)
        self._window.clear()
        self._read_offset = 0
        return text

    def _unread_text(self, drop: int = 0) -> str:
        """The text of the unread tokens (less the last `drop`), with the read tokens as context."""
        decode, skip = self._decode, self._skip
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
