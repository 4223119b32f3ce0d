"""What `chatd bench` sends, how hard and for how long: BenchOptions, and the flags that fill it.

It imports nothing but argparse and dataclasses, so the CLI declares `chatd bench` without
loading the load generator (load.py) or aiohttp's client.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchOptions:
    """What to send, how hard, and for how long; mirrors the `chatd bench` flags."""

    url: str  # base URL, e.g. http://127.0.0.1:8000/v1
    model: str | None = None  # omitted from the body when None
    concurrency: tuple[int, ...] = (1,)
    num_requests: int | None = None  # per level (sessions with multi_turn > 1); None: 2x concurrency
    prompt_tokens: tuple[int, int] = (100, 200)  # uniform MIN..MAX, one word per token
    output_tokens: tuple[int, int] = (64, 128)  # uniform MIN..MAX, sent as max_tokens
    endpoint: str = "chat"  # chat | completions
    multi_turn: int = 1
    temperature: float = 0.0
    top_p: float = 1.0  # sent only below 1
    ignore_eos: bool = False  # chatd/vLLM extra field; other servers may reject it
    seed: int = 0
    timeout: float = 300.0  # seconds, per request
    api_key: str | None = None
    conversations: bool = False  # chatd's /conversations API: the server keeps each session's history
    responses: bool = False  # OpenAI's /responses API, each turn continuing the last by previous_response_id

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency: each level must be at least 1, got {list(self.concurrency)}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests: must be at least 1, got {self.num_requests}")
        for name in ("prompt_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name}: need 1 <= MIN <= MAX, got MIN={low} MAX={high}")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint: must be 'chat' or 'completions', got {self.endpoint!r}")
        for name in ("conversations", "responses"):
            if getattr(self, name) and self.endpoint != "chat":
                raise ValueError(f"{name}: the API is chat only; endpoint must be 'chat', got {self.endpoint!r}")
        if self.conversations and self.responses:
            raise ValueError("conversations and responses: choose one API for the sessions")
        if self.multi_turn < 1:
            raise ValueError(f"multi_turn: must be at least 1, got {self.multi_turn}")
        if self.timeout <= 0:
            raise ValueError(f"timeout: must be positive, got {self.timeout}")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,16,64, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the `chatd bench` flags, one per BenchOptions field (and --json, where the report goes)."""
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", help="model name to send (omitted from the body by default)")
    parser.add_argument("--concurrency", type=_int_list, default=(1,), help="levels to run in turn, e.g. 1,16,64")
    parser.add_argument(
        "--num-requests", type=int, help="per level (sessions of N turns with --multi-turn); default 2x concurrency"
    )
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(100, 200), metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument(
        "--multi-turn", type=int, default=1, metavar="N",
        help="turns per session, history growing; reports per turn TTFT and prompt, cached and computed tokens",
    )
    parser.add_argument(
        "--conversations", action="store_true",
        help="use chatd's conversations API: one conversation per session (deleted at the end), each turn posting "
             "only the new user message while the server keeps the history. Default: each turn sends the whole "
             "history to /chat/completions",
    )
    parser.add_argument(
        "--responses", action="store_true",
        help="use OpenAI's Responses API: each turn sends only the new user message and continues the previous "
             "turn's response by previous_response_id (the server keeps the history); responses are deleted at the end",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's top_p (sent only below 1)")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (chatd, vLLM): exact lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    parser.add_argument("--api-key", help="sent as a Bearer token")
    parser.add_argument("--json", metavar="PATH", help="write options, summaries and every request here")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """The BenchOptions that parsed `chatd bench` flags ask for."""
    return BenchOptions(
        url=args.url, model=args.model, concurrency=args.concurrency, num_requests=args.num_requests,
        prompt_tokens=tuple(args.prompt_tokens), output_tokens=tuple(args.output_tokens), endpoint=args.endpoint,
        multi_turn=args.multi_turn, temperature=args.temperature, top_p=args.top_p, ignore_eos=args.ignore_eos, seed=args.seed,
        timeout=args.timeout, api_key=args.api_key, conversations=args.conversations, responses=args.responses,
    )
