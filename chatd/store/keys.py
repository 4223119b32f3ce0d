"""Who may call the API, in the store: tenants and their API keys, made, listed, revoked, and
checked on every request.

A key is `chatd_<key id>_<secret>`; only the SHA-256 of the secret is kept. `KeyRing` is a mixin
of `Store` (db.py): its SQL runs through the store's `_fetch`, `_write` and `_transaction`. It
knows nothing of HTTP or of which tiers a config defines: a tier name's spelling is checked here.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import re
import secrets
import sqlite3

import aiosqlite

from chatd.config import TIER_NAME  # which tiers exist is the config's to say; a name's spelling is checked here
from chatd.store.database import Database, StoreUnavailableError, whole
from chatd.store.records import ApiKey, Tenant, new_id

LOCAL_TENANT = "local"  # id and name of the one user while auth is off
LAST_USED_RESOLUTION_S = 60.0  # a key's last_used_at is written at most this often
KEY_PATTERN = re.compile(r"chatd_([0-9a-f]{12})_([A-Za-z0-9_-]+)")  # chatd_<key id>_<secret>
# In the order of ApiKey's fields, so a row becomes `ApiKey(*row)`.
_API_KEY_COLUMNS = "k.id, k.tenant_id, t.name, t.tier, k.created_at, k.revoked_at, k.last_used_at"


class KeyRing(Database):
    """Store methods for tenants and their API keys."""

    @whole
    async def local_tenant(self, tier: str) -> Tenant:
        """The one user while auth is off, created on first use; its tier is set to `tier`."""
        _check_tier(tier)
        async with self._transaction() as conn:
            tenant_id = await _upsert_tenant(conn, LOCAL_TENANT, tier, self._clock())
        return Tenant(tenant_id, LOCAL_TENANT, tier)

    @whole
    async def create_key(self, name: str, tier: str) -> tuple[str, ApiKey]:
        """Make a key for tenant `name` (created if new; its tier set). Returns the key, shown once."""
        _check_tier(tier)
        if not name.strip():
            raise ValueError("a key needs a tenant name")
        key_id, secret, now = secrets.token_hex(6), secrets.token_urlsafe(32), self._clock()
        async with self._transaction() as conn:
            tenant_id = await _upsert_tenant(conn, name, tier, now)
            await conn.execute(
                "INSERT INTO api_keys (id, tenant_id, secret_sha256, created_at) VALUES (?, ?, ?, ?)",
                (key_id, tenant_id, _sha256(secret), now))
        return f"chatd_{key_id}_{secret}", ApiKey(key_id, tenant_id, name, tier, now, None, None)

    async def list_keys(self) -> list[ApiKey]:
        """Every key, revoked ones included, newest first."""
        rows = await self._fetch(f"SELECT {_API_KEY_COLUMNS} FROM api_keys k JOIN tenants t ON t.id = k.tenant_id "
                                 "ORDER BY k.created_at DESC, k.id DESC")
        return [ApiKey(*row) for row in rows]

    async def revoke_key(self, key_id: str) -> bool:
        """Revoke a key for good; False when there is no such live key."""
        revoked = await self._write("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                                    (self._clock(), key_id))
        return revoked == 1

    async def authenticate(self, key: str) -> Tenant | None:
        """The tenant of a live key; None for a malformed, unknown, wrong or revoked one."""
        match = KEY_PATTERN.fullmatch(key)
        if match is None:
            return None
        key_id, secret = match.groups()
        rows = await self._fetch(
            "SELECT k.secret_sha256, k.revoked_at, k.last_used_at, t.id, t.name, t.tier "
            "FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE k.id = ?", (key_id,))
        if not rows:
            return None
        digest, revoked_at, last_used_at, tenant_id, name, tier = rows[0]
        if not hmac.compare_digest(digest, _sha256(secret)) or revoked_at is not None:
            return None
        now = self._clock()
        if last_used_at is None or now - last_used_at >= LAST_USED_RESOLUTION_S:
            # Bookkeeping only: a store that cannot write now (full disk) must not lock every key out.
            with contextlib.suppress(sqlite3.OperationalError, StoreUnavailableError):
                await self._write("UPDATE api_keys SET last_used_at = ? WHERE id = ?", (now, key_id))
        return Tenant(tenant_id, name, tier, key_id)

    async def keys_with_unknown_tiers(self, tiers: set[str]) -> list[ApiKey]:
        """The live keys whose tenant's tier is not among `tiers` (the ones a config defines)."""
        return [key for key in await self.list_keys() if key.revoked_at is None and key.tier not in tiers]


async def _upsert_tenant(conn: aiosqlite.Connection, name: str, tier: str, now: float) -> str:
    """Create tenant `name` or set its tier; returns its id. Runs inside a transaction."""
    new_tenant_id = LOCAL_TENANT if name == LOCAL_TENANT else new_id("ten_", 8)
    await conn.execute("INSERT INTO tenants (id, name, tier, created_at) VALUES (?, ?, ?, ?) "
                       "ON CONFLICT (name) DO UPDATE SET tier = excluded.tier", (new_tenant_id, name, tier, now))
    [(tenant_id,)] = await conn.execute_fetchall("SELECT id FROM tenants WHERE name = ?", (name,))
    return tenant_id


def _check_tier(tier: str) -> None:
    if not TIER_NAME.fullmatch(tier):
        raise ValueError(f"a tier name is 1-32 lower-case letters, digits, '-' or '_'; got {tier!r}")


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
