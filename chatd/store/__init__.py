"""chatd's store, on SQLite (one file, through aiosqlite) or PostgreSQL (through asyncpg): tenants
and API keys, conversations and their messages, OpenAI-style responses, usage, moderation events,
feedback, idempotency keys and canary ramps, by table family (db.py is the `Store`; url.py opens
what `[store] url` names; postgres.py runs the same SQL on a server; copy.py moves every row from
one store to another).

The store knows nothing of HTTP or the engine; it takes and returns plain values and frozen
dataclasses, so it is tested on a real database without a server.
"""
