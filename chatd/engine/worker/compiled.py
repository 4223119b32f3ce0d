"""Decode steps on CPU through torch.compile: what CUDA graphs are to a GPU step.

An eager decode step at batch 1 spends its time in two places a compiler can fix: each float
projection goes to the matmul library's one-row path, which on the CPUs measured here streams the
weight at a third of the memory bandwidth; and some 25 small operations per layer (norms, rope,
residuals, the KV write, the context gather) each cost their dispatch and a pass over memory.
Compiled with inductor, a projection of a few rows becomes reduction loops that stream the
weight at memory speed (models/matvec.py), attention reads the pages where they lie
(attention/decode.py), and the small operations fuse into a few loops per layer.

What is compiled is one decoder layer, and the final norm with the LM head; every layer of the model
runs the same compiled code with its own weights (they are inputs of the graph, not constants),
so compiling costs what one layer costs, not what thirty do. Graphs: batches 1 to 4, each
specialized (float and int8 projections as one reduction per row), and one for every larger
decode batch (a dynamic size: the projections stay matmuls, which pay there), each with the
context width dynamic. All of them are compiled at start by `warm_up` (logged with the time it
took: SmolLM2-135M on two cores, 32 s cold, 6 s with inductor's on-disk cache warm), so no
request waits for a compile (`compile_count` says whether a later step compiled again: tests check none does).

Prefill chunks and mixed steps run eagerly: their work is in large matmuls already. An int4
layer's kernel (quant.py) is called from the graph as it is: written as a reduction, int4 was
8x slower than that kernel.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from chatd.engine.attention import AttentionMetadata, KVCache, build_step
from chatd.engine.attention.decode import DecodeAttention, DecodeContext
from chatd.engine.models.matvec import ROWS_AS_REDUCTIONS


def unavailable_reason(model: nn.Module, device: torch.device) -> str | None:
    """Why decode steps cannot be compiled here; None when they can."""
    if device.type != "cpu":
        return "only CPU decode steps are compiled (CUDA replays CUDA graphs)"
    if getattr(getattr(model, "tp", None), "size", 1) > 1:
        return "tensor-parallel ranks run eagerly"
    if torch._dynamo.config.disable:
        return "torch.compile is disabled in this process (TORCH_COMPILE_DISABLE=1)"
    return None


def keep_compiled_in(folder: Path) -> None:
    """Inductor's on-disk cache in `folder` rather than its default under /tmp (gone at a reboot),
    unless TORCHINDUCTOR_CACHE_DIR names a place. Importing torch._dynamo sets that variable to
    the default itself, so the default counts as not named."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named is None or os.path.abspath(named) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


def _layer(layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, context: DecodeContext,
           attention: DecodeAttention) -> Tensor:
    return layer(x, cos, sin, kv_cache, context, attention)


def _head(model: nn.Module, x: Tensor) -> Tensor:
    return model.compute_logits(model.norm(x))


class CompiledDecode:
    """A model's decode steps through compiled layers: `logits(meta, input_ids, positions)`."""

    def __init__(self, model: nn.Module, kv_caches: list[KVCache], block_size: int, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.attention = DecodeAttention(k_scale, v_scale)
        # torch.compile keeps graphs per function, not per model: a process with a guard model beside
        # the served one (or a test with many models) needs more than the default 8 before it would
        # silently fall back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.layer = torch.compile(_layer, fullgraph=True, dynamic=None)
        self.head = torch.compile(_head, fullgraph=True, dynamic=None)

    @torch.inference_mode()
    def logits(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """Logits [B, vocab] of a decode-only step (one new token per sequence), in float32."""
        context = DecodeContext.of(meta, self.block_size, self.model.embed_tokens.weight.dtype)
        batch = len(meta.seq_lens_cpu)
        # Sizes the graphs keep dynamic; batches of 1 to ROWS_AS_REDUCTIONS are specialized.
        torch._dynamo.maybe_mark_dynamic(context.context_slots, 1)
        torch._dynamo.maybe_mark_dynamic(context.context_bias, 1)
        if batch > ROWS_AS_REDUCTIONS:
            for tensor in (input_ids, positions, context.slot_mapping, context.context_slots, context.context_bias):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        x, cos, sin = self.model.embed(input_ids, positions)
        for layer, kv_cache in zip(self.model.layers, self.kv_caches, strict=True):
            x = self.layer(layer, x, cos, sin, kv_cache, context, self.attention)
        return self.head(self.model, x)

    @torch.inference_mode()  # as the runner's steps run: inference tensors are a guard of the graphs
    def warm_up(self) -> float:
        """Compile every graph (batches 1 to 4 and a larger one) on dummy steps; returns the seconds it took.

        The dummy steps' tables name block 0 twice (so a pool of one block will do); their K/V
        go into it, which holds nothing yet, and it is zeroed afterwards."""
        started = time.perf_counter()
        for batch in range(1, ROWS_AS_REDUCTIONS + 2):
            for context in (2, self.block_size + 2):  # two widths: the dynamic one is compiled now, not at a later step
                tables = [[0, 0] for _ in range(batch)]
                step = build_step([0] * batch, [context - 1] * batch, [1] * batch, tables, self.block_size,
                                  torch.device("cpu"))
                self.logits(step.input_ids, step.positions, step.meta)
        for cache in self.kv_caches:
            for pool in cache:
                pool[:1].zero_()
        return time.perf_counter() - started


def compile_count() -> int:
    """Frames torch.compile has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
