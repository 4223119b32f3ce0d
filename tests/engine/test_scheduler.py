"""Scheduler: token budget, decodes first, chunked prefill, priority, preemption — no model needed."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatd.engine.core.scheduler import Scheduler, SchedulerOutput
from chatd.engine.core.sequence import Sequence, SequenceStatus
from tests.factories import make_scheduler, make_seq
from tests.engine.invariants import check_invariants

BS = 4  # the factories' block size


def complete(sched: Scheduler, plan: SchedulerOutput, next_token: int = 1) -> list[Sequence]:
    """Do what the engine does after the model ran: each sequence that reached its end samples
    `next_token`, and the scheduler's postprocess folds it in. Returns the sequences that finished."""
    sampled = sched.postprocess(plan, [next_token] * sum(s.samples for s in plan.scheduled))
    return [seq for seq, _ in sampled if seq.is_finished]


def test_decodes_go_first_and_prefill_fills_the_rest_of_the_budget():
    sched = make_scheduler(budget=10)
    a = make_seq(prompt_len=4, max_tokens=5)
    sched.add(a)
    complete(sched, sched.schedule())  # a prefilled, now decoding
    b = make_seq(prompt_len=20, first_token=100)
    sched.add(b)
    plan = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in plan.scheduled] == [(a, 1), (b, 9)]
    assert plan.num_batched_tokens == 10


def test_long_prompt_is_prefilled_in_chunks():
    sched = make_scheduler(budget=8)
    seq = make_seq(prompt_len=20, max_tokens=1)
    sched.add(seq)
    chunks = []
    while not seq.is_finished:
        plan = sched.schedule()
        chunks.append(plan.scheduled[0].num_new_tokens)
        complete(sched, plan)
    assert chunks == [8, 8, 4]


def test_lower_priority_value_is_admitted_first():
    sched = make_scheduler(budget=6)
    low = make_seq(priority=5, first_token=0)
    high = make_seq(priority=-1, first_token=50)
    sched.add(low)
    sched.add(high)
    plan = sched.schedule()
    assert plan.scheduled[0].seq is high


def test_pool_exhaustion_preempts_lowest_priority_newest_and_recomputes():
    sched = make_scheduler(num_blocks=4, budget=64)
    keep = make_seq(prompt_len=7, max_tokens=6, priority=0, first_token=0)
    victim = make_seq(prompt_len=7, max_tokens=6, priority=1, first_token=50)
    sched.add(keep)
    sched.add(victim)
    complete(sched, sched.schedule())  # both prefilled: 2 blocks each, pool full
    complete(sched, sched.schedule())  # both decode position 7, the last slot of their second block
    plan = sched.schedule()  # keep needs a third block for position 8
    assert plan.preempted == [victim]
    assert victim.status == SequenceStatus.WAITING and victim.block_table == [] and victim.num_computed_tokens == 0
    assert [s.seq for s in plan.scheduled] == [keep]
    complete(sched, plan)  # a plan moves the counters when it is made: every plan is folded back
    while sched.has_unfinished():
        complete(sched, sched.schedule())
    assert victim.num_output_tokens == 6 and victim.num_preemptions >= 1
    assert sched.block_manager.num_free_blocks == 4


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_seqs=2, budget=100)
    for i in range(3):
        sched.add(make_seq(first_token=i * 10))
    plan = sched.schedule()
    assert len(plan.scheduled) == 2 and sched.num_waiting == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 8), st.integers(0, 2), st.integers(0, 3), st.integers(0, 2)),
             min_size=1, max_size=16),
    st.integers(8, 40),
    st.integers(10, 30),
)
def test_random_workloads_finish_without_leaks(requests, budget, num_blocks):
    """Every request finishes or is aborted; ref counts match block tables every step; budget holds."""
    sched = make_scheduler(num_blocks=num_blocks, budget=budget, max_seqs=6)
    seqs = []
    for i, (prompt_len, max_tokens, priority, prefix, tenant) in enumerate(requests):
        if -(-(prompt_len + max_tokens) // BS) > num_blocks:
            continue  # the engine rejects requests that can never fit
        seq = make_seq(prompt_len, max_tokens, priority, first_token=prefix * 1000, tenant=f"t{tenant}")
        seqs.append(seq)
        sched.add(seq)
    aborted = set()
    for step in range(2000):
        if not sched.has_unfinished():
            break
        if step % 7 == 3 and len(aborted) < len(seqs) // 4:  # a client goes away now and then
            victim = next((s for s in seqs if not s.is_finished), None)
            if victim is not None:
                sched.finish(victim)
                aborted.add(victim.seq_id)
                continue
        plan = sched.schedule()
        assert plan.num_batched_tokens <= budget
        assert not plan.is_empty, "a step with work waiting must schedule something"
        ones = [s.num_new_tokens == 1 for s in plan.scheduled]
        assert ones == sorted(ones, reverse=True), "one-token rows come first"
        complete(sched, plan)
        live = [s for s in seqs if not s.is_finished]
        check_invariants(sched.block_manager, live)
    assert all(s.is_finished for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs if s.seq_id not in aborted)
    assert sched.block_manager.num_free_blocks == num_blocks
    assert sched.share.num_tenants == 0 and not sched.share.service, "idle tenants are forgotten"


# -- tiers and fairness (fairness.py) ------------------------------------------------------------


def run_until(sched: Scheduler, done, steps: int = 500) -> None:
    for _ in range(steps):
        if done():
            return
        complete(sched, sched.schedule())
    raise AssertionError("did not happen")


def test_a_tenant_with_many_waiting_requests_cannot_starve_one_with_a_single_request():
    sched = make_scheduler(max_seqs=2, budget=100)
    flood = [make_seq(max_tokens=4, first_token=i * 10, tenant="flood") for i in range(8)]
    for seq in flood:
        sched.add(seq)
    complete(sched, sched.schedule())  # the flood fills both slots
    single = make_seq(max_tokens=4, first_token=500, tenant="single")
    sched.add(single)
    run_until(sched, lambda: single.status != SequenceStatus.WAITING)
    # It takes the first slot that frees: at most the two that were running finished before it.
    assert sum(s.is_finished for s in flood) <= 2


def test_tenants_of_one_class_get_equal_token_shares_and_weights_scale_them():
    for weight_b, expected in ((1.0, 1.0), (3.0, 3.0)):
        sched = make_scheduler(max_seqs=4, budget=8, num_blocks=256)
        tokens = {"a": 0, "b": 0}
        for i in range(12):  # both have far more work than 24 steps can do
            sched.add(make_seq(prompt_len=40, max_tokens=2, first_token=1000 + 100 * i, tenant="a"))
            sched.add(make_seq(prompt_len=40, max_tokens=2, first_token=5000 + 100 * i, tenant="b", weight=weight_b))
        for _ in range(24):
            plan = sched.schedule()
            for s in plan.scheduled:
                tokens[s.seq.tenant] += s.num_new_tokens
            complete(sched, plan)
        assert tokens["b"] / tokens["a"] == pytest.approx(expected, rel=0.35), tokens


def test_a_better_class_takes_a_full_batch_s_place_from_the_worst_ranked_running_sequence():
    sched = make_scheduler(max_seqs=2, budget=100)
    old = make_seq(max_tokens=20, priority=20, first_token=0, tenant="free1")
    new = make_seq(max_tokens=20, priority=20, first_token=100, tenant="free2")
    sched.add(old)
    sched.add(new)
    complete(sched, sched.schedule())
    paid = make_seq(max_tokens=3, priority=10, first_token=200, tenant="paid")
    sched.add(paid)
    plan = sched.schedule()
    assert plan.preempted == [new], "the most recent of the worst class makes room"
    assert paid in [s.seq for s in plan.scheduled] and old in [s.seq for s in plan.scheduled]
    assert new.status == SequenceStatus.WAITING
    complete(sched, plan)
    run_until(sched, lambda: not sched.has_unfinished())
    assert new.num_output_tokens == 20 and sched.block_manager.num_free_blocks == 64


def test_a_full_kv_pool_preempts_the_worst_class_for_a_better_waiting_one():
    sched = make_scheduler(num_blocks=6, budget=64, max_seqs=8)
    older = make_seq(prompt_len=12, max_tokens=8, priority=20, first_token=0, tenant="free")
    newer = make_seq(prompt_len=8, max_tokens=4, priority=20, first_token=100, tenant="free")
    sched.add(older)
    sched.add(newer)
    complete(sched, sched.schedule())  # 3 + 2 of the 6 blocks held
    paid = make_seq(prompt_len=8, max_tokens=2, priority=10, first_token=300, tenant="paid")
    sched.add(paid)
    plan = sched.schedule()  # paid needs 2 blocks; 1 is free
    assert plan.preempted == [newer] and paid in [s.seq for s in plan.scheduled]
    complete(sched, plan)
    run_until(sched, lambda: not sched.has_unfinished())
    assert newer.num_output_tokens == 4 and sched.block_manager.num_free_blocks == 6


def test_an_equal_class_never_preempts_to_be_admitted():
    sched = make_scheduler(max_seqs=1, budget=100)
    first = make_seq(max_tokens=5, priority=10, first_token=0, tenant="a")
    sched.add(first)
    complete(sched, sched.schedule())
    second = make_seq(max_tokens=5, priority=10, first_token=100, tenant="b")
    sched.add(second)
    plan = sched.schedule()
    assert plan.preempted == [] and [s.seq for s in plan.scheduled] == [first]


def test_a_worse_class_s_prompt_never_shares_a_step_with_a_better_class_s():
    sched = make_scheduler(budget=100, max_seqs=8)
    decoding = make_seq(prompt_len=4, max_tokens=10, priority=20, first_token=0, tenant="free")
    sched.add(decoding)
    complete(sched, sched.schedule())
    free = make_seq(prompt_len=30, max_tokens=2, priority=20, first_token=100, tenant="free")
    paid = make_seq(prompt_len=30, max_tokens=2, priority=10, first_token=200, tenant="paid")
    sched.add(free)
    sched.add(paid)
    plan = sched.schedule()  # budget for both prompts, but free's would slow paid's first token
    assert [(s.seq, s.num_new_tokens) for s in plan.scheduled] == [(decoding, 1), (paid, 30)]
    complete(sched, plan)
    assert [s.seq for s in sched.schedule().scheduled if s.num_new_tokens > 1] == [free]  # its turn next
