"""What `[store] url` names, and opening it: a SQLite file (a path, or sqlite:///path) or a
PostgreSQL database (postgresql://user[:password]@host[:port]/db). Callers open every store here.

It knows which class runs each dialect, not how: asyncpg is imported only when a PostgreSQL
store is opened, so chatd runs on SQLite without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from chatd.config import Config, chatd_home
from chatd.store.db import Store


def store_target(config: Config) -> str | Path:
    """The store a configuration names: [store] url, else the SQLite file at db_path, else
    $CHATD_HOME/chatd.db."""
    return config.store.url or (Path(config.store.db_path) if config.store.db_path else chatd_home() / "chatd.db")


async def open_store(url_or_path: str | Path, *, clock: Callable[[], float] = time.time, max_bytes: int = 0) -> Store:
    """Open and migrate the store `url_or_path` names: a SQLite file (as Store.open, `max_bytes` its
    size limit; 0: none) or a PostgreSQL database."""
    dialect, location = store_location(url_or_path)
    if dialect == "sqlite":
        return await Store.open(location, clock=clock, max_bytes=max_bytes)
    if max_bytes > 0:
        raise ValueError("[store] max_db_mb limits a SQLite file; a PostgreSQL database's size is its "
                         "server's to limit: leave max_db_mb at 0 with a postgresql:// url")
    from chatd.store.postgres import PostgresStore

    return await PostgresStore.open(location, clock=clock)


def store_location(url_or_path: str | Path) -> tuple[str, str]:
    """("sqlite", the file's path) or ("postgresql", the url); ValueError naming [store] url for another scheme."""
    text = str(url_or_path)
    scheme, separator, rest = text.partition("://")
    if isinstance(url_or_path, Path) or not separator:
        return "sqlite", text
    if scheme == "sqlite":
        return "sqlite", rest  # sqlite:///var/lib/chatd.db is /var/lib/chatd.db, as in a file:// url
    if scheme in ("postgresql", "postgres"):
        return "postgresql", text
    raise ValueError(f"[store] url must be a SQLite file (a path, or sqlite:///path) or "
                     f"postgresql://user@host:port/db; got a {scheme}:// url")
