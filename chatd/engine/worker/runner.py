"""ModelRunner: owns the KV tensors, turns a scheduled step into one flat forward, samples.

The only engine module besides the model, attention and sampler that touches torch. A step's
sequences (one-token decodes first, then prefill chunks) are one batch of tokens with per-token
positions and cache slots; logits are computed only for the last token of each sequence that
samples. On a GPU a step's inputs go to the device in one copy and its draws come back in one (its
only wait). Faster steps where enabled (CUDA graphs, compiled steps) are fast_steps/'s.
"""

from __future__ import annotations

import time

import torch

from chatd.engine.attention import AttentionBackend, KVCache, build_step
from chatd.engine.core.host_tier import KVCopy
from chatd.engine.core.scheduler import ScheduledSequence
from chatd.engine.core.sequence import Sequence
from chatd.engine.core.stage_times import StageTimes
from chatd.engine.worker.fast_steps.fast_steps import FastSteps
from chatd.engine.worker.forward_inputs import ForwardInputs, StepHandle, fill_pending, forward_inputs
from chatd.engine.worker.host_kv import HostKVTier
from chatd.engine.worker.prompt_logprobs import prompt_logprobs
from chatd.engine.worker.sampler import SampledTokens, Sampler
from chatd.engine.worker.sampling_rows import SamplingRows


class ModelRunner:
    """Runs the model over the paged KV cache for one scheduled step at a time."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, eos_token_ids: frozenset[int] = frozenset(), seed: int = 0,
                 max_model_len: int = 0, kv_dtype: torch.dtype | None = None) -> None:
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
        self.host_tier: HostKVTier | None = None  # host_kv.py's allocate_host_kv
        self.fast = FastSteps(device)  # CUDA graphs, compiled steps: fast_steps/fast_steps.py
        self.times = StageTimes()  # inputs, forward, sample (the engine times the rest)
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
        self.fast.clear()

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

    # Each step's next one may be launched before it is waited for (engine.py's async scheduling).
    supports_async_scheduling = True

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSequence], previous: StepHandle | None = None) -> StepHandle:
        """Start one step: on a GPU, queue its work and return without waiting for the device. `previous`:
        the step still in flight, if any, whose draws some of these inputs are (they stay on the device)."""
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
        if (logits := self.fast.logits(inputs)) is not None:
            return logits
        started = time.perf_counter()
        step = build_step(inputs.token_ids, inputs.starts, inputs.query_lens, inputs.block_tables, self.block_size,
                          self.device)
        if inputs.pending:  # fed on the device from the step before, which may still be running there
            index, rows = zip(*inputs.pending)
            step.input_ids[torch.tensor(index, device=self.device)] = draws[torch.tensor(rows, device=self.device)]
        self.times.since("inputs", started)  # and the forward's own time less this, by launch
        hidden = self.fast.hidden(step, self.kv_caches, self.backend)  # a CUDA graph, a compiled prefill
        if hidden is None:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta, self.backend)
        if inputs.prompt_rows:
            self.prompt_logprobs = prompt_logprobs(self.model, hidden, inputs.prompt_rows)
        if not inputs.sampling:
            return None
        last_token = [step.meta.query_starts_cpu[i + 1] - 1 for i in inputs.sampling]
        if last_token != list(range(len(hidden))):
            hidden = hidden[torch.tensor(last_token, device=self.device)]
        return self.model.compute_logits(hidden)  # [num_sampling, vocab]

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor | None, scheduled: list[ScheduledSequence]) -> SampledTokens | None:
        """Launch the draws of the rows of `logits` (one per sample of each scheduled sequence
        that samples, in order); None without logits."""
        if logits is None:
            return None
        return self.sampler.launch(logits, self.rows.of(scheduled))

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence's RNG."""
        self.rows.release(seq)

    def keep_draws(self, kept: list[tuple[Sequence, range]]) -> None:
        """After a verify step: each sampling sequence's RNG as if it had drawn only for the tokens it kept."""
        self.rows.verify.keep_draws(kept)
