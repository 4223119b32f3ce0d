"""What every handler shares: the engine, the tokenizer, the model's name, metrics, readiness."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from chatd.engine.async_engine import AsyncEngine
from chatd.engine.tokenizer import Tokenizer
from chatd.http.errors import APIError
from chatd.http.metrics import ServerMetrics


@dataclass
class ServerState:
    """The server's shared state, stored on the app under STATE."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    details: dict  # chatd's own model details for /v1/models (dtype, attention backend, ...)
    heartbeat_seconds: float = 15.0
    ready: bool = False
    metrics: ServerMetrics = field(init=False)
    _token_text: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name)

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
