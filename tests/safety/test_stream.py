"""The output window: a reply checked as it streams is never sent a blocked match, whatever the
chunking; masked matches are sent masked; benign text is sent whole and held back only a little."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from chatd.config import CategoryPolicy
from chatd.safety.rules import CategoryRules, RuleSet
from chatd.safety.stream import OutputWindow

RULES = RuleSet({"violence": CategoryRules(words=("kill yourself",)), "illicit": CategoryRules(words=("bomb",))})
POLICIES = {"violence": CategoryPolicy("block"), "illicit": CategoryPolicy("flag"), "pii/email": CategoryPolicy("redact")}


def stream(text: str, cuts: list[int], hold: int | None = None) -> tuple[OutputWindow, list[str]]:
    """Feed `text` cut at `cuts` (the last piece final); the window and what it released each time."""
    window = OutputWindow(RULES, POLICIES, hold)
    points = sorted({c for c in cuts if 0 < c < len(text)})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    released = [window.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return window, released


VIOLATING = "Sure, here is my answer. You should kill   yourself, said nobody ever, and then more text follows."


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(VIOLATING)), max_size=40))
def test_a_blocked_match_is_never_sent_however_the_reply_is_cut(cuts):
    window, released = stream(VIOLATING, cuts)
    sent = "".join(released)
    assert sent == "Sure, here is my answer. You should "  # everything before the match, nothing of it or after
    assert window.stopped and window.violation.category == "violence"
    assert VIOLATING[window.violation.start : window.violation.end] == "kill   yourself"


BENIGN = ("The bombastic speaker killed it on stage: skills like that take years. "
          "Kill the process with SIGTERM if it hangs, then restart yourself a coffee. ") * 3


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, len(BENIGN)), max_size=60))
def test_benign_text_is_sent_whole_and_held_back_at_most_the_window(cuts):
    window = OutputWindow(RULES, POLICIES, hold=24)
    points = sorted({c for c in cuts if 0 < c < len(BENIGN)})
    pieces = [BENIGN[a:b] for a, b in zip([0, *points], [*points, len(BENIGN)])]
    sent = ""
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        sent += window.feed(piece, final)
        if not final:
            assert len(window.text) - window.released <= 24  # only the window is held back
    assert sent == BENIGN and not window.stopped and window.findings == []


def test_a_word_at_the_end_of_a_chunk_is_judged_only_once_it_cannot_grow():
    window = OutputWindow(RULES, POLICIES)
    sent = window.feed("a bomb") + window.feed("astic talk", final=True)  # "bomb" could have been "bombastic"
    assert sent == "a bombastic talk" and window.findings == []
    window = OutputWindow(RULES, POLICIES)
    sent = window.feed("a bomb") + window.feed(" threat", final=True)
    assert sent == "a bomb threat"  # flagged, sent as it is
    assert [(f.category, f.action) for f in window.findings] == [("illicit", "flag")]
    window = OutputWindow(RULES, POLICIES)
    assert window.feed("a bomb", final=True) == "a bomb"  # at the very end: it cannot grow any more
    assert [f.category for f in window.findings] == ["illicit"]


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, 60), max_size=20))
def test_an_email_split_over_chunks_is_sent_masked(cuts):
    text = "Write to jane.doe@example.org today, or to bob@example.com."
    window, released = stream(text, cuts)
    assert "".join(released) == "Write to [email] today, or to [email]."
    assert [f.action for f in window.findings] == ["redact", "redact"]


def test_each_finding_is_reported_once_however_often_it_is_rescanned():
    window, _ = stream("a bomb, " + "x " * 100 + "another bomb.", list(range(0, 220, 3)))
    assert [(f.category, f.start) for f in window.findings] == [("illicit", 2), ("illicit", 216)]


def test_nothing_is_sent_after_a_block():
    window = OutputWindow(RULES, POLICIES, hold=8)
    assert window.feed("fine text then kill yourself now", final=False) == "fine text then "
    assert window.feed(" and more", final=True) == ""


SKILL = "We talked about how to skill yourself up at chess, and how to reskill yourself after a break. " * 2


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(SKILL)), max_size=30), hold=st.integers(16, 40))
def test_a_rescan_never_starts_inside_a_word(cuts, hold):
    """The window rescans from a little before what it sent; started inside "skill" it would read
    "kill yourself" there."""
    window = OutputWindow(RULES, POLICIES, hold)
    points = sorted({c for c in cuts if 0 < c < len(SKILL)})
    pieces = [SKILL[a:b] for a, b in zip([0, *points], [*points, len(SKILL)])]
    sent = "".join(window.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces))
    assert sent == SKILL and not window.stopped


# Disguised replies: the window counts characters as the rules read them (chatd/safety/normalize.py)

PADDING = "\u200b" * 5
PADDED = "Sure, here is my answer. You should " + PADDING.join("kill yourself") + ", said nobody ever."


def test_a_blocked_phrase_padded_with_invisible_characters_is_never_sent_a_character_at_a_time():
    # 73 characters as written, 13 as read: a window that counted the written ones would send "k".
    window, released = stream(PADDED, list(range(len(PADDED))))
    assert "".join(released) == "Sure, here is my answer. You should "
    assert PADDED[window.violation.start : window.violation.end] == PADDING.join("kill yourself")


def test_invisible_characters_do_not_count_towards_what_is_held_back():
    window = OutputWindow(RULES, POLICIES, hold=10)
    assert window.feed("a" * 20 + "\u200b" * 30) == "a" * 10


DISGUISED = ("Sure, here is my answer. You should \uff4b\u0456ll\u00ad   y\u043eur\u0455elf, said nobody ever, "
             "and then more text follows.")  # fullwidth k, Cyrillic i, o and s, a soft hyphen


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(DISGUISED)), max_size=40))
def test_a_disguised_blocked_match_is_never_sent_however_the_reply_is_cut(cuts):
    window, released = stream(DISGUISED, cuts)
    assert "".join(released) == "Sure, here is my answer. You should "
    assert DISGUISED[window.violation.start : window.violation.end] == "\uff4b\u0456ll\u00ad   y\u043eur\u0455elf"


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 60), max_size=20))
def test_a_disguised_email_split_over_chunks_is_sent_masked(cuts):
    text = "Write to \uff4aane.doe\uff20example.org today, or to bob\u200b@example.com."
    window, released = stream(text, cuts)
    assert "".join(released) == "Write to [email] today, or to [email]."


def test_an_invisible_character_after_a_word_does_not_end_it():
    window = OutputWindow(RULES, POLICIES)
    sent = window.feed("a bomb\u200b") + window.feed("astic talk", final=True)  # reads "a bombastic talk"
    assert sent == "a bomb\u200bastic talk" and window.findings == []
