"""What the configured policies make of what the checks found: findings, decisions, redactions.

A check (the rules, the guard model) says which categories a text falls in; the operator's
policies ([policies.CATEGORY] in config.toml) say, per category and tier, whether that blocks
the request, only flags it for review, or masks the matched text. This module turns the one
into the other and knows nothing of HTTP, the store or the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from chatd.config import CategoryPolicy
from chatd.safety.rules import ALL_CATEGORIES, Match

# What a redacted match is replaced with, by category.
REDACTIONS = {"pii/email": "[email]", "pii/phone": "[phone number]", "pii/card": "[card number]"}


def check_policy_names(policies: Mapping[str, CategoryPolicy]) -> None:
    """ValueError naming a [policies.X] table whose category the pipeline does not know."""
    unknown = sorted(set(policies) - set(ALL_CATEGORIES))
    if unknown:
        raise ValueError(f"setting policies.{unknown[0]!r}: unknown category; known: {', '.join(ALL_CATEGORIES)}")


def policies_for(policies: Mapping[str, CategoryPolicy], tier: str | None) -> dict[str, CategoryPolicy]:
    """The policies that apply to a tenant of `tier` (a policy with no tiers applies to all)."""
    return {name: policy for name, policy in policies.items() if not policy.tiers or tier in policy.tiers}


@dataclass(frozen=True)
class Finding:
    """One category a check found in a text, and what its policy does about it."""

    category: str
    action: str  # the policy's: "block" | "flag" | "redact" (a guard's finding has no span: redact flags it)
    stage: str  # which check: "rules" or "guard"
    start: int = -1  # the matched span (rules only; -1: the guard judged the whole text)
    end: int = -1
    rule: str = ""  # what matched (rules), or the guard's own category code


def findings_from_matches(matches: Iterable[Match], policies: Mapping[str, CategoryPolicy]) -> list[Finding]:
    """The rules' matches under the policies (a category with no policy is not checked)."""
    return [Finding(m.category, policies[m.category].action, "rules", m.start, m.end, m.rule)
            for m in matches if m.category in policies]


def redact(text: str, findings: Iterable[Finding]) -> str:
    """`text` with every redact finding's span replaced (overlapping spans merged)."""
    spans = sorted((f.start, f.end, f.category) for f in findings if f.action == "redact" and f.start >= 0)
    pieces, at = [], 0
    for start, end, category in spans:
        if end <= at:
            continue
        pieces.append(text[at:max(start, at)])
        if start >= at:
            pieces.append(REDACTIONS.get(category, "[redacted]"))
        at = end
    pieces.append(text[at:])
    return "".join(pieces)


@dataclass
class Decision:
    """What the input checks decided for one request."""

    findings: list[Finding] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the request's texts, redacted where a policy says so
    guard_failed: str | None = None  # why the guard could not judge (it failed open), or None
    refused_unchecked: tuple[str, ...] = ()  # categories that fail closed, left unjudged by a failed guard

    def categories(self, action: str) -> list[str]:
        """The categories found with this action, each once, in the order of ALL_CATEGORIES."""
        found = {f.category for f in self.findings if f.action == action}
        return [c for c in ALL_CATEGORIES if c in found]

    @property
    def blocked(self) -> list[str]:
        return self.categories("block")
