"""The prompt work admitted and not yet answered with a first token, per class and tenant: what
limits.py divides by the engine's pace to estimate a new request's wait, and bounds per tier.

It counts what each replica admitted: the engine it estimates is this process's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Queued(Protocol):
    """What the queue counts of an admitted request (limits.py's Lease)."""

    tier_name: str
    tenant_id: str
    priority: int
    queued_tokens: int  # its prompt: work the engine does before its first token


@dataclass
class QueuedWork:
    """Prompt tokens admitted and not yet answered with a first token, per class and tenant."""

    tokens: dict[int, dict[str, int]] = field(default_factory=dict)  # priority -> tenant id -> tokens
    weights: dict[str, float] = field(default_factory=dict)  # tenant id -> its tier's weight
    requests: dict[str, int] = field(default_factory=dict)  # tier name -> requests waiting

    def add(self, lease: Queued, weight: float) -> None:
        tenants = self.tokens.setdefault(lease.priority, {})
        tenants[lease.tenant_id] = tenants.get(lease.tenant_id, 0) + lease.queued_tokens
        self.weights[lease.tenant_id] = weight
        self.requests[lease.tier_name] = self.requests.get(lease.tier_name, 0) + 1

    def remove(self, lease: Queued) -> None:
        tenants = self.tokens[lease.priority]
        tenants[lease.tenant_id] -= lease.queued_tokens
        if tenants[lease.tenant_id] <= 0:  # its last queued request (an empty prompt counts 0 either way)
            del tenants[lease.tenant_id]
            if not tenants:
                del self.tokens[lease.priority]
            if not any(lease.tenant_id in t for t in self.tokens.values()):
                self.weights.pop(lease.tenant_id, None)
        self.requests[lease.tier_name] -= 1

    def ahead(self, priority: int, tenant_id: str, weight: float, num_tokens: int) -> int:
        """Prompt tokens the engine computes before a new request's: every better class's, then
        its own tenant's, and each other tenant of its class up to the same weighted share."""
        work = sum(sum(t.values()) for p, t in self.tokens.items() if p < priority)
        own_class = self.tokens.get(priority, {})
        mine = own_class.get(tenant_id, 0)
        for other, tokens in own_class.items():
            if other != tenant_id:
                work += min(tokens, (mine + num_tokens) * self.weights.get(other, 1.0) / weight)
        return int(work + mine)
