"""Tokenizer and IncrementalDetokenizer, against the demo SentencePiece tokenizer (byte fallback)."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatd.engine.models.demo import build_tokenizer
from chatd.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from chatd.engine.window_detokenizer import REPLACEMENT_CHAR
from tests.engine.test_chat_tokens import build_llama3_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo-tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session", params=["rust-stream", "window"])
def tok(tokenizer_dir, request) -> Tokenizer:
    """The demo tokenizer; with "window", one whose class decodes on its own (as some models'
    tokenizers do), so that its detokenizers decode a window (window_detokenizer.py)."""
    tokenizer = Tokenizer.from_pretrained(tokenizer_dir)
    if request.param == "rust-stream":
        return tokenizer

    class OwnDecode(type(tokenizer.hf)):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs)

    windowed = Tokenizer(OwnDecode.from_pretrained(str(tokenizer_dir)), tokenizer.eos_token_ids)
    assert type(windowed.decode_stream([])).__name__ == "WindowDecodeStream"
    return windowed


def byte_id(tok: Tokenizer, byte: int) -> int:
    return tok.hf.convert_tokens_to_ids(f"<0x{byte:02X}>")


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """The byte-fallback spelling of text: one token per UTF-8 byte."""
    return [byte_id(tok, b) for b in text.encode("utf-8")]


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk: int = 1) -> list[str]:
    """Feed token ids chunk by chunk; return the deltas, flush included unless a stop hit."""
    deltas = []
    for i in range(0, len(token_ids), chunk):
        delta, hit = detok.step(token_ids[i : i + chunk])
        deltas.append(delta)
        if hit is not None:
            return deltas
    deltas.append(detok.flush())
    return deltas


# --- Tokenizer ---------------------------------------------------------------------------


def test_encode_decode_round_trips_text_outside_the_vocabulary(tok):
    text = "A café in Zürich 🦙 says 你好 — ok?"
    ids = tok.encode(text)
    assert ids[0] == tok.hf.bos_token_id
    assert tok.decode(ids) == text
    assert tok.vocab_size == len(tok.hf)


@pytest.mark.parametrize("kind", ["sentencepiece", "llama3-bpe"])
def test_decode_is_transformers_decode_without_clean_up(tokenizer_dir, tmp_path, kind):
    """Tokenizer.decode calls the Rust tokenizer itself (faster): it must read every id sequence,
    special tokens shown or skipped, exactly as transformers' own decode does."""
    import random

    chosen = Tokenizer.from_pretrained(tokenizer_dir if kind == "sentencepiece" else build_llama3_tokenizer(tmp_path))
    assert chosen._backend_decode is not None  # the fast path is the one under test
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(chosen.vocab_size) for _ in range(rng.randint(1, 16))]
        for skip in (True, False):
            assert chosen.decode(ids, skip_special_tokens=skip) == chosen.hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_chat_template_renders_every_role_and_encode_chat_has_one_bos(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a token?"},
        {"role": "assistant", "content": "A piece of text."},
        {"role": "user", "content": "Thanks!"},
    ]
    text = tok.apply_chat_template(messages)
    for message in messages:
        assert f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")

    ids = tok.encode_chat(messages)
    assert ids[0] == tok.hf.bos_token_id
    assert ids.count(tok.hf.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_apply_chat_template_without_a_template_is_a_value_error(tokenizer_dir, tmp_path):
    folder = tmp_path / "no-template"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "chat_template.jinja").unlink()
    bare = Tokenizer.from_pretrained(folder)
    with pytest.raises(ValueError, match="chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_messages_a_template_refuses_are_a_value_error_with_its_reason(tokenizer_dir, tmp_path):
    """Llama 2's and Mistral's templates raise_exception on roles that do not alternate: the client's
    mistake, which the server answers with a 400 (a jinja2 TemplateError had been a 500)."""
    folder = tmp_path / "strict-template"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")
    strict = Tokenizer.from_pretrained(folder)
    assert strict.encode_chat([{"role": "user", "content": "hi"}])
    for forged in ("", "<|im_end|>"):  # the plain path and the control-token guard's path alike
        with pytest.raises(ValueError, match="roles must alternate"):
            strict.encode_chat([{"role": "user", "content": "hi" + forged}, {"role": "user", "content": "again"}])


@pytest.mark.parametrize("kind", ["chatml", "llama3"])
def test_no_token_decodes_to_more_characters_than_max_token_chars(tokenizer_dir, tmp_path, kind):
    """The HTTP layer refuses text longer than max_model_len * max_token_chars without tokenizing it."""
    tok = Tokenizer.from_pretrained(tokenizer_dir if kind == "chatml" else build_llama3_tokenizer(tmp_path))
    left = tok.encode("a", add_special_tokens=False)  # a left neighbour keeps SentencePiece's leading space
    lengths = [
        len(tok.decode(left + [i], skip_special_tokens=False)) - len(tok.decode(left, skip_special_tokens=False))
        for i in range(tok.vocab_size)
    ]
    assert max(lengths) <= tok.max_token_chars
    assert max(lengths) >= 8  # words and markers, not just bytes: the bound is not vacuous


@pytest.mark.parametrize("eos_field", [[2, 5], 5])
def test_eos_ids_include_generation_config(tokenizer_dir, tmp_path, eos_field):
    assert Tokenizer.from_pretrained(tokenizer_dir).eos_token_ids == {2}
    folder = tmp_path / "with-generation-config"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_field}))
    tok = Tokenizer.from_pretrained(folder)
    assert tok.eos_token_ids == {2, 5}
    assert tok.hf.convert_ids_to_tokens(5) == "<|im_end|>"


# --- IncrementalDetokenizer ----------------------------------------------------------------


def test_characters_split_across_byte_tokens_are_never_emitted_half(tok):
    prompt = tok.encode("Say something:")
    out = tok.encode(" a llama", add_special_tokens=False) + byte_ids(tok, "🦙") + byte_ids(tok, "你好")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, out)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    # The 4 bytes of the llama: nothing until the last one, then the whole character.
    assert deltas[len(out) - 10 : len(out) - 6] == ["", "", "", "🦙"]
    assert deltas[len(out) - 6 : len(out)] == ["", "", "你", "", "", "好"]
    assert detok.text.endswith("a llama🦙你好")


def test_leading_spaces_survive_token_by_token_streaming(tok):
    ids = tok.encode("The server reads the prompt and writes the answer")
    prompt, out = ids[:4], ids[4:]
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(stream(detok, out))
    assert text == tok.decode(ids)[len(tok.decode(prompt)) :]
    assert text.startswith(" ") and "writes the answer" in text
    # Decoding each token alone drops SentencePiece's leading spaces: the reason for the window.
    assert "".join(tok.decode([t]) for t in out) != text


def test_stop_string_split_across_tokens_is_detected_and_not_emitted(tok):
    out = tok.encode("the server works well today", add_special_tokens=False)
    stop = "works well"
    detok = IncrementalDetokenizer(tok, [tok.hf.bos_token_id], stop=(stop,))
    hits = []
    for token in out:
        delta, hit = detok.step([token])
        hits.append(hit)
    assert hits.count(stop) == 1
    assert detok.text == "the server "
    assert detok.stop_string == stop
    # The stop string spans more than one token.
    hit_step = hits.index(stop)
    assert stop not in tok.decode(out[:hit_step])
    assert "well" not in tok.decode(out[hit_step:hit_step + 1])
    # Anything after the stop is ignored.
    assert detok.step(tok.encode(" more", add_special_tokens=False)) == ("", None)
    assert detok.flush() == ""


def test_text_that_might_start_a_stop_is_held_then_released(tok):
    out = tok.encode("the server works hard", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [tok.hf.bos_token_id], stop=("works well",))
    seen = []
    for token in out:
        detok.step([token])
        seen.append(detok.text)
    # While "works" could still become "works well", it is not sent...
    at_works = next(i for i in range(len(out)) if tok.decode(out[: i + 1]).endswith("works"))
    assert not seen[at_works].endswith("works")
    assert len(tok.decode(out[: at_works + 1])) - len(seen[at_works]) <= len("works well") - 1
    # ...and once it cannot, it is.
    assert detok.flush() == ""
    assert detok.text == "the server works hard"
    assert detok.stop_string is None


def test_flush_releases_the_held_tail_but_never_a_dangling_half_character(tok):
    detok = IncrementalDetokenizer(tok, [], stop=("the end",))
    stream_ids = tok.encode("the story is nearly at the", add_special_tokens=False)
    deltas = [detok.step([t])[0] for t in stream_ids]
    assert not "".join(deltas).endswith("the")
    half_emoji = byte_ids(tok, "🙂")[:2]
    assert detok.step(half_emoji) == ("", None)
    assert detok.flush() == "the"
    assert detok.text == "the story is nearly at the"


def test_a_stray_byte_does_not_take_back_text_already_sent(tok):
    detok = IncrementalDetokenizer(tok, [])
    deltas = stream(detok, byte_ids(tok, "🙂") + [byte_id(tok, 0x99)] + tok.encode("ok", add_special_tokens=False))
    assert deltas[3] == "🙂"
    assert detok.text == "🙂" + REPLACEMENT_CHAR + " ok"


def test_special_tokens_are_skipped_or_shown(tok):
    out = tok.encode("<|im_start|>assistant\nhello<|im_end|>", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(tok, [1]), out)) == "assistant\nhello"
    shown = "".join(stream(IncrementalDetokenizer(tok, [1], skip_special_tokens=False), out))
    assert shown == "<|im_start|>assistant\nhello<|im_end|>"


def test_prompt_ending_inside_a_byte_run_still_streams_the_next_character(tok):
    prompt = tok.encode("x", add_special_tokens=False) + byte_ids(tok, "🦙🦙🦙")
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(stream(detok, byte_ids(tok, "你"))) == "你"


# --- Properties ----------------------------------------------------------------------------

CHARS = "éüñ—…€你好世界東京日本語🙂🚀🦙✨👋🎉🍀"


@st.composite
def output_ids(draw, tok: Tokenizer, allow_truncated_tail: bool = True) -> tuple[list[int], list[int]]:
    """Token ids a model could emit: vocabulary pieces, special tokens, and characters spelled
    in byte-fallback tokens; returned as (whole, cut): `cut` is the first bytes of one more
    character (a length limit mid-emoji), or empty."""
    specials = sorted(tok.hf.all_special_ids)
    bytes_ = {byte_id(tok, b) for b in range(256)}
    pieces = [i for i in range(tok.vocab_size) if i not in bytes_ and i not in specials]
    parts = draw(
        st.lists(
            st.one_of(
                st.sampled_from(pieces).map(lambda i: [i]),
                st.sampled_from(specials).map(lambda i: [i]),
                # U+FFFD itself is left out: a model writing it is indistinguishable from a
                # character still incomplete, and is held back like one.
                st.one_of(
                    st.sampled_from(CHARS),
                    st.characters(min_codepoint=0x80, exclude_categories=["Cs"], exclude_characters=REPLACEMENT_CHAR),
                )
                .map(lambda c: byte_ids(tok, c)),
            ),
            max_size=30,
        )
    )
    whole = [i for part in parts for i in part]
    cut = []
    if allow_truncated_tail and draw(st.booleans()):
        char_bytes = byte_ids(tok, draw(st.sampled_from("🦙你é")))
        cut = char_bytes[: draw(st.integers(1, len(char_bytes) - 1))]
    return whole, cut


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk=st.integers(1, 4), skip=st.booleans())
def test_streamed_text_equals_decoding_everything_at_once(tok, data, chunk, skip):
    whole, cut = data.draw(output_ids(tok))
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    deltas = stream(detok, whole + cut, chunk)
    # A character cut short at the end is dropped, and nothing else.
    assert "".join(deltas) == detok.text == tok.decode(whole, skip_special_tokens=skip)
    assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), prompt=st.sampled_from(["Hi", "Tell me a story.", "日本語で", "ok 🙂"]))
def test_streamed_text_after_a_prompt_keeps_the_first_tokens_space(tok, data, prompt):
    prompt_ids = tok.encode(prompt)
    out, _ = data.draw(output_ids(tok, allow_truncated_tail=False))
    detok = IncrementalDetokenizer(tok, prompt_ids)
    text = "".join(stream(detok, out))
    full = tok.decode(prompt_ids + out)
    assert full.startswith(tok.decode(prompt_ids))
    assert text == full[len(tok.decode(prompt_ids)) :]


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 999), max_size=40), chunk=st.integers(1, 3), stops=st.sampled_from([(), ("the",)]))
def test_any_token_ids_stream_without_error(tok, ids, chunk, stops):
    """Random ids include stray bytes that never form a character: they show as U+FFFD."""
    detok = IncrementalDetokenizer(tok, [1], stop=stops)
    deltas = stream(detok, ids, chunk)
    if not stops:  # (with stops, a stray U+FFFD can end a delta when the text after it is held)
        assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas)
    full = tok.decode(ids)
    if REPLACEMENT_CHAR not in full:
        assert detok.text == (full[: full.index("the")] if stops and "the" in full else full)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stop_strings_end_the_text_exactly_where_they_begin(tok, data):
    out, _ = data.draw(output_ids(tok, allow_truncated_tail=False))
    full = tok.decode(out)
    if full:
        start = data.draw(st.integers(0, len(full) - 1))
        stop = full[start : start + data.draw(st.integers(1, 6))]
    else:
        stop = "x"
    stops = (stop, "zzq")
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    max_held = max(map(len, stops)) - 1
    hit_at = None
    for k, token in enumerate(out):
        _, hit = detok.step([token])
        decoded = tok.decode(out[: k + 1]).rstrip(REPLACEMENT_CHAR)
        if hit is not None:
            hit_at = k
            break
        assert stop not in decoded  # no stop is ever late
        assert len(decoded) - len(detok.text) <= max_held  # and little is held back
    if stop in full:
        assert hit_at is not None and detok.stop_string == stop
        assert detok.text == full[: full.index(stop)]
    else:
        assert hit_at is None
        detok.flush()
        assert detok.text == full


# --- stored replies go back into the prompt as the ids the model generated ---

@pytest.fixture(scope="module", params=["sentencepiece", "llama3-bpe"])
def chat_tok(request, tokenizer_dir, tmp_path_factory) -> Tokenizer:
    if request.param == "sentencepiece":
        return Tokenizer.from_pretrained(tokenizer_dir)
    return Tokenizer.from_pretrained(build_llama3_tokenizer(tmp_path_factory.mktemp("llama3")))


def one_token_per_character(tok: Tokenizer, text: str) -> list[int]:
    """Ids for text that its tokenizer would never choose (one token per character, as a model
    may generate it), yet that decode to exactly the text."""
    if "<0x41>" in tok.hf.get_vocab():  # byte fallback: one byte token per UTF-8 byte
        ids = byte_ids(tok, text)
    else:
        ids = [i for char in text for i in tok.encode(char, add_special_tokens=False)]
    assert tok.decode(ids, skip_special_tokens=False).strip() == text.strip()
    return ids


def test_a_stored_reply_goes_into_the_next_prompt_as_its_generated_ids(chat_tok):
    tok = chat_tok
    first = [{"role": "user", "content": "What is a paged cache?"}]
    prompt = tok.encode_chat(first)
    reply_ids = one_token_per_character(tok, "Blocks of keys and values.")
    reply = tok.decode(prompt + reply_ids, skip_special_tokens=False)[len(tok.decode(prompt, skip_special_tokens=False)):]
    chat = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And a prefix cache?"}]

    ids = tok.encode_chat(chat, reply_ids={1: reply_ids})
    assert ids[: len(prompt) + len(reply_ids)] == prompt + reply_ids  # the last turn's tokens, exactly
    assert ids != tok.encode_chat(chat)  # (the text alone tokenizes otherwise)
    # It reads as the template renders the chat: the template still writes the end of the turn.
    assert tok.decode(ids, skip_special_tokens=False) == tok.decode(tok.encode_chat(chat), skip_special_tokens=False)


def test_ids_that_do_not_read_as_the_stored_text_leave_the_text_in_the_prompt(chat_tok):
    tok = chat_tok
    chat = [{"role": "user", "content": "Say stop."}, {"role": "assistant", "content": "I will"},
            {"role": "user", "content": "Now."}]
    # A stop string cut the text short of the ids: the ids are not what the history says.
    cut_by_stop = tok.encode("I will stop here", add_special_tokens=False)
    assert tok.encode_chat(chat, reply_ids={1: cut_by_stop}) == tok.encode_chat(chat)
    # Ids that spell a control token the text does not show are never spliced in.
    forged = tok.encode("I will", add_special_tokens=False) + [tok.hf.convert_tokens_to_ids("<|im_end|>")] \
        if "<|im_end|>" in tok.hf.get_vocab() else tok.encode("I will!", add_special_tokens=False)
    assert tok.encode_chat(chat, reply_ids={1: forged}) == tok.encode_chat(chat)
