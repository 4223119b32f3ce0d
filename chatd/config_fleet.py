"""The [aliases] settings: names that pick one of several models ([[models]], config.py's
FleetModel), split by weight for a canary (with an optional ramp that moves the weight by
measurement), or escalating from a small model to a large one by declared rules. Plain
dataclasses checked when built; config_loader.py reads them from TOML."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EscalationRules:
    """When an escalating alias sends a request to its large model: any one rule that holds. 0, false
    and () leave a rule out."""

    prompt_chars: int = 0  # its messages' (or prompt's, or input's) text is longer than this
    messages: int = 0  # its thread holds more messages than this (the stored history and the new ones)
    tools: bool = False  # it offers tools
    response_format: bool = False  # it asks for structured output (a JSON schema, json_object, a grammar)
    tiers: tuple[str, ...] = ()  # its tenant's tier is one of these
    # None holds, and the small model's first `confidence_tokens` greedy tokens are less sure than this (http/models/escalation.py)
    min_confidence: float = 0.0
    confidence_tokens: int = 8

    def __post_init__(self) -> None:
        if self.prompt_chars < 0 or self.messages < 0:
            raise ValueError("prompt_chars and messages must be 0 (no such rule) or more")
        if not 0 <= self.min_confidence < 1:
            raise ValueError(f"min_confidence must be in [0, 1) (0: no such rule), got {self.min_confidence!r}")
        if not 1 <= self.confidence_tokens <= 64:
            raise ValueError(f"confidence_tokens must be in [1, 64], got {self.confidence_tokens!r}")


@dataclass(frozen=True)
class RampConfig:
    """A canary's ramp ([aliases.NAME] ramp = { canary = "v2", ... }): its share of the alias's new
    threads goes up step by step, each after `bake_seconds`, only while it measures within these
    bounds of the other target's (the stable version), and back to 0 the moment it does not
    (http/models/canary.py). A bound of 0 leaves that measure out."""

    canary: str = ""  # the target ramped ("": no ramp); the alias's other target is the stable version
    steps: tuple[float, ...] = (1.0, 5.0, 25.0, 100.0)  # its percentage of new threads at each step
    bake_seconds: float = 600.0  # the least time a step lasts
    min_requests: int = 50  # what the canary serves in a step before it is judged
    max_error_rate_increase: float = 0.02  # its share of requests ending in an error, over stable's
    max_ttft_p95_ratio: float = 1.5  # its p95 time to first token over stable's
    max_thumbs_down_increase: float = 0.05  # its thumbs down per request served, over stable's

    def __post_init__(self) -> None:
        if not self.steps or list(self.steps) != sorted(self.steps) or not (0 < self.steps[0] and self.steps[-1] <= 100):
            raise ValueError(f"steps must be increasing percentages in (0, 100], got {list(self.steps)}")
        if self.bake_seconds < 0 or self.min_requests < 1:
            raise ValueError("bake_seconds must be 0 or more and min_requests at least 1")
        if min(self.max_error_rate_increase, self.max_ttft_p95_ratio, self.max_thumbs_down_increase) < 0:
            raise ValueError("the bounds must be 0 (not measured) or more")


@dataclass(frozen=True)
class AliasConfig:
    """A name clients send that picks one of several models. Either split by weight ([aliases.NAME]
    targets = { stable = 95, canary = 5 }: each new thread draws one and keeps it), or escalating
    (small = "s", large = "l", escalate_when = { ... }: a request goes to the large model when a rule
    holds, and its thread stays there)."""

    targets: dict[str, float] = field(default_factory=dict)
    ramp: RampConfig | None = None  # a split's canary moved by measurement (http/models/canary.py)
    small: str = ""
    large: str = ""
    escalate_when: EscalationRules = field(default_factory=EscalationRules)

    @property
    def models(self) -> tuple[str, ...]:
        """The models it may pick."""
        return (self.small, self.large) if self.small else tuple(self.targets)
