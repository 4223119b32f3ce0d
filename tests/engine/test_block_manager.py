"""Block manager: ref counts, sharing, the prefix cache and its eviction order."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatd.engine.core.block_manager import BlockManager
from chatd.engine.core.sequence import Sequence
from tests.factories import make_seq
from tests.engine.invariants import check_invariants

BS = 4


def admit(bm: BlockManager, seq: Sequence) -> None:
    """Allocate as the scheduler does, compute everything, and publish the full blocks."""
    bm.allocate(seq)
    assert bm.allocate_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)


def test_second_request_reuses_a_three_block_prefix():
    bm = BlockManager(16, BS)
    first = make_seq(tokens=range(100, 114))  # 3 full blocks + 2 tokens
    admit(bm, first)
    second = make_seq(tokens=list(range(100, 112)) + [7, 8, 9])
    bm.allocate(second)
    assert second.num_cached_tokens == 12
    assert second.block_table == first.block_table[:3]
    assert all(bm.ref_counts[b] == 2 for b in first.block_table[:3])
    assert bm.num_prefix_hits == 12 and bm.num_prefix_queries == 14 + 15
    check_invariants(bm, [first, second])


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(16, BS)
    admit(bm, make_seq(tokens=range(8)))
    again = make_seq(tokens=range(8))
    bm.allocate(again)
    assert again.num_computed_tokens == 4 and again.num_uncomputed_tokens == 4


def test_freed_blocks_stay_findable_until_reused():
    bm = BlockManager(16, BS)
    seq = make_seq(tokens=range(12))
    admit(bm, seq)
    bm.free(seq)
    assert bm.num_free_blocks == 16 and bm.usage == 0.0
    again = make_seq(tokens=range(13))
    bm.allocate(again)
    assert again.num_cached_tokens == 12


def test_evicted_blocks_are_never_served_stale():
    bm = BlockManager(4, BS)
    old = make_seq(tokens=range(8))
    admit(bm, old)
    bm.free(old)
    # A new request takes every block, overwriting the cached ones.
    hog = make_seq(tokens=range(50, 66))
    admit(bm, hog)
    bm.free(hog)
    probe = make_seq(tokens=range(9))
    bm.allocate(probe)
    assert probe.num_cached_tokens == 0, "a block reused for other tokens must lose its old name"
    check_invariants(bm, [probe])


def test_plain_blocks_are_handed_out_before_cached_ones():
    bm = BlockManager(4, BS)
    cached = make_seq(tokens=range(8))
    admit(bm, cached)
    bm.free(cached)
    other = make_seq(tokens=[9, 9, 9])
    admit(bm, other)
    assert not set(other.block_table) & set(cached.block_table[:2])


def test_cache_salt_isolates_tenants():
    bm = BlockManager(16, BS)
    admit(bm, make_seq(tokens=range(12), salt="tenant-a"))
    b = make_seq(tokens=range(12), salt="tenant-b")
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    a2 = make_seq(tokens=range(12), salt="tenant-a")
    bm.allocate(a2)
    assert a2.num_cached_tokens == 8


def test_a_shared_prefix_is_shared_across_salts_and_the_rest_is_not():
    # A shared system prompt of 9 tokens: its 2 full blocks are everyone's; what follows is the tenant's.
    bm = BlockManager(32, BS)
    admit(bm, make_seq(tokens=list(range(9)) + [50, 51, 52, 53, 54, 55, 56], salt="tenant-a", shared=9))
    b = make_seq(tokens=list(range(9)) + [50, 51, 52, 53, 54, 55, 56], salt="tenant-b", shared=9)
    bm.allocate(b)
    assert b.num_cached_tokens == 8  # the shared blocks, not tenant a's own third block
    a2 = make_seq(tokens=list(range(9)) + [50, 51, 52, 53, 54, 55, 56], salt="tenant-a", shared=9)
    bm.allocate(a2)
    assert a2.num_cached_tokens == 12
    # Unsalted requests (auth off) share the shared blocks too, but not tenant a's.
    plain = make_seq(tokens=list(range(9)) + [50, 51, 52, 53, 54, 55, 56])
    bm.allocate(plain)
    assert plain.num_cached_tokens == 8
    # A prompt that merely starts like the shared prefix, without declaring it, shares nothing.
    undeclared = make_seq(tokens=list(range(9)) + [50, 51, 52, 53, 54, 55, 56], salt="tenant-b")
    bm.allocate(undeclared)
    assert undeclared.num_cached_tokens == 0


def test_allocation_failure_changes_nothing():
    bm = BlockManager(2, BS)
    seq = make_seq(tokens=range(3))
    bm.allocate(seq)
    assert not bm.allocate_slots(seq, 9)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_fork_shares_blocks_by_reference():
    bm = BlockManager(8, BS)
    parent = make_seq(tokens=range(10))
    admit(bm, parent)
    child = make_seq(tokens=range(10))
    bm.fork(parent, child, 2)
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 8
    bm.free(parent)
    assert all(bm.ref_counts[b] == 1 for b in child.block_table)
    check_invariants(bm, [child])


def test_prefix_caching_off_shares_nothing_across_requests():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    admit(bm, make_seq(tokens=range(12)))
    again = make_seq(tokens=range(12))
    bm.allocate(again)
    assert again.num_cached_tokens == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 50), st.integers(1, 12)), max_size=60))
def test_random_workload_keeps_books_straight(ops):
    """No leaked or double-freed blocks; ref counts always match the live block tables."""
    bm = BlockManager(12, BS)
    live: list[Sequence] = []
    for op, pick, length in ops:
        if op == "add":
            # Prompts drawn from a few shared prefixes so the cache gets hits.
            seq = make_seq(tokens=[pick % 3] * 4 + list(range(length)))
            bm.allocate(seq)
            if bm.allocate_slots(seq, seq.num_uncomputed_tokens):
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_blocks(seq)
                live.append(seq)
            else:
                bm.free(seq)
        elif op == "grow" and live:
            seq = live[pick % len(live)]
            seq.append_token(pick)
            if bm.allocate_slots(seq, 1):
                seq.num_computed_tokens += 1
                bm.cache_blocks(seq)
            else:
                seq.token_ids.pop()
                seq.output_token_ids.pop()
        elif op == "free" and live:
            bm.free(live.pop(pick % len(live)))
        check_invariants(bm, live)
    for seq in live:
        bm.free(seq)
    check_invariants(bm, [])
    assert bm.num_free_blocks == 12
