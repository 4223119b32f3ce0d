"""The host KV tier: blocks evicted from the device pool are kept in host RAM by their prefix
name and copied back on a later hit, so sessions beyond the device pool are restored, not
recomputed, and produce exactly the tokens they would have produced never evicted."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatd.engine.core.block_manager import BlockManager
from chatd.engine.core.host_tier import KVCopy
from chatd.engine.core.sequence import Sequence
from chatd.engine.params import SamplingParams
from tests.engine.conftest import make_llm
from tests.factories import make_seq
from tests.engine.invariants import check_invariants

BS = 4


class Pools:
    """What the runner's tensors would hold, one "content" per block: the name of the block
    whose keys and values it holds (None: garbage). Copies move contents as the runner would."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.device: list[bytes | None] = [None] * bm.num_blocks
        self.host: list[bytes | None] = [None] * bm.host.num_blocks

    def copy(self, copies: list[KVCopy]) -> None:
        for c in copies:
            if c.to_host:
                self.host[c.host_slot] = self.device[c.device_block]
            else:
                self.device[c.device_block] = self.host[c.host_slot]

    def admit(self, seq: Sequence) -> int:
        """Allocate as the scheduler does, make the copies, check every cached block holds what
        its name says, then compute the rest. Returns how many blocks came from the host."""
        before = self.bm.host.num_blocks_from_host
        self.bm.allocate(seq)
        assert self.bm.allocate_slots(seq, seq.num_uncomputed_tokens)
        self.copy(self.bm.host.take_copies())
        for i in range(seq.num_computed_tokens // BS):  # cached: on the device, or restored just now
            assert self.device[seq.block_table[i]] == seq.block_hashes[i]
        seq.num_computed_tokens = seq.num_tokens
        self.bm.cache_blocks(seq)
        for i, name in enumerate(seq.block_hashes):  # the forward writes the rest
            self.device[seq.block_table[i]] = name
        return self.bm.host.num_blocks_from_host - before

    def check(self, live: list[Sequence]) -> None:
        check_invariants(self.bm, live)
        for name, block in self.bm.cached_blocks.items():
            assert self.device[block] == name, "a findable device block holds other contents"
        for name, slot in self.bm.host.slots.items():
            assert self.host[slot] == name, "a host slot holds other contents than its name says"


def session_prompt(session: int, turns: int) -> list[int]:
    """A conversation's prompt after `turns` turns: each turn adds 6 tokens to the same history."""
    return [1000 * session + t for t in range(6 * turns)]


def test_a_session_evicted_from_the_device_comes_back_from_the_host():
    bm = BlockManager(8, BS, num_host_blocks=16)
    pools = Pools(bm)
    first = make_seq(tokens=session_prompt(1, 2))  # 12 tokens: 3 blocks
    assert pools.admit(first) == 0
    bm.free(first)
    crowd = make_seq(tokens=session_prompt(2, 5))  # 30 tokens: 8 blocks, the whole pool
    assert pools.admit(crowd) == 0
    assert bm.host.num_blocks_to_host == 3 and not bm.cached_blocks.keys() & set(first.block_hashes)
    bm.free(crowd)

    again = make_seq(tokens=session_prompt(1, 3))  # the next turn of the first session
    assert pools.admit(again) == 3  # its history, copied back instead of recomputed
    assert again.num_cached_tokens == 12 and bm.host.num_hits == 12
    pools.check([again])


def test_the_host_tier_lets_its_least_recently_used_blocks_go_first():
    bm = BlockManager(2, BS, num_host_blocks=3)
    pools = Pools(bm)
    names = {}
    for session in "ABCD":  # one full block each (and a partial one): each pushes the one before to the host
        seq = make_seq(tokens=[ord(session)] * 5)
        pools.admit(seq)
        names[session] = seq.block_hashes[0]
        bm.free(seq)
    assert list(bm.host.slots) == [names["A"], names["B"], names["C"]]
    again = make_seq(tokens=[ord("A")] * 5)
    assert pools.admit(again) == 1  # A is used again; D goes out, and B, now the least recently used, goes
    assert list(bm.host.slots) == [names["C"], names["A"], names["D"]]
    bm.free(again)
    pools.check([])


def test_another_tenant_never_finds_a_tenants_blocks_on_the_host():
    bm = BlockManager(4, BS, num_host_blocks=16)
    pools = Pools(bm)
    alice = make_seq(tokens=session_prompt(1, 2), salt="alice")
    pools.admit(alice)
    bm.free(alice)
    filler = make_seq(tokens=range(50000, 50016), salt="alice")
    pools.admit(filler)  # pushes alice's history to the host
    assert bm.host.num_blocks_to_host == 3
    bm.free(filler)

    bob = make_seq(tokens=session_prompt(1, 3), salt="bob")  # the same tokens, another tenant
    bm.allocate(bob)
    assert bob.num_cached_tokens == 0 and bm.host.num_hits == 0
    bm.free(bob)
    alice_again = make_seq(tokens=session_prompt(1, 3), salt="alice")
    bm.allocate(alice_again)
    assert alice_again.num_cached_tokens == 12


def test_a_host_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(4, BS, enable_prefix_caching=False, num_host_blocks=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(4, 12),
    num_host_blocks=st.integers(1, 10),
    steps=st.lists(st.tuples(st.sampled_from(["turn", "free", "tenant"]), st.integers(0, 5), st.integers(1, 4)),
                   max_size=50),
)
def test_random_sessions_keep_every_cached_block_true_to_its_name(num_blocks, num_host_blocks, steps):
    """Under any mix of sessions, turns and frees: every block findable on the device or the host
    holds the contents its name says, every restored block holds what was computed, host slots
    are never lost or shared, and nothing leaks."""
    bm = BlockManager(num_blocks, BS, num_host_blocks=num_host_blocks)
    pools = Pools(bm)
    live: list[Sequence] = []
    for action, session, turns in steps:
        if action == "free":
            if live:
                bm.free(live.pop(session % len(live)))
        else:
            salt = "other" if action == "tenant" else None
            seq = make_seq(tokens=session_prompt(session, turns), salt=salt)
            bm.allocate(seq)
            if not bm.allocate_slots(seq, seq.num_uncomputed_tokens):
                bm.free(seq)  # as the scheduler gives back what a sequence that cannot run took
                pools.copy(bm.host.take_copies())
            else:
                bm.free(seq)
                pools.copy(bm.host.take_copies())
                pools.admit(seq)
                live.append(seq)
        pools.check(live)
    for seq in live:
        bm.free(seq)
    pools.check([])
    assert bm.num_free_blocks == num_blocks


# --- the engine: restored sessions produce exactly what they would have produced ---

def run_sessions(llm, num_sessions: int = 6, turns: int = 3) -> tuple[list[list[int]], object]:
    """Round-robin multi-turn sessions on token ids: each turn's prompt is the session's history
    (prompts and replies) plus a new message, so every turn reuses the one before it."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    histories = [[] for _ in range(num_sessions)]
    replies: list[list[int]] = []
    for turn in range(turns):
        for s in range(num_sessions):
            histories[s] += [(37 * s + 11 * turn + i) % 300 + 5 for i in range(13)]  # the new message
            [out] = llm.generate([histories[s]], params)
            ids = list(out.outputs[0].token_ids)
            histories[s] += ids
            replies.append(ids)
    return replies, llm.engine.stats()


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_sessions_restored_from_the_host_generate_what_never_evicted_and_recomputed_ones_do(model_dirs, kv_cache_dtype):
    path = model_dirs["llama"]
    never_evicted, _ = run_sessions(make_llm(path, num_blocks=256, kv_cache_dtype=kv_cache_dtype))
    # 16 blocks of 8 tokens hold about two sessions' histories: the other four are pushed out.
    recomputed, recompute_stats = run_sessions(make_llm(path, num_blocks=16, kv_cache_dtype=kv_cache_dtype))
    restored, host_stats = run_sessions(make_llm(path, num_blocks=16, host_kv_cache_gb=0.01,
                                                 kv_cache_dtype=kv_cache_dtype))
    assert restored == never_evicted
    assert recomputed == never_evicted
    assert host_stats.num_blocks_to_host > 0 and host_stats.num_blocks_from_host > 0
    assert host_stats.host_cache_hits == host_stats.num_blocks_from_host * 8
    # What the host gave back was not computed again.
    assert host_stats.num_prompt_tokens == recompute_stats.num_prompt_tokens - host_stats.host_cache_hits
