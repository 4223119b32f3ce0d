"""Read a checkpoint's config and stream its weights into the model.

A checkpoint is a Hugging Face folder: config.json + *.safetensors, single file or sharded with
model.safetensors.index.json. The default model, hub ids and GGUF files are sources.py's. This
module decides nothing about the KV cache or the batch; it only turns a checkpoint into a ready model.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from chatd.engine.models.llama import LlamaForCausalLM
from chatd.engine.models.quantized.gguf import GGUFCheckpoint
from chatd.engine.models.quantized.quantize_model import chosen_quantization, quantize_loaded
from chatd.engine.models.rope import max_positions
from chatd.engine.models.sources import gguf_weights, open_gguf
from chatd.engine.models.tensor_parallel import Shard, TPGroup, check_weights_fit

log = logging.getLogger("chatd.engine")

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALLOWED_DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16", "float16", "float32")}


def resolve_dtype(name: str, device: torch.device, config_dtype: torch.dtype | str | None = None) -> torch.dtype:
    """The weights' dtype: `auto` is float32 on CPU, bfloat16 on CUDA (float16 if the checkpoint is float16)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if config_dtype in (torch.float16, "float16") else torch.bfloat16
    allowed = ALLOWED_DTYPES.get(device.type, ())
    if name not in allowed:
        choices = ", ".join(("auto", *allowed))
        raise ValueError(f"model.dtype {name!r} is not supported on {device.type}; choose one of: {choices}")
    return DTYPES[name]


def check_architecture(hf_config: PretrainedConfig) -> None:
    """Raise a ValueError naming the supported architectures when the checkpoint is not one of them."""
    architectures = getattr(hf_config, "architectures", None) or ["(none given)"]
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ValueError(f"model architecture {architectures[0]} is not supported; supported: {supported}")


def max_model_len(hf_config: PretrainedConfig) -> int:
    """The longest context this engine serves for the model: its rope length, capped by a sliding window."""
    length = max_positions(hf_config)
    window = getattr(hf_config, "sliding_window", None)
    # Qwen2/Qwen3 carry a sliding_window value that only applies when use_sliding_window is set.
    if not getattr(hf_config, "use_sliding_window", True):
        window = None
    # The attention backends attend to the whole context and have no sliding-window mask, so past
    # the window they would compute something the model was not trained for. Capping the context
    # to the window keeps every answer exact (Mistral v0.1: 4096 instead of 32768).
    if window and window < length:
        length = window
    return length


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: those listed in the shard index, or every *.safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {path}")
    return files


def iter_weights(files: list[Path], shards: Mapping[str, Shard | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, so host memory holds one tensor, not the checkpoint;
    of a tensor `shards` names, only that part is read (a tensor-parallel rank's rows or columns)."""
    shards = shards or {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shard = shards.get(name)
                if shard is None:
                    yield name, f.get_tensor(name)
                    continue
                part = slice(shard.start, shard.start + shard.length)
                yield name, f.get_slice(name)[(slice(None),) * shard.dim + (part,)]


def count_tensors(files: list[Path]) -> int:
    """How many tensors the files hold (reads only their headers)."""
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            total += len(f.keys())
    return total


@dataclass
class Checkpoint:
    """A model's files: the folder its config and tokenizer are read from, and where its weights are."""

    config_dir: Path  # config.json, tokenizer files, chat template
    gguf: GGUFCheckpoint | None = None  # weights in a GGUF file; None: *.safetensors in config_dir

    @functools.cached_property
    def hf_config(self) -> PretrainedConfig:
        """The transformers config (read once: loading asks for it twice)."""
        return AutoConfig.from_pretrained(self.config_dir)


def open_checkpoint(path: Path, cache_root: Path) -> Checkpoint:
    """A folder of safetensors as is; a GGUF file, or a folder holding one, as sources.open_gguf opens it."""
    gguf = open_gguf(path, cache_root)
    return Checkpoint(path) if gguf is None else Checkpoint(*gguf)


def load_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device,
               tp: TPGroup = TPGroup(), quantization: str = "none") -> tuple[LlamaForCausalLM, PretrainedConfig]:
    """Build the model (this rank's part of it, under tensor parallelism) from the checkpoint's
    config and load its weights onto `device` in `dtype`, then quantize them if asked (quantized/)."""
    hf_config = checkpoint.hf_config
    check_architecture(hf_config)
    quantization = chosen_quantization(quantization, checkpoint.gguf, device, tp)
    # Built on "meta", parameters get storage only on the target device and only once, with no
    # random init that the checkpoint would overwrite anyway.
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, tp)
    model = model.to(dtype)
    if device.type == "cuda":
        check_weights_fit(model, device, tp)
    model = model.to_empty(device=device)
    model.reset_rope_cache()
    shards = {name: shard for name, (_, shard) in model.checkpoint_destinations().items() if shard is not None}
    if checkpoint.gguf is not None:
        weights, total = gguf_weights(checkpoint.gguf, dtype, shards), checkpoint.gguf.num_tensors
    else:
        files = safetensors_files(checkpoint.config_dir)
        weights, total = iter_weights(files, shards), count_tensors(files)
    weights = tqdm(weights, total=total, desc="Loading weights", unit="tensor",
                   disable=None)  # None: a bar on a terminal only, never in a log file
    try:
        model.load_weights(weights)
    except ValueError as exc:  # a tensor missing, extra or misshapen: say which checkpoint
        source = checkpoint.gguf.path if checkpoint.gguf is not None else checkpoint.config_dir
        raise ValueError(f"{source}: {exc}") from exc
    if quantization != "none":
        quantize_loaded(model, quantization, checkpoint.gguf, device)
    return model.eval(), hf_config
