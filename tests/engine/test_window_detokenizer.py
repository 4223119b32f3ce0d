"""Where a decode stream starts reading a prompt; WindowDecodeStream's own streaming is tested through
IncrementalDetokenizer in test_tokenizer.py (its `tok` fixture's "window" tokenizer)."""

from __future__ import annotations

import re

import pytest

from chatd.engine.models.demo import build_tokenizer
from chatd.engine.window_detokenizer import PROMPT_CONTEXT_TOKENS, continuation_byte_ids, prompt_context


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("demo-tokenizer")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def test_continuation_bytes_are_the_byte_fallback_tokens_0x80_to_0xbf(hf):
    """Where a detokenizer's window may start (not inside a character): every token the vocabulary
    names <0x80> to <0xBF>, and nothing else."""
    named = {i for i in range(len(hf)) if re.fullmatch(r"<0x[89AB][0-9A-F]>", hf.convert_ids_to_tokens(i))}
    assert len(named) == 64
    assert continuation_byte_ids(hf) == named


def test_the_prompt_context_starts_on_a_character_boundary(hf):
    continuation = continuation_byte_ids(hf)
    words = hf.encode("a short prompt of several words", add_special_tokens=False)
    assert prompt_context(words, continuation) == words[-PROMPT_CONTEXT_TOKENS:]
    emoji = [hf.convert_tokens_to_ids(f"<0x{byte:02X}>") for byte in "🦙".encode()]  # a lead byte and 3 more
    prompt = words + emoji + emoji[:2]
    # The last five tokens open inside the first emoji (at its second byte): its lead byte is read too.
    assert prompt_context(prompt, continuation) == emoji + emoji[:2]
    assert prompt_context(prompt[:3], continuation) == prompt[:3]
