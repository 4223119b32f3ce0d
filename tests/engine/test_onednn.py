"""float32 projections on CPU by oneDNN (models/onednn.py, through matvec.dense, and packed.py's
packed copies): the products F.linear gives, to float32 rounding, eagerly and inside a compiled
graph; other dtypes untouched; packing only where its copy fits, the engine's tokens unchanged."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from chatd.engine import SamplingParams
from chatd.engine.models import onednn
from chatd.engine.models.layers import FusedLinear, RowParallelLinear
from chatd.engine.models.matvec import dense
from chatd.engine.models.quantized import packed
from chatd.engine.models.quantized.packed import PackedLinear
from tests.engine.conftest import make_llm
from tests.engine.test_compiled import needs_cpp_compiler

pytestmark = pytest.mark.skipif(not onednn.AVAILABLE, reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_float32_products_go_to_onednn_and_match_f_linear(rows, monkeypatch):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(rows, 96), torch.randn(160, 96), torch.randn(160)
    calls = []
    real = onednn._onednn
    monkeypatch.setattr(onednn, "_onednn", lambda *args: calls.append(args) or real(*args))
    got = dense(x, weight, bias)
    assert len(calls) == 1, "a float32 product on a CPU is oneDNN's"
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    # A view that is not contiguous (a slice of a wider activation) gives the same.
    wide = torch.randn(rows, 2 * 96)
    torch.testing.assert_close(dense(wide[:, ::2], weight), F.linear(wide[:, ::2], weight), rtol=1e-5, atol=1e-5)


def test_other_dtypes_keep_f_linear(monkeypatch):
    monkeypatch.setattr(onednn, "_onednn", lambda *args: pytest.fail("oneDNN called for a bfloat16 product"))
    x, weight = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(8, 32, dtype=torch.bfloat16)
    assert torch.equal(dense(x, weight), F.linear(x, weight))


@needs_cpp_compiler
def test_inside_a_compiled_graph_the_product_is_the_custom_op_and_matches():
    """Compiled with a dynamic row count (a batch past the reductions' few rows), as chatd's
    compiled decode and prefill steps take their weights: as inputs, not constants."""
    torch.manual_seed(0)
    weight, bias = torch.randn(160, 96), torch.randn(160)

    def step(x, weight, bias):
        return F.silu(dense(x, weight, bias)) * 2

    graphs = []

    def recorded(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    with torch._dynamo.config.patch(disable=False), torch.inference_mode():
        torch.compile(step, backend=recorded, fullgraph=True, dynamic=True)(torch.randn(9, 96), weight, bias)
        assert "chatd.onednn_linear" in graphs[0]
        compiled = torch.compile(step, fullgraph=True, dynamic=True)
        for rows in (9, 33):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(compiled(x, weight, bias), F.silu(F.linear(x, weight, bias)) * 2,
                                       rtol=1e-5, atol=1e-5)


# --- weights packed beside the weight as stored (models/quantized/packed.py) --------------------------------


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_a_packed_layer_gives_f_linear_products(rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(160, 96), torch.randn(160)
    layer = PackedLinear(weight, bias)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert layer.weight is not None, "the weight as stored is kept, for the reductions of few-row steps"


@needs_cpp_compiler
def test_compiled_layers_sharing_one_graph_each_use_their_own_packed_weight():
    """chatd compiles one graph for all layers of one shape and hands it each layer's tensors:
    the packed weight is found by the layer's handle, an input, not baked into the graph."""
    torch.manual_seed(0)
    layers = [PackedLinear(torch.randn(160, 96), torch.randn(160)) for _ in range(3)]

    def step(layer, x):
        return F.silu(layer(x))

    with torch._dynamo.config.patch(disable=False), torch.inference_mode():
        compiled = torch.compile(step, fullgraph=True, dynamic=True)
        for layer in layers:
            for rows in (9, 40):
                x = torch.randn(rows, 96)
                torch.testing.assert_close(compiled(layer, x), F.silu(F.linear(x, layer.weight, layer.bias)),
                                           rtol=1e-5, atol=1e-5)
        # A step of two rows, compiled for that size, multiplies as reductions over the weight as stored.
        two_rows = torch.compile(step, fullgraph=True, dynamic=False)
        x = torch.randn(2, 96)
        torch.testing.assert_close(two_rows(layers[1], x), F.silu(F.linear(x, layers[1].weight, layers[1].bias)),
                                   rtol=1e-5, atol=1e-5)


def test_a_dropped_layer_releases_its_packed_weight():
    before = len(packed._PACKED)
    layer = PackedLinear(torch.randn(32, 16))
    assert len(packed._PACKED) == before + 1
    del layer
    gc.collect()
    assert len(packed._PACKED) == before


@pytest.mark.parametrize("available_gib, packs", [(64.0, True), (0.001, False)])
def test_the_engine_packs_float32_weights_only_where_the_copy_fits(model_dirs, monkeypatch, available_gib, packs):
    """Packing keeps a second copy of every float32 weight: done when it fits in a quarter of the
    memory available, and either way the engine's greedy tokens are the unpacked model's."""
    monkeypatch.setattr("chatd.engine.worker.build.available_memory", lambda: int(available_gib * 2**30))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [[5, 40, 41, 42] * 6, [7, 8, 9]]
    with make_llm(model_dirs["llama"], compile=False) as llm:
        model = llm.engine.runner.model
        layers = [m.quantized for m in model.modules() if isinstance(m, (FusedLinear, RowParallelLinear))]
        assert all(isinstance(layer, PackedLinear) for layer in layers) is packs
        assert isinstance(model.quantized_head, PackedLinear) is packs
        got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert llm.engine.model_info().details()["kv_cache_dtype"] == "float32"  # float weights, however stored
    monkeypatch.setattr("chatd.engine.worker.build.available_memory", lambda: None)  # unknown: never packs
    with make_llm(model_dirs["llama"], compile=False) as llm:
        assert llm.engine.runner.model.quantized_head is None
        want = [o.outputs[0] for o in llm.generate(prompts, params)]
    for g, w in zip(got, want, strict=True):
        assert list(g.token_ids) == list(w.token_ids)
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
