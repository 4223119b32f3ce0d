"""A thread's parallel torch ops alone, and while another thread that ran parallel torch work is alive.

torch's CPU kernels split work with OpenMP; each thread that runs a parallel region gets a pool of
workers of its own. With two pools on a machine of few cores, libgomp stops spinning for work and
sleeps its workers, so each region pays for waking them (docs/design.md, issue 53's second part).
chatd's engine thread runs every step; the embedding model's thread and the guard model's engine
thread are other long-lived threads that may hold a pool.

    python benchmarks/omp_teams.py            # a few seconds; prints ms and the ratio per case
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def timed(op, repeats: int) -> float:
    for _ in range(50):
        op()
    started = time.perf_counter()
    for _ in range(repeats):
        op()
    return time.perf_counter() - started


def on_thread(op, repeats: int, beside_pool: bool) -> float:
    """Seconds for `repeats` calls of `op` on a new thread; with `beside_pool`, while another thread
    that ran a parallel matmul (and so holds an OpenMP pool) is alive."""
    result, release = {}, threading.Event()
    other = None
    if beside_pool:
        ready = threading.Event()

        def hold() -> None:
            torch.randn(512, 512) @ torch.randn(512, 512)
            ready.set()
            release.wait()

        other = threading.Thread(target=hold)
        other.start()
        ready.wait()
    worker = threading.Thread(target=lambda: result.setdefault("s", timed(op, repeats)))
    worker.start()
    worker.join()
    release.set()
    if other is not None:
        other.join()
    return result["s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    v = torch.randn(100_000)
    x, w = torch.randn(1, 576), torch.randn(1536, 576)
    cases = {"multiply 100k floats": lambda: v * 2, "linear [1,576]x[576,1536]": lambda: torch.nn.functional.linear(x, w)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {args.runs} runs of {args.repeats} calls")
    for name, op in cases.items():
        alone = statistics.median(on_thread(op, args.repeats, False) for _ in range(args.runs))
        beside = statistics.median(on_thread(op, args.repeats, True) for _ in range(args.runs))
        print(f"{name}: alone {alone * 1000:.0f} ms, beside a thread holding a pool {beside * 1000:.0f} ms: "
              f"{beside / alone:.1f}x")


if __name__ == "__main__":
    main()
