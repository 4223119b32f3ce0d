"""What every handler shares: the engine, the tokenizer, the store, metrics, readiness, background work."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import sqlite3
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TypeVar

import orjson
from aiohttp import web

from chatd.config import Config
from chatd.engine import Embedder, EngineClient, ModelInfo, StructuredOutput, Tokenizer
from chatd.http.buckets import shared_buckets
from chatd.http.errors import APIError
from chatd.http.limits import Limits
from chatd.http.metrics import ServerMetrics
from chatd.http.protocol import shown
from chatd.http.safety import Safety
from chatd.http.tool_calls import ToolParser
from chatd.http.tools import ToolRequest, ToolUse, tool_parser, tool_use
from chatd.safety.guard import GuardModel
from chatd.safety.pipeline import SafetyPipeline
from chatd.store.db import Store, StoreUnavailableError, Tenant
from chatd.store.ledger import Ledger, cannot_write_now
from chatd.store.records import new_id

log = logging.getLogger("chatd.http")

T = TypeVar("T")


@dataclass
class ServerState:
    """The server's shared state, stored on the app under STATE."""

    engine: EngineClient
    tokenizer: Tokenizer
    model: ModelInfo  # what the engine loaded
    model_name: str  # the name it is served under ([server] model_name's first, or the model folder's name)
    store: Store
    local_tenant: Tenant  # who every request is while the key database is off (shared key or none)
    ledger: Ledger  # usage and finished replies, written in order even when the store must wait
    config: Config = field(default_factory=Config)
    model_aliases: tuple[str, ...] = ()  # other names a request may use ([server] model_name's others)
    # This process, to the other replicas sharing its store: who runs a turn with an idempotency key.
    replica: str = field(default_factory=lambda: new_id("rep_", 8))
    ready: bool = False
    stopping: bool = False  # set at shutdown: replies cut short now are partial, not failed
    draining_until: float | None = None  # on SIGTERM: the loop time the grace period ends; new requests get 503
    num_in_flight: int = 0  # requests whose handlers have not returned (app.py's draining_middleware counts them)
    guard: GuardModel | None = None  # [safety] guard_model, on its own engine (serve.py starts it)
    embedder: Embedder | None = None  # [embeddings] model, on its own thread (serve.py loads it); None: off
    metrics: ServerMetrics = field(init=False)
    limits: Limits = field(init=False)  # the tiers' buckets, bounds and load shedding
    safety: Safety = field(init=False)  # input checks, output windows, moderation, the audit trail
    # Token ids of the chat template's rendering of each [cache] shared_system_prompts entry.
    shared_prefixes: list[list[int]] = field(default_factory=list)
    # Rendering and tokenizing run here, off the event loop. Two threads: a huge prompt does not
    # hold up everyone else's, and the loop competes for the GIL with few threads.
    tokenizing: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="chatd-tokenize"))
    heartbeats: object = None  # completions.py's one timer for every stream's keep-alive comments
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _token_text: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name, self.model.kv_bytes_per_token, self.model.block_size)
        self.metrics.declare_tiers(self.config.tiers)
        self.limits = Limits(self.config.tiers, self.config.auth.enabled, self.metrics,
                             shared_buckets(self.config.tiers_storage), self.config.tiers_on_storage_error == "open")
        pipeline = SafetyPipeline.build(self.config.safety, self.config.policies, self.guard)
        self.safety = Safety(pipeline, self.store, self.metrics, self.token_text)

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may give as `model`, the served name first."""
        return (self.model_name, *self.model_aliases)

    # -- prompts: sized before tokenizing, tokenized off the event loop ------------------------

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

    @functools.cached_property
    def tool_parser(self) -> ToolParser:
        """How the served model's tool calls are read ([model] tool_parser, or its template's family)."""
        return tool_parser(self.config.model.tool_parser, self.tokenizer.chat_template)

    def tool_use(self, request: ToolRequest | None, messages: list[dict],
                 reply_format: StructuredOutput | None = None) -> ToolUse:
        """How a chat request's messages and tools are rendered for the served model, the grammar its
        reply follows and how its calls are read. The tools must fit the context window (their JSON
        length, measured when parsed) before they are walked in Python: run it off the event loop."""
        if request is not None:
            self.check_text_size(request.offered_chars, "tools")
        tokenizer = self.tokenizer
        return tool_use(request, messages, self.tool_parser, tokenizer.template_takes_tools, tokenizer.added_token_ids,
                        reply_format)

    async def off_loop(self, function: Callable[..., T], *args) -> T:
        """Run CPU work on text (templates, tokenizing) in the tokenizing threads."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, function, *args)

    @property
    def heartbeat_seconds(self) -> float:
        return self.config.server.heartbeat_seconds

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """USD for one request at the served model's configured prices."""
        return self.config.price(self.model_name).cost(prompt_tokens, cached_tokens, completion_tokens)

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        """Run work that must outlive the request that started it; `wait_background` awaits it at shutdown."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    async def wait_background(self, timeout: float) -> None:
        """Wait for background work (replies being saved, usage being recorded); cancel what is left."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    def check_store_writable(self) -> None:
        """New work waits while the store cannot write: no token is served that could not be billed."""
        if not self.ledger.healthy:
            raise self.store_unavailable()

    def store_failed(self, exc: BaseException) -> bool:
        """Whether an error is the store's file or disk refusing writes now (not a client's connection,
        not a bug); if so the ledger hears of it, and new work waits until writes succeed again."""
        if not (isinstance(exc, sqlite3.Error | StoreUnavailableError) and cannot_write_now(exc)):
            return False
        self.ledger.report_failure(exc)
        return True

    def store_unavailable(self) -> APIError:
        """The 503 a client gets while the store cannot write, with when to try again. It says no
        more: the store's error names its address (a PostgreSQL URL's user, host, port, database),
        which is the operator's to read, in the log (ledger.py logs it once an outage)."""
        return APIError(503, "the server cannot record usage right now; try again later", None,
                        "store_unavailable", headers={"Retry-After": str(self.ledger.retry_after)})

    def check_model(self, model: str | None, tenant: Tenant | None = None) -> None:
        """A request may name the served model, one of its aliases, or leave it out; any other name,
        or one the tenant's tier may not use, is a 404."""
        if model is not None and model not in self.model_names:
            served = ", ".join(repr(name) for name in self.model_names)
            raise APIError(404, f"the model {shown(model)} does not exist; this server serves {served}", "model",
                           "model_not_found")
        if tenant is not None:
            self.limits.check_model(tenant, model if model is not None else self.model_name)

    def model_card(self, name: str | None = None) -> dict:
        """The model as OpenAI describes one, under `name` (default: the served name); `root` is the served name."""
        return {
            "id": name or self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "chatd",
            "root": self.model_name,
            "context_length": self.max_model_len,
            "chatd": self._model_details(),
        }

    def _model_details(self) -> dict:
        """The model's facts, with its compiled steps as of now (on a CPU they compile while it serves)."""
        details = self.model.details()
        compiled = self.engine.compile_state()
        details["compiled_steps"] = compiled
        if compiled != "compiled":
            details["compiled_decode"], details["compiled_prefill_tokens"] = False, 0
        else:
            details["compiled_decode"] = True
        return details

    def token_text(self, token_id: int) -> str:
        """A token's own text, as logprobs report it (cached: the same ids come back often)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


STATE = web.AppKey("state", ServerState)
