"""Where each canary ramp stands (http/models/canary.py), kept so that a restart goes on from the same
step with the same weight, and every step and rollback as an event the operator can read.

`CanaryLog` is a mixin of `Store`: a ramp's state changes together with its event, in one
transaction (on SQLite or PostgreSQL alike).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from chatd.store.records import new_id

RAMP_STATES = ("ramping", "done", "rolled_back")
RAMP_ACTIONS = ("start", "advance", "done", "rollback", "restart")

# Schema version 9 (database.py runs it as MIGRATIONS[7]). A migration step is fixed once released.
CANARY_MIGRATION = [
    """CREATE TABLE canary_ramps (
        alias           TEXT PRIMARY KEY,
        canary          TEXT NOT NULL,     -- the model ramped
        step            INTEGER NOT NULL,  -- its index in the ramp's steps
        weight          REAL NOT NULL,     -- the canary's percentage of new threads now
        state           TEXT NOT NULL CHECK (state IN ('ramping', 'done', 'rolled_back')),
        step_started_at REAL NOT NULL,
        updated_at      REAL NOT NULL
    )""",
    """CREATE TABLE canary_events (
        id         TEXT PRIMARY KEY,  -- "cev_" + 16 hex
        alias      TEXT NOT NULL,
        seq        INTEGER NOT NULL,  -- 1, 2, 3, ... within the alias: the order they happened in
        canary     TEXT NOT NULL,
        action     TEXT NOT NULL CHECK (action IN ('start', 'advance', 'done', 'rollback', 'restart')),
        weight     REAL NOT NULL,     -- the canary's percentage after it
        reason     TEXT NOT NULL,
        created_at REAL NOT NULL
    )""",
    "CREATE UNIQUE INDEX canary_events_by_alias ON canary_events (alias, seq)",
]
_RAMP_COLUMNS = "alias, canary, step, weight, state, step_started_at, updated_at"


@dataclass(frozen=True)
class RampState:
    """Where one alias's canary ramp stands."""

    alias: str
    canary: str
    step: int
    weight: float
    state: str  # ramping | done | rolled_back
    step_started_at: float
    updated_at: float


@dataclass(frozen=True)
class RampEvent:
    id: str
    alias: str
    canary: str
    action: str
    weight: float
    reason: str
    created_at: float


class CanaryLog:
    """Store methods that keep canary ramps and their history."""

    # Provided by Store.
    _clock: Callable[[], float]
    _fetch: Callable[..., Awaitable[list[sqlite3.Row]]]
    _transaction: Callable[[], AbstractAsyncContextManager]

    async def get_ramp(self, alias: str) -> RampState | None:
        rows = await self._fetch(f"SELECT {_RAMP_COLUMNS} FROM canary_ramps WHERE alias = ?", (alias,))
        return RampState(*rows[0]) if rows else None

    async def save_ramp(self, ramp: RampState, action: str, reason: str) -> RampEvent:
        """Keep a ramp's new state and the event that moved it there, together (to the end even if
        the caller is cancelled)."""
        if ramp.state not in RAMP_STATES or action not in RAMP_ACTIONS:
            raise ValueError(f"a ramp's state is one of {RAMP_STATES} and its action one of {RAMP_ACTIONS}")
        event = RampEvent(new_id("cev_", 8), ramp.alias, ramp.canary, action, ramp.weight, reason, self._clock())
        await asyncio.shield(self._write_ramp(ramp, event))
        return event

    async def _write_ramp(self, ramp: RampState, event: RampEvent) -> None:
        async with self._transaction() as conn:
            await conn.execute(
                f"INSERT INTO canary_ramps ({_RAMP_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (alias) DO UPDATE "
                "SET canary = excluded.canary, step = excluded.step, weight = excluded.weight, state = excluded.state, "
                "step_started_at = excluded.step_started_at, updated_at = excluded.updated_at",
                (ramp.alias, ramp.canary, ramp.step, ramp.weight, ramp.state, ramp.step_started_at, ramp.updated_at))
            await conn.execute("INSERT INTO canary_events (id, alias, seq, canary, action, weight, reason, created_at) "
                               "SELECT ?, ?, COALESCE(MAX(seq), 0) + 1, ?, ?, ?, ?, ? FROM canary_events WHERE alias = ?",
                               (event.id, event.alias, event.canary, event.action, event.weight, event.reason,
                                event.created_at, event.alias))

    async def ramp_events(self, alias: str, limit: int = 50) -> list[RampEvent]:
        """An alias's ramp events, oldest first (the last `limit`)."""
        rows = await self._fetch("SELECT id, alias, canary, action, weight, reason, created_at FROM canary_events "
                                 "WHERE alias = ? ORDER BY seq DESC LIMIT ?", (alias, limit))
        return [RampEvent(*row) for row in reversed(rows)]
