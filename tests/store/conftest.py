"""The store's tests open a real SQLite file in tmp_path, with a clock the test moves by hand."""

from __future__ import annotations

import pytest

from chatd.store.db import Store
from tests.store.factories import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def store(tmp_path, clock):
    async with await Store.open(tmp_path / "chatd.db", clock=clock) as store:
        yield store
