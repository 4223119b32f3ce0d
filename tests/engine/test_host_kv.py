"""The host tier's copies (worker/host_kv.py) against copies made one by one, in order: whatever
the block manager queues — a slot written out and read back in one step, a block restored and
written out again, a slot written twice, write-outs still travelling when the next step's forward
writes the pool — the device pool and, once landed, the host pool hold what sequential copies give.
On a GPU the same checks run with the copies on their side stream."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatd.engine.core.host_tier import KVCopy
from chatd.engine.worker.host_kv import HostKVTier

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 2, 4, 2, 3
NUM_BLOCKS, NUM_HOST_BLOCKS = 6, 5

copy_records = st.builds(KVCopy, st.booleans(), st.integers(0, NUM_BLOCKS - 1), st.integers(0, NUM_HOST_BLOCKS - 1))
steps = st.lists(st.tuples(st.lists(copy_records, max_size=8), st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=3)),
                 min_size=1, max_size=8)


def random_pools(num_blocks: int, dtype: torch.dtype, device: str, generator: torch.Generator) -> list:
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return [tuple(torch.randn(shape, generator=generator).to(dtype).to(device) for _ in range(2)) for _ in range(NUM_LAYERS)]


def check_copies_match_sequential_ones(step_list, dtype: torch.dtype, device: str) -> None:
    generator = torch.Generator().manual_seed(0)
    device_pools = random_pools(NUM_BLOCKS, dtype, device, generator)
    reference_device = [tuple(t.cpu().clone() for t in kv) for kv in device_pools]
    reference_host = [tuple(torch.zeros_like(t) for t in kv) for kv in reference_device]
    tier = HostKVTier(device_pools, NUM_HOST_BLOCKS)
    written: set[int] = set()
    for copies, forward_writes in step_list:
        for c in copies:  # the reference: one block at a time, in order, as bytes
            for ref_dev, ref_host in zip(reference_device, reference_host):
                for dev, host in zip(ref_dev, ref_host):
                    if c.to_host:
                        host.view(torch.uint8)[c.host_slot] = dev.view(torch.uint8)[c.device_block]
                    else:
                        dev.view(torch.uint8)[c.device_block] = host.view(torch.uint8)[c.host_slot]
            written |= {c.host_slot} if c.to_host else set()
        tier.copy(copies, device_pools)
        for kv, ref_kv in zip(device_pools, reference_device):
            for pool, ref in zip(kv, ref_kv):
                assert torch.equal(pool.cpu().view(torch.uint8), ref.view(torch.uint8))
        # The step's forward overwrites some blocks, maybe ones whose old contents are still travelling.
        for block in forward_writes:
            for kv, ref_kv in zip(device_pools, reference_device):
                for pool, ref in zip(kv, ref_kv):
                    fresh = torch.randn(pool.shape[1:], generator=generator).to(dtype)
                    pool[block] = fresh.to(device)
                    ref[block] = fresh
    tier.flush()
    for kv, ref_kv in zip(tier.pools, reference_host):
        for pool, ref in zip(kv, ref_kv):
            for slot in written:
                assert torch.equal(pool[slot].view(torch.uint8), ref[slot].view(torch.uint8)), f"host slot {slot}"


def filter_reads(step_list):
    """Drop restores of slots never written out before them (the block manager never queues one)."""
    written: set[int] = set()
    kept = []
    for copies, forward_writes in step_list:
        ok = []
        for c in copies:
            if c.to_host:
                written.add(c.host_slot)
                ok.append(c)
            elif c.host_slot in written:
                ok.append(c)
        kept.append((ok, forward_writes))
    return kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_list=steps)
def test_copies_leave_both_pools_as_sequential_copies_would(dtype, step_list):
    check_copies_match_sequential_ones(filter_reads(step_list), dtype, "cpu")


def test_a_slot_written_out_and_read_back_in_one_step_gives_the_block_back():
    step_list = [([KVCopy(True, 1, 0), KVCopy(False, 2, 0), KVCopy(True, 2, 0), KVCopy(False, 1, 0)], [1, 2])]
    check_copies_match_sequential_ones(step_list, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_list=steps)
def test_copies_on_the_side_stream_leave_both_pools_as_sequential_copies_would(dtype, step_list):
    check_copies_match_sequential_ones(filter_reads(step_list), dtype, "cuda")
