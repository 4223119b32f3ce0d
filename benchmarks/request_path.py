"""The path of one chat request through chatd's code: which files its functions run in, in order.

A real `chatd serve` (the demo model, on the CPU) runs in this process; once it is ready, one
chat completion (non-streamed, 4 tokens) is sent to it, and while it is in flight a profiler
(sys.setprofile and threading.setprofile) notes, per thread, the chatd file of every function
that starts. Consecutive starts in one file are one visit. It prints,
for the event loop's thread (the front end) and the engine's thread:

    files entered   how many of chatd's files the request's code ran in
    returns         visits to a file the path had already left (A -> B -> A counts one: a
                    function of A starts again after one of B did)

and the visits in order, so a reader can follow the trip.

    python benchmarks/request_path.py            # prints both threads' paths
    python benchmarks/request_path.py --quiet    # only the counts
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # a compile would run on the engine's thread meanwhile
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PACKAGE = str(ROOT / "chatd") + os.sep

recording = False
visits: dict[str, list[str]] = defaultdict(list)  # thread name -> files, one entry per visit


def note(frame, event, arg) -> None:
    if not recording or event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
        return
    path = frame.f_code.co_filename[len(PACKAGE) - len("chatd/"):]
    thread = threading.current_thread().name
    trail = visits[thread]
    if not trail or trail[-1] != path:
        trail.append(path)


def summary(trail: list[str]) -> tuple[int, int]:
    """(files entered, returns to a file already left)."""
    seen: set[str] = set()
    returns = 0
    for path in trail:
        if path in seen:
            returns += 1
        seen.add(path)
    return len(seen), returns


async def one_request(port: int) -> None:
    global recording
    import aiohttp

    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            try:
                async with session.get(base + "/ready") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        body = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
        async with session.post(base + "/v1/chat/completions", json=body) as response:  # warm: first-call work
            await response.read()
        recording = True
        async with session.post(base + "/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            await response.read()
        recording = False


async def main_async(folder: Path) -> None:
    from chatd.config_loader import build_config
    from chatd.engine.models.demo import build_demo_model
    from chatd.http.serve import serve

    model = build_demo_model(folder / "demo")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = build_config({"model": {"path": str(model)}, "server": {"port": port, "log_level": "warning"},
                           "store": {"db_path": str(folder / "chatd.db")}})
    stop = asyncio.Event()
    server = asyncio.create_task(serve(config, stop))
    try:
        await one_request(port)
    finally:
        stop.set()
        await server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quiet", action="store_true", help="only the counts")
    args = parser.parse_args()
    threading.setprofile(note)
    sys.setprofile(note)
    with tempfile.TemporaryDirectory(prefix="chatd-path-") as folder:
        asyncio.run(main_async(Path(folder)))
    sys.setprofile(None)
    for thread, trail in sorted(visits.items(), key=lambda item: -len(item[1])):
        entered, returns = summary(trail)
        print(f"{thread}: {entered} files entered, {returns} returns to a file already left, {len(trail)} visits")
        if not args.quiet:
            print("  " + " -> ".join(trail) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
