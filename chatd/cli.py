"""The `chatd` command: the composition root, the one module that sees every part.

Subcommands: `serve` (the OpenAI-compatible server), `bench` (load-test a server), `generate`
(stream one completion to the terminal), `demo-model DIR` (build the random-weight demo model),
`keys create|list|revoke` (API keys in the store). Each subcommand imports what it runs only
when it runs: `chatd keys list` loads neither the engine, the HTTP server nor the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from chatd.bench import add_parser as add_bench_parser
from chatd.config import load_config, store_path
from chatd.logs import setup_logging
from chatd.store.db import TIERS, Store

T = TypeVar("T")


def _generate(args: argparse.Namespace) -> int:
    from chatd.engine import LLMEngine, SamplingParams

    overrides = {"model": {"path": args.model}} if args.model else {}
    if args.device:
        overrides.setdefault("model", {})["device"] = args.device
    engine = LLMEngine.from_config(load_config(args.config, overrides))
    prompt: str | list[int] = args.prompt
    tokenizer = engine.tokenizer
    if tokenizer is not None and not args.raw and tokenizer.hf.chat_template:
        prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    engine.add_request(uuid.uuid4().hex, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
            if out.error:
                print(f"\nerror: {out.error}", file=sys.stderr)
                return 1
    sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from chatd.http.serve import serve

    overrides: dict[str, dict] = {"model": {}, "server": {}}
    if args.model:
        overrides["model"]["path"] = args.model
    if args.device:
        overrides["model"]["device"] = args.device
    if args.host:
        overrides["server"]["host"] = args.host
    if args.port is not None:
        overrides["server"]["port"] = args.port
    if args.attention_backend:
        overrides["model"]["attention_backend"] = args.attention_backend
    if args.no_cuda_graphs:
        overrides["model"]["cuda_graphs"] = False
    config = load_config(args.config, overrides)
    setup_logging(config.server.log_json)
    asyncio.run(serve(config))
    return 0


def _demo_model(args: argparse.Namespace) -> int:
    from chatd.engine.models.demo import DEMO_WARNING, build_demo_model

    path = build_demo_model(Path(args.dir))
    print(f"built the demo model in {path}\n{DEMO_WARNING}")
    return 0


def _on_store(args: argparse.Namespace, work: Callable[[Store], Awaitable[T]]) -> T:
    """Open the store that the config names, run `work` on it, and close it."""
    async def run() -> T:
        async with await Store.open(store_path(load_config(args.config))) as store:
            return await work(store)

    return asyncio.run(run())


def _keys_create(args: argparse.Namespace) -> int:
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


def _when(timestamp: float | None) -> str:
    return "-" if timestamp is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatd", description="A self-hosted LLM chat server you can read end to end.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--model", help="model folder or Hugging Face hub id (default: the demo model)")
    serve.add_argument("--config", help="path to a config.toml")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    serve.add_argument("--device", help="auto | cpu | cuda[:N]")
    serve.add_argument("--attention-backend", help="auto | flash-attn | torch-varlen | triton | sdpa")
    serve.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly (no CUDA graphs)")
    serve.set_defaults(func=_serve)

    add_bench_parser(sub)

    gen = sub.add_parser("generate", help="generate one reply and stream it to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="model folder or Hugging Face hub id (default: the demo model)")
    gen.add_argument("--config", help="path to a config.toml")
    gen.add_argument("--device", help="auto | cpu | cuda[:N]")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.set_defaults(func=_generate)

    demo = sub.add_parser("demo-model", help="build the tiny random-weight demo model in DIR")
    demo.add_argument("dir")
    demo.set_defaults(func=_demo_model)

    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="make a key for a tenant (created if new); it is printed once")
    create.add_argument("--name", required=True, help="the tenant's name")
    create.add_argument("--tier", required=True, choices=TIERS, help="the tenant's tier")
    create.set_defaults(func=_keys_create)
    list_ = keys_sub.add_parser("list", help="list every key (never a secret)")
    list_.set_defaults(func=_keys_list)
    revoke = keys_sub.add_parser("revoke", help="revoke a key for good")
    revoke.add_argument("key_id", help="the key id, as `chatd keys list` shows it")
    revoke.set_defaults(func=_keys_revoke)
    for command in (create, list_, revoke):
        command.add_argument("--config", help="path to a config.toml (its [store] db_path says where the keys live)")
    return parser


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # a user's mistake (bad model path, bad config): say it plainly
        print(f"chatd: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
