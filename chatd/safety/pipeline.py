"""The safety pipeline: the rules, an optional guard model, and the policies, put together.

`check_input` judges a request's texts before they reach the model: the rules find spans (and
mask those whose policy says redact), then, unless the rules already refuse it, the guard model
judges the whole input. A guard that fails or times out leaves its categories unjudged: those
whose policy fails closed refuse the request, the others let it through and say so.
`output_window` gives each streamed reply its OutputWindow (stream.py). `moderate` is what
`/v1/moderations` answers: every category, whatever the policies.

It knows nothing of HTTP or the store: chatd/http/server/safety.py records, counts and answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from chatd.config import CategoryPolicy, SafetyConfig
from chatd.safety.guard import GuardModel
from chatd.safety.policy import Decision, Finding, check_policy_names, findings_from_matches, policies_for, redact
from chatd.safety.rules import CATEGORIES, RuleSet
from chatd.safety.stream import OutputWindow


@dataclass(frozen=True)
class Moderation:
    """One input's moderation: the categories found (rules or guard) and a score for each category."""

    categories: tuple[str, ...]
    scores: dict[str, float]

    @property
    def flagged(self) -> bool:
        return bool(self.categories)


class SafetyPipeline:
    """What a server asks of the safety pipeline: judge inputs, watch outputs, moderate texts."""

    def __init__(self, config: SafetyConfig, policies: Mapping[str, CategoryPolicy], rules: RuleSet,
                 guard: GuardModel | None = None, clock=time.perf_counter) -> None:
        check_policy_names(policies)
        self.config, self.policies, self.rules, self.guard, self.clock = config, dict(policies), rules, guard, clock
        # The categories a guard's verdict can name: those it leaves unjudged when it fails.
        self.guarded = frozenset(c for codes in guard.family.codes.values() for c in codes) if guard else frozenset()

    @classmethod
    def build(cls, config: SafetyConfig, policies: Mapping[str, CategoryPolicy], guard: GuardModel | None = None) -> SafetyPipeline:
        """The pipeline for a config: its rules file (or the shipped rules) and its policies."""
        return cls(config, policies, RuleSet.load(Path(config.rules_file) if config.rules_file else None), guard)

    def output_window(self, tier: str | None) -> OutputWindow | None:
        """A window for one reply of a tenant of `tier`; None when outputs are not checked."""
        if not self.config.check_output:
            return None
        return OutputWindow(self.rules, policies_for(self.policies, tier))

    async def check_input(self, texts: list[str], tier: str | None, timings: dict[str, float] | None = None) -> Decision:
        """Judge a request's texts under the policies for `tier`. `timings` gets each check's seconds."""
        policies = policies_for(self.policies, tier)
        decision = Decision(texts=list(texts))
        started = self.clock()
        # In a thread: a long input takes the rules tens of milliseconds, which the event loop
        # (every other client's stream) must not wait for.
        for i, found in enumerate(await asyncio.to_thread(self._scan_all, texts, policies)):
            decision.findings += found
            decision.texts[i] = redact(texts[i], found)
        if timings is not None:
            timings["rules"] = self.clock() - started
        guarded = {c for c in policies if c in self.guarded}
        if self.guard is None or not guarded or decision.blocked:
            return decision
        started = self.clock()
        try:
            verdict = await self.guard.judge("\n\n".join(decision.texts))
        except Exception as exc:  # noqa: BLE001 - a guard that cannot judge is a decision of its own
            decision.guard_failed = f"{type(exc).__name__}: {exc}"
            decision.refused_unchecked = tuple(c for c in CATEGORIES if c in guarded and policies[c].failure == "closed")
        else:
            for category in verdict.categories:
                if category in policies:
                    action = "flag" if policies[category].action == "redact" else policies[category].action
                    decision.findings.append(Finding(category, action, "guard", rule=",".join(verdict.codes)))
        if timings is not None:
            timings["guard"] = self.clock() - started
        return decision

    def _scan_all(self, texts: list[str], policies: Mapping[str, CategoryPolicy]) -> list[list[Finding]]:
        return [findings_from_matches(self.rules.scan(text, policies), policies) for text in texts]

    async def moderate(self, texts: list[str]) -> list[Moderation]:
        """What /v1/moderations answers for each text: OpenAI's categories the rules or the guard
        find (a guard that fails raises: the endpoint cannot answer without it)."""
        results = []
        scanned = await asyncio.to_thread(lambda: [self.rules.scan(text, CATEGORIES) for text in texts])
        for text, matches in zip(texts, scanned):
            found = {m.category for m in matches}
            if self.guard is not None:
                found |= set((await self.guard.judge(text)).categories)
            categories = tuple(c for c in CATEGORIES if c in found)
            results.append(Moderation(categories, {c: 1.0 if c in found else 0.0 for c in CATEGORIES}))
        return results

