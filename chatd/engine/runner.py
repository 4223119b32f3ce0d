"""ModelRunner: owns the KV tensors, turns a scheduled step into one flat forward, samples.

The only engine module besides the model, attention and sampler that touches torch. A step's
sequences (one-token decodes first, then prefill chunks) are concatenated into one batch of
tokens with per-token positions and cache slots; logits are computed only for the last token
of each sequence that samples this step.
"""

from __future__ import annotations

import torch

from chatd.engine.attention import AttentionBackend, AttentionMetadata, KVCache, build_metadata
from chatd.engine.sampler import Sampler, SamplerOutput, SamplingRow
from chatd.engine.scheduler import ScheduledSequence
from chatd.engine.sequence import Sequence


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (keys and values)."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


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
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> its own RNG
        self._seed_source = torch.Generator().manual_seed(seed)  # seeds requests that bring none
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        # Zeros, not empty: padded reads of never-written slots must not meet NaN garbage.
        self.kv_caches: list[KVCache] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> SamplerOutput:
        """Run one step; return the sampled token of each scheduled sequence whose chunk reached its end."""
        input_ids, positions, meta = self._prepare(scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)  # [T, hidden]
        sampling = [i for i, s in enumerate(scheduled) if s.samples]
        if not sampling:
            return SamplerOutput(token_ids=[], logprobs=[])
        last_token = meta.query_start_loc[1:][sampling].long() - 1
        logits = self.model.compute_logits(hidden[last_token])  # [num_sampling, vocab]
        rows = [self._sampling_row(scheduled[i].seq) for i in sampling]
        return self.sampler(logits, rows)

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence's RNG."""
        self.generators.pop(seq.seq_id, None)

    def _prepare(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        token_ids: list[int] = []
        for s in scheduled:
            start = s.seq.num_computed_tokens
            token_ids.extend(s.seq.token_ids[start : start + s.num_new_tokens])
        positions, meta = build_metadata(
            starts=[s.seq.num_computed_tokens for s in scheduled],
            query_lens=[s.num_new_tokens for s in scheduled],
            block_tables=[s.seq.block_table for s in scheduled],
            block_size=self.block_size,
            device=self.device,
            dtype=self.dtype,
        )
        return torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True), positions, meta

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < params.min_tokens:
            banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(self.eos_token_ids))
        return SamplingRow(
            params=params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=None if params.greedy else self._generator(seq),
            banned_token_ids=banned,
        )

    def _generator(self, seq: Sequence) -> torch.Generator:
        generator = self.generators.get(seq.seq_id)
        if generator is None:
            seed = seq.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (), generator=self._seed_source))
            # Each choice of a request gets its own stream, derived from the request's seed.
            seed = (seed + seq.index * 0x9E3779B97F4A7C15) % 2**63
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[seq.seq_id] = generator
        return generator
