"""chatd past one node, on one machine: replicas on one PostgreSQL database behind a real gateway.

    python benchmarks/replicas.py [--replicas 3] [--conversations 8] [--turns 6] [--kills 20]

Starts a throwaway PostgreSQL server, N `chatd serve` replicas of the demo model (or --model)
sharing its database, and two SGLang Model Gateways in front of them, one cache-aware and one
round-robin, all on 127.0.0.1. Then:

1. Affinity: the same multi-turn chat (each turn resends the history) through each gateway, the
   conversations interleaved. Per turn from the second: the share of the previous turn's prompt
   (its full KV blocks) the replica found cached, and the turn's latency. Prints both gateways'
   medians and the ratio.
2. Failover: HAProxy in front of the same replicas; each round streams a conversation turn with
   an Idempotency-Key, kills -9 the replica streaming it, and retries with the same key until
   answered (the killed replica restarts meanwhile). Prints acknowledged turns, and turns lost
   or billed twice, read back from PostgreSQL.

Needs PostgreSQL's binaries, HAProxy and smg (`pip install "chatd[replicas]"`); the cluster is
tests/replicas/cluster.py's, so the tests and this script run the same processes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatd.engine.models.demo import build_demo_model  # noqa: E402
from tests.postgres_server import PostgresServer  # noqa: E402
from tests.replicas import cluster  # noqa: E402
from tests.replicas.test_failover import _read, keyed_turn_until_answered, new_conversation  # noqa: E402

BLOCK = 16  # chatd's KV block, in tokens


def affinity(url: str, model: str, conversations: int, turns: int, tag: str) -> tuple[list[float], list[float]]:
    """(cached share of the previous prompt's blocks, seconds) per turn from the second."""
    histories = [[{"role": "system", "content": f"Conversation {tag}-{c}: answer in short lines. " * 8}]
                 for c in range(conversations)]
    previous, rates, latencies = [0] * conversations, [], []
    with httpx.Client(timeout=120) as client:
        for turn in range(turns):
            for c, history in enumerate(histories):
                history.append({"role": "user", "content": f"Question {turn} of {tag}-{c}: what comes next?"})
                started = time.perf_counter()
                r = client.post(f"{url}/v1/chat/completions", json={
                    "model": model, "messages": history, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                elapsed = time.perf_counter() - started
                r.raise_for_status()
                usage = r.json()["usage"]
                if turn > 0:
                    rates.append(usage["prompt_tokens_details"]["cached_tokens"] / (previous[c] // BLOCK * BLOCK))
                    latencies.append(elapsed)
                previous[c] = usage["prompt_tokens"]
                history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    return rates, latencies


def failover(url: str, replicas: list[cluster.Replica], kills: int, store_url: str) -> dict:
    acknowledged: dict[str, list[str]] = {}
    with httpx.Client(timeout=120) as client:
        conversations = [new_conversation(client, url) for _ in range(4)]
        for round_ in range(kills):
            conversation, key = conversations[round_ % 4], uuid.uuid4().hex
            content = f"Round {round_}: tell me more."
            with client.stream("POST", f"{url}/v1/conversations/{conversation}/messages",
                               headers={"X-Chatd-Routing-Key": conversation, "Idempotency-Key": key},
                               json={"content": content, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                                     "stream": True}) as r:
                victim = next(x for x in replicas if x.name == r.headers["X-Served-By"])
                lines = r.iter_lines()
                while '"content"' not in next(lines):
                    pass
                victim.kill()
            victim.start()
            reply = keyed_turn_until_answered(client, url, conversation, content, key)
            acknowledged.setdefault(conversation, []).append(reply["id"])
            victim.wait_ready()
    rows = asyncio.run(_read(store_url, list(acknowledged)))
    replies = [reply for ids in acknowledged.values() for reply in ids]
    return {"kills": kills, "acknowledged": len(replies),
            "lost": sum(rows["usage"].get(r, 0) == 0 for r in replies),
            "doubled": sum(rows["usage"].get(r, 0) > 1 for r in replies),
            "usage_rows": sum(rows["usage"].values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--kills", type=int, default=20, help="0: no failover phase")
    parser.add_argument("--model", help="a model folder or file (default: the demo model)")
    args = parser.parse_args()
    why = cluster.missing("smg", "haproxy")
    if why:
        print(f"replicas: cannot run here: {why}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="chatd-replicas-"))
    model = Path(args.model) if args.model else build_demo_model(root / "demo")
    with PostgresServer() as postgres:
        store_url = postgres.create_database("chatd")
        replicas = [cluster.Replica(f"r{i}", root, model, cluster.replica_config(store_url))
                    for i in range(args.replicas)]
        gateways = []
        try:
            for replica in replicas:
                replica.start()
            for replica in replicas:
                replica.wait_ready()
            served = httpx.get(f"{replicas[0].url}/v1/models").json()["data"][0]["id"]
            results = {}
            for policy in ("cache_aware", "round_robin"):
                gateways.append(cluster.Smg(root, replicas, policy))
                results[policy] = affinity(gateways[-1].url, served, args.conversations, args.turns, policy)
            print(f"affinity: {args.conversations} conversations x {args.turns} turns over {args.replicas} replicas, "
                  "turns 2 on (previous prompt's full blocks found cached; latency)")
            for policy, (rates, latencies) in results.items():
                print(f"  {policy:<12} cached median {statistics.median(rates):6.1%} (min {min(rates):6.1%})  "
                      f"latency median {statistics.median(latencies) * 1000:7.1f} ms")
            ratio = statistics.median(results["round_robin"][1]) / statistics.median(results["cache_aware"][1])
            print(f"  round_robin / cache_aware latency: {ratio:.2f}x")
            if args.kills == 0:
                return 0
            gateways.append(cluster.HAProxy(root, replicas))
            counts = failover(gateways[-1].url, replicas, args.kills, store_url)
            print(f"failover: {counts['kills']} kills -9 mid-stream, {counts['acknowledged']} turns acknowledged, "
                  f"{counts['lost']} lost, {counts['doubled']} billed twice, {counts['usage_rows']} usage rows")
        finally:
            for gateway in gateways:
                gateway.stop()
            for replica in replicas:
                replica.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
