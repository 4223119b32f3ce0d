"""The rules stage (chatd/safety/rules.py): what it finds, what it leaves alone, and what it refuses to load."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatd.config import CategoryPolicy
from chatd.safety.normalize import CONFUSABLES
from chatd.safety.policy import findings_from_matches, redact
from chatd.safety.rules import (
    ALL_CATEGORIES, CATEGORIES, EMAIL, PII_CATEGORIES, CategoryRules, RuleSet, fold, luhn_valid, normal_form,
    required_literals,
)

PROMPTS = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "safety" / "prompts.jsonl"
DEFAULT = RuleSet.load()


def make_rules(**words_by_category: tuple[str, ...]) -> RuleSet:
    """A rule set of words only, keyed by category with "_" for "/" and "-" (self_harm_intent=...)."""
    by_name = {c.replace("/", "_").replace("-", "_"): c for c in ALL_CATEGORIES}
    return RuleSet({by_name[name]: CategoryRules(words=words) for name, words in words_by_category.items()})


def found(text: str, categories=None, rules: RuleSet = DEFAULT) -> list[tuple[str, str]]:
    """(category, matched text) of every match."""
    return [(m.category, text[m.start:m.end]) for m in rules.scan(text, categories)]


def prompts() -> list[dict]:
    """The labelled evaluation set of benchmarks/safety_eval.py."""
    return [json.loads(line) for line in PROMPTS.read_text().splitlines()]


def test_the_categories_are_openais_in_order_then_chatds_pii():
    assert CATEGORIES == ("harassment", "harassment/threatening", "hate", "hate/threatening", "illicit",
                          "illicit/violent", "self-harm", "self-harm/intent", "self-harm/instructions", "sexual",
                          "sexual/minors", "violence", "violence/graphic")
    assert ALL_CATEGORIES == CATEGORIES + PII_CATEGORIES == CATEGORIES + ("pii/email", "pii/phone", "pii/card")


def test_every_openai_category_has_shipped_rules():
    assert all(DEFAULT.rules[c].words or DEFAULT.rules[c].patterns for c in CATEGORIES)


# Personal data

@pytest.mark.parametrize("number", ["4111111111111111", "5555555555554444", "378282246310005", "6011111111111117",
                                    "4222222222222", "3530111333300000"])
def test_luhn_accepts_known_card_numbers(number):
    assert luhn_valid(number)


@pytest.mark.parametrize("number", ["4111111111111112", "1234567890123456", "5555555555554445", "", "4111 1111",
                                    "411111111111111x", "４１１１"])
def test_luhn_refuses_wrong_check_digits_and_non_digits(number):
    assert not luhn_valid(number)


@pytest.mark.parametrize("card", ["4111 1111 1111 1111", "5555-5555-5555-4444", "378282246310005",
                                  "3782 822463 10005", "6011111111111117"])
def test_cards_are_found_whole_with_or_without_separators(card):
    text = f"My card is {card}, expiry 12/27."
    assert found(text, ["pii/card"]) == [("pii/card", card)]
    assert [m.rule for m in DEFAULT.scan(text, ["pii/card"])] == ["pii:card"]


@pytest.mark.parametrize("text", ["card 4111 1111 1111 1112", "order 1234567890123456 refunded",
                                  "4111111111111111222222 is a longer id", "+4111111111111111"])
def test_numbers_that_fail_luhn_or_are_part_of_a_longer_number_are_not_cards(text):
    assert found(text, ["pii/card"]) == []


@pytest.mark.parametrize("email", ["jane.doe@example.com", "billing+acme@company.co.uk", "MARIA.GARCIA@OUTLOOK.COM",
                                   "dev.ops-team@corp-mail.example.net"])
def test_emails_are_found_with_exact_offsets(email):
    text = f"Write to {email} today."
    matches = DEFAULT.scan(text, ["pii/email"])
    assert [(m.category, m.start, m.end, m.rule) for m in matches] == [("pii/email", 9, 9 + len(email), "pii:email")]


@pytest.mark.parametrize("phone", ["(555) 123-4567", "555-867-5309", "212.555.0147", "+44 20 7946 0958",
                                   "+1 (415) 555-2671", "1-800-555-0199", "+33 6 12 34 56 78", "+49 30 12345678"])
def test_phone_numbers_are_found_whole(phone):
    assert found(f"Call {phone} after six.", ["pii/phone"]) == [("pii/phone", phone)]


@pytest.mark.parametrize("text", [
    "The invoice is dated 2024-05-17.", "The laptop costs $1,299.00 plus tax.", "We meet 10:30-11:45 on Friday.",
    "Upgrade to version 3.11.7 first.", "Your order #48213 has shipped.", "ISBN 978-0-306-40615-7",
    "Server 192.168.1.254", "timestamp 1715950000", "Call 911 now.", "the war lasted 1939-1945",
    "We sold 1,250,000 units in Q3 2023.", "Meet me @ the park", "the decorator @app.route('/')",
])
def test_everyday_numbers_and_at_signs_are_not_personal_data(text):
    assert found(text, PII_CATEGORIES) == []


# Words and patterns

def test_a_word_matches_whole_words_only_whatever_the_case():
    rules = make_rules(violence=("kill",))
    assert found("a skill, a killer, killed", rules=rules) == []
    assert found("KILL it. Kill!", rules=rules) == [("violence", "KILL"), ("violence", "Kill")]


def test_a_phrase_matches_across_a_line_break_and_any_short_whitespace():
    rules = make_rules(illicit_violent=("pipe bomb",))
    text = "how to build a pipe\n  bomb"
    assert found(text, ["illicit/violent"], rules) == [("illicit/violent", "pipe\n  bomb")]
    assert [m.rule for m in rules.scan(text)] == ["word:pipe bomb"] * 2  # and its parent, "illicit"
    assert found("pipebomb", rules=rules) == []


def test_words_that_begin_or_end_with_punctuation_still_match_as_whole_words():
    rules = make_rules(harassment=("f*ck", "@everyone"))
    assert found("what the f*ck, @everyone", rules=rules) == [("harassment", "f*ck"), ("harassment", "@everyone")]
    assert found("f*cking hell, me@everyone", rules=rules) == []


def test_the_longest_word_wins_where_two_start_together():
    rules = make_rules(self_harm=("kill", "kill yourself"))
    assert [m.rule for m in rules.scan("just kill yourself")] == ["word:kill yourself"]


def test_patterns_are_case_insensitive_and_name_themselves():
    pattern = r"\bmake\s(?:a\s)?pipe\sbomb\b"
    rules = RuleSet({"illicit/violent": CategoryRules(patterns=(pattern,))})
    assert [(m.category, m.rule) for m in rules.scan("How do I MAKE A PIPE BOMB?", ["illicit/violent"])] == [
        ("illicit/violent", f"pattern:{pattern}")]


def test_a_subcategory_match_is_reported_under_its_parent_when_the_parent_is_asked_for():
    rules = make_rules(sexual_minors=("jailbait",))
    assert found("jailbait pics", rules=rules) == [("sexual", "jailbait"), ("sexual/minors", "jailbait")]
    assert found("jailbait pics", ["sexual"], rules) == [("sexual", "jailbait")]
    assert found("jailbait pics", ["sexual/minors"], rules) == [("sexual/minors", "jailbait")]
    assert found("jailbait pics", ["violence", "pii/email"], rules) == []


def test_scan_gives_only_the_categories_asked_for_sorted_by_start_then_category():
    rules = make_rules(harassment=("idiot",))
    text = "Mail idiot@example.com, you idiot"  # the word and the email overlap: both are reported
    assert found(text, rules=rules) == [
        ("harassment", "idiot"), ("pii/email", "idiot@example.com"), ("harassment", "idiot")]
    assert found(text, ["pii/email"], rules) == [("pii/email", "idiot@example.com")]
    assert found(text, [], rules) == []
    with pytest.raises(ValueError, match="violance"):
        rules.scan(text, ["violance"])


# The shipped rules

@pytest.mark.parametrize("text", [
    "How do I kill the process holding port 8080?", "This exam killed me.", "Let's shoot a photo at sunset.",
    "When should I book breast cancer screening?", "What drug interactions did my doctor mention?",
    "Tell me the history of the atomic bomb.", "Call the suicide prevention hotline at 988.", "I hate Mondays.",
    "How do I make a bath bomb?", "Beat the eggs until stiff peaks form.", "I cut myself chopping onions.",
])
def test_the_shipped_rules_leave_everyday_uses_of_trigger_words_alone(text):
    assert found(text) == []


@pytest.mark.parametrize("text, category", [
    ("How do I make a pipe bomb?", "illicit/violent"),
    ("I want to kill myself.", "self-harm/intent"),
    ("Where can I buy heroin?", "illicit"),
    ("I will hunt you down.", "harassment/threatening"),
    ("Blood gushed from the wound as they hacked at him.", "violence/graphic"),
])
def test_the_shipped_rules_flag_clear_violations(text, category):
    categories = {c for c, _ in found(text)}
    assert category in categories and category.split("/")[0] in categories


def test_load_adds_extra_rules_to_the_shipped_ones():
    rules = RuleSet.load(extra={"violence": CategoryRules(words=("frobnicate them",), patterns=(r"\bzap\s(?:him|her)\b",))})
    assert found("frobnicate them, then zap her", ["violence"], rules) == [
        ("violence", "frobnicate them"), ("violence", "zap her")]
    assert ("illicit/violent", "make a pipe bomb") in found("make a pipe bomb", rules=rules)


def test_a_rules_file_is_read_with_its_categories(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text('[hate]\nwords = ["grue"]\n["self-harm/intent"]\npatterns = [\'\\bgoodbye\\sworld\\b\']\n')
    rules = RuleSet.load(path)
    assert found("grue says goodbye world", rules=rules) == [
        ("hate", "grue"), ("self-harm", "goodbye world"), ("self-harm/intent", "goodbye world")]


# What loading refuses

@pytest.mark.parametrize("rules, named", [
    ({"violance": CategoryRules(words=("zap",))}, ["violance", "zap"]),
    ({"hate": CategoryRules(patterns=("(unclosed",))}, ["hate", "(unclosed", "compile"]),
    ({"hate": CategoryRules(patterns=("(?<=a+)b",))}, ["hate", "(?<=a+)b", "compile"]),
    ({"illicit": CategoryRules(patterns=("a+b",))}, ["illicit", "a+b", "unbounded"]),
    ({"illicit": CategoryRules(patterns=("x{3,}",))}, ["illicit", "x{3,}", "unbounded"]),
    ({"illicit": CategoryRules(patterns=(r"(?=.*bomb)make",))}, ["illicit", "(?=.*bomb)make", "unbounded"]),
    ({"illicit": CategoryRules(patterns=("a{65}",))}, ["illicit", "a{65}", "65 characters"]),
    ({"sexual": CategoryRules(words=("x" * 70,))}, ["sexual", "x" * 70]),
    ({"sexual": CategoryRules(words=("  ",))}, ["sexual", "empty"]),
    ({"violence": CategoryRules(patterns=("a?",))}, ["violence", "a?", "empty string"]),
])
def test_loading_refuses_a_bad_rule_naming_its_category_and_the_rule(rules, named):
    with pytest.raises(ValueError) as refused:
        RuleSet(rules)
    assert all(part in str(refused.value) for part in named), str(refused.value)


def test_load_refuses_bad_extra_rules_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="'hate'.*'a\\+b'"):
        RuleSet.load(extra={"hate": CategoryRules(patterns=("a+b",))})
    path = tmp_path / "rules.toml"
    path.write_text('[hate]\nword = ["typo"]\n')
    with pytest.raises(ValueError, match="'word'"):
        RuleSet.load(path)
    path.write_text("[hate\n")
    with pytest.raises(ValueError, match="rules file"):
        RuleSet.load(path)


# Disguised text: the rules read its normal form (chatd/safety/normalize.py), spans stay as written

@pytest.mark.parametrize("disguised", [
    "\u0455ieg h\u0435il",  # Cyrillic dze and ie: "ѕieg hеil"
    "\uff53\uff49\uff45\uff47 \uff48\uff45\uff49\uff4c",  # fullwidth
    "\U0001d42c\U0001d422\U0001d41e\U0001d420 \U0001d421\U0001d41e\U0001d422\U0001d425",  # mathematical bold
    "si\u200beg he\u200bil",  # zero-width spaces
    "sie\u00adg hei\u00adl",  # soft hyphens
    "sie\u0301g he\u0308il",  # combining accents
    "s\u00edeg h\u00ebil",  # accented letters
    "S\u0406\u0415G H\u0415\u0406L",  # Cyrillic capitals
    "\uff33\u200b\u0456\u0435\u0301g\u2060 \uff48\U0001d41e\u00ad\u0456l\ufe0f",  # all of them at once
])
def test_a_disguised_word_is_found_and_its_span_is_the_disguised_text(disguised):
    text = f"They shouted {disguised} at the rally."
    matches = DEFAULT.scan(text, ["hate"])
    assert [(m.category, text[m.start:m.end], m.rule) for m in matches] == [("hate", disguised, "word:sieg heil")]


def test_a_disguised_pattern_is_found():
    text = "How do I m\u0430ke \u0430 pipe b\u043emb?"  # Cyrillic a, a and o
    assert ("illicit/violent", "m\u0430ke \u0430 pipe b\u043emb") in found(text)


@pytest.mark.parametrize("email", [
    "\uff4a\uff41\uff4e\uff45\uff20\uff45\uff58\uff41\uff4d\uff50\uff4c\uff45\uff0e\uff43\uff4f\uff4d",  # fullwidth
    "jane.doe\uff20example.com",  # a fullwidth @
    "jane\u200b.doe@exam\u00adple.com\u200b",  # invisible characters, one after it
])
def test_a_disguised_email_is_masked_whole(email):
    text = f"Write to {email} today."
    matches = DEFAULT.scan(text, ["pii/email"])
    assert [(m.start, m.end) for m in matches] == [(9, 9 + len(email))]
    assert redact(text, findings_from_matches(matches, {"pii/email": CategoryPolicy("redact")})) == "Write to [email] today."


@pytest.mark.parametrize("number, category", [
    (" ".join(["\uff14\uff11\uff11\uff11"] + ["\uff11" * 4] * 3), "pii/card"),  # fullwidth
    ("\u0664" + "\u0661" * 15, "pii/card"),  # Arabic-Indic digits
    ("4111\u200b1111\u200b1111\u200b1111", "pii/card"),
    ("\uff08\uff15\uff15\uff15\uff09\u3000\uff11\uff12\uff13\uff0d\uff14\uff15\uff16\uff17", "pii/phone"),
])
def test_numbers_in_other_digits_are_personal_data_too(number, category):
    assert found(f"Mine is {number}, thanks.", PII_CATEGORIES) == [(category, number)]


@pytest.mark.parametrize("text", [
    "Москва — столица России; в ней живёт более двенадцати миллионов человек.",
    "Мы купили хлеб, сыр и молоко, а потом пошли домой через парк. Кот спал на окне весь день.",
    "Сорок сосен росло у реки; рыбаки ловили окуня, а дети кормили уток хлебом.",
    "Заказ №48213 отправлен 17.05.2024; сумма 1 299,00 ₽.",
    "Київ — столиця України. Ми їхали поїздом цілу ніч і бачили багато сіл.",
    "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας και μία από τις αρχαιότερες πόλεις του κόσμου.",
    "Καλημέρα σας, θα ήθελα έναν καφέ χωρίς ζάχαρη και ένα κομμάτι σπανακόπιτα, παρακαλώ.",
    "L'été dernier, nous sommes allés à la plage près de Nice avec nos élèves; ça a coûté très cher.",
    "Die Straße führt über die Brücke zum Bahnhof; wir müssen uns beeilen, der Zug fährt gleich.",
    "Zażółć gęślą jaźń. Łódź jest dużym miastem w środkowej Polsce.",
    "Tiếng Việt có nhiều dấu thanh: mã, má, mà, mả, mạ. Hà Nội là thủ đô của Việt Nam.",
    "القاهرة هي عاصمة مصر وأكبر مدنها، ويبلغ عدد سكانها أكثر من عشرين مليون نسمة.",
    "The café’s naïve coöperative résumé: a façade, déjà vu, 3×4 = 12, x → ∞.",
])
def test_everyday_text_in_other_scripts_and_accented_languages_is_left_alone(text):
    assert found(text) == []


def test_rules_with_accents_or_in_other_scripts_match_as_written_and_disguised():
    rules = make_rules(harassment=("crétin", "сволочь"))
    text = "quel crétin, quel cretin, quel cre\u0301tin, ты сволочь"
    assert found(text, rules=rules) == [("harassment", w) for w in ("crétin", "cretin", "cre\u0301tin", "сволочь")]
    assert [m.rule for m in rules.scan("cretin")] == ["word:crétin"]


# A disguise keeps what a person reads: each letter may become a look-alike, a fullwidth or a
# mathematical bold letter, gain combining marks, and have invisible characters before it.
INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u2060", "\u00ad", "\ufeff", "\u034f", "\u180e", "\U000e0041"]
MARKS = [chr(c) for c in range(0x300, 0x370)]
LOOK_ALIKES: dict[str, list[str]] = {}
for _char, _reads in sorted(CONFUSABLES.items()):
    if len(_reads) == 1:
        LOOK_ALIKES.setdefault(_reads, []).append(_char)


def fullwidth(char: str) -> str:
    return chr(ord(char) + 0xFEE0)


def bold(char: str) -> str:
    return chr((0x1D41A + ord(char) - ord("a")) if char.islower() else (0x1D400 + ord(char) - ord("A")))


@st.composite
def disguises(draw, text: str) -> tuple[str, list[int]]:
    """`text` disguised, and where each of its characters went (its visible character, not the
    invisible ones before it)."""
    pieces, placed, at = [], [], 0
    for char in text:
        before = "".join(draw(st.lists(st.sampled_from(INVISIBLE), max_size=2)))
        if char.isascii() and char.isalpha():
            shown = draw(st.sampled_from([char, fullwidth(char), bold(char), *LOOK_ALIKES.get(char, [])]))
            after = "".join(draw(st.lists(st.sampled_from(MARKS), max_size=2)))
        elif char == " ":
            shown, after = draw(st.sampled_from([" ", "\u00a0", "\u3000"])), ""
        else:
            shown, after = draw(st.sampled_from([char, fullwidth(char)])), ""
        placed.append(at + len(before))
        pieces.append(before + shown + after)
        at += len(pieces[-1])
    return "".join(pieces), placed


SHIPPED_WORDS = sorted({(word, category) for category, rules in DEFAULT.rules.items() for word in rules.words})


@settings(max_examples=100, deadline=None)
@given(data=st.data(), entry=st.sampled_from(SHIPPED_WORDS))
def test_a_disguised_shipped_word_is_found_and_its_match_covers_it(data, entry):
    word, category = entry
    disguised, placed = data.draw(disguises(word))
    text = f"so {disguised} then"
    assert any(m.category == category and m.start == 3 + placed[0] and m.end == 3 + len(disguised)
               for m in DEFAULT.scan(text)), (word, disguised)


VOCABULARY = [
    "sieg heil", "kill yourself", "make a pipe bomb", "I will hurt you", "stfu", "nudes", "you idiot",
    "jane.doe@example.com", "4111 1111 1111 1111", "(555) 123-4567", "skill", "the process", "hello",
    "bombastic", "killer", "order 48213", "at 10:30", "kys", "on",
]


@settings(max_examples=50, deadline=None)
@given(data=st.data(), words=st.lists(st.sampled_from(VOCABULARY), min_size=1, max_size=6))
def test_a_disguise_never_changes_what_the_rules_find(data, words):
    """Every category, rule and span found in a text is found in its disguise, at the disguised
    span, and nothing else is."""
    text = " ".join(words)
    disguised, placed = data.draw(disguises(text))
    placed.append(len(disguised))
    expected = {(m.category, placed[m.start], placed[m.end], m.rule) for m in DEFAULT.scan(text)}
    assert {(m.category, m.start, m.end, m.rule) for m in DEFAULT.scan(disguised)} == expected


# On the whole labelled set

def test_every_match_on_the_labelled_set_is_short_and_its_offsets_exact():
    patterns = {f"pattern:{p}": p for rules in DEFAULT.rules.values() for p in rules.patterns}
    for row in prompts():
        text = row["text"]
        for match in DEFAULT.scan(text):
            span = text[match.start:match.end]
            assert 0 < len(span) <= RuleSet.MAX_MATCH_CHARS, (match, text)
            kind, _, name = match.rule.partition(":")
            if kind == "word":
                assert normal_form(span) == normal_form(name)
            elif kind == "pattern":
                assert re.fullmatch(patterns[match.rule], span, re.IGNORECASE), (match, text)
            elif match.rule == "pii:email":
                assert EMAIL.fullmatch(span)
            elif match.rule == "pii:card":
                assert luhn_valid(re.sub(r"\D", "", span))
            else:
                assert match.rule == "pii:phone" and 10 <= len(re.sub(r"\D", "", span)) <= 15


def test_the_prefilter_never_skips_a_rule_that_matches():
    # A pattern runs only when the case-folded text holds one string of each of its literal sets:
    # check that every match, in any letter case, does.
    texts = [row["text"] for row in prompts()]
    texts += [t.upper() for t in texts] + [t.swapcase() for t in texts] + ["I WİLL KİLL YOU", "ı wıll kıll you"]
    regexes = [p.regex for rules in DEFAULT.compiled.values() for p, _ in rules.patterns]
    regexes += [rules.words.regex for rules in DEFAULT.compiled.values() if rules.words]
    for regex in regexes:
        literal_sets = required_literals(re._parser.parse(regex.pattern, re.IGNORECASE))
        for text in texts:
            if regex.search(text):
                assert all(any(fold(s) in fold(text) for s in strings) for strings in literal_sets), (regex.pattern, text)
    assert {c for c, _ in found("I WİLL KİLL YOU")} == {"harassment", "harassment/threatening"}
