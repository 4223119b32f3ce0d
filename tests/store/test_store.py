"""The store as callers see it (db.py): a file from chatd's first release opens and every table
family reads its rows and writes beside them; the names callers import from chatd.store.db are
still there."""

from __future__ import annotations

import hashlib
import sqlite3

from chatd.store import db
from chatd.store.database import SCHEMA_FILE
from chatd.store.db import SCHEMA_VERSION, Store, Tenant
from tests.store.factories import user_version


async def test_a_version_1_file_is_migrated_and_keeps_its_data(tmp_path):
    """A file as chatd's first release wrote it (schema.sql, rows written by hand as it wrote them)
    opens, keeps every row, and takes what later versions add: the probe, responses."""
    path = tmp_path / "chatd.db"
    key_id, secret = "0123456789ab", "s3cret"
    with sqlite3.connect(path) as conn:
        conn.executescript(SCHEMA_FILE.read_text())
        conn.execute("PRAGMA user_version = 1")
        conn.execute("INSERT INTO tenants VALUES ('ten_1', 'alice', 'paid', 1.0)")
        conn.execute("INSERT INTO api_keys (id, tenant_id, secret_sha256, created_at) VALUES (?, 'ten_1', ?, 1.0)",
                     (key_id, hashlib.sha256(secret.encode()).hexdigest()))
        conn.execute("INSERT INTO conversations VALUES ('conv_1', 'ten_1', 'm', 'kept', NULL, '{}', 1.0, 2.0, NULL)")
        conn.executemany("INSERT INTO messages VALUES (?, 'conv_1', ?, ?, ?, 'complete', ?, 0, 0, ?, 0, 1.0, 2.0)",
                         [("msg_1", 0, "user", "hi", None, 0), ("msg_2", 1, "assistant", "hello", "stop", 3)])
        conn.execute("INSERT INTO usage_events (tenant_id, endpoint, model, conversation_id, message_id, prompt_tokens, "
                     "cached_tokens, completion_tokens, cost, created_at) "
                     "VALUES ('ten_1', 'conversations', 'm', 'conv_1', 'msg_2', 12, 4, 3, 0.5, 2.0)")
    async with await Store.open(path) as store:
        assert user_version(path) == SCHEMA_VERSION
        assert await store.authenticate(f"chatd_{key_id}_{secret}") == Tenant("ten_1", "alice", "paid", key_id)
        assert (await store.get_conversation("ten_1", "conv_1")).title == "kept"
        history = await store.list_messages("conv_1")
        assert [(m.id, m.role, m.content, m.completion_tokens) for m in history] == [
            ("msg_1", "user", "hi", 0), ("msg_2", "assistant", "hello", 3)]
        assert [m.token_ids for m in history] == [None, None]  # an old reply's ids are unknown: its text it is
        assert (await store.usage("ten_1", 0, float("inf"))).requests == 1
        await store.probe_write()  # the table it needs came with the migration
        response, output = await store.create_response("ten_1", model="m", stored=True, inputs=[("user", "more")],
                                                       conversation_id="conv_1")
        assert [m.content for m in await store.list_messages("conv_1")] == ["hi", "hello", "more", ""]
        assert [m.id for m in await store.response_messages(response.id)][-1] == output.id


def test_the_names_callers_import_from_db_are_still_there():
    # chatd/http, chatd/cli.py and the ledger import these from chatd.store.db; the split by
    # concern (database.py and a module per table family) kept them there.
    callers_names = {"Store", "StoreFileError", "SCHEMA_VERSION", "STATUSES", "check_status",
                     "Tenant", "ApiKey", "Conversation", "Message", "Response", "Usage"}
    assert callers_names <= set(db.__all__)
    assert all(hasattr(db, name) for name in db.__all__)
