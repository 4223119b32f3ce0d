"""`chatd chat`: a chat in the terminal, with the model in this process or with a server over HTTP.

`Chat` is the loop: it reads the user's lines from a stream, keeps the conversation (the whole
history is sent again each turn, as OpenAI's API is stateless), and streams each reply from a
backend. A backend does one thing, `reply(messages, write)`: `EngineBackend` steps an LLMEngine on
the calling thread, `HTTPBackend` posts to any OpenAI-compatible `/v1/chat/completions` and reads
its SSE stream. Ctrl-C while a reply streams stops that reply (the engine request is aborted, or
the HTTP response closed) and keeps what was said so far. This module knows nothing of argparse
or config files; it imports the engine or aiohttp only when a backend that needs them is made.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TextIO

if TYPE_CHECKING:
    from chatd.engine import LLMEngine

PROMPT = "> "
HELP = "/reset clears the history, /exit or Ctrl-D quits, Ctrl-C stops a reply."


class ChatError(Exception):
    """A turn that failed (server down, refused request, prompt too long); the chat goes on."""


@dataclass(frozen=True)
class Usage:
    """The tokens one turn cost: its whole prompt (the history included) and its reply."""

    prompt_tokens: int
    completion_tokens: int


class Backend(Protocol):
    """Where replies come from."""

    def reply(self, messages: list[dict], write: Callable[[str], None]) -> Usage | None:
        """Stream the assistant's reply to `messages` through `write`; the usage, where known.

        Raises ChatError when the turn fails, and KeyboardInterrupt (after stopping the reply)
        when Ctrl-C is pressed while it streams."""


class EngineBackend:
    """Replies from an LLMEngine in this process, stepped on the calling thread."""

    def __init__(self, engine: LLMEngine, max_tokens: int | None, temperature: float | None) -> None:
        if engine.tokenizer is None:
            raise ValueError("`chatd chat` needs a model with a tokenizer and a chat template")
        self.engine = engine
        # No --temperature: the model's recommended sampling, as the server would give.
        self.params = engine.default_params(max_tokens=max_tokens, temperature=temperature)

    def reply(self, messages: list[dict], write: Callable[[str], None]) -> Usage:
        request_id, num_reply_tokens = uuid.uuid4().hex, 0
        try:
            with _ctrl_c_as_flag() as pressed:
                try:
                    prompt = self.engine.tokenizer.encode_chat(messages)
                    self.engine.add_request(request_id, prompt, self.params)
                except ValueError as exc:  # no chat template, or the history outgrew the context window
                    raise ChatError(str(exc)) from None
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.error:
                            raise ChatError(out.error)
                        write(out.outputs[0].text)
                        num_reply_tokens += len(out.outputs[0].token_ids)
                    if pressed.is_set():
                        raise KeyboardInterrupt
        finally:
            self.engine.abort(request_id)  # frees its KV blocks when stopped; a no-op once it finished
        return Usage(len(prompt), num_reply_tokens)


@contextmanager
def _ctrl_c_as_flag() -> Iterator[threading.Event]:
    """Inside, Ctrl-C sets the flag instead of raising: checked between steps, it never cuts a step in half."""
    pressed = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.set())
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


class HTTPBackend:
    """Replies from an OpenAI-compatible server: POST /v1/chat/completions with `stream: true`."""

    def __init__(self, url: str, api_key: str | None, model: str | None, max_tokens: int | None,
                 temperature: float | None, with_usage: bool = False) -> None:
        base = url.rstrip("/")
        self.url = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Only fields every OpenAI-compatible server knows; `model` only if given (chatd needs none).
        self.fields: dict = {"stream": True}
        if temperature is not None:  # else the server's default (chatd: the model's recommendation)
            self.fields["temperature"] = temperature
        if model:
            self.fields["model"] = model
        if max_tokens is not None:
            self.fields["max_tokens"] = max_tokens
        if with_usage:
            self.fields["stream_options"] = {"include_usage": True}

    def reply(self, messages: list[dict], write: Callable[[str], None]) -> Usage | None:
        # Ctrl-C cancels the stream (which closes the response) and is raised here as KeyboardInterrupt.
        try:
            return asyncio.run(self._stream({**self.fields, "messages": messages}, write))
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None

    async def _stream(self, body: dict, write: Callable[[str], None]) -> Usage | None:
        # Our own Ctrl-C handler, as the engine backend has: asyncio.run installs one only where
        # Ctrl-C is Python's default, and a process started with it ignored (a parent that
        # ignores it, as a test runner once did) would never stop a reply.
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, asyncio.current_task().cancel)
        try:
            return await self._events(body, write)
        finally:
            loop.remove_signal_handler(signal.SIGINT)  # back to Python's default: Ctrl-C at the prompt quits

    async def _events(self, body: dict, write: Callable[[str], None]) -> Usage | None:
        import aiohttp

        from chatd.bench.load import parse_event

        usage = None
        # A reply may stream for minutes: only connecting is timed.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        try:
            async with aiohttp.ClientSession(headers=self.headers, timeout=timeout) as http, \
                    http.post(self.url, json=body) as response:
                if response.status != 200:
                    body_bytes = await response.read()
                    message = parse_event(body_bytes).error or body_bytes.decode(errors="replace")[:300]
                    raise ChatError(f"HTTP {response.status}: {message}")
                async for raw_line in response.content:
                    line = raw_line.strip()
                    if not line.startswith(b"data:"):  # blank lines, `:` heartbeats, `event:` lines
                        continue
                    event = parse_event(line[5:].strip())
                    if event.error is not None:
                        raise ChatError(event.error)
                    write(event.text)
                    # Ctrl-C cancels this task, which takes effect only where it waits: with the
                    # rest of the reply already received, reading never waits, and the reply ran
                    # to its end with the Ctrl-C lost. Yield to the loop once per event.
                    await asyncio.sleep(0)
                    if event.usage is not None:
                        usage = Usage(event.usage.get("prompt_tokens", 0), event.usage.get("completion_tokens", 0))
                    if event.done:
                        break
        except aiohttp.ClientError as exc:
            raise ChatError(f"request to {self.url} failed: {exc}") from None
        return usage


class Chat:
    """The terminal chat loop: the user's lines in, streamed replies out, the history in between."""

    def __init__(self, backend: Backend, input: TextIO, output: TextIO, system: str | None = None,
                 verbose: bool = False) -> None:
        self.backend = backend
        self.input, self.output = input, output
        self.system = system
        self.verbose = verbose
        self.history: list[dict] = []  # the turns so far; the system prompt is not one of them

    def run(self) -> int:
        """Chat until /exit, end of input or Ctrl-C at the prompt; returns the exit status (0)."""
        self._say(HELP + "\n")
        while True:
            try:
                line = self._ask()
            except KeyboardInterrupt:
                line = None
            if line is None:  # Ctrl-D or Ctrl-C: end the prompt's line before leaving
                self._say("\n")
                return 0
            text = line.strip()
            if text == "/exit":
                return 0
            if text == "/reset":
                self.history.clear()
                self._say("(history cleared)\n")
            elif text.startswith("/"):
                self._say(f"unknown command {text.split()[0]}; {HELP}\n")
            elif text:
                self.turn(text)

    def turn(self, text: str) -> None:
        """Send one user message with the history before it, and stream the reply."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages += [*self.history, {"role": "user", "content": text}]
        pieces: list[str] = []

        def write(piece: str) -> None:
            pieces.append(piece)
            self._say(piece)

        usage, stopped = None, False
        try:
            usage = self.backend.reply(messages, write)
        except ChatError as exc:  # the turn never happened: the user may send it again
            self._say(("\n" if pieces else "") + f"error: {exc}\n")
            return
        except KeyboardInterrupt:
            stopped = True
            self._say("\n[reply stopped]")
        self._say("\n")
        reply = "".join(pieces)
        if reply or not stopped:  # a stopped reply stays as what the assistant said, if it said anything
            self.history += [messages[-1], {"role": "assistant", "content": reply}]
        if self.verbose and usage is not None:
            self._say(f"[{usage.prompt_tokens} prompt tokens, {usage.completion_tokens} reply tokens]\n")

    def _ask(self) -> str | None:
        """The user's next line, or None at end of input (Ctrl-D)."""
        if self.input is sys.stdin and sys.stdin.isatty():
            import readline  # noqa: F401 -- loaded, it lets input() edit the line and recall earlier ones

            try:
                return input(PROMPT)
            except EOFError:
                return None
        self._say(PROMPT)
        line = self.input.readline()
        return line.rstrip("\n") if line else None

    def _say(self, text: str) -> None:
        self.output.write(text)
        self.output.flush()
