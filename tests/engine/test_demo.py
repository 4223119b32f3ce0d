"""The demo model and the tiny-model factory: they load with transformers and with chatd's
Tokenizer, are reproducible from their seed, and the demo says it is one."""

from __future__ import annotations

import json
import time

import pytest
import sentencepiece as spm
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from chatd.engine import Tokenizer
from chatd.engine.models import demo


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    return demo.build_demo_model(tmp_path_factory.mktemp("demo") / "demo-model")


def test_demo_model_loads_with_transformers_and_runs(demo_dir):
    hf_tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_dir)
    assert model.config.vocab_size == len(hf_tokenizer)
    assert model.config.hidden_size == 256 and model.config.num_hidden_layers == 4
    ids = torch.tensor([hf_tokenizer.encode("How does a chat server work?")])
    with torch.no_grad():
        logits = model(ids).logits  # [batch, tokens, vocab]
    assert logits.shape == (1, ids.shape[1], len(hf_tokenizer))
    assert torch.isfinite(logits).all()


def test_demo_model_says_it_is_one(demo_dir, tmp_path):
    assert demo.is_demo_model(demo_dir)
    assert json.loads((demo_dir / "config.json").read_text())["chatd_demo"] is True
    assert demo.DEMO_WARNING in (demo_dir / "README.md").read_text()
    assert "random weights" in demo.DEMO_WARNING
    assert not demo.is_demo_model(tmp_path)
    assert not demo.is_demo_model(tmp_path / "missing")
    assert not demo.is_demo_model(demo.build_model_dir(tmp_path / "plain"))


def test_demo_model_loads_with_chatd_tokenizer(demo_dir):
    tok = Tokenizer.from_pretrained(demo_dir)
    hf = tok.hf
    assert tok.vocab_size == len(hf) == demo.VOCAB_SIZE
    assert (hf.unk_token_id, hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2, 3)
    im_start, im_end = hf.convert_tokens_to_ids([demo.IM_START, demo.IM_END])
    assert (im_start, im_end) == (4, 5)
    # An assistant turn ends with <|im_end|>: generation_config.json lists it beside </s>.
    assert tok.eos_token_ids == {hf.eos_token_id, im_end}
    ids = tok.encode_chat([{"role": "user", "content": "Bonjour, ça va? 🙂"}])
    assert ids.count(hf.bos_token_id) == 1 and ids.count(im_start) == 2
    assert tok.decode(ids) == "user\nBonjour, ça va? 🙂\nassistant\n"


def test_same_seed_gives_identical_weights_and_another_seed_does_not(tmp_path):
    first = demo.build_model_dir(tmp_path / "a", seed=7)
    again = demo.build_model_dir(tmp_path / "b", seed=7)
    other = demo.build_model_dir(tmp_path / "c", seed=8)
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    a, c = load_file(first / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == c.keys()
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_demo_model_is_reproducible(demo_dir, tmp_path):
    rebuilt = demo.build_demo_model(tmp_path / "again")
    assert (rebuilt / "model.safetensors").read_bytes() == (demo_dir / "model.safetensors").read_bytes()


@pytest.mark.parametrize("family", demo.FAMILIES)
def test_every_family_builds_loads_and_runs(tmp_path, family):
    path = demo.build_model_dir(tmp_path / family, family)
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    expected_type = {"llama3": "llama"}.get(family, family)
    assert config.model_type == expected_type
    assert config.vocab_size == len(AutoTokenizer.from_pretrained(path))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 4)
    assert config.num_key_value_heads == 2 and config.intermediate_size == 128
    assert config.initializer_range == 0.3
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [2, 5]
    if family == "llama3":
        assert config.tie_word_embeddings
        assert config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        logits = model(torch.tensor([[1, 4, 300, 301, 16]])).logits  # [batch, tokens, vocab]
    assert logits.shape == (1, 5, config.vocab_size)
    # initializer_range 0.3 makes a clear favourite; the default 0.02 gives about 1/vocab.
    top_probability = logits[0].softmax(-1).max(-1).values.median()
    assert top_probability > 20 / config.vocab_size


def test_config_overrides_reach_the_transformers_config(tmp_path):
    path = demo.build_model_dir(tmp_path / "m", "qwen3", hidden_size=96, num_hidden_layers=1, num_attention_heads=6)
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (96, 1, 6)
    assert config["head_dim"] == 16  # Qwen3's own default is 128 whatever the width


def test_unknown_family_is_refused(tmp_path):
    with pytest.raises(ValueError, match="family must be one of"):
        demo.build_model_dir(tmp_path, "gpt2")


def test_tokenizer_builds_fast_and_agrees_with_sentencepiece(tmp_path):
    demo.build_tokenizer(tmp_path / "warm")  # the first call pays for imports
    start = time.perf_counter()
    demo.build_tokenizer(tmp_path / "tok")
    assert time.perf_counter() - start < 2.0
    assert AutoTokenizer.from_pretrained(tmp_path / "tok").chat_template == demo.CHAT_TEMPLATE
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tok" / "tokenizer.model"))
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    for line in demo.CORPUS_PATH.read_text(encoding="utf-8").splitlines()[:40]:
        assert hf.encode(line, add_special_tokens=False) == sp.encode(line)


def test_default_demo_dir_follows_chatd_home(monkeypatch, tmp_path):
    monkeypatch.setenv("CHATD_HOME", str(tmp_path))
    assert demo.default_demo_dir() == tmp_path / "demo-model"
    monkeypatch.delenv("CHATD_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo.default_demo_dir() == tmp_path / "home" / ".cache" / "chatd" / "demo-model"


def test_ensure_demo_model_builds_once_and_leaves_no_half_built_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("CHATD_HOME", str(tmp_path))
    path = demo.ensure_demo_model()
    assert path == tmp_path / "demo-model" and demo.is_demo_model(path)
    built_at = (path / "model.safetensors").stat().st_mtime_ns
    assert demo.ensure_demo_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == built_at
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-model"]


def test_ensure_demo_model_never_overwrites_another_folder(tmp_path):
    (tmp_path / "demo-model").mkdir()
    (tmp_path / "demo-model" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not chatd's demo model"):
        demo.ensure_demo_model(tmp_path / "demo-model")
    assert (tmp_path / "demo-model" / "notes.txt").read_text() == "mine"
