"""How soon `chatd serve` answers after the command: the start timeline, first starts and later ones.

Each run starts `chatd serve` (the default model unless --model) as a new process and, from the
moment it is started, polls /health and /ready every 20 ms; as soon as /ready is 200 it streams
one chat reply, then waits for the log's `start timeline:` line (the compiled steps in use), and
streams the same reply again. A "first" start has an empty CHATD_HOME (nothing converted, nothing
compiled); a "later" start reuses the CHATD_HOME of the first. Printed per kind, the median over
--repeats runs, in seconds from the command:

  port     /health first answered          first token  the first reply's first content
  ready    /ready first 200                 compiled     the compiled steps in use (from the log)
  reply    the first reply's 32 tokens      after        the same reply once compiled

With --llama-server PATH it starts llama.cpp's server on the same GGUF file the same way (port =
/health answered at all, ready = /health 200) for a side-by-side line and the ratio of first tokens.

    python benchmarks/startup.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 32


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def stream_reply(base: str, model: str) -> tuple[float, float]:
    """Stream one chat reply; (seconds to its first content, seconds to its end)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started, first = time.monotonic(), None
    with urllib.request.urlopen(request, timeout=600) as answer:
        for line in answer:
            if first is None and b'"content"' in line:
                first = time.monotonic() - started
    return first or 0.0, time.monotonic() - started


def start_run(command: list[str], port: int, env: dict, log: Path, ready_path: str, model: str | None,
              timeline: bool) -> dict[str, float]:
    """One start of a server: the marks above, in seconds from the command."""
    marks: dict[str, float] = {}
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        while "ready" not in marks:
            if proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            answered = status(base + "/health")
            if answered is not None and "port" not in marks:
                marks["port"] = time.monotonic() - t0
            if status(base + ready_path) == 200:
                marks["ready"] = time.monotonic() - t0
            time.sleep(0.02)
        if model is None:  # chatd answers only to the names it serves
            with urllib.request.urlopen(base + "/v1/models", timeout=10) as answer:
                model = json.load(answer)["data"][0]["id"]
        sent = time.monotonic()
        first, whole = stream_reply(base, model)
        marks["first token"] = sent - t0 + first
        marks["reply"] = whole
        if timeline:
            while "start timeline:" not in log.read_text():
                if time.monotonic() - t0 > 900 or proc.poll() is not None:
                    raise RuntimeError(f"no start timeline:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
            compiled = re.search(r"start: compiled after ([\d.]+) s", log.read_text())
            if compiled:
                marks["compiled"] = float(compiled.group(1))
            marks["after"] = stream_reply(base, model)[1]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return marks


def report(name: str, runs: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in ("port", "ready", "first token", "compiled", "reply", "after") if all(k in r for r in runs)]
    medians = {k: statistics.median(r[k] for r in runs) for k in keys}
    print(f"{name:<22}" + "  ".join(f"{k} {v:6.2f} s" for k, v in medians.items()), flush=True)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model for chatd (default: chatd's default model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-server", help="a llama-server binary to start the same way (needs a GGUF --model, "
                                               "or the default model's file)")
    parser.add_argument("--json", help="write the medians here")
    parser.add_argument("--log-dir", help="keep each chatd start's log here (first-N.log, later-N.log)")
    args = parser.parse_args()
    chatd = [sys.executable, "-m", "chatd", "serve"] + (["--model", args.model] if args.model else [])
    results = {}
    first_runs, later_runs = [], []
    for run in range(args.repeats):
        with tempfile.TemporaryDirectory() as home:
            env = {**os.environ, "CHATD_HOME": home}
            env.pop("TORCH_COMPILE_DISABLE", None)
            port = free_port()
            first_runs.append(start_run(chatd + ["--port", str(port)], port, env, Path(home) / "first.log", "/ready",
                                        None, timeline=True))
            port = free_port()
            later_runs.append(start_run(chatd + ["--port", str(port)], port, env, Path(home) / "later.log", "/ready",
                                        None, timeline=True))
            if args.log_dir:
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                for kind in ("first", "later"):
                    shutil.copy(Path(home) / f"{kind}.log", Path(args.log_dir) / f"{kind}-{run}.log")
    results["chatd first start"] = report("chatd first start", first_runs)
    results["chatd later start"] = report("chatd later start", later_runs)
    if args.llama_server:
        from chatd.engine.models.sources import default_model_path

        gguf = args.model or str(default_model_path())
        runs = []
        for _ in range(args.repeats):
            port = free_port()
            with tempfile.TemporaryDirectory() as work:
                runs.append(start_run([args.llama_server, "-m", gguf, "--port", str(port), "--host", "127.0.0.1"], port,
                                      dict(os.environ), Path(work) / "llama.log", "/health", "any", timeline=False))
        results["llama-server"] = report("llama-server", runs)
        ratio = results["chatd first start"]["first token"] / results["llama-server"]["first token"]
        print(f"first token, chatd first start / llama-server: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
