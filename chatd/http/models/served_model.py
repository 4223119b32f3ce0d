"""One chat model of the fleet (fleet.py): its engine once loaded, loading and unloading it, and
what rendering and billing need of it (its tokenizer, context window, tool-call parser, prices).

Its KV pool, prefix cache and host tier are its engine's, so a block of one model can never be
read by another. Loading runs on the engine's own thread, never on the event loop; requests that
come while it loads wait for the same load, up to MAX_WAITING_FOR_LOAD (then 503 with
Retry-After). Handlers hold it with `in_use` from the moment it is picked until they return, so
a model with a request being admitted, queued or streamed is never idle. It knows nothing of
which model a request should get: that is fleet.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import orjson

from chatd.config import Config, FleetModel
from chatd.engine import EngineClient, ModelInfo, StructuredOutput, Tokenizer
from chatd.http.errors import APIError
from chatd.http.telemetry.metrics import ServerMetrics
from chatd.http.tools.tool_calls import ToolParser
from chatd.http.tools.tools import ToolRequest, ToolUse, tool_parser, tool_use

log = logging.getLogger("chatd.http")

T = TypeVar("T")

LOADED, LOADING, UNLOADED = "loaded", "loading", "unloaded"
# Requests that may wait for one model to load; more get a 503 with Retry-After.
MAX_WAITING_FOR_LOAD = 256
LOAD_RETRY_AFTER_SECONDS = 5


class ServedModel:
    """One chat model of the fleet: its engine once loaded, and what rendering and billing need of it."""

    def __init__(self, entry: FleetModel, config: Config, make_engine: Callable[[Config], EngineClient] | None,
                 tokenizing: concurrent.futures.Executor) -> None:
        self.entry = entry
        self.config = config  # the server's, with this model's [model], [cache] and [speculative]
        self.names: tuple[str, ...] = entry.names  # ([model] alone: its folder's name, once loaded)
        self.keep_alive = entry.keep_alive
        self._make_engine = make_engine
        self._tokenizing = tokenizing
        self.engine: EngineClient | None = None
        self.tokenizer: Tokenizer | None = None
        self.info: ModelInfo | None = None
        self.status = UNLOADED
        self.load_error: str | None = None  # why its last load failed
        self.num_loads = 0
        self.loading_since: float | None = None  # monotonic time its current load began
        self.last_load_seconds: float | None = None  # how long its last load took: the next one's estimate
        self.metrics: ServerMetrics | None = None  # where its loads and unloads are counted (the server's)
        self.num_in_use = 0  # handlers holding it (in_use): rendering, admitting, starting requests
        self.num_waiting_for_load = 0
        self.last_used = time.monotonic()
        self._loading: asyncio.Task | None = None
        self._token_text: dict[int, str] = {}
        self._tool_parser: ToolParser | None = None
        # Token ids of the chat template's rendering of each [cache] shared_system_prompts entry.
        self.shared_prefixes: list[list[int]] = []
        # Called before each load, to unload others if this one would not fit (fleet.py's).
        self.make_room: Callable[[ServedModel], Awaitable[None]] | None = None
        # Whether a dead engine is loaded again ([[models]]: the others serve on meanwhile). Alone, a
        # dead model stays dead: /health says why, and a supervisor restarts the process.
        self.reloads = False
        self._weights_bytes: tuple[str, int] | None = None  # (the path measured, its files' bytes)

    def __repr__(self) -> str:
        return f"ServedModel({self.name!r}, {self.status})"

    @property
    def name(self) -> str:
        """The name replies and usage carry."""
        return self.names[0]

    # -- loading ---------------------------------------------------------------------------------

    def loaded(self, engine: EngineClient, tokenizer: Tokenizer, info: ModelInfo) -> None:
        """Take an engine started elsewhere (serve.py starts the first model's itself)."""
        self.engine, self.tokenizer, self.info = engine, tokenizer, info
        self.names = self.names or (info.name,)
        self.status, self.load_error = LOADED, None
        self._token_text, self._tool_parser = {}, None
        self.num_loads += 1
        self.last_used = time.monotonic()

    async def load(self) -> None:
        """Load it unless it is loaded; requests that come meanwhile wait for the same load."""
        if self.status == LOADED:
            return
        if self._loading is None:
            self._loading = asyncio.get_running_loop().create_task(self._load(), name=f"load {self.name}")
        await asyncio.shield(self._loading)

    async def _load(self) -> None:
        self.status, self.load_error = LOADING, None
        started = self.loading_since = time.monotonic()
        try:
            if self.make_room is not None:
                await self.make_room(self)
            log.info("model %s: loading %s", self.name, self.entry.model.path or "the default model")
            engine = self._make_engine(self.config)
            info = await engine.start()
            if engine.tokenizer is None:
                await engine.stop()
                raise ValueError("it has no tokenizer")
        except APIError:  # no room for it now: nothing is wrong with the model
            self.status = UNLOADED
            raise
        except Exception as exc:
            self.status, self.load_error = UNLOADED, f"{type(exc).__name__}: {exc}"
            log.error("model %s could not be loaded: %s", self.name, self.load_error)
            self._observe_load(None)
            raise
        finally:
            self._loading = self.loading_since = None
        self.loaded(engine, engine.tokenizer, info)
        await self.render_shared_prefixes()
        self.last_load_seconds = time.monotonic() - started
        self._observe_load(self.last_load_seconds)
        log.info("model %s: loaded in %.1f s (%d KV blocks, context %d)", self.name, self.last_load_seconds,
                 info.num_kv_blocks, info.max_model_len)

    def _observe_load(self, seconds: float | None) -> None:
        if self.metrics is not None:
            self.metrics.model_loaded(self.name, seconds)

    def load_progress(self, now: float) -> dict | None:
        """While it loads: for how long, how long its last load took (None before its second), and
        the share of that passed (capped at 0.99: a load is done when it says so)."""
        if self.loading_since is None:
            return None
        seconds, expected = now - self.loading_since, self.last_load_seconds
        return {"seconds": round(seconds, 1), "expected_seconds": None if expected is None else round(expected, 1),
                "progress": None if not expected else round(min(0.99, seconds / expected), 2)}

    async def render_shared_prefixes(self) -> None:
        """Render [cache] shared_system_prompts with this model's template, off the event loop."""
        self.shared_prefixes = await self.off_loop(shared_prefixes, self.tokenizer, self.config.cache.shared_system_prompts)

    async def unload(self, reason: str, why: str) -> None:
        """Stop its engine and let its weights and KV pool go (whatever is in flight ends with an
        error). reason: idle, room, stopped or admin (its /metrics series); why: the log's words."""
        if self.status != LOADED:
            return
        engine, self.engine, self.status = self.engine, None, UNLOADED
        log.info("model %s: unloading (%s)", self.name, why)
        if self.metrics is not None:
            self.metrics.model_unloaded(self.name, reason)
        await engine.stop()
        del engine
        await asyncio.to_thread(gc.collect)  # the weights' tensors go now, not at some later collection

    @contextlib.asynccontextmanager
    async def in_use(self) -> AsyncIterator[ServedModel]:
        """Hold the model loaded while a handler renders and starts its requests (loading it first,
        waiting in a bounded line while it loads); its requests in the engine hold it after that."""
        self.num_in_use += 1
        try:
            problem = self.engine.health() if self.status == LOADED and self.reloads else None
            if problem is not None:  # its engine died (a crash, out of memory): load it again
                await self.unload("stopped", f"its engine stopped ({problem})")
            if self.status != LOADED:
                await self._wait_for_load()
            self.last_used = time.monotonic()
            yield self
        finally:
            self.num_in_use -= 1
            self.last_used = time.monotonic()

    async def _wait_for_load(self) -> None:
        if self.num_waiting_for_load >= MAX_WAITING_FOR_LOAD:
            raise APIError(503, f"the model {self.name!r} is loading and {MAX_WAITING_FOR_LOAD} requests already wait "
                                "for it; try again shortly", "model", "model_loading",
                           headers={"Retry-After": str(LOAD_RETRY_AFTER_SECONDS)})
        self.num_waiting_for_load += 1
        try:
            await self.load()
        except APIError:
            raise
        except Exception:
            raise APIError(503, f"the model {self.name!r} could not be loaded; try again later", "model",
                           "model_unavailable", headers={"Retry-After": str(LOAD_RETRY_AFTER_SECONDS)}) from None
        finally:
            self.num_waiting_for_load -= 1

    def footprint_bytes(self) -> int:
        """What it takes loaded, as far as is known: its weight files' size (once loaded, the files it
        loaded; before, those of a local path: the default model or a hub id count 0 until then),
        and its KV pool once loaded."""
        info = self.info
        path = info.path if info is not None else self.entry.model.path
        if self._weights_bytes is None or self._weights_bytes[0] != path:
            self._weights_bytes = (path, weights_bytes(path))
        kv = info.num_kv_blocks * info.block_size * info.kv_bytes_per_token if info is not None else 0
        return self._weights_bytes[1] + kv

    def busy(self) -> bool:
        """Requests hold it (being admitted or rendered, queued or generating in its engine), or its
        steps are still compiling on a thread (CPU): a model is not unloaded under either."""
        if self.num_in_use or self.num_waiting_for_load:
            return True
        engine = self.engine
        return engine is not None and (engine.stats().num_request_streams > 0 or engine.compile_state() == "compiling")

    # -- what rendering and billing need -----------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        """More characters than this cannot fit the context window: no token decodes to more than max_token_chars."""
        return self.max_model_len * self.tokenizer.max_token_chars

    def check_text_size(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit the context window from its length alone, before tokenizing it."""
        if num_chars > self.max_prompt_chars:
            raise APIError(400, f"{param} has {num_chars} characters; the context window of {self.max_model_len} tokens "
                                f"holds at most {self.max_prompt_chars} characters of text", param, "context_length_exceeded")

    async def encode_chat(self, messages: list[dict], param: str = "messages",
                          add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
        """Render messages (and tools) with the chat template and tokenize them, in a worker thread."""
        calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
        extra = len(orjson.dumps([calls, tools])) if calls or tools else 0  # rendered as JSON, about this long
        self.check_text_size(sum(len(m["content"]) for m in messages) + extra, param)
        try:
            return await self.off_loop(self.tokenizer.encode_chat, messages, add_generation_prompt, tools)
        except ValueError as exc:
            raise APIError(400, f"cannot render messages with this model's chat template: {exc}", param) from exc

    async def encode_prompt(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """A completion's prompt as token ids (text is tokenized in a worker thread)."""
        if not isinstance(prompt, str):
            return prompt
        self.check_text_size(len(prompt), param)
        return await self.off_loop(self.tokenizer.encode, prompt) if prompt else []

    async def off_loop(self, function: Callable[..., T], *args) -> T:
        """Run CPU work on text (templates, tokenizing) in the server's tokenizing threads."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, function, *args)

    @property
    def tool_parser(self) -> ToolParser:
        """How this model's tool calls are read ([model] tool_parser, or its template's family)."""
        if self._tool_parser is None:
            self._tool_parser = tool_parser(self.config.model.tool_parser, self.tokenizer.chat_template)
        return self._tool_parser

    def tool_use(self, request: ToolRequest | None, messages: list[dict],
                 reply_format: StructuredOutput | None = None) -> ToolUse:
        """How a chat request's messages and tools are rendered for this model, the grammar its
        reply follows and how its calls are read. The tools must fit the context window (their JSON
        length, measured when parsed) before they are walked in Python: run it off the event loop."""
        if request is not None:
            self.check_text_size(request.offered_chars, "tools")
        tokenizer = self.tokenizer
        return tool_use(request, messages, self.tool_parser, tokenizer.template_takes_tools, tokenizer.added_token_ids,
                        reply_format)

    def token_text(self, token_id: int) -> str:
        """A token's own text, as logprobs report it (cached: the same ids come back often)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """USD for one request at this model's configured prices ([prices."NAME"])."""
        return self.config.price(self.name).cost(prompt_tokens, cached_tokens, completion_tokens)

    def card(self, name: str | None = None) -> dict:
        """The model as OpenAI describes one, under `name` (default: its own); `root` is its own
        name, `status` whether it is loaded, and chatd's details once it is."""
        card = {"id": name or self.name, "object": "model", "created": 0, "owned_by": "chatd", "root": self.name,
                "status": self.status}
        if self.info is not None:
            card["context_length"] = self.max_model_len
        elif self.entry.model.max_model_len:
            card["context_length"] = self.entry.model.max_model_len
        if self.load_error is not None:
            card["load_error"] = self.load_error
        progress = self.load_progress(time.monotonic())
        if progress is not None:
            card["load"] = progress
        details = self._details() if self.status == LOADED else {}
        card["chatd"] = {**details, "keep_alive": self.keep_alive, "loads": self.num_loads}
        return card

    def _details(self) -> dict:
        """The model's facts, with its compiled steps as of now (on a CPU they compile while it serves)."""
        details = self.info.details()
        compiled = self.engine.compile_state() if self.engine is not None else "off"
        details["compiled_steps"] = compiled
        if compiled != "compiled":
            details["compiled_decode"], details["compiled_prefill_tokens"] = False, 0
        else:
            details["compiled_decode"] = True
        return details


def weights_bytes(path: str) -> int:
    """The size of a model's weight files on a local path (a file, or a folder's weight files); 0
    for anything else (a hub id, "demo", "" before the default model is found)."""
    found = Path(path) if path and path != "demo" else None
    if found is None or not found.exists():
        return 0
    if found.is_file():
        return found.stat().st_size
    return sum(f.stat().st_size for f in found.iterdir() if f.suffix in (".safetensors", ".gguf", ".bin", ".pt"))


def shared_prefixes(tokenizer: Tokenizer, prompts: tuple[str, ...]) -> list[list[int]]:
    """Each shared system prompt as the chat template renders it alone, in tokens."""
    prefixes = []
    for prompt in prompts:
        try:
            prefixes.append(tokenizer.encode_chat([{"role": "system", "content": prompt}], add_generation_prompt=False))
        except ValueError as exc:
            log.warning("shared system prompt %r cannot be rendered on its own (%s); it is not shared", prompt[:40], exc)
    return prefixes


def fleet_config(config: Config, entry: FleetModel) -> Config:
    """The config one model's engine is built from: the server's, with the model's own sections."""
    return dataclasses.replace(config, model=entry.model, cache=entry.cache, speculative=entry.speculative)
