"""Large prefill steps on CPU through torch.compile: the work of each layer around its attention.

A prefill step of a thousand tokens spends its time in the projections' matmuls (for quantized
weights, bfloat16 matmuls of weights unpacked for the step, near this CPU's rate) and in what
lies between them: the norms, rope, the SwiGLU, the residual adds, each quantized layer's
conversions of its input to bfloat16 and of its output back, and an int4 weight's unpacking.
Eagerly each of those is its own pass over [tokens, features] of memory, several for one unpack:
on SmolLM2-135M's Q4_1 file (2-core EPYC, 980 tokens) they were a third of the step, beside half
in matmuls and a sixth in attention. Compiled, inductor fuses them into a few loops per layer.

What is compiled is each decoder layer's two halves around attention, `before_attention` (norm,
q/k/v projection, rope) and `after_attention` (output projection, residual, norm, MLP, residual),
each once for all the layers of one structure (their weights are its inputs; layers of another
structure, a GGUF file's mix of quant types, get their own). Attention runs eagerly between them:
the KV write and the backend's per-sequence kernels are already as fast as they get, and a
varlen batch's Python loop is no graph. The embedding, the final norm and the LM head (which
sees only the rows that sample) stay eager too.

The token count is dynamic from PREFILL_TOKENS up, so one compiled half serves every step that
large, prefill chunks alone or mixed with decode rows; a smaller step runs eagerly. Knowing its
tokens are that many, the graph takes the quantized layers' many-rows path (quant.py `has_rows`).
Like the decode steps (compiled.py), each half is compiled ahead of time, called without guards,
and saved under CHATD_HOME for a later start to read back.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from chatd.engine.attention import AttentionBackend, KVCache, StepInputs
from chatd.engine.models.quantized.quant import INT4_UNPACKED_ROWS
from chatd.engine.worker.fast_steps.compiled import code_digest, described, ready_compiled

# Steps of this many tokens or more run compiled: as many as an int4 layer needs to take its
# unpacked path (quant.py), where the unpacking itself gains most from being fused.
PREFILL_TOKENS = INT4_UNPACKED_ROWS
MAX_TOKENS = 1 << 24  # a bound for the compiler (it takes no open range): far past any step's budget


def _before_attention(layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return layer.before_attention(x, cos, sin)


def _after_attention(layer: nn.Module, x: Tensor, attended: Tensor) -> Tensor:
    return layer.after_attention(x, attended)


class CompiledPrefill:
    """A model's large steps with each layer's halves around attention compiled: `hidden(step, ...)`."""

    min_tokens = PREFILL_TOKENS  # the steps it takes: this many tokens or more

    def __init__(self, model: nn.Module, folder: Path | None = None) -> None:
        self.model = model
        self.folder = folder
        # Layers of one structure share their compiled halves: structure key -> (before, after).
        code = code_digest()
        self.keys = [_layer_key(layer, code.copy()) for layer in model.layers]
        self.halves: dict[str, tuple[Callable[..., tuple[Tensor, Tensor, Tensor]], Callable[..., Tensor]]] = {}
        self.read_back = 0  # halves warm_up read from `folder` rather than compiled

    def hidden(self, step: StepInputs, kv_caches: list[KVCache], backend: AttentionBackend) -> Tensor:
        """The model's hidden states after the final norm, [T, hidden], for a step of PREFILL_TOKENS or more."""
        model = self.model
        x, cos, sin = model.embed(step.input_ids, step.positions)
        cos, sin = cos.contiguous(), sin.contiguous()  # halves of one tensor; the compiled halves took them apart
        for layer, key, kv_cache in zip(model.layers, self.keys, kv_caches, strict=True):
            before, after = self.halves[key]
            q, k, v = before(layer, x, cos, sin)
            attended = layer.self_attn.attend(q, k, v, kv_cache, step.meta, backend)
            x = after(layer, x, attended.contiguous())  # as compiled: contiguous (guards are not checked per call)
        return model.norm(x)

    @torch.inference_mode()  # as the runner's steps run: inference tensors are a guard
    def warm_up(self) -> float:
        """Compile (or read back) each structure's halves and run them on dummy inputs; returns the seconds it took."""
        started = time.perf_counter()
        for layer, key in zip(self.model.layers, self.keys, strict=True):
            if key not in self.halves:
                self.halves[key] = (self._ready(_before_attention, "before", key, self._before_examples(layer)),
                                    self._ready(_after_attention, "after", key, self._after_examples(layer)))
        return time.perf_counter() - started

    def _ready(self, function: Callable, half: str, key: str, examples: list[tuple]) -> Callable:
        """`function` read back or compiled for dynamic token counts from PREFILL_TOKENS, its guards
        checked on the examples (two token counts), then run on them."""
        path = self.folder / f"prefill-{key}-{half}.bin" if self.folder is not None else None
        compiled, read_back = ready_compiled(function, lambda: _marked(examples[0]), examples, path,
                                             f"prefill ({half} attention)")
        self.read_back += read_back
        return compiled

    def _inputs(self, tokens: int) -> tuple[Tensor, Tensor, Tensor]:
        """A step's x, cos, sin for `tokens` tokens, as `hidden` hands them to the first layer."""
        x, cos, sin = self.model.embed(torch.zeros(tokens, dtype=torch.long), torch.arange(tokens))
        return x, cos.contiguous(), sin.contiguous()

    def _before_examples(self, layer: nn.Module) -> list[tuple]:
        return [(layer, *self._inputs(tokens)) for tokens in (PREFILL_TOKENS, PREFILL_TOKENS + 37)]

    def _after_examples(self, layer: nn.Module) -> list[tuple]:
        attention = layer.self_attn
        examples = []
        for tokens in (PREFILL_TOKENS, PREFILL_TOKENS + 37):
            x = self._inputs(tokens)[0]
            examples.append((layer, x, torch.zeros(tokens, attention.num_heads, attention.head_dim, dtype=x.dtype)))
        return examples


def _marked(example: tuple) -> tuple:
    """A half's arguments with their token dimension marked dynamic from PREFILL_TOKENS, for the compiler."""
    layer, *tensors = example
    tensors = [tensor.clone() for tensor in tensors]  # the examples themselves stay unmarked, as real steps are
    for tensor in tensors:
        torch._dynamo.mark_dynamic(tensor, 0, min=PREFILL_TOKENS, max=MAX_TOKENS)
    return (layer, *tensors)


def _layer_key(layer: nn.Module, digest: hashlib._Hash) -> str:
    """Names a layer's compiled halves, here and on disk: what they depend on and their guards do not
    check. That is the engine's code and torch (`digest`, begun by code_digest), the settings of the
    layer's modules, and the shapes and dtypes of its weights."""
    for name, module in layer.named_modules():
        digest.update(f"{name}={described(module)};".encode())
    for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype};".encode())
    return digest.hexdigest()[:20]
