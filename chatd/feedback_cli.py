"""`chatd feedback list|export`: the operator's view of users' ratings of replies (POST /v1/feedback),
read from the store the config names (SQLite or PostgreSQL), without the engine or the server.

`list` prints the newest ratings (a table, or JSON lines with `--json`); `export FILE` writes them
as JSON lines with, where the store keeps them, the user's message and the reply rated: what
`chatd eval add` turns into golden items, so a reply reported as bad once is checked on every
release after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from chatd.cli_args import positive_int
from chatd.config_loader import load_config
from chatd.store.feedback import RATINGS, Rating
from chatd.store.url import open_store, store_target


def add_parser(sub) -> None:
    """Register `feedback` on the CLI's subparsers."""
    feedback = sub.add_parser("feedback", help="list and export users' ratings of replies")
    feedback_sub = feedback.add_subparsers(dest="feedback_command", required=True)
    list_ = feedback_sub.add_parser("list", help="the newest ratings, by every tenant")
    export = feedback_sub.add_parser("export", help="ratings as JSON lines, with the message and the reply rated")
    export.add_argument("file", type=Path, help="where to write them ('-' for standard output)")
    list_.add_argument("--json", action="store_true", help="one JSON object a line instead of a table")
    for command in (list_, export):
        command.add_argument("--rating", choices=RATINGS, help="only this rating (down: what to look at first)")
        command.add_argument("--model", help="only replies this model served")
        command.add_argument("--days", type=float, default=0.0, metavar="D",
                             help="only ratings given or changed in the last D days (default: all)")
        command.add_argument("--limit", type=positive_int, default=100, metavar="N", help="at most N (default 100)")
        command.add_argument("--config", help="path to a config.toml (its [store] says where the ratings live)")
    list_.set_defaults(func=_list)
    export.set_defaults(func=_export)


def _list(args: argparse.Namespace) -> int:
    ratings = asyncio.run(_read(args, with_text=False))
    if args.json:
        for rated, _ in ratings:
            print(json.dumps(_row(rated)))
        return 0
    if not ratings:
        print("no ratings" + (f" {args.rating}" if args.rating else "") + " yet")
        return 0
    rows = [("WHEN (UTC)", "TENANT", "MODEL", "RATING", "REPLY", "COMMENT")]
    rows += [(_utc(r.updated_at), r.tenant_name or r.tenant_id, r.model, r.rating, r.target_id, (r.comment or "")[:60])
             for r, _ in ratings]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _export(args: argparse.Namespace) -> int:
    lines = [json.dumps({**_row(rated), "prompt": prompt, "reply": reply})
             for rated, (prompt, reply) in asyncio.run(_read(args, with_text=True))]
    text = "".join(line + "\n" for line in lines)
    if str(args.file) == "-":
        print(text, end="")
    else:
        args.file.write_text(text)
        print(f"wrote {len(lines)} ratings to {args.file}")
    return 0


async def _read(args: argparse.Namespace, with_text: bool) -> list[tuple[Rating, tuple[str | None, str | None]]]:
    since = time.time() - args.days * 86400 if args.days > 0 else 0.0
    async with await open_store(store_target(load_config(args.config))) as store:
        ratings = await store.list_feedback(rating=args.rating, model=args.model, limit=args.limit, since=since)
        return [(rated, await store.rated_exchange(rated) if with_text else (None, None)) for rated in ratings]


def _row(rated: Rating) -> dict:
    return {"id": rated.id, "tenant": rated.tenant_name, "tenant_id": rated.tenant_id, "reply_id": rated.target_id,
            "reply_type": rated.target, "model": rated.model, "rating": rated.rating, "comment": rated.comment,
            "created_at": rated.created_at, "updated_at": rated.updated_at}


def _utc(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(timestamp))
