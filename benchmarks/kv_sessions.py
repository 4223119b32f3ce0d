"""Session KV memory: many multi-turn sessions on a KV pool that holds a third of them.

Each session is a chat of `--turns` turns. A turn's prompt is the session's whole history (every
earlier message and reply, as token ids: what chatd's conversations and response chains send
since replies are stored as the ids generated) plus a new user message; sessions take turns
round robin, one request at a time, so the device pool (sized in bytes for `--fit` sessions in
the model's dtype) keeps only the last few sessions and every other session's history is gone
from the device by its next turn. Each configuration is a fresh engine:

  host tier off / on   (`cache.host_kv_cache_gb`: evicted blocks kept in host RAM by prefix hash)
  kv dtype model / fp8 (`cache.kv_cache_dtype`: one byte per value, so the same bytes hold more blocks)

For each: time to first token of the last turn (median over sessions, then over `--repeats`
runs of every configuration in turn), prompt tokens computed
per turn (the rest came from the cache, on the device or copied back from the host), blocks
copied each way, and the last turn's TTFT as a ratio of the host-off, model-dtype run.

This script only uses chatd's offline engine (LLM(...).engine: add_request, step, stats).

    python benchmarks/kv_sessions.py                       # the real SmolLM2-135M if installed, else the demo model
    python benchmarks/kv_sessions.py --quick               # seconds
    python benchmarks/kv_sessions.py --device cuda --model PATH --json kv.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

from chatd.engine import LLM, SamplingParams  # noqa: E402
from chatd.engine.models.demo import ensure_demo_model  # noqa: E402
from chatd.engine.models.sources import default_model_path  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder or GGUF file (default: SmolLM2-135M if installed, else the demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--fit", type=int, default=2, help="sessions (at their longest) the device pool holds in the model dtype")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--message-tokens", type=int, default=64, help="tokens in each new user message")
    parser.add_argument("--reply-tokens", type=int, default=16, help="tokens each reply generates")
    parser.add_argument("--host-gb", type=float, default=1.0, help="host tier size when it is on")
    parser.add_argument("--kv-dtypes", default="auto,fp8_e4m3", help="comma-separated cache.kv_cache_dtype values")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (figures: medians)")
    parser.add_argument("--quick", action="store_true", help="3 sessions, 3 turns, short messages")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.fit, args.turns, args.message_tokens, args.reply_tokens = 3, 1, 3, 24, 4
    return args


def session_messages(args, vocab: int) -> list[list[list[int]]]:
    """Each session's user messages, as token ids (fixed seed: every configuration gets the same)."""
    rng = random.Random(0)
    return [[[rng.randrange(100, vocab) for _ in range(args.message_tokens)] for _ in range(args.turns)]
            for _ in range(args.sessions)]


def run(args, model: str, kv_dtype: str, host_gb: float, pool_gb: float, max_len: int) -> dict:
    llm = LLM(model, device=args.device, dtype=args.dtype, kv_cache_dtype=kv_dtype, host_kv_cache_gb=host_gb,
              cpu_kv_cache_gb=pool_gb, gpu_memory_utilization=0.9, max_model_len=max_len, seed=0)
    engine = llm.engine
    info = engine.model_info()
    messages = session_messages(args, engine.vocab_size)
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0, ignore_eos=True)
    histories: list[list[int]] = [[] for _ in range(args.sessions)]
    ttft = [[0.0] * args.sessions for _ in range(args.turns)]
    computed = [0] * args.turns  # prompt tokens computed per turn, all sessions
    replies: list[list[int]] = []
    for turn in range(args.turns):
        for s in range(args.sessions):
            histories[s] += messages[s][turn]
            before = engine.stats().num_prompt_tokens
            request_id = f"s{s}t{turn}"
            started = time.perf_counter()
            engine.add_request(request_id, histories[s], params)
            reply: list[int] = []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.outputs and out.outputs[0].token_ids:
                        if not reply:
                            ttft[turn][s] = time.perf_counter() - started
                        reply += out.outputs[0].token_ids
            computed[turn] += engine.stats().num_prompt_tokens - before
            histories[s] += reply
            replies.append(reply)
    stats = engine.stats()
    return {
        "kv_dtype": info.kv_cache_dtype, "host_gb": host_gb, "device_blocks": info.num_kv_blocks,
        "host_blocks": info.num_host_kv_blocks, "kv_bytes_per_token": info.kv_bytes_per_token,
        "last_turn_ttft_s": statistics.median(ttft[-1]), "first_turn_ttft_s": statistics.median(ttft[0]),
        "computed_per_turn": computed, "prompt_tokens_per_turn": [sum(len(m[t]) for m in messages) for t in range(args.turns)],
        "blocks_to_host": stats.num_blocks_to_host, "blocks_from_host": stats.num_blocks_from_host,
        "host_hit_tokens": stats.host_cache_hits, "replies": replies,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = args.model or str(default_model_path() or ensure_demo_model())
    probe = LLM(model, device=args.device, dtype=args.dtype, num_blocks=64, max_model_len=256)
    bytes_per_token = probe.engine.model_info().kv_bytes_per_token
    del probe
    session_tokens = args.turns * (args.message_tokens + args.reply_tokens)
    max_len = -(-session_tokens // 16) * 16  # the pool must hold one sequence of max_model_len
    pool_gb = args.fit * max_len * bytes_per_token / 2**30
    print(f"model {model} on {args.device}; {args.sessions} sessions x {args.turns} turns of {args.message_tokens} "
          f"message + {args.reply_tokens} reply tokens ({session_tokens} tokens a session at its longest); "
          f"device KV pool {pool_gb * 1024:.1f} MiB (about {args.fit} sessions in the model dtype)")
    configs = [(kv_dtype, host_gb) for kv_dtype in args.kv_dtypes.split(",") for host_gb in (0.0, args.host_gb)]
    runs: list[list[dict]] = [[] for _ in configs]
    for _ in range(args.repeats):  # configurations in turn, so a slow spell of the machine hits them all
        for i, (kv_dtype, host_gb) in enumerate(configs):
            runs[i].append(run(args, model, kv_dtype, host_gb, pool_gb, max_len))
    first_replies = runs[0][0]["replies"]
    results = []
    for config_runs in runs:
        result = dict(config_runs[0])
        result["last_turn_ttft_s"] = statistics.median(r["last_turn_ttft_s"] for r in config_runs)
        result["first_turn_ttft_s"] = statistics.median(r["first_turn_ttft_s"] for r in config_runs)
        # Each run's last-turn TTFT over the first configuration's in the same repeat.
        result["last_turn_ttft_ratios"] = [r["last_turn_ttft_s"] / base["last_turn_ttft_s"]
                                           for r, base in zip(config_runs, runs[0])]
        result["same_replies_as_first_run"] = all(r.pop("replies") == first_replies for r in config_runs)
        del result["replies"]
        results.append(result)
    print(f"\nmedians of {args.repeats} run(s) each")
    print(f"{'kv dtype':14} {'host':>5} {'dev blocks':>10} {'turn-1 TTFT':>11} {'last TTFT':>10} {'vs base':>7} "
          f"{'to host':>7} {'from host':>9}  prompt tokens computed per turn (of new + history)")
    for r in results:
        print(f"{r['kv_dtype']:14} {'on' if r['host_gb'] else 'off':>5} {r['device_blocks']:>10} "
              f"{r['first_turn_ttft_s'] * 1e3:>9.1f}ms {r['last_turn_ttft_s'] * 1e3:>8.1f}ms "
              f"{statistics.median(r['last_turn_ttft_ratios']):>6.2f}x {r['blocks_to_host']:>7} "
              f"{r['blocks_from_host']:>9}  {r['computed_per_turn']}")
    same = sum(r["same_replies_as_first_run"] for r in results)
    print(f"\nreplies identical to the first configuration's: {same} of {len(results)} configurations "
          "(host on and off must agree; fp8 may differ: benchmarks/kv_accuracy.py measures by how much)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
