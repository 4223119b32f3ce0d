"""The host KV tier's tensors and the copies between them and the device pool.

The block manager decides which blocks move (`KVCopy` records, in the order they must be made);
this module makes them. Blocks move as bytes, so any pool dtype moves (CPU torch has no fp8
`index_copy_`). Each run of copies in one direction crosses between host and device in one
transfer: the blocks of every layer's keys and values gathered into one tensor first.

On CUDA the copies run on a side stream, so a block written out travels to host RAM while the
step's forward runs: the forward waits only until the blocks leaving have been gathered on the
device and the blocks coming back have landed. A block written out lands in the host pool (a CPU
scatter) once its transfer is done, at a later call, or at once when a restore needs its slot.
On a CPU the same path runs with nothing in flight, so its bookkeeping is tested there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from chatd.engine.attention import KVCache
from chatd.engine.core.host_tier import KVCopy


@dataclass
class _WriteOut:
    """Blocks on their way to host slots: `staged` (per pool, per block, bytes) once `done`."""

    slots: torch.Tensor  # [blocks] host slots, on the host
    staged: torch.Tensor | None  # [pools, blocks, ...] uint8, host (pinned on CUDA); None: still on the device
    gathered: torch.Tensor | None  # the same on the device until its transfer is queued
    done: torch.cuda.Event | None  # the transfer's end (None: complete, as on a CPU)


class HostKVTier:
    """`num_host_blocks` blocks in host RAM laid out as the device pool (pinned beside a GPU)."""

    def __init__(self, device_pools: list[KVCache], num_host_blocks: int) -> None:
        k_cache = device_pools[0][0]
        self.device = k_cache.device
        self.is_cuda = k_cache.is_cuda
        shape = (num_host_blocks, *k_cache.shape[1:])
        # Empty, not zeros: a slot is always written before it is read, and untouched pages of a
        # large unpinned tier then cost no RAM until used.
        self.pools: list[KVCache] = [
            (torch.empty(shape, dtype=k_cache.dtype, pin_memory=self.is_cuda),
             torch.empty(shape, dtype=k_cache.dtype, pin_memory=self.is_cuda))
            for _ in device_pools
        ]
        self._host_bytes = [pool.view(torch.uint8) for kv in self.pools for pool in kv]
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._in_flight: list[_WriteOut] = []  # oldest first: a later write to a slot lands last

    @property
    def num_blocks(self) -> int:
        return self.pools[0][0].shape[0]

    @torch.inference_mode()
    def copy(self, copies: list[KVCopy], device_pools: list[KVCache]) -> None:
        """Make the copies in order. On return the device pool may be used by the next forward
        (on CUDA: by work queued on the current stream after this call)."""
        self._land(wait=False)
        device_bytes = [pool.view(torch.uint8) for kv in device_pools for pool in kv]
        if self._stream is None:
            self._copy_runs(copies, device_bytes)
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # the blocks leaving were written by forwards queued there
        with torch.cuda.stream(self._stream):
            self._copy_runs(copies, device_bytes)
            ready = torch.cuda.Event()
            ready.record(self._stream)
            # Gathered and restored: the forward may go on while the gathered blocks travel.
            for write in self._in_flight:
                if write.gathered is not None:
                    self._send(write)
        compute.wait_event(ready)

    def flush(self) -> None:
        """Land every block on its way to the host (waits for the transfers)."""
        self._land(wait=True)

    # -- internals ------------------------------------------------------------------------

    def _copy_runs(self, copies: list[KVCopy], device_bytes: list[torch.Tensor]) -> None:
        for to_host, run in itertools.groupby(copies, key=lambda c: c.to_host):
            # Within a run the source pool is not written, so only each destination's last copy counts.
            last = {(c.host_slot if to_host else c.device_block): c for c in run}
            blocks = torch.tensor([c.device_block for c in last.values()], device=self.device)
            slots = torch.tensor([c.host_slot for c in last.values()])
            if to_host:
                gathered = torch.stack([pool.index_select(0, blocks) for pool in device_bytes])
                self._in_flight.append(_WriteOut(slots, None, gathered, None))
                if self._stream is None:
                    self._send(self._in_flight[-1])
            else:
                self._land(wait=True, slots=set(slots.tolist()))
                staged = torch.stack([host.index_select(0, slots) for host in self._host_bytes])
                if self.is_cuda:
                    staged = staged.pin_memory()
                moved = staged.to(self.device, non_blocking=True)
                for pool, part in zip(device_bytes, moved):
                    pool.index_copy_(0, blocks, part)

    def _send(self, write: _WriteOut) -> None:
        """Queue a gathered write-out's transfer to the host (on CUDA, on the side stream)."""
        if self.is_cuda:
            write.staged = torch.empty(write.gathered.shape, dtype=torch.uint8, pin_memory=True)
            write.staged.copy_(write.gathered, non_blocking=True)
            write.done = torch.cuda.Event()
            write.done.record(self._stream)
        else:
            write.staged = write.gathered
        write.gathered = None

    def _land(self, wait: bool, slots: set[int] | None = None) -> None:
        """Scatter finished write-outs into the host pool, oldest first. `wait`: wait for those
        not finished yet; `slots`: only as far as the last write-out to one of these slots
        (a restore about to read them), including one still gathered on the device."""
        if slots is not None:
            hits = [i for i, w in enumerate(self._in_flight) if slots.intersection(w.slots.tolist())]
            if not hits:
                return
            upto = hits[-1] + 1
        else:
            upto = len(self._in_flight)
        landed = 0
        for write in self._in_flight[:upto]:
            if write.gathered is not None:  # a write-out of this very call: send it now
                self._send(write)
            if write.done is not None:
                if not wait and not write.done.query():
                    break
                write.done.synchronize()
            for host, part in zip(self._host_bytes, write.staged):
                host.index_copy_(0, write.slots, part)
            landed += 1
        del self._in_flight[:landed]


def allocate_host_kv(runner, num_host_blocks: int) -> None:
    """(Re)allocate a runner's host tier: `num_host_blocks` blocks laid out as its device pool, in
    host RAM (pinned when the pool is on a GPU, so copies are asynchronous DMA); 0: none."""
    runner.host_tier = HostKVTier(runner.kv_caches, num_host_blocks) if num_host_blocks else None
