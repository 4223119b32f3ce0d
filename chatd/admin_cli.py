"""`chatd keys create|list|revoke` (API keys in the store) and `chatd moderation list|show|resolve`
(review what the safety pipeline blocked, flagged or redacted, and the users' appeals): the
commands that read and write the store that the config names ([store] url or db_path), SQLite or
PostgreSQL alike. They load neither the engine nor the HTTP server.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from chatd.cli_args import positive_int
from chatd.config_loader import load_config
from chatd.store.moderation import EVENT_STATUSES
from chatd.store.url import open_store, store_target

if TYPE_CHECKING:
    from chatd.store.db import Store

T = TypeVar("T")


def add_parsers(sub) -> None:
    """Register `keys` and `moderation` on the CLI's subparsers."""
    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="make a key for a tenant (created if new); it is printed once")
    create.add_argument("--name", required=True, help="the tenant's name")
    create.add_argument("--tier", required=True, help="the tenant's tier: free, paid, premium, or one [tiers.NAME] "
                        "in the config defines")
    create.set_defaults(func=_keys_create)
    list_ = keys_sub.add_parser("list", help="list every key (never a secret)")
    list_.set_defaults(func=_keys_list)
    revoke = keys_sub.add_parser("revoke", help="revoke a key for good")
    revoke.add_argument("key_id", help="the key id, as `chatd keys list` shows it")
    revoke.set_defaults(func=_keys_revoke)
    for command in (create, list_, revoke):
        command.add_argument("--config", help="path to a config.toml (its [store] db_path says where the keys live)")

    moderation = sub.add_parser("moderation", help="review what the safety pipeline blocked, flagged or redacted, "
                                                   "and the users' appeals")
    moderation_sub = moderation.add_subparsers(dest="moderation_command", required=True)
    list_events = moderation_sub.add_parser("list", help="list moderation events, newest first")
    list_events.add_argument("--status", choices=EVENT_STATUSES,
                             help="only events with this status (appealed: the ones waiting for your review)")
    list_events.add_argument("--tenant", metavar="TENANT_ID", help="only this tenant's events")
    list_events.add_argument("--limit", type=positive_int, default=50, metavar="N",
                             help="list at most N (default 50)")
    list_events.set_defaults(func=_moderation_list)
    show = moderation_sub.add_parser("show", help="every field of one event, its appeal and resolution included")
    show.add_argument("event_id", help="the event (appeal) id, as `chatd moderation list` shows it")
    show.set_defaults(func=_moderation_show)
    resolve = moderation_sub.add_parser("resolve", help="end the review of an event, appealed or not: once")
    resolve.add_argument("event_id", help="the event (appeal) id, as `chatd moderation list` shows it")
    decision = resolve.add_mutually_exclusive_group(required=True)
    decision.add_argument("--uphold", action="store_true", help="the decision stands")
    decision.add_argument("--overturn", action="store_true", help="the decision was wrong")
    resolve.add_argument("--note", help="why, kept with the event")
    resolve.set_defaults(func=_moderation_resolve)
    for command in (list_events, show, resolve):
        command.add_argument("--config", help="path to a config.toml (its [store] db_path says where the events live)")


def _on_store(args: argparse.Namespace, work: Callable[[Store], Awaitable[T]]) -> T:
    """Open the store that the config names, run `work` on it, and close it."""
    async def run() -> T:
        config = load_config(args.config)
        async with await open_store(store_target(config)) as store:
            return await work(store)

    return asyncio.run(run())


def _keys_create(args: argparse.Namespace) -> int:
    tiers = load_config(args.config).tiers
    if args.tier not in tiers:  # refused before anything is written
        raise ValueError(f"tier {args.tier!r} is not defined; defined tiers: {', '.join(tiers)} "
                         f"(add [tiers.{args.tier}] to the config, and pass it with --config)")
    key, record = _on_store(args, lambda store: store.create_key(args.name, args.tier))
    print(f"created key {record.id} for tenant {record.tenant_name!r} (tier {record.tier}):\n")
    print(f"    {key}\n")
    print("Copy it now: it will not be shown again (chatd keeps only its hash).")
    return 0


def _keys_list(args: argparse.Namespace) -> int:
    keys = _on_store(args, lambda store: store.list_keys())
    if not keys:
        print("no API keys yet; make one with `chatd keys create --name NAME --tier TIER`")
        return 0
    rows = [("KEY ID", "TENANT", "TIER", "CREATED", "LAST USED", "REVOKED")]
    rows += [(k.id, k.tenant_name, k.tier, _when(k.created_at), _when(k.last_used_at), _when(k.revoked_at))
             for k in keys]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    if not _on_store(args, lambda store: store.revoke_key(args.key_id)):
        print(f"chatd: no live key {args.key_id!r} (unknown or already revoked; see `chatd keys list`)",
              file=sys.stderr)
        return 1
    print(f"revoked key {args.key_id}")
    return 0


def _moderation_list(args: argparse.Namespace) -> int:
    async def work(store: Store) -> tuple[list, int]:
        events = await store.list_moderation_events(status=args.status, tenant_id=args.tenant, limit=args.limit)
        return events, await store.count_moderation_events(status=args.status, tenant_id=args.tenant)

    events, total = _on_store(args, work)
    if not events:
        status = f"{args.status} " if args.status else ""
        print(f"no {status}moderation events" + (f" for tenant {args.tenant}" if args.tenant else ""))
        return 0
    rows = [("EVENT ID", "WHEN (UTC)", "TENANT", "STAGE", "ACTION", "CATEGORIES", "STATUS")]
    rows += [(e.id, _utc(e.created_at), e.tenant_id, e.stage, e.action, ",".join(e.categories) or "-", e.status)
             for e in events]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    shown = len(events)
    if shown < total:
        print(f"{shown} of {total} events (newest first; raise --limit to see more)")
    else:
        print(f"{total} event{'' if total == 1 else 's'}")
    return 0


def _moderation_show(args: argparse.Namespace) -> int:
    event = _on_store(args, lambda store: store.get_moderation_event(args.event_id))
    if event is None:
        print(f"chatd: no moderation event {args.event_id!r} (see `chatd moderation list`)", file=sys.stderr)
        return 1
    for name, value in vars(event).items():  # the record's fields, in order
        if name.endswith("_at"):
            value = _utc(value)
        elif name == "categories":
            value = ",".join(value) or "-"
        elif isinstance(value, str):
            value = value.replace("\r", "\\r").replace("\n", "\\n")  # a user's text keeps to its one line
        print(f"{name + ':':<17} {'-' if value is None else value}")
    return 0


def _moderation_resolve(args: argparse.Namespace) -> int:
    decision = "upheld" if args.uphold else "overturned"
    try:
        event = _on_store(args, lambda store: store.resolve_moderation_event(args.event_id, decision, args.note))
    except LookupError:
        print(f"chatd: no moderation event {args.event_id!r} (see `chatd moderation list`)", file=sys.stderr)
        return 1
    except ValueError as exc:  # already resolved: the first review stands
        print(f"chatd: {exc}", file=sys.stderr)
        return 1
    print(f"{event.id} {event.status}")
    return 0


def _utc(timestamp: float | None) -> str:
    return "-" if timestamp is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))


def _when(timestamp: float | None) -> str:
    return "-" if timestamp is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))
