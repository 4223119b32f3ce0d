"""The rules stage (chatd/safety/rules.py): what it finds, what it leaves alone, and what it refuses to load."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

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
