"""Text as the rules read it: disguises undone, and each character traced back to where it was written.

A word can be disguised so that a person still reads it but a rule no longer matches it: Cyrillic
or Greek look-alike letters (`ѕieg hеil`), fullwidth or mathematical letters (`ｋｉｌｌ`, `𝐤𝐢𝐥𝐥`), an
invisible character or a soft hyphen inside it, an accent on a letter. `normalize` undoes these,
character by character:

- invisible characters are dropped: format characters (Unicode category Cf: zero-width space and
  joiners, soft hyphen, word joiner, bidi controls, byte order mark, tag characters) and the
  Hangul fillers;
- NFKC's compatibility folding applies: fullwidth, mathematical, circled and superscript letters,
  ligatures (`ﬁ` reads "fi"), non-breaking and other wide spaces;
- combining marks are dropped (categories Mn and Me: accents, the combining grapheme joiner,
  variation selectors), so "é" and "e" + U+0301 both read "e". A rule word then matches its
  accented spellings in every language, which for slurs and explicit terms is wanted;
- decimal digits of every script read as ASCII digits, so the personal-data detectors see them;
- a letter or symbol that Unicode's confusables data (UTS #39) says looks like Latin letters
  reads as those letters: `ѕ` as s, `е` as e, `α` as a, `І` as I, `∞` as oo (see CONFUSABLES).

ASCII text is its own normal form (and costs nothing). Each character is read alone, never with
its neighbours, so text that comes later cannot change how earlier text reads; the streaming check
relies on that. `NormalizedText.original_span` maps a span of the normal form back to the text as
written; a span's end takes in the invisible characters and marks that follow it.

Still out of reach: leetspeak ("k1ll", "$ieg"); letters spaced or punctuated apart ("s i e g",
"s.i.e.g"); look-alikes that UTS #39 does not list or lists only with a non-Latin prototype
(Cyrillic д, л, и, п, я), and letters that look like digits (Cyrillic З, б: folding them would
make numbers out of words); regional indicator letters (🇰🇮🇱🇱); words drawn in ASCII art or
images; transliteration (Cyrillic "хуй" is not read as "khui"); languages and scripts that the
rule lists do not cover; characters newer than the tables here (UTS #39 confusables of Unicode
13.0, NFKC of the running Python's unicodedata).
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from dataclasses import dataclass

# What each group of characters reads as, from Unicode's confusables.txt (UTS #39, version 13.0.0;
# (c) Unicode, Inc., Unicode License v3): its rows whose source is one non-ASCII character that the
# rest of `reading` leaves alone (no compatibility decomposition, no mark, no digit) and whose
# prototype, without its marks, is ASCII letters. Code points in hex. Three changes to the data:
# prototype "rn" reads "m" (UTS #39 maps m itself to "rn"); an uppercase source of prototype "l"
# reads "I" (UTS #39 maps I to l as well, but ASCII is left as written here, and IGNORECASE must see
# an i in "KІLL"); and the Latin small capitals and kra (ᴀ ʙ ᴄ ... ĸ), which UTS #39 gives as the
# prototypes of Cyrillic в н т м к and Greek κ τ, read as their letters. Rows whose prototype is a
# digit or punctuation are left out.
# Why a table here and not a dependency: PyPI has no kept package that gives a skeleton for Latin.
# PyICU's SpoofChecker has one but ships no wheels (it compiles against the system's ICU);
# `confusable-homoglyphs` lists look-alikes both ways, not prototypes; `confusables` (last release
# 2021) ships the same confusables.txt, read here once to make this table, and an API for other uses.
CONFUSABLES: dict[str, str] = {chr(int(point, 16)): reads for reads, points in {
    "A": "0391 0410 13AA 15C5 A4EE 102A0 16F40", "a": "0251 03B1 0430 1D00 2376 237A AB7A", "AA": "A732",
    "aa": "A733", "AE": "00C6 04D4", "ae": "00E6 04D5", "AO": "A734", "ao": "A735", "AR": "1F707", "AU": "A736",
    "au": "A737", "AV": "A738 A73A", "av": "A739 A73B", "AY": "A73C", "ay": "A73D",
    "B": "0392 0412 13F4 15F7 A4D0 A7B4 10282 102A1 10301",
    "b": "0180 0182 0183 0184 0253 0299 0411 042C 0432 0462 0463 048C 048D 13CF 13FC 1472 1473 15AF",
    "bI": "042B", "C": "0421 04AA 13DF 20A1 2CA4 A4DA 102A2 10302 10415 1051C 118F2 1F16E 1F74C",
    "c": "00A2 023C 0441 04AB 1D04 2CA5 ABAF 1043D", "D": "00D0 0110 0189 13A0 15DE 15EA A4D3",
    "d": "0111 018C 0256 0257 0501 13E7 146F 1D05 20AB A4D2 AB70", "dz": "02A3",
    "E": "0246 0395 0415 13AC 22FF 2D39 A4F0 10286 118A6 118AE", "e": "0247 0435 04BD 04BF 1D07 212E AB32 AB7C",
    "F": "0191 03DC 15B4 A4DD A798 10287 102A5 10525 118A2 118C2 1D213",
    "f": "0192 0584 1D6E 1E9D A730 A799 AB35", "G": "01E4 050C 13C0 13F3 A4D6",
    "g": "018D 01E5 0260 0261 0262 050D 0581 13FB 1D83 AB90",
    "H": "0126 0397 041D 04A2 04C7 04C9 13BB 157C 2C67 2C8E A4E7 102CF",
    "h": "0127 0266 029C 043D 045B 04A3 04BB 04C8 04CA 0570 13C2 13F2 A695 AB8B",
    "I": "0196 0197 0399 0406 04C0 2C92",
    "i": "0131 0268 0269 026A 03B9 0456 04CF 13A5 1D7B 1D7C 2373 2378 A647 AB75 118C3", "IO": "042E",
    "J": "0248 037F 0408 13AB 148D A4D9 A7B2", "j": "0249 03F3 0458 1D0A AB7B",
    "K": "039A 041A 049A 049E 13E6 16D5 20AD 2C69 2C94 A4D7 A740 10518",
    "k": "0138 0199 03BA 043A 049B 049F 1D0B 2C95 ABB6",
    "L": "0141 13DE 14AA 2CD0 A4E1 1041B 10526 118A3 118B2 16F16 1D22A",
    "l": "0142 019A 01C0 026B 026D 029F 05C0 05D5 05DF 0627 0673 07CA 16C1 2223 23FD 2CD1 2D4F A4F2 ABAE 1028A "
         "10309 10320 10443 16F28 1E8C7",
    "ll": "01C1 05F0 2016 2225 10199", "llS": "10198", "ls": "02AA", "lt": "20B6", "lz": "02AB",
    "M": "039C 03FA 041C 04CD 13B7 15F0 16D6 2C98 A4DF 102B0 10311", "m": "0271 1D0D 1D6F 20A5 11700",
    "MB": "1F76B", "N": "019D 039D 2C9A A4E0 1018E 10513", "n": "019E 0273 0274 03B7 0578 057C 1D70",
    "O": "00D8 019F 0398 039F 03B8 041E 0472 04E8 0555 0B20 12D0 13BE 13EB 2296 229D 236C 2C9E 2D31 2D41 2D54 "
         "3007 A4F3 A74A 10292 102AB 10404 104C2 10516 118B5 1D21A 1F714",
    "o": "00F8 0275 03BF 03C3 043E 0473 04E9 0585 05E1 0647 06BE 06C1 06D5 06FF 0C02 0C82 0D02 0D20 0D82 101D "
         "10FF 1D0F 1D11 2C9F A74B AB3D AB3E AB74 AB8E ABBB 1042C 104EA 118C8 118D7",
    "OE": "0152", "oe": "0153 0276", "OO": "A698 A74E", "oo": "221E A699 A74F",
    "P": "03A1 0420 13E2 146D 2CA2 A4D1 10295", "p": "01A5 03C1 0440 1D18 1D29 1D7D 2374 2CA3 ABB2",
    "Q": "2D55", "q": "02A0 051B 0563 0566", "QE": "1F700", "R": "01A6 13A1 13D2 1587 A4E3 104B4 16F35 1D216",
    "r": "024D 027C 027D 0280 0433 0493 1D26 1D72 2C85 AB47 AB48 AB71 AB81 ABA2",
    "S": "0405 054F 13D5 13DA A4E2 10296 10420 16F3A", "s": "01BD 0282 0455 1D74 A731 ABAA 10448 118C1",
    "sss": "1F75C",
    "T": "0166 01AE 023E 03A4 0422 04AC 13A2 20AE 22A4 2361 27D9 2CA6 A4D4 10297 102B1 10315 118BC 16F0A 1F768",
    "t": "0167 01AD 03C4 0442 04AD 1D1B 1D75 AB72", "tf": "A777", "ts": "02A6",
    "U": "0244 054D 1200 13CC 144C 222A 22C3 A4F4 104CE 118B8 16F42",
    "u": "028B 03C5 057D 1D1C 1D7E A79F AB4E AB52 AB9C 104F6 118D8", "ue": "1D6B", "uo": "AB63",
    "V": "0474 13D9 142F 2D38 A4E6 A6DF 10197 1051D 118A0 16F08 1D20D 1F708",
    "v": "03BD 0475 05D8 1D20 2228 22C1 ABA9 11706 118C0", "VB": "1F76C", "W": "051C 13B3 13D4 20A9 A4EA 118EF",
    "w": "026F 0461 047D 051D 0561 1D21 A761 AB83 114C5 1170A 1170E 1170F",
    "X": "03A7 0425 04B2 166D 16B7 2573 2CAC 2D5D A4EB A7B3 10196 10290 102B4 10317 10322 10527 118EC",
    "x": "00D7 0445 1541 157D 166E 292B 292C 2A2F 2A30",
    "Y": "00A5 024E 03A5 0423 04AE 04B0 13A9 13BD 2CA8 A4EC 102B2 118A4 16F43",
    "y": "01B4 024F 0263 028F 03B3 0443 04AF 04B1 10E7 1D8C 1EFF AB5A 118DC",
    "Z": "01B5 0224 0396 13C3 A4DC 102F5 118A9", "z": "01B6 0225 0290 1D22 1D76 AB93 118C4",
}.items() for point in points.split()}

DROPPED_CATEGORIES = frozenset({"Cf", "Mn", "Me"})  # format characters (invisible) and combining marks
FILLERS = frozenset("\u115f\u1160\u3164\uffa0")  # Hangul fillers: letters that show nothing


def reading(char: str) -> str:
    """How one character reads to the rules: itself for ASCII, "" for an invisible one or a mark."""
    if char.isascii():
        return char
    category = unicodedata.category(char)
    if category in DROPPED_CATEGORIES or char in FILLERS:
        return ""
    if category == "Nd":
        return str(unicodedata.decimal(char))
    # NFKC without the marks: decompose, drop the marks, compose what is left (a Hangul syllable).
    decomposed = unicodedata.normalize("NFKD", char)
    kept = "".join(c for c in decomposed if unicodedata.category(c) not in DROPPED_CATEGORIES)
    plain = unicodedata.normalize("NFC", kept)
    return "".join(CONFUSABLES.get(c, c) for c in plain)


class Readings(dict):
    """Code point -> its `reading`, filled in as characters are met (a `str.translate` table)."""

    MAX_ENTRIES = 1 << 16  # a text of every code point must not grow it without bound

    def __missing__(self, code_point: int) -> str:
        if len(self) >= self.MAX_ENTRIES:
            self.clear()
        self[code_point] = found = reading(chr(code_point))
        return found


READINGS = Readings()


@dataclass(frozen=True)
class NormalizedText:
    """A text's normal form, and where each of its characters was written."""

    text: str  # the normal form
    written: str  # the text as written
    origins: list[int] | None  # per character of `text`, its index in `written`; None: the same index

    def original_span(self, start: int, end: int) -> tuple[int, int]:
        """The span of the written text that the non-empty span [start, end) of the normal form
        came from, through the invisible characters and marks right after it."""
        if self.origins is None:
            return start, end
        last = self.origins[end - 1]
        after = bisect.bisect_right(self.origins, last, lo=end)
        return self.origins[start], self.origins[after] if after < len(self.origins) else len(self.written)


def normalize(text: str) -> NormalizedText:
    """`text` with its disguises undone (see the module's docstring), traced back to `text`."""
    if text.isascii():
        return NormalizedText(text, text, None)
    normal = text.translate(READINGS)
    # Most texts have no character that reads as more or fewer than one: their offsets are the same.
    uneven = "".join(sorted(c for c in set(text) if len(READINGS[ord(c)]) != 1))
    if not uneven:
        return NormalizedText(normal, text, None)
    origins: list[int] = []
    at = 0
    for found in re.finditer(f"[{re.escape(uneven)}]", text):
        origins += range(at, found.start())
        origins += [found.start()] * len(READINGS[ord(found.group())])
        at = found.end()
    origins += range(at, len(text))
    return NormalizedText(normal, text, origins)


def start_of_last(text: str, count: int, end: int | None = None) -> int:
    """Where the last `count` characters of the normal form of `text[:end]` begin in `text` (0 when
    it has fewer): how far back the streaming check must hold or rescan, however much is invisible."""
    end = len(text) if end is None else end
    start = max(0, end - count)
    tail = text[start:end]
    # Mostly each character reads as one: then the tail of `count` characters is the answer.
    if tail.isascii() or (len(tail.translate(READINGS)) == count and READINGS[ord(tail[0])]):
        return start
    found = 0
    for i in range(end - 1, -1, -1):
        found += len(READINGS[ord(text[i])])
        if found >= count:
            return i
    return 0
