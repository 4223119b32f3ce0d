"""What each request used, in the store: one usage event per request, summed per tenant over a
time window. A finished conversation reply writes its event in the same transaction as the reply
(messages.py runs INSERT_USAGE there); everything else records it here.

`UsageLog` is a mixin of `Store` (db.py): its SQL runs through the store's `_fetch` and `_write`.
It knows nothing of prices or tiers: it keeps the tokens and the cost it is given.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatd.store.database import Database, whole
from chatd.store.records import Usage

INSERT_USAGE = ("INSERT INTO usage_events (tenant_id, endpoint, model, conversation_id, message_id, prompt_tokens, "
                "cached_tokens, completion_tokens, cost, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")


class UsageLog(Database):
    """Store methods that record what requests used and sum it per tenant."""

    async def record_usage(self, tenant_id: str, *, endpoint: str, model: str, prompt_tokens: int,
                           cached_tokens: int, completion_tokens: int, cost: float,
                           conversation_id: str | None = None, message_id: str | None = None,
                           created_at: float | None = None) -> None:
        """Record what one request used, at `created_at` (default: now)."""
        await self._write(INSERT_USAGE, (tenant_id, endpoint, model, conversation_id, message_id, prompt_tokens,
                                         cached_tokens, completion_tokens, cost,
                                         self._clock() if created_at is None else created_at))

    @whole
    async def record_usages(self, events: Sequence[dict]) -> None:
        """Record several requests' usage at once, each as record_usage's fields (`created_at`
        given): one transaction, so all of them are written or none (the ledger's batches)."""
        rows = [(e["tenant_id"], e["endpoint"], e["model"], e["conversation_id"], e["message_id"], e["prompt_tokens"],
                 e["cached_tokens"], e["completion_tokens"], e["cost"], e["created_at"]) for e in events]
        async with self._transaction() as conn:
            await conn.executemany(INSERT_USAGE, rows)

    async def usage(self, tenant_id: str, start: float, end: float) -> Usage:
        """The tenant's totals over events with start <= created_at < end."""
        [row] = await self._fetch(
            "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0), "
            "COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(cost), 0.0) FROM usage_events "
            "WHERE tenant_id = ? AND created_at >= ? AND created_at < ?", (tenant_id, start, end))
        return Usage(*row)
