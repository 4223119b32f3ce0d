"""GGUF files (llama.cpp's format): config, tokenizer and weights of a Llama-family model.

The `gguf` library reads the file and dequantizes each tensor (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
the K-quants and the rest it knows) to float32, one tensor at a time, so host memory holds one
tensor, not the model. This module maps llama.cpp's names to Hugging Face's, undoes the q/k
row order llama.cpp's converter gives `llama` models, and derives a transformers config from
the file's metadata. The tokenizer and chat template come from the same metadata through
transformers' own GGUF converter; they are written once to a cache folder beside the config,
so later starts read plain tokenizer files instead of re-parsing 50k tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from chatd.engine.models.gguf_quant import INT4_TYPES, INT8_TYPES, int4_parts, int8_parts

log = logging.getLogger("chatd.engine")

# general.architecture -> the transformers config class and the architecture name chatd serves it as.
ARCHITECTURES = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "mistral": (MistralConfig, "MistralForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
}

# llama.cpp's tensor names (after `blk.N.`) -> Hugging Face's (after `model.layers.N.`).
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

CACHE_FORMAT = 2  # bump when what prepare_config_dir writes changes

# general.sampling.* (the file's recommended sampling) -> generation_config.json's names.
SAMPLING_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "penalty_repeat": "repetition_penalty"}


def is_gguf(path: Path) -> bool:
    """A .gguf file (by name; its magic is checked when it is read)."""
    return path.is_file() and path.suffix.lower() == ".gguf"


def find_gguf(folder: Path) -> Path | None:
    """The one .gguf file in a folder that holds no safetensors weights; None if there is none.
    Several .gguf files (one model in several quantizations) are ambiguous: a ValueError names them."""
    if any(folder.glob("*.safetensors")):
        return None
    files = sorted(folder.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ValueError(f"{folder} holds several GGUF files ({names}); name one of them as the model")
    return files[0] if files else None


class GGUFCheckpoint:
    """One GGUF file, read once: its metadata, a transformers config, and its weights under Hugging Face names."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        try:
            self.reader = GGUFReader(path)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
        self.architecture = str(self.field("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            supported = ", ".join(sorted(ARCHITECTURES))
            raise ValueError(f"GGUF architecture {self.architecture!r} ({path.name}) is not supported; "
                             f"supported GGUF architectures: {supported}")
        self.tensor_names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in self.tensor_names:
            # Llama 3.1-style rope scaling stored as per-frequency factors; chatd derives rope from the config.
            raise ValueError(f"GGUF file {path.name} scales rope with a rope_freqs tensor (Llama 3.1 style), "
                             "which chatd does not support yet; use the model's Hugging Face folder")

    def field(self, key: str, default=None):
        """A metadata value (strings and arrays as Python values), or `default` when absent."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def config(self) -> PretrainedConfig:
        """A transformers config for the model, from the file's `<architecture>.*` metadata."""
        arch = self.architecture
        config_class, architecture = ARCHITECTURES[arch]

        def get(key: str, default=None):
            value = self.field(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF file {self.path.name} lacks the metadata {arch}.{key}")
            return value

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        tokens = self.field("tokenizer.ggml.tokens")
        vocab = self.field(f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
        if vocab is None:
            vocab = self._tensor_rows("token_embd.weight")
        fields = dict(
            architectures=[architecture],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            max_position_embeddings=int(get("context_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_parameters=self._rope_parameters(float(get("rope.freq_base", 10000.0))),
            tie_word_embeddings="output.weight" not in self.tensor_names,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
        )
        if arch == "llama":
            fields["attention_bias"] = "blk.0.attn_q.bias" in self.tensor_names
        if arch in ("mistral", "qwen2", "qwen3"):
            fields["sliding_window"] = None  # llama.cpp files carry none; attention is over the whole context
        return config_class(**fields)

    def _rope_parameters(self, theta: float) -> dict:
        kind = self.field(f"{self.architecture}.rope.scaling.type", "none")
        if kind in ("none", None):
            return {"rope_type": "default", "rope_theta": theta}
        factor = float(self.field(f"{self.architecture}.rope.scaling.factor", 1.0))
        original = self.field(f"{self.architecture}.rope.scaling.original_context_length")
        if kind == "linear":
            return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
        if kind == "yarn" and original:
            return {"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                    "original_max_position_embeddings": int(original)}
        raise ValueError(f"GGUF file {self.path.name}: rope scaling {kind!r} is not supported")

    def _tensor_rows(self, name: str) -> int:
        tensor = next(t for t in self.reader.tensors if t.name == name)
        return int(tensor.shape[-1])

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, tensor in `dtype`) one tensor at a time, dequantized."""
        from gguf import dequantize

        heads = int(self.field(f"{self.architecture}.attention.head_count"))
        kv_heads = int(self.field(f"{self.architecture}.attention.head_count_kv", heads))
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            try:
                values = dequantize(tensor.data, tensor.tensor_type)  # [rows, cols] as Hugging Face stores it
            except NotImplementedError:
                raise ValueError(f"GGUF tensor {tensor.name} ({self.path.name}) is stored as {tensor.tensor_type.name}, "
                                 "which the gguf library cannot dequantize") from None
            values = np.asarray(values, dtype=np.float32).reshape([int(n) for n in reversed(tensor.shape)])
            if self.architecture == "llama" and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
                values = unpermute_rope_rows(values, heads)
            elif self.architecture == "llama" and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
                values = unpermute_rope_rows(values, kv_heads)
            if not values.flags.writeable:  # an unquantized tensor is a view of the read-only file mapping
                values = values.copy()
            yield name, torch.from_numpy(np.ascontiguousarray(values)).to(dtype)

    def _tensor(self, hf: str):
        """The file's tensor of a Hugging Face name, or None."""
        if not hasattr(self, "_by_hf_name"):
            self._by_hf_name = {hf_name(t.name): t for t in self.reader.tensors}
        return self._by_hf_name.get(hf)

    def is_quantized(self, hf: str) -> bool:
        """Whether the file stores this tensor in a block format (not F32, F16 or BF16)."""
        tensor = self._tensor(hf)
        return tensor is not None and tensor.tensor_type.name not in ("F32", "F16", "BF16", "F64")

    def int4_parts(self, hf: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """A Q4_0, Q4_1 or Q4_K tensor as the int4 kernel's (q, scales, zeros), rows in Hugging
        Face's order (q/k rows of `llama` files put back as weights() does); None for other types."""
        tensor = self._tensor(hf)
        if tensor is None or tensor.tensor_type.name not in INT4_TYPES:
            return None
        return self._rows_as_hf(tensor, int4_parts(np.asarray(tensor.data), tensor.tensor_type.name, int(tensor.shape[0])))

    def int8_parts(self, hf: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        """A Q8_0, Q6_K, Q5_0, Q5_1 or Q5_K tensor as (q int8, a scale per block of 32 or 16
        weights, a zero per block or None), rows in Hugging Face's order; None for other types."""
        tensor = self._tensor(hf)
        if tensor is None or tensor.tensor_type.name not in INT8_TYPES:
            return None
        return self._rows_as_hf(tensor, int8_parts(np.asarray(tensor.data), int(tensor.shape[0]), tensor.tensor_type.name))

    def _rows_as_hf(self, tensor, parts: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """Per-row arrays (or None) of a tensor with a `llama` file's q/k rows put back in Hugging Face's order."""
        heads = int(self.field(f"{self.architecture}.attention.head_count"))
        kv_heads = int(self.field(f"{self.architecture}.attention.head_count_kv", heads))
        if self.architecture == "llama" and tensor.name.endswith("attn_q.weight"):
            return tuple(None if part is None else unpermute_rope_rows(part, heads) for part in parts)
        if self.architecture == "llama" and tensor.name.endswith("attn_k.weight"):
            return tuple(None if part is None else unpermute_rope_rows(part, kv_heads) for part in parts)
        return parts

    def prepare_config_dir(self, cache_root: Path) -> Path:
        """A folder with config.json, the tokenizer files (and chat template) and the recommended
        sampling (generation_config.json, when the file has general.sampling.*) of this GGUF, made once.

        Keyed by the file's path, size and modification time; a model without tokenizer metadata
        gets only its config (it then serves token-id prompts, as a weights-only folder does).
        """
        stat = self.path.stat()
        key = hashlib.sha256(f"{CACHE_FORMAT}:{self.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        folder = cache_root / f"{self.path.stem}-{key}"
        if (folder / "config.json").exists():
            return folder
        partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        config = self.config().to_dict()
        config.pop("dtype", None)
        (partial / "config.json").write_text(json.dumps(config, indent=2))
        sampling = {name: self.field(f"general.sampling.{key}") for key, name in SAMPLING_KEYS.items()}
        # Stored as float32: 0.7 reads back as 0.699999988; 7 significant digits give back what was written.
        sampling = {name: float(f"{value:.7g}") if isinstance(value, float) else value
                    for name, value in sampling.items() if value is not None}
        if sampling:
            (partial / "generation_config.json").write_text(json.dumps(sampling, indent=2))
        if self.field("tokenizer.ggml.model") is not None:
            log.info("converting the tokenizer of %s (once; cached in %s)", self.path.name, folder)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
            tokenizer.save_pretrained(partial)
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
        return folder


def hf_name(gguf_name: str) -> str:
    """llama.cpp's tensor name as Hugging Face's (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    stem, _, kind = gguf_name.rpartition(".")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if layer and layer.group(2) in LAYER_NAMES:
        return f"model.layers.{layer.group(1)}.{LAYER_NAMES[layer.group(2)]}.{kind}"
    if stem in MODEL_NAMES:
        return f"{MODEL_NAMES[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a Llama-family model")


def unpermute_rope_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which reorders each head's q/k rows from rotate-half pairs
    (i, i + d/2) to interleaved pairs (2i, 2i + 1); chatd's rope (as transformers') wants halves."""
    rows = values.shape[0]
    head_dim = rows // num_heads
    return values.reshape(num_heads, head_dim // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
