"""The normal form the rules read (chatd/safety/normalize.py): disguises undone, offsets kept."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatd.safety.normalize import CONFUSABLES, normalize, reading, start_of_last


@pytest.mark.parametrize("written, reads", [
    ("\u0455", "s"), ("\u0435", "e"), ("\u03b1", "a"), ("\u0406", "I"), ("\u01c0", "l"),  # ѕ е α І ǀ
    ("\u0442", "t"), ("\u043a", "k"),  # Cyrillic т к: small capital and kra prototypes, read as their letters
    ("\uff4b", "k"), ("\U0001d424", "k"), ("\u24da", "k"),  # fullwidth, mathematical bold, circled
    ("\u200b", ""), ("\u00ad", ""), ("\u2060", ""), ("\ufeff", ""), ("\U000e0041", ""), ("\u3164", ""),  # invisible
    ("\u0301", ""), ("\ufe0f", ""), ("\u034f", ""),  # combining accent, variation selector, grapheme joiner
    ("\u00e9", "e"), ("\u0142", "l"), ("\ufb01", "fi"), ("\u00e6", "ae"), ("\u221e", "oo"),
    ("\u0664", "4"), ("\uff14", "4"), ("\u00b2", "2"),  # digits of other scripts read as ASCII digits
    ("\u0417", "\u0417"), ("\u0431", "\u0431"),  # Cyrillic З and б look like 3 and 6: never made digits
    ("\ud55c", "\ud55c"), ("\u4e2d", "\u4e2d"), ("\u00df", "\u00df"),  # Hangul, Han, German sharp s stay
    ("\u3000", " "), ("\u00a0", " "),
])
def test_each_character_reads_as_a_person_would_read_it(written, reads):
    assert reading(written) == reads
    assert normalize(f"x{written}x").text == f"x{reads}x"


def test_ascii_text_is_its_own_normal_form():
    text = "Plain ASCII, with\ttabs and\x00controls."
    normal = normalize(text)
    assert normal.text == text and normal.original_span(5, 10) == (5, 10)


def test_a_span_maps_back_to_what_was_written_through_the_invisible_characters_after_it():
    text = "\u200bk\u200bi\u00adll\u0301\u200b now \ufb01ne"
    normal = normalize(text)
    assert normal.text == "kill now fine"
    assert text[slice(*normal.original_span(0, 4))] == "k\u200bi\u00adll\u0301\u200b"  # not the ZWSP before it
    assert text[slice(*normal.original_span(10, 13))] == "\ufb01ne"  # from inside a ligature: all of it
    assert text[slice(*normal.original_span(11, 13))] == "ne"


def test_the_confusables_table_reads_non_ascii_characters_as_ascii_letters():
    assert len(CONFUSABLES) > 500
    for char, reads in CONFUSABLES.items():
        assert not char.isascii() and reads.isascii() and reads.isalpha()
        assert reading(char) == reads, f"U+{ord(char):04X} is changed before the table is looked at"


@settings(max_examples=150, deadline=None)
@given(st.text(), st.text())
def test_the_normal_form_is_read_one_character_at_a_time(before, after):
    """What comes later never changes how earlier text reads: the streaming check relies on it."""
    assert normalize(before + after).text == normalize(before).text + normalize(after).text
    normal = normalize(before + after)
    for i in range(len(normal.text)):
        start, end = normal.original_span(i, i + 1)
        assert normal.text[i] in normalize(normal.written[start:end]).text


@settings(max_examples=150, deadline=None)
@given(st.text(st.sampled_from(["a", " ", "\u00e9", "\u200b", "\u0301", "\ufb01", "\u0455"])), st.integers(1, 12))
def test_start_of_last_finds_the_shortest_tail_with_that_many_characters_of_normal_form(text, count):
    start = start_of_last(text, count)
    assert start == 0 or len(normalize(text[start:]).text) >= count
    assert len(normalize(text[start + 1:]).text) < count
