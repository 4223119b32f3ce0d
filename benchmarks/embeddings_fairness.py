"""One tenant's large `POST /v1/embeddings` beside another tenant's small ones: what does the small
tenant wait, and does `/health` still answer?

It starts `chatd serve` with `[embeddings] model = "default"` (all-MiniLM-L6-v2), keys on, two
tenants of the paid tier (its requests a minute raised: bob sends hundreds), and measures in two
phases, each repeated:

  alone    bob sends one-text requests one after another: their latency
  beside   alice sends one request of --texts texts of ~252 tokens each (MiniLM reads 256 at most);
           while it runs, bob sends one-text requests one after another, and /health is polled
           every 20 ms

It prints bob's latency (median and max) alone and beside alice, the ratio, /health's worst while
alice's request ran, and alice's request's time (her throughput, tokens a second). The chat model
beside it is the demo model (random weights): it loads in seconds and takes no part.

    python benchmarks/embeddings_fairness.py                    # 512 texts, 3 repeats
    python benchmarks/embeddings_fairness.py --texts 2048 --repeats 1
    python benchmarks/embeddings_fairness.py --quick            # 32 texts, 1 repeat (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not
sys.path.insert(0, str(ROOT / "benchmarks"))  # embeddings.py's helpers

from embeddings import serve_demo  # noqa: E402

WORDS = ("the cache holds keys and values of past tokens so that each new token reads them instead of computing "
         "them again while a scheduler batches requests from many users").split()


def long_texts(count: int, tokens: int = 250, seed: int = 11) -> list[str]:
    """Texts of common words cut to `tokens` wordpieces of all-MiniLM-L6-v2's tokenizer (with [CLS]
    and [SEP]: `tokens` + 2 as the model reads them)."""
    from transformers import AutoTokenizer

    from chatd.engine.embeddings import locate_embedding_model

    tokenizer = AutoTokenizer.from_pretrained(str(locate_embedding_model("default")))
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(tokens)) for _ in range(count)]
    return [tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]) for text in texts]


def start_chatd(work: Path) -> tuple[subprocess.Popen, str, dict[str, str]]:
    """chatd serve with keys on and two paid tenants; the process, its URL and the keys."""
    config = work / "config.toml"
    # The paid tier as it ships but for its requests a minute: bob sends hundreds of requests.
    config.write_text(f'[embeddings]\nmodel = "default"\n[auth]\nenabled = true\n[store]\ndb_path = "{work / "chatd.db"}"\n'
                      '[tiers.paid]\nrequests_per_minute = 1000000\n')
    env = {**os.environ, "CHATD_HOME": str(work / "home")}
    keys = {}
    for name in ("alice", "bob"):
        made = subprocess.run([sys.executable, "-m", "chatd", "keys", "create", "--name", name, "--tier", "paid",
                               "--config", str(config)], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
        keys[name] = re.search(r"chatd_[0-9a-f]{12}_\S+", made.stdout).group(0)
    proc, url = serve_demo(work, config)
    return proc, url, keys


def bob_requests(client, until: threading.Event | None, count: int) -> list[float]:
    """Bob's one-text requests one after another: `count` of them, or until `until` is set."""
    latencies = []
    while (until is None and len(latencies) < count) or (until is not None and not until.is_set()):
        start = time.perf_counter()
        client.embeddings.create(model="all-MiniLM-L6-v2", input="how long does one short text wait?")
        latencies.append(time.perf_counter() - start)
    return latencies


def beside(url: str, keys: dict[str, str], texts: list[str]) -> dict:
    import httpx
    import openai

    alice = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["alice"], max_retries=0, timeout=3600)
    bob = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["bob"], max_retries=0, timeout=3600)
    done, health = threading.Event(), []
    result: dict = {}

    def alice_request() -> None:
        start = time.perf_counter()
        try:
            reply = alice.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
            result["alice_s"], result["alice_tokens"] = time.perf_counter() - start, reply.usage.prompt_tokens
        finally:
            done.set()

    def poll_health() -> None:
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                start = time.perf_counter()
                client.get(f"{url}/health")
                health.append(time.perf_counter() - start)
                time.sleep(0.02)

    threads = [threading.Thread(target=alice_request), threading.Thread(target=poll_health)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # alice's request is being embedded
    result["bob_s"] = bob_requests(bob, done, 0)
    for thread in threads:
        thread.join()
    if "alice_s" not in result:
        raise SystemExit("alice's request failed (above)")
    result["health_max_s"] = max(health)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=512, help="texts in alice's request (default 512)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="32 texts, 1 repeat (a smoke run)")
    parser.add_argument("--json", help="write every run and the medians here too")
    args = parser.parse_args(argv)
    if args.quick:
        args.texts, args.repeats = 32, 1
    import openai

    texts = long_texts(args.texts)
    runs: dict[str, list] = {"alone": [], "beside": []}
    with tempfile.TemporaryDirectory() as tmp:
        proc, url, keys = start_chatd(Path(tmp))
        try:
            bob = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["bob"], max_retries=0)
            bob_requests(bob, None, 3)  # warm up
            for _ in range(args.repeats):
                runs["alone"].append(bob_requests(bob, None, 20))
                runs["beside"].append(beside(url, keys, texts))
                print(f"alone: bob p50 {statistics.median(runs['alone'][-1]) * 1000:.1f} ms; beside: "
                      + json.dumps({k: v if k != "bob_s" else f"{len(v)} requests" for k, v in runs["beside"][-1].items()}),
                      flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    alone_p50 = statistics.median(statistics.median(r) for r in runs["alone"])
    beside_p50 = statistics.median(statistics.median(r["bob_s"]) for r in runs["beside"])
    beside_max = statistics.median(max(r["bob_s"]) for r in runs["beside"])
    health_max = statistics.median(r["health_max_s"] for r in runs["beside"])
    alice_s = statistics.median(r["alice_s"] for r in runs["beside"])
    tokens = runs["beside"][0]["alice_tokens"]
    summary = {"texts": args.texts, "alice_tokens": tokens, "alice_s": alice_s, "alice_tokens_per_s": tokens / alice_s,
               "bob_alone_p50_s": alone_p50, "bob_beside_p50_s": beside_p50, "bob_beside_max_s": beside_max,
               "bob_beside_over_alone": beside_p50 / alone_p50, "health_max_s": health_max}
    print(f"alice: {args.texts} texts, {tokens} tokens in {alice_s:.2f} s ({tokens / alice_s:.0f} tokens/s)")
    print(f"bob's one text: alone p50 {alone_p50 * 1000:.1f} ms; beside alice p50 {beside_p50 * 1000:.1f} ms, "
          f"max {beside_max * 1000:.1f} ms ({beside_p50 / alone_p50:.1f}x alone)")
    print(f"/health worst while alice's request ran: {health_max * 1000:.1f} ms (goal: under 100 ms)")
    print(f"(medians of {args.repeats} repeats)")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
