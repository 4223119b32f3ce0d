"""Builds tiny random-weight models with a real tokenizer: the demo model `chatd` runs when
no model is given, and the factory that tests and benchmarks use for every supported family.

The tokenizer is a SentencePiece BPE model trained here, in a fraction of a second, on
demo_corpus.txt (with byte fallback, so any text round-trips), wrapped as a Hugging Face
tokenizer folder with a ChatML-style chat template. The weights are random: the models prove
the serving pipeline and say so; their output is not language. Nothing here is downloaded.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from pathlib import Path

from chatd.config import chatd_home

DEMO_WARNING = "This is chatd's demo model with random weights; its output is not meaningful text."

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")

CORPUS_PATH = Path(__file__).parent / "demo_corpus.txt"
VOCAB_SIZE = 1000  # about what 15 KB of English supports; SentencePiece refuses more than it can fill

# SentencePiece places these at fixed ids: unk 0, bos 1, eos 2, pad 3, then the chat markers.
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# ChatML with a leading BOS; an assistant turn ends with <|im_end|>, which generation_config.json
# lists as an EOS next to </s>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SMALL_DEFAULTS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=2048,
    initializer_range=0.3,  # the default 0.02 gives near-uniform logits, and greedy ties
)

# What each family adds to the small defaults (transformers 5 config field names).
_FAMILY_CONFIG = {
    "llama": dict(model_type="llama"),
    "llama3": dict(
        model_type="llama",
        tie_word_embeddings=True,
        # Llama 3.1's frequency-dependent scaling; original length 256 puts the head's
        # frequencies in all three of its bands (kept, interpolated, divided by factor).
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
    ),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3"),
}

_DEMO_SIZE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=688,
)

_DEMO_README = f"""# chatd demo model

{DEMO_WARNING}

This folder was written by `chatd.engine.models.demo.build_demo_model`. It holds a small Llama-style
model ({_DEMO_SIZE['num_hidden_layers']} layers, hidden size {_DEMO_SIZE['hidden_size']}) whose
weights were drawn at random from a fixed seed, and a SentencePiece tokenizer of
{VOCAB_SIZE} tokens trained on a short English text that ships with chatd.

It exists so that `chatd` can be started, queried and measured without downloading anything:
requests, chat templates, batching, the KV cache and streaming all work, but the model was never
trained, so what it writes is not language. Serve a real model folder for real answers.

Deleting this folder is safe; chatd builds it again (identically) when it is needed.
"""


def build_tokenizer(dir: Path) -> None:
    """Train the demo SentencePiece model on the bundled corpus and save a Hugging Face tokenizer folder in dir."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    lines = [line for line in CORPUS_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        byte_fallback=True,  # unseen characters become <0xHH> tokens instead of <unk>
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        unk_piece=UNK,
        bos_piece=BOS,
        eos_piece=EOS,
        pad_piece=PAD,
        user_defined_symbols=[IM_START, IM_END],
        # Identity normalization and kept whitespace: Hugging Face's converted tokenizer does
        # neither NFKC nor whitespace collapsing, and the two must tokenize alike.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        num_threads=1,  # one thread: the same corpus always gives the same model
        minloglevel=2,
    )
    (dir / "tokenizer.model").write_bytes(model.getvalue())
    # A bare tokenizer.model plus this config is what AutoTokenizer converts; constructing
    # LlamaTokenizer(vocab_file=...) directly gives a 4-token vocabulary instead.
    config = dict(
        tokenizer_class="LlamaTokenizer",
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        add_bos_token=True,
        add_eos_token=False,
        legacy=False,
        clean_up_tokenization_spaces=False,
    )
    (dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf = AutoTokenizer.from_pretrained(str(dir))
    # The chat markers are already in the vocabulary; marking them special makes
    # skip_special_tokens drop them from decoded text.
    hf.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(dir))


def build_model_dir(dir: Path, family: str = "llama", seed: int = 0, **config_overrides) -> Path:
    """Write the demo tokenizer and a tiny random-weight model of family into dir; same seed, same weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    dir = Path(dir)
    build_tokenizer(dir)
    tokenizer = AutoTokenizer.from_pretrained(str(dir))
    eos_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)]

    fields = {**_SMALL_DEFAULTS, **_FAMILY_CONFIG[family], **config_overrides}
    model_type = fields.pop("model_type")
    # A larger vocabulary than the tokenizer's (a benchmark's 32000) is fine: the extra ids are
    # reachable through token-id prompts and simply never produced by the tokenizer.
    vocab_size = fields.pop("vocab_size", len(tokenizer))
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size must be at least the tokenizer's {len(tokenizer)}, got {vocab_size}")
    if model_type == "qwen3" and "head_dim" not in fields:
        # Qwen3's config defaults head_dim to 128 whatever the hidden size; keep hidden = heads * head_dim.
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **fields,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(str(dir), safe_serialization=True)
    return dir


def build_demo_model(dir: Path) -> Path:
    """Build the model `chatd` serves when no model is given: a small random Llama, marked as the demo."""
    dir = Path(dir)
    # transformers keeps unknown config keys, so the marker travels inside config.json.
    build_model_dir(dir, "llama", seed=0, chatd_demo=True, **_DEMO_SIZE)
    (dir / "README.md").write_text(_DEMO_README)
    return dir


def is_demo_model(path: str | Path) -> bool:
    """Whether the model folder at path is chatd's random-weight demo model."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("chatd_demo") is True
    except (OSError, ValueError):
        return False


def default_demo_dir() -> Path:
    """Where chatd keeps its demo model: $CHATD_HOME/demo-model, else ~/.cache/chatd/demo-model."""
    return chatd_home() / "demo-model"


def ensure_demo_model(dir: Path | None = None) -> Path:
    """Return the demo model folder (default_demo_dir() unless given), building it first if missing."""
    target = Path(dir) if dir is not None else default_demo_dir()
    if is_demo_model(target):
        return target
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not chatd's demo model; move it or choose another folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place, so a crash mid-build never leaves a
    # half-written folder where a later start would find it.
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}-building-", dir=target.parent))
    try:
        build_demo_model(building)
        os.rename(building, target)  # POSIX rename replaces an empty folder, never a full one
    except OSError:
        # Another process may have finished the same build first; its folder is as good.
        if not is_demo_model(target):
            raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target
