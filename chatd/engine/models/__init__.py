"""Model implementations (one decoder for the Llama family) and the checkpoint loader."""

from chatd.engine.models.llama import LlamaForCausalLM
from chatd.engine.models.loader import (
    SUPPORTED_ARCHITECTURES,
    load_model,
    max_model_len,
    resolve_dtype,
    resolve_model_path,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "load_model",
    "max_model_len",
    "resolve_dtype",
    "resolve_model_path",
]
