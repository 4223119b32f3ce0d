"""What every handler shares: the engine, the tokenizer, the store, metrics, readiness, background work."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from chatd.config import Config
from chatd.engine.async_engine import AsyncEngine
from chatd.engine.tokenizer import Tokenizer
from chatd.http.errors import APIError
from chatd.http.metrics import ServerMetrics
from chatd.store.db import Store, Tenant

if TYPE_CHECKING:
    from chatd.http.conversations import ReplyStream

log = logging.getLogger("chatd.http")


@dataclass
class ServerState:
    """The server's shared state, stored on the app under STATE."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    details: dict  # chatd's own model details for /v1/models (dtype, attention backend, ...)
    store: Store
    local_tenant: Tenant  # who every request is while auth is off
    config: Config = field(default_factory=Config)
    ready: bool = False
    stopping: bool = False  # set at shutdown: replies cut short now are partial, not failed
    metrics: ServerMetrics = field(init=False)
    replies: dict[str, ReplyStream] = field(default_factory=dict)  # assistant message id -> its reply's events
    busy: set[str] = field(default_factory=set)  # conversations with a reply being generated
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _token_text: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name)

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

    def check_model(self, model: str | None) -> None:
        """A request may name the served model or leave it out; any other name is a 404."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}", "model", "model_not_found")

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "chatd",
            "context_length": self.max_model_len,
            "chatd": self.details,
        }

    def token_text(self, token_id: int) -> str:
        """A token's own text, as logprobs report it (cached: the same ids come back often)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


STATE = web.AppKey("state", ServerState)
