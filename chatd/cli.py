"""The `chatd` command: the composition root, the one module that sees every part.

Subcommands: `serve` (the OpenAI-compatible server), `bench` (load-test a server), `generate`
(stream one completion to the terminal), `chat` (chat in the terminal, in-process or with a
server), `demo-model DIR` (build the random-weight demo model), `keys` and `moderation` (the
store's API keys, and the review of what the safety pipeline blocked: admin_cli.py), `feedback`
(users' ratings of replies: feedback_cli.py), `eval` (a golden set scored and gated: evals/), `store
copy` (one store into another: store/copy.py), `plan` (a capacity plan: plan/). Each subcommand imports what it runs only when it
runs: `chatd keys list` loads neither the engine, the HTTP server nor the load generator, and
`chatd bench`'s flags are declared only when it is the command being run.
`chatd --version` prints the installed version.

A shared API key comes from --api-key or else the CHATD_API_KEY environment variable, for
`serve` (the key callers must send) and `chat --url` (the key it sends) alike.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.metadata
import logging
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from chatd.admin_cli import add_parsers as add_admin_parsers
from chatd.evals import add_parser as add_eval_parser
from chatd.feedback_cli import add_parser as add_feedback_parser
from chatd.cli_args import non_negative_float, positive_int
from chatd.config import ASYNC_SCHEDULING, DTYPES, ENGINE_PROCESS, KV_CACHE_DTYPES, LOG_LEVELS, QUANTIZATIONS, TOOL_PARSERS, Config
from chatd.config_loader import load_config, speculative_settings
from chatd.logs import setup_logging
from chatd.plan import add_parser as add_plan_parser
from chatd.store.copy import add_parser as add_store_parser

if TYPE_CHECKING:
    from chatd.engine import LLMEngine

API_KEY_ENV = "CHATD_API_KEY"
ADMIN_KEY_ENV = "CHATD_ADMIN_KEY"  # [auth] admin_key: the /admin/ routes' key, kept out of files


def _load_engine(args: argparse.Namespace, one_reply: bool = False) -> LLMEngine:
    """The LLMEngine for `generate` and `chat`: the config file, with --model and --device over it.
    For one reply, steps are not compiled: compiling (seconds to a minute) would not repay."""
    from chatd.engine import LLMEngine

    overrides = model_flag_overrides(args)
    if one_reply:
        overrides["model"]["compile"] = False
    return LLMEngine.from_config(load_config(args.config, overrides))


def model_flag_overrides(args: argparse.Namespace) -> dict[str, dict]:
    """The settings the flags of every command that loads a model set (`_add_model_flags`); `chatd
    serve --model NAME=PATH`, once or more, serves each as one of [[models]] (the first the default)."""
    models = list(args.models or []) if hasattr(args, "models") else [args.model] if args.model else []
    named = [model.partition("=") for model in models if "=" in model]
    if named and len(named) != len(models):
        raise SystemExit("chatd: --model: give every model as NAME=PATH, or one model as a path")
    if len(models) > 1 and not named:
        raise SystemExit("chatd: --model: to serve several models, name each: --model small=demo --model large=PATH")
    flags = {"path": models[0] if models and not named else None, "device": args.device,
             "tensor_parallel_size": args.tensor_parallel_size, "quantization": args.quantization}
    overrides: dict[str, dict] = {"model": {name: value for name, value in flags.items() if value}}
    if named:
        overrides["models"] = [{"name": name, "path": path} for name, _, path in named]
    if args.speculative_config is not None:
        overrides["speculative"] = args.speculative_config
    return overrides


def _generate(args: argparse.Namespace) -> int:
    engine = _load_engine(args, one_reply=True)
    prompt: str | list[int] = args.prompt
    tokenizer = engine.tokenizer
    if tokenizer is not None and not args.raw and tokenizer.hf.chat_template:
        prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    params = engine.default_params(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
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


def _chat(args: argparse.Namespace) -> int:
    from chatd.chat import Chat, EngineBackend, HTTPBackend

    if args.url:
        api_key = args.api_key or os.environ.get(API_KEY_ENV)
        backend = HTTPBackend(args.url, api_key, args.model, args.max_tokens, args.temperature,
                              with_usage=args.verbose)
    else:
        backend = EngineBackend(_load_engine(args), args.max_tokens, args.temperature)
    return Chat(backend, sys.stdin, sys.stdout, system=args.system, verbose=args.verbose).run()


# Set once `chatd serve` has shut down cleanly: `run` may then skip the interpreter's teardown.
_served = False


def _serve(args: argparse.Namespace) -> int:
    global _served
    from chatd.http.serve import serve

    config = serve_config(args)
    setup_logging(config.server.log_json, getattr(logging, config.server.log_level.upper()))
    asyncio.run(serve(config, reload_config=functools.partial(serve_config, args)))
    _served = True
    return 0


def serve_config(args: argparse.Namespace) -> Config:
    """The server's config: the config file, with `chatd serve`'s flags (and CHATD_API_KEY) over it."""
    overrides = {**model_flag_overrides(args), "server": {}, "auth": {}, "cache": {}, "scheduler": {}}
    if args.host:
        overrides["server"]["host"] = args.host
    if args.port is not None:
        overrides["server"]["port"] = args.port
    if args.attention_backend:
        overrides["model"]["attention_backend"] = args.attention_backend
    if args.no_cuda_graphs:
        overrides["model"]["cuda_graphs"] = False
    if args.no_compile:
        overrides["model"]["compile"] = False
    if args.allowed_origins is not None:
        overrides["server"]["allowed_origins"] = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    if args.served_model_name:
        overrides["server"]["model_name"] = tuple(args.served_model_name)
    if args.max_model_len is not None:
        overrides["model"]["max_model_len"] = args.max_model_len
    if args.dtype:
        overrides["model"]["dtype"] = args.dtype
    if args.log_level:
        overrides["server"]["log_level"] = args.log_level
    if args.shutdown_grace_seconds is not None:
        overrides["server"]["shutdown_grace_seconds"] = args.shutdown_grace_seconds
    if args.kv_cache_dtype:
        overrides["cache"]["kv_cache_dtype"] = args.kv_cache_dtype
    if args.host_kv_cache_gb is not None:
        overrides["cache"]["host_kv_cache_gb"] = args.host_kv_cache_gb
    if args.tool_call_parser:
        overrides["model"]["tool_parser"] = args.tool_call_parser
    if args.async_scheduling:
        overrides["scheduler"]["async_scheduling"] = args.async_scheduling
    if args.engine_process:
        overrides["server"]["engine_process"] = args.engine_process
    if args.stream_interval is not None:
        overrides["server"]["stream_interval"] = args.stream_interval
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if api_key:
        overrides["auth"]["api_key"] = api_key
    if os.environ.get(ADMIN_KEY_ENV):
        overrides["auth"]["admin_key"] = os.environ[ADMIN_KEY_ENV]
    return load_config(args.config, overrides)


def _demo_model(args: argparse.Namespace) -> int:
    from chatd.engine.models.demo import DEMO_WARNING, build_demo_model

    path = build_demo_model(Path(args.dir))
    print(f"built the demo model in {path}\n{DEMO_WARNING}")
    return 0


def installed_version() -> str:
    """chatd's version as installed; from a checkout run with PYTHONPATH (no metadata), the source's."""
    try:
        return importlib.metadata.version("chatd")
    except importlib.metadata.PackageNotFoundError:
        import chatd

        return f"{chatd.__version__} (from {Path(chatd.__file__).parent.parent}, not installed)"


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The `chatd` command line's parser. `chatd bench`'s flags are declared only when `argv` runs it:
    they live with the load generator, which no other command imports."""
    parser = argparse.ArgumentParser(prog="chatd", description="A self-hosted LLM chat server you can read end to end.")
    parser.add_argument("--version", action="version", version=f"chatd {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    _add_model_flags(serve, many=True)
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    serve.add_argument("--allowed-origins", metavar="ORIGINS",
                       help="comma-separated browser origins allowed to call the API (CORS), e.g. https://a.example")
    serve.add_argument("--attention-backend", help="auto | flash-attn | torch-varlen | triton | sdpa")
    serve.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly (no CUDA graphs)")
    serve.add_argument("--no-compile", action="store_true",
                       help="on CPU, run every step eagerly (no torch.compile on a thread beside them)")
    serve.add_argument("--async-scheduling", choices=ASYNC_SCHEDULING,
                       help="plan each step while the device runs the one before (default auto: on a GPU)")
    serve.add_argument("--engine-process", nargs="?", const="on", choices=ENGINE_PROCESS,
                       help="run the engine in a process of its own, its Python and the HTTP server's at once (alone: "
                            "on; default auto: on a GPU with the CPUs for it)")
    serve.add_argument("--stream-interval", type=positive_int, metavar="TOKENS",
                       help="send a stream's tokens once this many have come (default 1: each as it comes)")
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="the model ids requests may name; the first is the one replies show (default: the model "
                            "folder's name)")
    serve.add_argument("--max-model-len", type=positive_int, metavar="TOKENS",
                       help="the context window, prompt and reply, in tokens (default: the model's own)")
    serve.add_argument("--dtype", choices=DTYPES, help="the weights' dtype (default auto: float32 on CPU, bfloat16 on CUDA)")
    serve.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                       help="how the KV cache stores values (default auto: the model's dtype, float16 beside quantized "
                            "weights on a CPU; fp8 halves 16-bit bytes)")
    serve.add_argument("--host-kv-cache-gb", type=non_negative_float, metavar="GIB",
                       help="host RAM for KV blocks evicted from the device pool, copied back on reuse (default 0: off)")
    serve.add_argument("--tool-call-parser", choices=TOOL_PARSERS,
                       help="how the model's tool calls are read (default auto: from its chat template)")
    serve.add_argument("--log-level", choices=LOG_LEVELS, help="the least severe log lines written (default info)")
    serve.add_argument("--shutdown-grace-seconds", type=non_negative_float, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, how long in-flight replies may finish while new requests get 503 "
                            "(default 30)")
    serve.add_argument("--api-key", metavar="KEY",
                       help=f"one key every caller must send as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; "
                            "prefer it: a flag shows in `ps`)")
    serve.set_defaults(func=_serve)

    if _command(argv) == "bench":
        from chatd.bench import add_parser as add_bench_parser

        add_bench_parser(sub)
    else:  # a stand-in that lists it in `chatd --help`
        sub.add_parser("bench", help="load-test an OpenAI-compatible server (chatd, vLLM, ...)")

    add_plan_parser(sub)
    add_store_parser(sub)
    add_admin_parsers(sub)
    add_feedback_parser(sub)
    add_eval_parser(sub)

    gen = sub.add_parser("generate", help="generate one reply and stream it to the terminal")
    gen.add_argument("prompt")
    _add_model_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None, help="default: the model's recommendation, else 1")
    gen.add_argument("--seed", type=int)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="chat in the terminal with the model, loaded here or served at --url")
    _add_model_flags(chat, model_help="model folder, GGUF file or Hugging Face hub id to load (default: "
                                      "SmolLM2-135M-Instruct where its package is installed, else the demo model); "
                                      "with --url, the model name sent to the server (default: none)")
    chat.add_argument("--url", help="an OpenAI-compatible server to chat with, e.g. http://127.0.0.1:8000 "
                                    "(default: load the model in this process)")
    chat.add_argument("--api-key", help=f"the server's API key (with --url; default: ${API_KEY_ENV})")
    chat.add_argument("--system", help="a system prompt, kept across /reset")
    chat.add_argument("--max-tokens", type=int,
                      help="the most tokens a reply may have (default: what the context window leaves)")
    chat.add_argument("--temperature", type=float, default=None, help="default: the model's recommendation, else 1")
    chat.add_argument("--verbose", action="store_true",
                      help="after each reply, print its prompt and reply token counts")
    chat.set_defaults(func=_chat)

    demo = sub.add_parser("demo-model", help="build the tiny random-weight demo model in DIR")
    demo.add_argument("dir")
    demo.set_defaults(func=_demo_model)

    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` runs: its first word that is not an option (`chatd` itself takes none with a value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _add_model_flags(parser: argparse.ArgumentParser,
                     model_help: str = "model folder, GGUF file or Hugging Face hub id, or 'demo' (default: "
                                       "SmolLM2-135M-Instruct where its package is installed, else the demo model)",
                     many: bool = False) -> None:
    if many:  # `chatd serve`: NAME=PATH, repeated, serves several models ([[models]])
        parser.add_argument("--model", dest="models", action="append", metavar="[NAME=]PATH",
                            help=model_help + "; NAME=PATH, repeated, serves several models by name (the first is "
                                 "the default), as [[models]] in config.toml")
    else:
        parser.add_argument("--model", help=model_help)
    parser.add_argument("--config", help="path to a config.toml")
    parser.add_argument("--device", help="auto | cpu | cuda[:N]")
    parser.add_argument("--quantization", choices=QUANTIZATIONS,
                        help="weights in fewer bits, on CPU: int8, int4, or gguf (a GGUF file's own Q4, Q6_K and Q8_0 blocks); "
                             "on a CUDA GPU: int4 or fp8; none: the weights as floats (default auto: gguf for a "
                             "quantized GGUF file on a CPU, else none)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=positive_int, metavar="N",
                        help="split the model over N ranks: N GPUs from the first (gloo ranks on CPU) (default 1)")
    parser.add_argument("--speculative-config", type=_speculative_config, metavar="JSON",
                        help="speculative decoding, as vLLM's flag: a JSON object of [speculative]'s settings (method "
                             "ngram | draft_model, model, num_speculative_tokens, ...), over the config's (default: off)")


def _speculative_config(text: str) -> dict:
    try:
        return speculative_settings(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # a user's mistake (bad model path, bad config): say it plainly
        print(f"chatd: {exc}", file=sys.stderr)
        return 2


def run() -> None:
    """The `chatd` command: main(), then exit with its code. After `chatd serve` has stopped
    cleanly (its store closed, its ledger written, its spans sent) the interpreter's own teardown
    is skipped: freeing torch's objects one by one took a second more of every stop."""
    code = main()
    if _served:
        logging.shutdown()  # every log line written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
