"""Tenants and API keys (keys.py) on a real SQLite file: a key authenticates its tenant until
revoked, a wrong key never does, the secret never reaches the file, tiers are spelled right, the
local tenant is one row, and last_used is written at most once a minute."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from chatd.store.db import Store, Tenant
from tests.store.factories import START


async def test_a_key_authenticates_its_tenant_until_revoked(store):
    key, record = await store.create_key("alice", "premium")
    assert key.startswith(f"chatd_{record.id}_")
    assert await store.authenticate(key) == Tenant(record.tenant_id, "alice", "premium", record.id)
    assert await store.revoke_key(record.id)
    assert await store.authenticate(key) is None
    assert not await store.revoke_key(record.id)  # already revoked
    assert not await store.revoke_key("0123456789ab")  # unknown
    [listed] = await store.list_keys()
    assert listed.revoked_at is not None


async def test_wrong_malformed_and_unknown_keys_fail(store):
    key, _ = await store.create_key("alice", "paid")
    _, key_id, secret = key.split("_", 2)
    flipped = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    for bad in [f"chatd_{key_id}_{flipped}", f"chatd_{key_id}_", f"chatd_{key_id}", f"chatd_0123456789ab_{secret}",
                f"chatd_{key_id.upper()}_{secret}", f"sk_{key_id}_{secret}", "", "chatd", key + " ",
                f"chatd_{key_id}_{secret}\x00", f"chatd_{key_id}_{secret[:-1]}é", "chatd_' OR 1=1 --_x"]:
        assert await store.authenticate(bad) is None, bad
    assert await store.authenticate(key) is not None


async def test_the_secret_never_reaches_the_file(tmp_path):
    path = tmp_path / "chatd.db"
    async with await Store.open(path) as store:
        key, _ = await store.create_key("alice", "paid")
        await store.authenticate(key)
        secret = key.split("_", 2)[2]
        while_open = path.read_bytes() + Path(f"{path}-wal").read_bytes()
    after_close = path.read_bytes() + (Path(f"{path}-wal").read_bytes() if Path(f"{path}-wal").exists() else b"")
    for stored in (while_open, after_close):
        assert secret.encode() not in stored
        assert hashlib.sha256(secret.encode()).hexdigest().encode() in stored  # the bytes read are the real ones


async def test_a_key_for_an_existing_name_joins_that_tenant_and_sets_its_tier(store, clock):
    first_key, first = await store.create_key("alice", "free")
    clock.advance(1)
    _, second = await store.create_key("alice", "premium")
    assert second.tenant_id == first.tenant_id and second.tenant_id.startswith("ten_")
    assert (await store.authenticate(first_key)).tier == "premium"
    assert [k.id for k in await store.list_keys()] == [second.id, first.id]  # newest first


async def test_any_well_formed_tier_is_kept_and_malformed_names_are_refused(store):
    _, record = await store.create_key("alice", "gold")  # which tiers exist is the config's to say
    assert record.tier == "gold"
    for bad in ("Gold", "", "a b", "x" * 33):
        with pytest.raises(ValueError, match="lower-case letters"):
            await store.create_key("alice", bad)
        with pytest.raises(ValueError, match="lower-case letters"):
            await store.local_tenant(bad)


async def test_a_key_needs_a_tenant_name_and_nothing_is_kept_without_one(store):
    for blank in ("", "   "):
        with pytest.raises(ValueError, match="tenant name"):
            await store.create_key(blank, "paid")
    assert await store.list_keys() == []


async def test_a_request_s_tenant_names_the_key_it_came_with(store):
    first, first_record = await store.create_key("alice", "free")
    second, second_record = await store.create_key("alice", "free")
    assert (await store.authenticate(first)).key_id == first_record.id
    assert (await store.authenticate(second)).key_id == second_record.id
    assert (await store.local_tenant("free")).key_id is None


async def test_keys_with_unknown_tiers_are_the_live_ones_outside_the_config(store):
    _, gold = await store.create_key("alice", "gold")
    _, paid = await store.create_key("bob", "paid")
    _, silver = await store.create_key("carol", "silver")
    await store.revoke_key(silver.id)
    assert [k.id for k in await store.keys_with_unknown_tiers({"free", "paid", "premium"})] == [gold.id]
    assert await store.keys_with_unknown_tiers({"gold", "paid"}) == []


async def test_the_local_tenant_is_one_row_whose_tier_follows_the_config(store):
    assert await store.local_tenant("paid") == Tenant("local", "local", "paid")
    assert await store.local_tenant("free") == Tenant("local", "local", "free")
    key, record = await store.create_key("local", "premium")  # the operator's own key reaches the same data
    assert record.tenant_id == "local"
    assert await store.authenticate(key) == Tenant("local", "local", "premium", record.id)


async def test_last_used_is_written_at_most_once_a_minute(store, clock):
    key, record = await store.create_key("alice", "paid")

    async def last_used() -> float | None:
        return next(k.last_used_at for k in await store.list_keys() if k.id == record.id)

    assert await last_used() is None
    await store.authenticate(key)
    assert await last_used() == START
    clock.advance(30)
    await store.authenticate(key)
    assert await last_used() == START
    clock.advance(31)
    await store.authenticate(key)
    assert await last_used() == START + 61
