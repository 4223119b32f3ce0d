"""A runner's faster steps, where they were enabled: `FastSteps` holds them and says which one runs
a step; the runner (worker/runner.py) asks it once per step and runs eagerly when it declines.

The functions here enable them on a runner (on every tensor-parallel rank alike: parallel.py sends
them by reference) and measure what a decode step of several rows costs, which speculative decoding
weighs its guesses by.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from chatd.engine.attention import AttentionBackend, KVCache, StepInputs
from chatd.engine.models.matvec import ROWS_AS_REDUCTIONS
from chatd.engine.worker.fast_steps.compiled import CompiledDecode, step_cost
from chatd.engine.worker.fast_steps.compiled_prefill import CompiledPrefill
from chatd.engine.worker.fast_steps.cuda_graphs import DecodeGraphs
from chatd.engine.worker.forward_inputs import ForwardInputs


class FastSteps:
    """CUDA graphs for decode batches (a GPU), compiled decode and prefill steps (a CPU), and what a
    decode step of several rows costs; each gives the tokens the eager step gives."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graphs: DecodeGraphs | None = None  # enable_decode_graphs
        self.compiled: CompiledDecode | None = None  # enable_compiled_steps
        self.compiled_prefill: CompiledPrefill | None = None
        self.compiled_rows = ROWS_AS_REDUCTIONS  # decode steps of 1 to this many rows are compiled each for its size
        self.measure_steps = False  # compiled decode steps are timed at start (speculative decoding weighs guesses so)
        self.eager_step_seconds: dict[int, float] = {}  # measure_eager_steps

    def clear(self) -> None:
        """Forget the steps made over a KV pool that is gone."""
        self.graphs = self.compiled = self.compiled_prefill = None

    def logits(self, inputs: ForwardInputs) -> torch.Tensor | None:
        """A decode-only step's logits from its compiled step, [rows, vocab]; None where none applies."""
        if self.compiled is None or max(inputs.query_lens) != 1 or len(inputs.sampling) != len(inputs.starts):
            return None
        assert not inputs.pending, "compiled decode steps run on a CPU, where pending inputs are known"
        return self.compiled.logits(inputs.token_ids, inputs.starts, inputs.block_tables)

    def hidden(self, step: StepInputs, kv_caches: list[KVCache], backend: AttentionBackend) -> torch.Tensor | None:
        """A step's hidden states after the final norm, [T, hidden]: replayed from a CUDA graph, or
        through the compiled prefill (a step of its many tokens); None where neither applies."""
        meta = step.meta
        if self.graphs is not None and meta.max_query_len == 1 and self.graphs.padded_size(meta.num_seqs):
            return self.graphs.run(step)
        if self.compiled_prefill is not None and len(step.input_ids) >= self.compiled_prefill.min_tokens:
            return self.compiled_prefill.hidden(step, kv_caches, backend)
        return None

    def step_cost(self, rows: int) -> float:
        """What a decode step of `rows` rows costs against one of a single row (what speculative
        decoding weighs its guesses by): as measured where decode steps are compiled; on a GPU
        nearly flat (a step reads every weight once however many rows share it, up to the batches
        guessing is allowed at); in eager CPU steps a row each."""
        if self.compiled is not None and self.compiled.step_seconds:
            return self.compiled.step_cost(rows)
        if self.device.type == "cuda":
            return 1.0 + 0.02 * (rows - 1)
        if self.eager_step_seconds:
            return step_cost(self.eager_step_seconds, rows)
        return float(rows)


def enable_decode_graphs(runner, max_batch: int, capture: bool = True) -> float:
    """Replay a runner's decode-only steps of up to max_batch sequences from CUDA graphs; returns
    capture seconds. capture=False runs the same padded path eagerly (CPU tests of the padding)."""
    if not runner.backend.capturable():
        raise ValueError(f"attention backend {runner.backend.name} cannot run in CUDA graphs")
    graphs = DecodeGraphs(runner.model, runner.backend, runner.kv_caches, max_batch, runner.max_model_len,
                          runner.block_size, runner.device)
    seconds = graphs.capture() if capture else 0.0
    runner.fast.graphs = graphs
    return seconds


def enable_compiled_steps(runner, folder: Path | None = None) -> float:
    """Run a runner's decode-only steps (compiled.py) and steps of PREFILL_TOKENS or more
    (compiled_prefill.py) through torch.compile, keeping what is compiled in `folder` for later
    starts; returns the seconds compiling (or reading back) took."""
    fast = runner.fast
    decode = CompiledDecode(runner.model, runner.kv_caches, runner.block_size, runner.backend.k_scale,
                            runner.backend.v_scale, folder, measure=fast.measure_steps, max_rows=fast.compiled_rows)
    prefill = CompiledPrefill(runner.model, folder)
    seconds = decode.warm_up() + prefill.warm_up()
    fast.compiled, fast.compiled_prefill = decode, prefill
    return seconds


@torch.inference_mode()
def measure_eager_steps(runner, sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 8)) -> None:
    """Time a runner's eager decode steps of these many rows (on CPU, before serving: dummy rows
    writing the pool's last block, zeroed afterwards), for `step_cost` until compiled steps take over."""
    scratch = runner.num_blocks - 1
    for rows in sizes:
        inputs = ForwardInputs([0] * rows, [runner.block_size * 16 - 1] * rows, [1] * rows,
                               [[scratch] * 16] * rows, list(range(rows)))
        times = []
        for _ in range(3):
            started = time.perf_counter()
            runner.forward(inputs)
            times.append(time.perf_counter() - started)
        runner.fast.eager_step_seconds[rows] = sorted(times)[1]
    for cache in runner.kv_caches:
        for pool in cache:
            pool[scratch].zero_()
