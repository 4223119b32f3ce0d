"""ModelRunner: owns the KV tensors, turns a scheduled step into one flat forward, samples.

The only engine module besides the model, attention and sampler that touches torch. A step's
sequences (one-token decodes first, then prefill chunks) are concatenated into one batch of
tokens with per-token positions and cache slots; logits are computed only for the last token
of each sequence that samples this step.

On a GPU the step is kept lean: its inputs go to the device in one copy, the sampled ids come
back in one (the step's only wait for the GPU), and decode-only steps replay CUDA graphs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from chatd.engine.attention import AttentionBackend, KVCache, StepInputs, build_step
from chatd.engine.core.host_tier import KVCopy
from chatd.engine.core.scheduler import ScheduledSequence
from chatd.engine.core.sequence import Sequence
from chatd.engine.core.stage_times import StageTimes
from chatd.engine.models.matvec import ROWS_AS_REDUCTIONS
from chatd.engine.worker.fast_steps.compiled import CompiledDecode, step_cost
from chatd.engine.worker.fast_steps.compiled_prefill import CompiledPrefill
from chatd.engine.worker.fast_steps.cuda_graphs import DecodeGraphs
from chatd.engine.worker.forward_inputs import ForwardInputs, StepHandle, fill_pending, forward_inputs
from chatd.engine.worker.host_kv import HostKVTier
from chatd.engine.worker.kv_memory import profile_kv_blocks
from chatd.engine.worker.prompt_logprobs import prompt_logprobs
from chatd.engine.worker.sampler import SampledTokens, Sampler
from chatd.engine.worker.sampling_rows import SamplingRows

log = logging.getLogger("chatd.engine")



class ModelRunner:
    """Runs the model over the paged KV cache for one scheduled step at a time."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        eos_token_ids: frozenset[int] = frozenset(),
        seed: int = 0,
        max_model_len: int = 0,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the KV pool's: the model's dtype, or fp8 (cache.kv_cache_dtype)
        self.max_model_len = max_model_len
        self.sampler = Sampler()
        self.rows = SamplingRows(eos_token_ids, device, seed)  # each sequence's sampling row and RNG
        # The last forward's prompt logprobs (forward_inputs.py's StepHandle.prompt_logprobs), for its launch to take.
        self.prompt_logprobs: dict[int, tuple[int, list]] = {}
        self.kv_caches: list[KVCache] = []
        self.host_tier: HostKVTier | None = None  # allocate_host_kv
        self.graphs: DecodeGraphs | None = None
        self.compiled: CompiledDecode | None = None  # enable_compiled_steps
        self.compiled_prefill: CompiledPrefill | None = None
        self.times = StageTimes()  # inputs, forward, sample (the engine times the rest)
        self.eager_step_seconds: dict[int, float] = {}  # measure_eager_steps
        self.measure_steps = False  # compiled decode steps are timed at start (speculative decoding weighs guesses so)
        self.compiled_rows = ROWS_AS_REDUCTIONS  # decode steps of 1 to this many rows are compiled each for its size
        self.allocate_kv(num_blocks)

    def allocate_kv(self, num_blocks: int) -> None:
        """(Re)allocate the KV pool: per layer, keys and values of `num_blocks` blocks."""
        self.kv_caches = []  # the old pool is freed before the new one is made
        shape = (num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        # Zeros, not empty: padded reads of never-written slots must not meet NaN garbage.
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=self.device), torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            for _ in range(self.model.num_layers)
        ]
        self.graphs = None
        self.compiled = self.compiled_prefill = None

    def allocate_host_kv(self, num_host_blocks: int) -> None:
        """(Re)allocate the host tier: `num_host_blocks` blocks laid out as the device pool's, in
        host RAM (pinned when the pool is on a GPU, so copies are asynchronous DMA); 0: none."""
        self.host_tier = HostKVTier(self.kv_caches, num_host_blocks) if num_host_blocks else None

    def copy_kv(self, copies: list[KVCopy]) -> None:
        """Make the scheduler's copies between the device pool and the host tier, in order."""
        self.host_tier.copy(copies, self.kv_caches)

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0][0].shape[0] if self.kv_caches else 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's keys and values take across all layers of this rank's pool (0 for none)."""
        if not self.kv_caches:
            return 0
        k_cache = self.kv_caches[0][0]  # [blocks, block_size, kv_heads, head_dim]
        return 2 * len(self.kv_caches) * k_cache[0, 0].numel() * k_cache.element_size()

    def enable_decode_graphs(self, max_batch: int, capture: bool = True) -> float:
        """Replay decode-only steps of up to max_batch sequences from CUDA graphs; returns capture seconds.

        capture=False runs the same padded path eagerly (CPU tests of the padding).
        """
        if not self.backend.capturable():
            raise ValueError(f"attention backend {self.backend.name} cannot run in CUDA graphs")
        graphs = DecodeGraphs(
            self.model, self.backend, self.kv_caches, max_batch, self.max_model_len, self.block_size, self.device
        )
        seconds = graphs.capture() if capture else 0.0
        self.graphs = graphs
        return seconds

    def enable_compiled_steps(self, folder: Path | None = None) -> float:
        """Run decode-only steps (fast_steps/compiled.py) and steps of PREFILL_TOKENS or more
        (fast_steps/compiled_prefill.py) through torch.compile, keeping what is compiled in `folder`
        for later starts; returns the seconds compiling (or reading back) took."""
        decode = CompiledDecode(self.model, self.kv_caches, self.block_size, self.backend.k_scale, self.backend.v_scale,
                                folder, measure=self.measure_steps, max_rows=self.compiled_rows)
        prefill = CompiledPrefill(self.model, folder)
        seconds = decode.warm_up() + prefill.warm_up()
        self.compiled, self.compiled_prefill = decode, prefill
        return seconds

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

    @torch.inference_mode()
    def measure_eager_steps(self, sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 8)) -> None:
        """Time eager decode steps of these many rows (on CPU, before serving: dummy rows writing
        the pool's last block, zeroed afterwards), for `step_cost` until compiled steps take over."""
        scratch = self.num_blocks - 1
        for rows in sizes:
            inputs = ForwardInputs([0] * rows, [self.block_size * 16 - 1] * rows, [1] * rows,
                                   [[scratch] * 16] * rows, list(range(rows)))
            times = []
            for _ in range(3):
                started = time.perf_counter()
                self.forward(inputs)
                times.append(time.perf_counter() - started)
            self.eager_step_seconds[rows] = sorted(times)[1]
        for cache in self.kv_caches:
            for pool in cache:
                pool[scratch].zero_()

    # Each step's next one may be launched before it is waited for (engine.py's async scheduling).
    supports_async_scheduling = True

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSequence], previous: StepHandle | None = None) -> StepHandle:
        """Start one step: on a GPU, queue its work and return without waiting for the device.
        `previous` is the step still in flight, if any, whose draws some of these inputs are:
        they go from its draws to this step's inputs on the device."""
        times, started = self.times, time.perf_counter()
        inputs = forward_inputs(scheduled, previous)
        draws = None
        if inputs.pending:
            draws = previous.token_ids
            if draws.device.type == "cpu":  # known already: a CPU step has run by the time it returns
                inputs, draws = fill_pending(inputs, draws.tolist()), None
        started = times.since("inputs", started)
        inputs_before = times.seconds["inputs"]
        logits = self.forward(inputs, draws)  # it counts the inputs it builds (build_step) as inputs
        now = time.perf_counter()
        times.add("forward", now - started - (times.seconds["inputs"] - inputs_before))
        started = now
        sampled = self.sample(logits, scheduled)
        times.since("sample", started)
        handle = StepHandle(scheduled, sampled)
        handle.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, {}
        return handle

    @torch.inference_mode()
    def forward(self, inputs: ForwardInputs, draws: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's forward, and the logits of the rows that sample ([rows, vocab]; None when no
        row samples, or on a tensor-parallel rank other than 0, which only takes part). `draws`:
        the previous step's draws on the device, where `inputs.pending` are still to be filled in."""
        if inputs.pending and draws is None:
            raise ValueError("a step with pending inputs needs the draws they come from")
        if self.compiled is not None and max(inputs.query_lens) == 1 and len(inputs.sampling) == len(inputs.starts):
            assert not inputs.pending, "compiled decode steps run on a CPU, where pending inputs are known"
            return self.compiled.logits(inputs.token_ids, inputs.starts, inputs.block_tables)
        started = time.perf_counter()
        step = build_step(inputs.token_ids, inputs.starts, inputs.query_lens, inputs.block_tables, self.block_size,
                          self.device)
        if inputs.pending:  # fed on the device from the step before, which may still be running there
            index, rows = zip(*inputs.pending)
            step.input_ids[torch.tensor(index, device=self.device)] = draws[torch.tensor(rows, device=self.device)]
        self.times.since("inputs", started)  # and the forward's own time less this, by launch
        meta = step.meta
        hidden = self.hidden(step)
        if inputs.prompt_rows:
            self.prompt_logprobs = prompt_logprobs(self.model, hidden, inputs.prompt_rows)
        if not inputs.sampling:
            return None
        last_token = [meta.query_starts_cpu[i + 1] - 1 for i in inputs.sampling]
        if last_token != list(range(len(hidden))):
            hidden = hidden[torch.tensor(last_token, device=self.device)]
        return self.model.compute_logits(hidden)  # [num_sampling, vocab]

    def hidden(self, step: StepInputs) -> torch.Tensor:
        """The model's hidden states after the final norm, [T, hidden], of a step: replayed from a CUDA
        graph, through the compiled prefill (a step of its many tokens), or eagerly."""
        meta = step.meta
        if self.graphs is not None and meta.max_query_len == 1 and self.graphs.padded_size(meta.num_seqs):
            return self.graphs.run(step)
        if self.compiled_prefill is not None and len(step.input_ids) >= self.compiled_prefill.min_tokens:
            return self.compiled_prefill.hidden(step, self.kv_caches, self.backend)
        return self.model(step.input_ids, step.positions, self.kv_caches, meta, self.backend)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor | None, scheduled: list[ScheduledSequence]) -> SampledTokens | None:
        """Launch the draws of the rows of `logits` (one per sample of each scheduled sequence
        that samples, in order); None without logits."""
        if logits is None:
            return None
        return self.sampler.launch(logits, self.rows.of(scheduled))

    def profile_kv_blocks(self, num_tokens: int, num_seqs: int, utilization: float, block_bytes: int) -> int:
        """On CUDA: how many KV blocks fit beside the largest step's peak (kv_memory.py)."""
        return profile_kv_blocks(self, num_tokens, num_seqs, utilization, block_bytes)

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence's RNG."""
        self.rows.release(seq)

    def keep_draws(self, kept: list[tuple[Sequence, range]]) -> None:
        """After a verify step: each sampling sequence's RNG as if it had drawn only for the tokens it kept."""
        self.rows.keep_draws(kept)
