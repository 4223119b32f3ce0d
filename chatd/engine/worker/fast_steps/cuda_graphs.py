"""Decode steps replayed from CUDA graphs: one captured graph per padded batch size.

A decode-only step launches a few hundred small kernels whose CPU launch cost can exceed their
GPU time at small batches. At start the runner captures the whole model forward (embedding to
final norm) for batch sizes 1, 2, 4, 8, 16, 24, ... up to a configured maximum, all graphs
sharing one memory pool (captured largest first, so the smaller ones fit in its blocks). A
decode-only step of B sequences copies its inputs into static buffers, pads to the next
captured size, and replays. Padding rows have no queries, a context of 0 and slot -1, so they
write no KV and attend to nothing; their outputs are dropped. Logits and sampling run eagerly
(their work depends on each request's settings).

With `capture=False` the same static-buffer, padded path runs eagerly: that is how CPU tests
check the padding without a GPU.
"""

from __future__ import annotations

import time

import torch

from chatd.engine.attention import AttentionBackend, AttentionMetadata, KVCache, StepInputs


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Padded sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch + 1, 16))
    if not sizes or sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Static input buffers, and per padded batch size a captured forward (or, uncaptured, the eager one)."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_caches: list[KVCache],
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        zeros = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = zeros(self.max_batch, dtype=torch.long)
        self.positions = zeros(self.max_batch, dtype=torch.long)
        self.slot_mapping = zeros(self.max_batch, dtype=torch.long)
        self.seq_lens = zeros(self.max_batch, dtype=torch.int32)
        self.query_start_loc = zeros(self.max_batch + 1, dtype=torch.int32)
        self.block_tables = zeros(self.max_batch, max_blocks, dtype=torch.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # padded size -> the graph's hidden-state output

    def _metadata(self, size: int) -> AttentionMetadata:
        # Host fields describe the padded shape only; graph-capable backends read the device tensors.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_starts_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,
            block_tables_cpu=torch.zeros(size, 1, dtype=torch.int32),
            num_decodes=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, size: int) -> torch.Tensor:
        meta = self._metadata(size)
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta, self.backend)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first, into one shared pool; returns the seconds it took."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Inputs of the capture runs: one token per row, contexts of one token, no KV written.
        self.query_start_loc.copy_(torch.arange(self.max_batch + 1, dtype=torch.int32))
        self.seq_lens.fill_(1)
        self.slot_mapping.fill_(-1)
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up outside the graph: autotuning, lazy inits
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        return time.perf_counter() - started

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs rows, None when the batch is too large."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def run(self, step: StepInputs) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only step, from the padded graph (or eager padded forward)."""
        meta = step.meta
        num_seqs = meta.num_seqs
        size = self.padded_size(num_seqs)
        assert size is not None and meta.max_query_len == 1, "only decode-only steps that fit run from graphs"
        self.input_ids[:num_seqs].copy_(step.input_ids)
        self.positions[:num_seqs].copy_(step.positions)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.slot_mapping[num_seqs:size].fill_(-1)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.seq_lens[num_seqs:size].fill_(0)
        self.query_start_loc[: num_seqs + 1].copy_(meta.query_start_loc)
        self.query_start_loc[num_seqs + 1 : size + 1].fill_(num_seqs)  # padding rows: no queries
        width = meta.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        graph = self.graphs.get(size)
        if graph is None:  # not captured: the same padded computation, eagerly
            return self._forward(size)[:num_seqs]
        graph.replay()
        return self.outputs[size][:num_seqs]
