"""float32 projections on CPU by oneDNN (models/onednn.py, through matvec.dense): the products
F.linear gives, to float32 rounding, eagerly and inside a compiled graph; other dtypes untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chatd.engine.models import onednn
from chatd.engine.models.matvec import dense
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
