"""GGUF files (llama.cpp's format): config, tokenizer and weights of a Llama-family model.

The `gguf` library reads the file and dequantizes each tensor (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
the K-quants and the rest it knows) to float32, one tensor at a time, so host memory holds one
tensor, not the model. This module maps llama.cpp's names to Hugging Face's, undoes the q/k
row order llama.cpp's converter gives `llama` models, and derives a transformers config from
the file's metadata. The tokenizer and chat template come from the same metadata through
transformers' own GGUF converter; they are written once to a cache folder beside the config,
so later starts read plain tokenizer files instead of re-parsing 50k tokens.

A bad file is refused before anything is built, by a ValueError that names it and says what is
wrong: gguf_layout.py first checks its structure against its size (the gguf library trusts every
length, count and offset a file states); gguf_metadata.py checks each metadata value this module
reads (config values, the tokenizer's arrays and ids); this module checks each tensor's name and
shape against the config. It knows nothing of the file's byte layout (gguf_layout.py) nor of block
formats (gguf_quant.py).
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

from chatd.engine.models.quantized.gguf_layout import check_layout, shown
from chatd.engine.models.quantized.gguf_metadata import GGUFMetadata
from chatd.engine.models.quantized.gguf_quant import INT4_TYPES, INT8_TYPES, int4_parts, int8_parts

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

FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})  # tensor types that are not blocks
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


def one_line(exc: Exception) -> str:
    """A library's exception as one line of a message: its type and its words."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


class GGUFCheckpoint:
    """One GGUF file, read once: its metadata, a transformers config, and its weights under Hugging Face names."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        try:
            check_layout(path)
        except OSError as exc:  # absent, a folder, not ours to read
            raise ValueError(f"{path} is not a readable GGUF file: {exc.strerror or exc}") from exc
        try:
            self.reader = GGUFReader(path)
        except Exception as exc:  # past check_layout, what the library still trips on is in the file's bytes
            raise ValueError(f"{path} is not a readable GGUF file: {one_line(exc)}") from exc
        self.metadata = GGUFMetadata(self.reader.fields, path.name)
        self.architecture = str(self.metadata.get("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            supported = ", ".join(sorted(ARCHITECTURES))
            raise ValueError(f"GGUF architecture {self.architecture[:60]!r} ({path.name}) is not supported; "
                             f"supported GGUF architectures: {supported}")
        self.tensor_names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in self.tensor_names:
            # Llama 3.1-style rope scaling stored as per-frequency factors; chatd derives rope from the config.
            raise ValueError(f"GGUF file {path.name} scales rope with a rope_freqs tensor (Llama 3.1 style), "
                             "which chatd does not support yet; use the model's Hugging Face folder")

    def config(self) -> PretrainedConfig:
        """A transformers config for the model, from the file's `<architecture>.*` metadata (each
        value checked: a ValueError names the key and what it holds)."""
        arch = self.architecture
        config_class, architecture = ARCHITECTURES[arch]
        heads = self.metadata.count(f"{arch}.attention.head_count")
        hidden = self.metadata.count(f"{arch}.embedding_length")
        kv_heads = self.metadata.count(f"{arch}.attention.head_count_kv", heads)
        if heads % kv_heads:
            raise self.metadata.invalid(f"metadata {arch}.attention.head_count ({heads}) must be a multiple of "
                            f"{arch}.attention.head_count_kv ({kv_heads})")
        if f"{arch}.attention.key_length" in self.metadata:
            head_dim = self.metadata.count(f"{arch}.attention.key_length")
        elif hidden % heads:
            raise self.metadata.invalid(f"metadata {arch}.embedding_length ({hidden}) must be a multiple of "
                            f"{arch}.attention.head_count ({heads}) when {arch}.attention.key_length is not given")
        else:
            head_dim = hidden // heads
        if head_dim % 2:  # rope turns pairs of a head's dimensions
            raise self.metadata.invalid(f"a head's size ({arch}.attention.key_length, or embedding_length / head_count) "
                            f"must be even, got {head_dim}")
        num_tokens = self.metadata.num_tokens()
        if f"{arch}.vocab_size" in self.metadata:
            vocab = self.metadata.count(f"{arch}.vocab_size")
        elif num_tokens is not None:
            vocab = num_tokens
        elif "token_embd.weight" in self.tensor_names:
            vocab = self._tensor_rows("token_embd.weight")
        else:
            raise self.metadata.invalid(f"it gives no vocabulary size ({arch}.vocab_size, tokenizer.ggml.tokens or a token_embd.weight tensor)")
        fields = dict(
            architectures=[architecture],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self.metadata.count(f"{arch}.feed_forward_length"),
            num_hidden_layers=self.metadata.count(f"{arch}.block_count"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=self.metadata.count(f"{arch}.context_length"),
            rms_norm_eps=self.metadata.positive_number(f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_parameters=self._rope_parameters(self.metadata.positive_number(f"{arch}.rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in self.tensor_names,
            **self.metadata.special_token_ids(num_tokens or vocab),
        )
        if arch == "llama":
            fields["attention_bias"] = "blk.0.attn_q.bias" in self.tensor_names
        if arch in ("mistral", "qwen2", "qwen3"):
            fields["sliding_window"] = None  # llama.cpp files carry none; attention is over the whole context
        return config_class(**fields)

    def _rope_parameters(self, theta: float) -> dict:
        kind = self.metadata.get(f"{self.architecture}.rope.scaling.type", "none")
        if kind in ("none", None):
            return {"rope_type": "default", "rope_theta": theta}
        factor = self.metadata.positive_number(f"{self.architecture}.rope.scaling.factor", 1.0)
        if kind == "linear":
            return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
        if kind == "yarn" and f"{self.architecture}.rope.scaling.original_context_length" in self.metadata:
            return {"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                    "original_max_position_embeddings": self.metadata.count(f"{self.architecture}.rope.scaling.original_context_length")}
        raise self.metadata.invalid(f"rope scaling {kind!r} is not supported")

    def _tensor_rows(self, name: str) -> int:
        tensor = next(t for t in self.reader.tensors if t.name == name)
        return int(tensor.shape[-1])

    def check_tensors(self) -> None:
        """Check every tensor's name against a Llama-family model's and its shape against the one
        config() gives it, before any weight is read; a ValueError names the tensor and both shapes."""
        config = self.config()
        shapes = hf_shapes(config)
        for tensor in self.reader.tensors:
            try:
                name = hf_name(tensor.name)
            except ValueError as exc:
                raise self.metadata.invalid(str(exc)) from exc
            layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            if layer and int(layer.group(1)) >= config.num_hidden_layers:
                raise self.metadata.invalid(f"tensor {shown(tensor.name)} is in layer {layer.group(1)}, but metadata "
                                f"{self.architecture}.block_count is {config.num_hidden_layers}")
            want = shapes.get(layer.group(2) if layer else name)  # [rows, columns], as Hugging Face stores it
            if want is None:  # a known name with an unknown ending (`blk.0.attn_q.weigXt`, `ffn_up.bias`)
                raise self.metadata.invalid(f"GGUF tensor {shown(repr(tensor.name))} is not part of a Llama-family model")
            got = tuple(int(n) for n in reversed(tensor.shape))
            if got != want:
                raise self.metadata.invalid(f"tensor {shown(tensor.name)} has shape {list(reversed(got))}, but the file's metadata "
                                f"make it {list(reversed(want))} (GGUF order, columns first)")

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, tensor in `dtype`) one tensor at a time, dequantized."""
        from gguf import dequantize

        heads = int(self.metadata.get(f"{self.architecture}.attention.head_count"))
        kv_heads = int(self.metadata.get(f"{self.architecture}.attention.head_count_kv", heads))
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            try:
                values = dequantize(tensor.data, tensor.tensor_type)  # [rows, cols] as Hugging Face stores it
            except NotImplementedError:
                raise ValueError(f"GGUF tensor {tensor.name} is stored as {tensor.tensor_type.name}, "
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
        return tensor is not None and tensor.tensor_type.name not in FLOAT_TYPES

    def quantized_types(self) -> list[str]:
        """The block formats the file stores its tensors in (Q4_1, Q6_K, ...), sorted; [] for a float file."""
        names = {t.tensor_type.name for t in self.reader.tensors}
        return sorted(names - FLOAT_TYPES)

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
        heads = int(self.metadata.get(f"{self.architecture}.attention.head_count"))
        kv_heads = int(self.metadata.get(f"{self.architecture}.attention.head_count_kv", heads))
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
        config = self.config().to_dict()
        config.pop("dtype", None)
        has_tokenizer = self.metadata.get("tokenizer.ggml.model") is not None
        if has_tokenizer:
            self.metadata.check_tokenizer()
        partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            (partial / "config.json").write_text(json.dumps(config, indent=2))
            sampling = {name: self.metadata.get(f"general.sampling.{key}") for key, name in SAMPLING_KEYS.items()}
            # Stored as float32: 0.7 reads back as 0.699999988; 7 significant digits give back what was written.
            sampling = {name: float(f"{value:.7g}") if isinstance(value, float) else value
                        for name, value in sampling.items() if value is not None}
            if sampling:
                (partial / "generation_config.json").write_text(json.dumps(sampling, indent=2))
            if has_tokenizer:
                log.info("converting the tokenizer of %s (once; cached in %s)", self.path.name, folder)
                self._convert_tokenizer().save_pretrained(partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
        return folder

    def _convert_tokenizer(self):
        """The tokenizer transformers' GGUF converter builds from this file's metadata."""
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        except Exception as exc:  # it reads nothing but this file's metadata: what it trips on is in there
            raise self.metadata.invalid(f"transformers cannot build a tokenizer from its tokenizer.* metadata ({one_line(exc)})") from exc


def hf_name(gguf_name: str) -> str:
    """llama.cpp's tensor name as Hugging Face's (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    stem, _, kind = gguf_name.rpartition(".")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if layer and layer.group(2) in LAYER_NAMES:
        return f"model.layers.{layer.group(1)}.{LAYER_NAMES[layer.group(2)]}.{kind}"
    if stem in MODEL_NAMES:
        return f"{MODEL_NAMES[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a Llama-family model")


def hf_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor a model of this config reads, by Hugging Face name ([rows, columns]);
    a layer's tensors by their name after `model.layers.N.`."""
    hidden, inner, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {
        "model.embed_tokens.weight": (config.vocab_size, hidden), "lm_head.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,), "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (hidden,), "self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (inner, hidden), "mlp.up_proj.weight": (inner, hidden), "mlp.down_proj.weight": (hidden, inner),
    }


def unpermute_rope_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which reorders each head's q/k rows from rotate-half pairs
    (i, i + d/2) to interleaved pairs (2i, 2i + 1); chatd's rope (as transformers') wants halves."""
    rows = values.shape[0]
    head_dim = rows // num_heads
    return values.reshape(num_heads, head_dim // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
