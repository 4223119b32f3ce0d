"""Tiny random-weight embedding models, saved as sentence-transformers folders: a BERT with a
WordPiece tokenizer (mean or cls pooling) and a Qwen3 decoder with last-token pooling and left
padding, as Qwen3-Embedding is. Built here in a second; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

WORDS = ("the a of and to in is was that paged attention cache token model batch query key value "
         "vector search embedding server request tenant").split()
LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'"
HIDDEN = 32


def _st_folder(root: Path, hf_dir: Path, pooling: str, normalize: bool) -> Path:
    """Save `hf_dir` as sentence-transformers itself would: Transformer, Pooling, Normalize."""
    from sentence_transformers import SentenceTransformer, models

    modules = [models.Transformer(str(hf_dir)), models.Pooling(HIDDEN, pooling)]
    if normalize:
        modules.append(models.Normalize())
    folder = root / "st"
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def build_bert(root: Path, pooling: str = "mean", normalize: bool = True, max_length: int = 64) -> Path:
    """A 2-layer BERT (hidden 32) with a WordPiece tokenizer of ~100 entries; returns its ST folder."""
    root.mkdir(parents=True, exist_ok=True)
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    vocab = list(dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *LETTERS,
                                *("##" + c for c in LETTERS)]))
    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}, model_max_length=max_length)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=max_length)
    hf_dir = root / "hf"
    BertModel(config).save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    return _st_folder(root, hf_dir, pooling, normalize)


def build_qwen3(root: Path) -> Path:
    """A 2-layer Qwen3 (hidden 32), its tokenizer closing every text with <|endoftext|> and padding
    on the left, last-token pooled and normalized (Qwen3-Embedding's recipe); returns its ST folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

    root.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(dict.fromkeys(["<|endoftext|>", "<unk>", *WORDS, *LETTERS]))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                           special_tokens=[("<|endoftext|>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                        unk_token="<unk>", padding_side="left", model_max_length=128)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(vocab), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128)
    hf_dir = root / "hf"
    Qwen3Model(config).save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    return _st_folder(root, hf_dir, "lasttoken", True)
