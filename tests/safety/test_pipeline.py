"""The pipeline under the operator's policies: per tier, block / flag / redact from the rules and
the guard model; a guard that fails leaves its categories to their failure mode; moderation
answers every category whatever the policies."""

from __future__ import annotations

import dataclasses

import pytest

from chatd.config import DEFAULT_POLICIES, CategoryPolicy, SafetyConfig
from chatd.safety.guard import FAMILIES, GuardVerdict
from chatd.safety.pipeline import SafetyPipeline
from chatd.safety.rules import CATEGORIES, CategoryRules, RuleSet

RULES = RuleSet({"violence": CategoryRules(words=("punch him",)), "hate/threatening": CategoryRules(words=("exterminate them",))})
ON = SafetyConfig(check_input=True, check_output=True)


class FakeGuard:
    """A guard whose verdict (or failure) the test sets."""

    family = FAMILIES["llama-guard-3"]

    def __init__(self, codes=(), error: Exception | None = None) -> None:
        self.codes, self.error, self.judged = codes, error, []

    async def judge(self, text: str) -> GuardVerdict:
        self.judged.append(text)
        if self.error is not None:
            raise self.error
        categories = tuple(dict.fromkeys(c for code in self.codes for c in self.family.codes[code]))
        return GuardVerdict(tuple(self.codes), categories, 0.01)


def pipeline(policies=None, guard=None) -> SafetyPipeline:
    return SafetyPipeline(ON, DEFAULT_POLICIES if policies is None else policies, RULES, guard)


async def test_rules_findings_follow_each_categorys_action():
    decision = await pipeline().check_input(["I will exterminate them all", "then punch him, mail a@b.co"], "paid")
    assert decision.blocked == ["hate", "hate/threatening"]  # the parent category is reported with its subcategory
    assert decision.categories("flag") == ["violence"]
    assert decision.categories("redact") == ["pii/email"]
    assert decision.texts == ["I will exterminate them all", "then punch him, mail [email]"]


async def test_a_policy_for_some_tiers_leaves_the_others_alone():
    policies = {**DEFAULT_POLICIES, "violence": CategoryPolicy("block", tiers=("free",))}
    free = await pipeline(policies).check_input(["punch him"], "free")
    paid = await pipeline(policies).check_input(["punch him"], "paid")
    assert free.blocked == ["violence"] and paid.findings == []


async def test_the_guards_verdict_is_judged_by_the_policies_and_skipped_once_the_rules_refuse():
    guard = FakeGuard(codes=("S10", "S8"))
    decision = await pipeline(guard=guard).check_input(["a perfectly fine sentence"], "paid")
    assert decision.blocked == ["hate"] and [f.rule for f in decision.findings] == ["S10,S8"]
    refused = FakeGuard(codes=("S10",))
    await pipeline(guard=refused).check_input(["exterminate them"], "paid")
    assert refused.judged == []  # the rules already refused it: the guard's time is not spent


async def test_a_failed_guard_refuses_what_fails_closed_and_lets_the_rest_through():
    guard = FakeGuard(error=TimeoutError("the guard model did not answer within 10 s"))
    decision = await pipeline(guard=guard).check_input(["hello"], "paid")
    assert decision.guard_failed == "TimeoutError: the guard model did not answer within 10 s"
    # Closed by policy and judged by this guard (Llama Guard 3 has no code for self-harm/instructions:
    # its failure leaves nothing of that category unjudged).
    assert list(decision.refused_unchecked) == ["illicit/violent", "sexual/minors"]
    open_only = {name: dataclasses.replace(policy, failure="open") for name, policy in DEFAULT_POLICIES.items()}
    decision = await pipeline(open_only, guard).check_input(["hello"], "paid")
    assert decision.guard_failed and decision.refused_unchecked == () and decision.blocked == []


async def test_moderation_reports_every_category_found_whatever_the_policies():
    results = await pipeline({}, FakeGuard(codes=("S11",))).moderate(["punch him", "hello"])
    assert [r.categories for r in results] == [("self-harm", "violence"), ("self-harm",)]
    assert results[0].flagged and results[0].scores["violence"] == 1.0 and results[0].scores["hate"] == 0.0
    assert set(results[1].scores) == set(CATEGORIES)


def test_a_policy_for_an_unknown_category_is_refused_by_name():
    with pytest.raises(ValueError, match="setting policies.'violense': unknown category"):
        pipeline({"violense": CategoryPolicy()})
