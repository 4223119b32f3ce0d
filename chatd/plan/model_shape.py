"""A model's shape as a capacity plan needs it: KV bytes per token and weight bytes, read from its config.

The config is read as chatd reads it to serve (a Hugging Face folder's config.json, a GGUF file's
metadata, the default model's GGUF file, `demo`), but no weight is loaded: parameters are counted
on a model built on torch's meta device. A hub id is read for its config.json alone. This module
knows nothing of GPUs, traffic or step times.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

# Bytes per value of each dtype a config or flag may name (fp8 KV caches store one byte a value).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# Bytes a quantized weight takes, its scales included (as benchmarks/steps.py counts chatd's formats):
# fp8 and int8 one byte (a scale per row, ~0.1%, not counted); int4 half a byte plus a bfloat16
# scale and zero per group of 32.
QUANTIZED_WEIGHT_BYTES = {"fp8": 1.0, "int8": 1.0, "int4": 0.5 + 4 / 32}


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's memory: its dimensions and parameter counts by kind."""

    source: str  # the path (or hub id) it was read from
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int  # the context window chatd serves it with
    config_dtype: str  # the checkpoint's own dtype ("" when the config names none)
    embedding_params: int
    projection_params: int  # every linear of the layers (q, k, v, o, gate, up, down)
    head_params: int  # the LM head; a tied one reads the embedding (quantized, chatd keeps a copy)
    other_params: int  # norms and biases
    tied_embeddings: bool
    file_bytes: int = 0  # a GGUF file's size (its blocks as stored); 0 for a folder
    file_blocks: bool = False  # a GGUF file that stores weights as blocks (Q4_1, Q8_0, ...), not floats

    @property
    def num_params(self) -> int:
        """Parameters as stored (a tied head counted once)."""
        tied_head = self.head_params if self.tied_embeddings else 0
        return self.embedding_params + self.projection_params + self.head_params + self.other_params - tied_head

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """Keys and values of one token over all layers: layers x kv_heads x head_dim x 2 x bytes."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * DTYPE_BYTES[kv_dtype]

    def weights_bytes(self, dtype: str, quantization: str) -> float:
        """The weights' bytes as chatd holds them: all in `dtype`, or the projections and LM head in
        the quantized format (a tied head becomes a quantized copy beside the embedding), `gguf`
        as the file stores its blocks."""
        dtype_bytes = DTYPE_BYTES[dtype]
        if quantization == "none":
            return self.num_params * dtype_bytes
        if quantization == "gguf":
            if not self.file_bytes:
                raise ValueError("--quantization gguf serves a GGUF file's own blocks; --model is not a GGUF file")
            return self.file_bytes
        unquantized = self.embedding_params + self.other_params
        return unquantized * dtype_bytes + (self.projection_params + self.head_params) * QUANTIZED_WEIGHT_BYTES[quantization]

    def dims(self) -> dict:
        """The dimensions a step's cost depends on, by transformers' names (as curves record them)."""
        return dict(hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                    num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                    head_dim=self.head_dim, intermediate_size=self.intermediate_size, vocab_size=self.vocab_size)


def read_model_shape(model: str | None) -> ModelShape:
    """The shape of the model `--model` names (None: chatd's default model); a ValueError that
    names --model when it cannot be read."""
    from chatd.engine.models.loader import check_architecture, max_model_len

    config, source, file_bytes, file_blocks = _read_config(model)
    try:
        check_architecture(config)
    except ValueError as exc:
        raise ValueError(f"--model {source}: {exc}") from None
    return replace(shape_of(config, source, max_model_len(config), file_bytes), file_blocks=file_blocks)


def shape_of(config, source: str, context_window: int, file_bytes: int = 0) -> ModelShape:
    """A transformers config's ModelShape; parameters counted on a meta-device model (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embedding = projection = other = 0
    for name, param in model.named_parameters():  # a tied head is not listed twice
        if "embed_tokens" in name:
            embedding += param.numel()
        elif name.endswith("proj.weight"):
            projection += param.numel()
        elif not name.startswith("lm_head"):
            other += param.numel()
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or ""
    heads = config.num_attention_heads
    return ModelShape(
        source=source, architecture=(config.architectures or ["?"])[0], num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size, num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size, max_model_len=context_window,
        config_dtype=str(dtype).removeprefix("torch."), embedding_params=embedding, projection_params=projection,
        head_params=config.vocab_size * config.hidden_size, other_params=other,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)), file_bytes=file_bytes,
    )


def _read_config(model: str | None):
    """(transformers config, where it came from, a GGUF file's size or 0, whether it stores blocks)."""
    from transformers import AutoConfig

    from chatd.engine.models.demo import ensure_demo_model
    from chatd.engine.models.quantized.gguf import GGUFCheckpoint, find_gguf, is_gguf
    from chatd.engine.models.sources import DEFAULT_MODEL_INSTALL, default_model_path

    if model is None:
        path = default_model_path()
        if path is None:
            raise ValueError(f"--model not given and the default model is not installed ({DEFAULT_MODEL_INSTALL} adds it)")
    elif model == "demo":
        path = ensure_demo_model()
    else:
        path = Path(model).expanduser()
    try:
        gguf_file = path if is_gguf(path) else find_gguf(path) if path.is_dir() else None
        if gguf_file is not None:
            checkpoint = GGUFCheckpoint(gguf_file)
            return checkpoint.config(), str(gguf_file), gguf_file.stat().st_size, bool(checkpoint.quantized_types())
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError("the folder has no config.json")
            return AutoConfig.from_pretrained(path), str(path), 0, False
        if path.exists() or path.suffix.lower() == ".gguf" or model.startswith((".", "/", "~")) or model.count("/") != 1:
            raise ValueError("no such model folder or GGUF file")
        return AutoConfig.from_pretrained(model), model, 0, False  # a hub id: its config.json alone
    except ValueError as exc:
        raise ValueError(f"--model {model or str(path)!r} cannot be read: {exc}") from None
    except Exception as exc:  # a config transformers or gguf trips on, a hub id that cannot be fetched
        reason = " ".join(str(exc).split())[:300]
        raise ValueError(f"--model {model or str(path)!r} cannot be read: {type(exc).__name__}: {reason}") from None
