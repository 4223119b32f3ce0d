"""Who goes next: strict priority between classes, fair shares between tenants within a class.

A class is a sequence's `priority` (lower first; a server sets it from the tenant's tier, and a
client's own `priority` can only add to it). Within a class, tenants share the engine's work by
weighted fair queuing on tokens (start-time fair queuing, as Linux's CFS shares a CPU): each
tenant's `service` is the tokens computed for it divided by its weight, and the tenant with the
least service goes next. A tenant that arrives, or comes back after being idle, starts at the
least service among the active tenants: it gets its share from now on, never a credit for the
time it was away. So a tenant with 64 streams and one with 1 are admitted one for one, and a
tenant's long prompts count against it. Within one tenant, first come first served.

Sequences without a tenant (the offline engine, a server without keys) are one tenant.
Plain Python, no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from chatd.engine.core.sequence import Sequence


class FairShare:
    """The service each active tenant has had, in tokens per unit of weight."""

    def __init__(self) -> None:
        self.service: dict[str | None, float] = {}
        self._members: dict[str | None, set[Sequence]] = {}  # active tenant -> its unfinished sequences

    def join(self, seq: Sequence) -> None:
        """A new sequence (not a preempted one coming back) enters the queues."""
        members = self._members.get(seq.tenant)
        if members is None:  # (re)arriving: start level with the least-served active tenant
            self.service[seq.tenant] = min(self.service.values(), default=0.0)
            members = self._members[seq.tenant] = set()
        members.add(seq)

    def leave(self, seq: Sequence) -> None:
        """A sequence finished (or never started); an idle tenant is forgotten."""
        members = self._members.get(seq.tenant)
        if members is None or seq not in members:
            return
        members.discard(seq)
        if not members:
            del self._members[seq.tenant], self.service[seq.tenant]

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        """Tokens were computed for `seq`'s tenant."""
        if seq.tenant in self.service:
            self.service[seq.tenant] += num_tokens / seq.weight

    def rank(self, seq: Sequence) -> tuple[int, float, int]:
        """Order of service: class, then the least-served tenant, then arrival."""
        return seq.priority, self.service.get(seq.tenant, 0.0), seq.arrival

    @property
    def num_tenants(self) -> int:
        return len(self._members)


class WaitQueue:
    """Waiting sequences, by class, then by tenant, each tenant's in arrival order.

    `peek` is the next to admit under `FairShare.rank` at this moment: services change every
    step, so the queue keeps no global order, only a first-come list per (class, tenant).
    """

    def __init__(self, share: FairShare) -> None:
        self._share = share
        self._classes: dict[int, dict[str | None, list[Sequence]]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        for tenants in self._classes.values():
            for queue in tenants.values():
                yield from queue

    def __contains__(self, seq: Sequence) -> bool:
        queue = self._classes.get(seq.priority, {}).get(seq.tenant, ())
        return any(s is seq for s in queue)

    def add(self, seq: Sequence) -> None:
        queue = self._classes.setdefault(seq.priority, {}).setdefault(seq.tenant, [])
        bisect.insort(queue, seq, key=lambda s: s.arrival)
        self._len += 1

    def peek(self) -> Sequence | None:
        """The sequence to admit next: best class, least-served tenant (earliest head on ties), its oldest."""
        if not self._classes:
            return None
        tenants = self._classes[min(self._classes)]
        service = self._share.service
        best = min(tenants.values(), key=lambda queue: (service.get(queue[0].tenant, 0.0), queue[0].arrival))
        return best[0]

    def remove(self, seq: Sequence) -> None:
        tenants = self._classes[seq.priority]
        queue = tenants[seq.tenant]
        queue.remove(seq)
        self._len -= 1
        if not queue:
            del tenants[seq.tenant]
            if not tenants:
                del self._classes[seq.priority]
