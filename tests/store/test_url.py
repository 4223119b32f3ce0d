"""What `[store] url` names (url.py): a path or sqlite:///path is a SQLite file, postgresql:// a
server; any other scheme is refused naming the setting, without echoing the rest of the url."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatd.store.url import open_store, store_location


@pytest.mark.parametrize(("url_or_path", "location"), [
    ("chatd.db", ("sqlite", "chatd.db")),
    (Path("/var/lib/chatd/chatd.db"), ("sqlite", "/var/lib/chatd/chatd.db")),
    ("sqlite:///var/lib/chatd/chatd.db", ("sqlite", "/var/lib/chatd/chatd.db")),
    ("postgresql://chatd:pw@db:5432/chatd", ("postgresql", "postgresql://chatd:pw@db:5432/chatd")),
    ("postgres://chatd@db/chatd", ("postgresql", "postgres://chatd@db/chatd")),
])
def test_a_path_or_a_url_names_its_store(url_or_path, location):
    assert store_location(url_or_path) == location


def test_another_scheme_is_refused_by_the_settings_name():
    with pytest.raises(ValueError, match=r"\[store\] url must be .*; got a mysql:// url$"):
        store_location("mysql://root:pw@db/chatd")


async def test_a_size_limit_is_sqlites_only():
    with pytest.raises(ValueError, match="max_db_mb limits a SQLite file"):
        await open_store("postgresql://chatd@127.0.0.1/chatd", max_bytes=2**20)
