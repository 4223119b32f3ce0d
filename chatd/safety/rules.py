"""The rules stage of the safety pipeline: word lists, regex patterns and personal-data detectors.

Per moderation category, a `RuleSet` holds words (whole words or phrases, matched
case-insensitively) and patterns (Python regexes), read from a TOML file (the shipped
`default_rules.toml`, or an operator's own) plus rules added in code. Three built-in detectors
find personal data: emails, phone numbers, and payment card numbers that pass the Luhn check.
`scan` returns every match with its character span and the rule that made it, for the audit trail.

The rules match the text's normal form (normalize.py): look-alike letters, fullwidth and accented
letters read as plain Latin, invisible characters are gone, so "ѕіеg\u200bhеіl" is "sieg heil".
Rules are read the same way when they are loaded. A match's span is still in the text as written,
the invisible characters inside it included, so that redaction masks what was written.

No rule may need more than `RuleSet.MAX_MATCH_CHARS` characters of the normal form to match (its
match plus what its lookarounds inspect): the streaming output check holds back that many, so a
match split across deltas is always seen whole before any of it is sent. Loading refuses a rule
that breaks this, as it refuses unknown categories and regexes that do not compile.

OpenAI's subcategories are subsets of their parent ("sexual/minors" content is "sexual"
content), so a subcategory's match is reported under its parent as well, whenever the parent is
one of the categories asked for: an operator who blocks "sexual" blocks "sexual/minors" too, and
/v1/moderations flags both, as OpenAI's does.

This module is pure Python (the standard library's `re` and `unicodedata` only) and knows nothing
of HTTP, config or the model; what a match leads to (block, flag, redact) is the policies' business.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

# `re`'s own parser (private, but the only way to learn how long a regex's longest match is, and
# which literal text every match contains; it is `re._parser` since Python 3.11).
from re import _parser as regex_parser

from chatd.safety.normalize import normalize

CATEGORIES: tuple[str, ...] = (  # OpenAI's moderation categories, in OpenAI's order
    "harassment", "harassment/threatening", "hate", "hate/threatening", "illicit", "illicit/violent",
    "self-harm", "self-harm/intent", "self-harm/instructions", "sexual", "sexual/minors",
    "violence", "violence/graphic",
)
PII_CATEGORIES: tuple[str, ...] = ("pii/email", "pii/phone", "pii/card")  # chatd's own
ALL_CATEGORIES: tuple[str, ...] = CATEGORIES + PII_CATEGORIES

# "violence/graphic" -> "violence": each OpenAI subcategory and the category it is part of.
PARENT_CATEGORY: dict[str, str] = {c: c.split("/")[0] for c in CATEGORIES if "/" in c}

DEFAULT_RULES_PATH = Path(__file__).with_name("default_rules.toml")


@dataclass(frozen=True)
class Match:
    """One rule's match in a scanned text."""

    category: str  # one of ALL_CATEGORIES
    start: int  # character offsets into the scanned text as written, end exclusive
    end: int
    rule: str  # what matched: "word:<the word>", "pattern:<the regex>", "pii:email|phone|card"


@dataclass(frozen=True)
class CategoryRules:
    """One category's rules as written: words and regex patterns."""

    words: tuple[str, ...] = ()  # whole words or phrases, case-insensitive; a phrase's spaces match any run of 1-4 whitespace
    patterns: tuple[str, ...] = ()  # Python regexes, compiled case-insensitive (both in normal form, as texts are)


def luhn_valid(digits: str) -> bool:
    """Whether a string of digits passes the Luhn checksum that every payment card number carries."""
    if not digits or not digits.isascii() or not digits.isdigit():
        return False
    total = 0
    for position, digit in enumerate(reversed(digits)):
        value = int(digit)
        if position % 2 == 1:  # every second digit from the right is doubled
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


# Personal-data detectors. Each is a candidate regex whose matches a check in code confirms
# (digit count, Luhn); bounded like every other rule. Conservative on purpose: a phone number
# needs separators in a known layout, so order numbers, timestamps and prices are left alone.
EMAIL = re.compile(r"[a-z0-9][a-z0-9._%+-]{0,22}@[a-z0-9][a-z0-9.-]{0,27}\.[a-z]{2,10}", re.IGNORECASE)
PHONE = re.compile(
    r"(?<![\w+])\+\d{1,3}(?:[ .-]?\(?\d{1,4}\)?){2,6}(?!\d)"  # international: +44 20 7946 0958, +1 (415) 555-2671
    r"|(?<![\w+.-])(?:1[ .-]?)?(?:\(\d{3}\) ?|\d{3}[ .-])\d{3}[ .-]\d{4}(?![\w-]|\.\d)",  # (555) 123-4567, 555.123.4567
)
CARD = re.compile(  # a whole run of digits: 4111111111111111, 4111 1111 1111 1111, 3782-822463-10005
    r"(?<![\d+])(?<!\d[ -])(?:\d{13,19}|\d{3,6}(?:[ -]\d{3,6}){1,5})(?!\d)(?![ -]\d)",
)
PHONE_DIGITS = range(10, 16)  # E.164 allows 15 digits; fewer than 10 is a short code or an extension
CARD_DIGITS = range(13, 20)
# Ten digits with at most three other characters between each two: no phone or card number
# without it, and a text without it (most texts) is done with in one quick search.
TEN_DIGITS = re.compile(r"\d(?:\D{0,3}\d){9}")


def digits_of(text: str) -> str:
    """The digits of a text, without its separators."""
    return "".join(c for c in text if c.isdigit())


def find_personal_data(text: str, category: str) -> Iterable[Match]:
    """The built-in detector's matches of one PII category in `text`."""
    if category == "pii/email":
        if "@" in text:
            for found in EMAIL.finditer(text):
                yield Match(category, found.start(), found.end(), "pii:email")
    elif not TEN_DIGITS.search(text):
        return
    elif category == "pii/phone":
        position = 0
        while found := PHONE.search(text, position):
            if len(digits_of(found.group())) in PHONE_DIGITS:
                yield Match(category, found.start(), found.end(), "pii:phone")
                position = found.end()
            else:  # a shorter number may start inside a rejected candidate
                position = found.start() + 1
    elif category == "pii/card":
        for found in CARD.finditer(text):
            digits = digits_of(found.group())
            if len(digits) in CARD_DIGITS and luhn_valid(digits):
                yield Match(category, found.start(), found.end(), "pii:card")


def reach(parsed) -> int:
    """How many characters a parsed regex can need: its longest match plus what its lookarounds
    inspect (huge for a regex with `*`, `+` or `{n,}`)."""
    return parsed.getwidth()[1] + lookaround_width(parsed)


def lookaround_width(parsed) -> int:
    """The summed widest matches of the lookarounds in a parsed regex (getwidth counts them as 0)."""
    total = 0
    for op, argument in parsed:
        if op in (regex_parser.ASSERT, regex_parser.ASSERT_NOT):
            _direction, inner = argument
            total += inner.getwidth()[1] + lookaround_width(inner)
        else:
            total += sum(lookaround_width(inner) for inner in nested_subpatterns(argument))
    return total


def nested_subpatterns(argument) -> Iterable:
    """The parsed sub-regexes inside one node's argument (groups, branches, repeats)."""
    if isinstance(argument, regex_parser.SubPattern):
        yield argument
    elif isinstance(argument, (tuple, list)):
        for item in argument:
            yield from nested_subpatterns(item)


# A prefilter, because Python's regex engine tries every pattern at every position of the text:
# most patterns cannot match without one of a few literal strings ("yourself" for
# "\b(?:kill|hang)\syourself"), and whether the text holds one is a fast case-sensitive search of
# the case-folded text. Sound by construction: a pattern is skipped only when none of them is there.
REPEATS = (regex_parser.MAX_REPEAT, regex_parser.MIN_REPEAT, regex_parser.POSSESSIVE_REPEAT)


def fold(text: str) -> str:
    """Text as the prefilter compares it: case-folded, Turkish dotted and dotless i as plain i
    (the two letters `re.IGNORECASE` matches to "i" that `str.casefold` keeps apart)."""
    return text.casefold().replace("i\u0307", "i").replace("\u0131", "i")


def required_literals(parsed) -> list[frozenset[str]]:
    """Sets of strings such that every match of a parsed regex contains at least one string of
    each set ("\\b(?:kill|hang)\\syourself": {"kill", "hang"} and {"yourself"}); [] if none is known."""
    found: list[frozenset[str]] = []
    run: list[str] = []  # consecutive literal characters

    def close_run() -> None:
        if len(run) >= 2:
            found.append(frozenset(["".join(run)]))
        run.clear()

    for op, argument in parsed:
        if op is regex_parser.LITERAL:
            run.append(chr(argument))
            continue
        close_run()
        if op is regex_parser.SUBPATTERN:
            found += required_literals(argument[-1])
        elif op is regex_parser.ATOMIC_GROUP:
            found += required_literals(argument)
        elif op in REPEATS and argument[0] >= 1:
            found += required_literals(argument[2])
        elif op is regex_parser.BRANCH:
            # Each alternative's most telling set; only when every alternative has one.
            options = [max(required_literals(branch), key=selectivity, default=None) for branch in argument[1]]
            if all(options):
                found.append(frozenset().union(*options))
    close_run()
    return found


def selectivity(strings: frozenset[str]) -> tuple[int, int]:
    """How rarely a set of strings is likely to occur in text: by its shortest, then fewest."""
    return min(map(len, strings)), -len(strings)


@dataclass(frozen=True)
class PrefilteredRegex:
    """A compiled rule regex, and the searches that must all find something before it is worth running."""

    regex: re.Pattern
    gates: tuple[re.Pattern, ...]  # over `fold(text)`, the most telling first; (): always run

    MAX_GATES = 3  # each costs a search; the third rarely rules out what the first two let through

    @classmethod
    def compile(cls, regex: str, parsed) -> PrefilteredRegex:
        literal_sets = sorted(set(required_literals(parsed)), key=selectivity, reverse=True)[:cls.MAX_GATES]
        gates = tuple(re.compile("|".join(sorted(re.escape(fold(s)) for s in strings))) for strings in literal_sets)
        return cls(re.compile(regex, re.IGNORECASE), gates)

    def finditer(self, text: str, folded: str) -> Iterable[re.Match]:
        if not all(gate.search(folded) for gate in self.gates):
            return ()
        return self.regex.finditer(text)


def words_regex(words: Iterable[str]) -> str:
    """Words and phrases as one regex: each escaped, the longest first (a phrase wins over a word
    it starts with), a phrase's spaces any short run of whitespace (it may wrap onto the next
    line), none part of a longer word on either side."""
    pieces = (r"\s{1,4}".join(re.escape(piece) for piece in word.split()) for word in sorted(words, key=len, reverse=True))
    return r"(?<!\w)(?:" + "|".join(pieces) + r")(?!\w)"


def normal_form(text: str) -> str:
    """How a word is looked up: lower case, whitespace runs as one space."""
    return " ".join(text.lower().split())


@dataclass(frozen=True)
class CompiledRules:
    """One category's rules, compiled: one alternation of all its words, and each pattern."""

    words: PrefilteredRegex | None
    word_names: dict[str, str]  # normal form -> the word as written, to name the rule that matched
    patterns: tuple[tuple[PrefilteredRegex, str], ...]  # (compiled, rule name)

    def matches(self, text: str, folded: str) -> Iterable[tuple[int, int, str]]:
        """(start, end, rule name) of every match in `text`, a normal form (`folded`: `fold(text)`)."""
        if self.words is not None:
            for found in self.words.finditer(text, folded):
                word = self.word_names.get(normal_form(found.group()), found.group())
                yield found.start(), found.end(), f"word:{word}"
        for pattern, name in self.patterns:
            for found in pattern.finditer(text, folded):
                if found.end() > found.start():
                    yield found.start(), found.end(), name


class RuleSet:
    """Compiled rules for every category."""

    MAX_MATCH_CHARS = 64  # no rule may need more characters of normal form (what the streaming check holds back)

    def __init__(self, rules: Mapping[str, CategoryRules]) -> None:
        """Compile `rules` (category -> its rules); ValueError naming the category and the rule
        when a category is unknown, a regex does not compile, or a rule could match too much."""
        for category, category_rules in rules.items():
            if category not in ALL_CATEGORIES:
                first = (category_rules.words or category_rules.patterns or ("",))[0]
                raise ValueError(f"rules for unknown category {category!r} (rule {first!r}); "
                                 f"the categories are: {', '.join(ALL_CATEGORIES)}")
        self.rules: dict[str, CategoryRules] = {c: rules[c] for c in ALL_CATEGORIES if c in rules}
        self.compiled: dict[str, CompiledRules] = {c: self._compile(c, r) for c, r in self.rules.items()}

    @classmethod
    def load(cls, path: Path | None = None, extra: Mapping[str, CategoryRules] | None = None) -> RuleSet:
        """The rules in `path` (a TOML file like default_rules.toml; None: the shipped one), with
        `extra` rules added per category."""
        path = DEFAULT_RULES_PATH if path is None else Path(path)
        rules = read_rules_file(path)
        for category, added in (extra or {}).items():
            known = rules.get(category, CategoryRules())
            rules[category] = CategoryRules(known.words + tuple(added.words), known.patterns + tuple(added.patterns))
        return cls(rules)

    def scan(self, text: str, categories: Iterable[str] | None = None) -> list[Match]:
        """Every match in `text` (of `categories` only, when given), sorted by start, then category.
        Overlapping matches, of one category or several, are all reported; a subcategory's match
        is reported under its parent too when the parent is asked for."""
        wanted = set(ALL_CATEGORIES) if categories is None else set(categories)
        unknown = wanted - set(ALL_CATEGORIES)
        if unknown:
            raise ValueError(f"unknown categories {sorted(unknown)}; the categories are: {', '.join(ALL_CATEGORIES)}")
        normal = normalize(text)
        folded = fold(normal.text)
        matches: list[Match] = []
        for category, compiled in self.compiled.items():
            reported_as = [c for c in (category, PARENT_CATEGORY.get(category)) if c in wanted]
            if reported_as:
                for start, end, rule in compiled.matches(normal.text, folded):
                    start, end = normal.original_span(start, end)
                    matches += [Match(c, start, end, rule) for c in reported_as]
        for category in PII_CATEGORIES:
            if category in wanted:
                matches += [Match(m.category, *normal.original_span(m.start, m.end), m.rule)
                            for m in find_personal_data(normal.text, category)]
        # A rule written in both a subcategory and its parent finds one span twice: report it once.
        return sorted(set(matches), key=lambda m: (m.start, m.category, m.end, m.rule))

    def _compile(self, category: str, rules: CategoryRules) -> CompiledRules:
        """One category's rules compiled, each checked: ValueError naming the category and the rule.
        Each is compiled in normal form, as texts are matched ("café" matches "cafe" and "café");
        a character a pattern writes as an escape ("\\u00e9") is not normalised, and never matches."""
        for word in rules.words:
            if not isinstance(word, str) or not normalize(word).text.strip():
                raise ValueError(f"rules for {category!r}: word {word!r} is empty")
            self._parse(category, f"word {word!r}", words_regex([normalize(word).text]))
        words = None
        if rules.words:
            regex = words_regex(normalize(w).text for w in rules.words)
            words = PrefilteredRegex.compile(regex, regex_parser.parse(regex, re.IGNORECASE))
        patterns = []
        for pattern in rules.patterns:
            normal_pattern = normalize(pattern).text if isinstance(pattern, str) else pattern  # _parse refuses a non-str
            parsed = self._parse(category, f"pattern {pattern!r}", normal_pattern)
            compiled = PrefilteredRegex.compile(normal_pattern, parsed)
            if compiled.regex.fullmatch(""):
                raise ValueError(f"rules for {category!r}: pattern {pattern!r} matches the empty string")
            patterns.append((compiled, f"pattern:{pattern}"))
        return CompiledRules(words, {normal_form(normalize(w).text): w for w in rules.words}, tuple(patterns))

    def _parse(self, category: str, rule: str, regex: str):
        """A rule's regex parsed, once checked that it compiles and is bounded."""
        try:
            re.compile(regex, re.IGNORECASE)  # some errors (a lookbehind of varying width) only compiling finds
            parsed = regex_parser.parse(regex, re.IGNORECASE)
        except (re.error, TypeError, OverflowError, RecursionError) as error:
            raise ValueError(f"rules for {category!r}: {rule} does not compile: {error}") from None
        needed = reach(parsed)
        if needed > self.MAX_MATCH_CHARS:
            how_much = ("any number of characters (an unbounded *, + or {n,})" if needed >= regex_parser.MAXREPEAT
                        else f"{needed} characters")
            raise ValueError(f"rules for {category!r}: {rule} can need {how_much}; at most "
                             f"{self.MAX_MATCH_CHARS} are allowed (bound its repeats, e.g. {{1,3}})")
        return parsed


def read_rules_file(path: Path) -> dict[str, CategoryRules]:
    """A rules TOML file as category -> rules; ValueError naming the file and what is wrong."""
    try:
        with open(path, "rb") as file:
            tables = tomllib.load(file)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"rules file {path}: {error}") from None
    rules = {}
    for category, table in tables.items():
        if not isinstance(table, dict):
            raise ValueError(f"rules file {path}: {category!r} must be a table with words and patterns")
        unexpected = sorted(set(table) - {"words", "patterns"})
        if unexpected:
            raise ValueError(f"rules file {path}: [{category!r}] has {unexpected[0]!r}; a category has words and patterns")
        lists = {key: table.get(key, []) for key in ("words", "patterns")}
        for key, values in lists.items():
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise ValueError(f"rules file {path}: [{category!r}] {key} must be a list of strings")
        rules[category] = CategoryRules(tuple(lists["words"]), tuple(lists["patterns"]))
    return rules
