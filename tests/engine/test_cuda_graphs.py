"""Decode steps through the CUDA-graph path: padded static buffers on CPU, real capture on a GPU.

On CPU the runner runs the graph path uncaptured (the triton backend under the interpreter):
the same static buffers, padding rows and slot -1 a captured graph replays, so a padding bug
shows as tokens that differ from the sdpa engine's. On a GPU, captured replay must give the
eager engine's tokens.
"""

from __future__ import annotations

import pytest
import torch

from chatd.engine import SamplingParams
from chatd.engine.worker.fast_steps.cuda_graphs import graph_batch_sizes
from chatd.engine.worker.fast_steps.fast_steps import enable_decode_graphs
from tests.engine.conftest import make_llm
from tests.engine.test_engine import prompts, token_ids


def test_captured_sizes_cover_every_batch_up_to_the_maximum():
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(3) == [1, 2, 3]


def test_padded_decode_path_gives_the_sdpa_engines_tokens(model_dirs):
    pytest.importorskip("triton")
    path = model_dirs["qwen3"]
    # Uneven lengths, so the decode batch shrinks 5 -> 1 and is padded (5 -> 8, 3 -> 4) on the way.
    batch = prompts(500, [5, 17, 12, 9, 30], seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 6, 9, 4)]
    want = token_ids(make_llm(path).generate(batch, params))
    llm = make_llm(path, attention_backend="triton")
    enable_decode_graphs(llm.engine.runner, max_batch=8, capture=False)
    assert token_ids(llm.generate(batch, params)) == want
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_cuda_graph_replay_equals_eager(family, model_dirs):
    path = model_dirs[family]
    batch = prompts(500, [5, 17, 40, 63, 8, 21], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    eager = make_llm(path, device="cuda", cuda_graphs=False)
    graphs = make_llm(path, device="cuda", cuda_graph_max_batch=4)  # batches of 5-6 run eagerly, 1-4 replay
    assert graphs.engine.runner.fast.graphs is not None and graphs.engine.runner.fast.graphs.graphs
    assert token_ids(graphs.generate(batch, params)) == token_ids(eager.generate(batch, params))


@pytest.mark.gpu
def test_kv_pool_is_sized_from_gpu_memory_utilization(model_dirs):
    path = model_dirs["llama"]
    total = torch.cuda.mem_get_info()[1]
    llm = make_llm(path, device="cuda", num_blocks=0, gpu_memory_utilization=0.3, max_model_len=256)
    pool = sum(k.numel() * k.element_size() * 2 for k, _ in llm.engine.runner.kv_caches)
    assert 0 < pool < 0.3 * total
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_llm(path, device="cuda", num_blocks=0, gpu_memory_utilization=0.001, max_model_len=256)
