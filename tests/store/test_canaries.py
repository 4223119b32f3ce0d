"""A canary ramp's state and history on a real database (SQLite, and PostgreSQL): a state saved
with its event replaces the last, and the events come back in the order they happened."""

from __future__ import annotations

import pytest

from chatd.store.canaries import RampState
from tests.store.factories import on_both_backends


@on_both_backends
async def test_a_ramp_is_kept_with_its_events_in_order(store, clock):
    assert await store.get_ramp("chat") is None
    start = RampState("chat", "v2", 0, 1.0, "ramping", clock(), clock())
    await store.save_ramp(start, "start", "a new canary")
    moved = RampState("chat", "v2", 1, 5.0, "ramping", clock(), clock())
    await store.save_ramp(moved, "advance", "held up")  # the same instant: order is kept all the same
    back = RampState("chat", "v2", 1, 0.0, "rolled_back", clock(), clock())
    await store.save_ramp(back, "rollback", "slow")
    assert await store.get_ramp("chat") == back
    events = await store.ramp_events("chat")
    assert [(e.action, e.weight, e.reason) for e in events] == [
        ("start", 1.0, "a new canary"), ("advance", 5.0, "held up"), ("rollback", 0.0, "slow")]
    assert [e.action for e in await store.ramp_events("chat", limit=2)] == ["advance", "rollback"]
    assert await store.ramp_events("other") == []
    with pytest.raises(ValueError, match="state is one of"):
        await store.save_ramp(RampState("chat", "v2", 1, 0.0, "paused", clock(), clock()), "rollback", "x")
