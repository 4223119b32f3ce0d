"""`chatd store copy SRC DST`: every row of one store into another, SQLite or PostgreSQL either way
(a file onto a server, a server back into a file, or a file into a new file), losslessly and in one
transaction on the destination.

Both stores are opened as chatd opens them, so both are migrated to this chatd's schema first. The
destination must be empty: a copy never merges into rows already there. Tables are copied parents
first, so every foreign key finds its row. Stop the chatd replicas that write to the source first:
rows written during the copy may be missed. It knows nothing of what the rows mean.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from chatd.store.database import SCHEMA_VERSION, StoreUnavailableError
from chatd.store.db import Store
from chatd.store.url import open_store, store_location

# Parents before the rows that point at them. A table not named here (a later schema version's)
# is copied after these, in name order.
TABLE_ORDER = ("tenants", "api_keys", "conversations", "responses", "messages", "usage_events", "moderation_events",
               "idempotency_keys", "replicas", "feedback", "canary_ramps", "canary_events")
PAGE_ROWS = 1000  # rows read from the source at a time
# A copy keeps usage_events' ids; PostgreSQL's identity must then number new rows after them.
_RESET_USAGE_IDS = ("SELECT setval(pg_get_serial_sequence('usage_events', 'id'), "
                    "COALESCE((SELECT MAX(id) FROM usage_events), 0) + 1, false)")


async def copy_store(src_url: str, dst_url: str) -> dict[str, int]:
    """Copy every row of the store at `src_url` into the empty store at `dst_url` (each a SQLite
    path, sqlite:///path or postgresql://...); returns the rows copied per table, in copy order.
    ValueError, and nothing written, when the destination is not empty or the schemas differ."""
    if store_location(src_url) == store_location(dst_url):
        raise ValueError("the source and the destination are the same store")
    async with await open_store(src_url) as source, await open_store(dst_url) as destination:
        for store in (source, destination):
            version = await store.schema_version()
            if version != SCHEMA_VERSION:
                raise ValueError(f"{store.path} is at schema version {version}, this chatd's is {SCHEMA_VERSION}: "
                                 "copy with the chatd that matches it")
        tables = await source.tables()
        if tables != await destination.tables():
            raise ValueError(f"{source.path} and {destination.path} have different tables or columns")
        order = [table for table in TABLE_ORDER if table in tables] + sorted(set(tables) - set(TABLE_ORDER))
        copied = {}
        async with destination._transaction() as conn:
            for table in order:
                [(count,)] = await conn.execute_fetchall(f"SELECT COUNT(*) FROM {table}")
                if count:
                    raise ValueError(f"{destination.path} is not empty ({table} has {count} rows): "
                                     "copy into a new database")
            for table in order:
                copied[table] = await _copy_table(source, conn, table, tables[table])
            if destination.dialect == "postgresql":
                await conn.execute(_RESET_USAGE_IDS)
        return copied


async def _copy_table(source: Store, conn, table: str, columns: list[str]) -> int:
    """Copy one table, a page at a time; returns its number of rows."""
    names = ", ".join(columns)
    # Every column: a total order whatever the key, so that no row is read twice or skipped.
    select = f"SELECT {names} FROM {table} ORDER BY {', '.join(map(str, range(1, len(columns) + 1)))} LIMIT ? OFFSET ?"
    insert = f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(columns))})"
    count = 0
    while rows := await source._fetch(select, (PAGE_ROWS, count)):
        await conn.executemany(insert, [tuple(row) for row in rows])
        count += len(rows)
    return count


def add_parser(subparsers) -> None:
    """Register `chatd store copy SRC DST` on the CLI's subparsers."""
    store = subparsers.add_parser("store", help="manage the store (the database of keys, conversations and usage)")
    commands = store.add_subparsers(dest="store_command", required=True)
    copy = commands.add_parser("copy", help="copy every row of a store into a new, empty one (SQLite or PostgreSQL)",
                               description=__doc__.split("\n\n")[0])
    copy.add_argument("source", help="the store to copy: a SQLite file's path, sqlite:///path, or "
                                     "postgresql://user[:password]@host[:port]/db")
    copy.add_argument("destination", help="where to copy it, named as the source: an empty database, or a new file")
    copy.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run `chatd store copy`: print the rows copied per table; 1 when a store cannot be reached."""
    try:
        copied = asyncio.run(copy_store(args.source, args.destination))
    except StoreUnavailableError as exc:
        print(f"chatd store copy: {exc}", file=sys.stderr)
        return 1
    for table, count in copied.items():
        print(f"{table:<20} {count:>10} rows")
    print(f"copied {sum(copied.values())} rows")
    return 0
