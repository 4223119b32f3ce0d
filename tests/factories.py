"""Factories shared by every test file: engine parts built without a model, and what a server is told of one.

(As vLLM's `tests/v1/core/utils.py`: a scheduler with no KV tensors at all, sequences made in
one line, and a fake runner for engine tests where the model does not matter.)
"""

from __future__ import annotations

from chatd.engine import ModelInfo


def make_model_info(max_model_len: int = 64, **fields) -> ModelInfo:
    """What `AsyncEngine.start` would report for a small CPU model."""
    defaults = dict(path="/models/m", max_model_len=max_model_len, vocab_size=1000, dtype="float32", device="cpu",
                    attention_backend="sdpa", cuda_graph_max_batch=0, num_kv_blocks=64, block_size=8, is_demo=True)
    return ModelInfo(**{**defaults, **fields})
