"""Forward passes of the embedding model (engine/embedding_queue.py), without a model: every input
runs once, a pass stays within its padded size, holders (tenants) and their requests take turns,
and a request that arrives late waits one pass, not for what others queued before it."""

from __future__ import annotations

import concurrent.futures

from hypothesis import given, settings
from hypothesis import strategies as st

from chatd.engine.embedding_queue import EmbeddingJob, EmbeddingQueue


def job(holder: str, lengths: list[int]) -> EmbeddingJob:
    return EmbeddingJob([[7] * n for n in lengths], concurrent.futures.Future(), holder)


def run(queue: EmbeddingQueue) -> list[list[tuple[EmbeddingJob, int]]]:
    """Every pass until the queue is empty."""
    passes = []
    while queue:
        passes.append(queue.next_pass())
    return passes


def padded(taken: list[tuple[EmbeddingJob, int]]) -> int:
    return len(taken) * max(len(job.inputs[index]) for job, index in taken)


jobs_strategy = st.lists(st.tuples(st.sampled_from("abc"), st.lists(st.integers(1, 300), min_size=1, max_size=40)),
                         min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(jobs=jobs_strategy, budget=st.integers(1, 2048))
def test_every_input_runs_once_in_passes_within_the_budget(jobs, budget):
    queue = EmbeddingQueue(budget)
    made = [job(holder, lengths) for holder, lengths in jobs]
    for each in made:
        queue.add(each)
    passes = run(queue)
    seen = sorted((id(j), index) for taken in passes for j, index in taken)
    assert seen == sorted((id(j), index) for j in made for index in range(len(j.inputs)))
    for taken in passes:
        assert taken and (len(taken) == 1 or padded(taken) <= budget)


@settings(max_examples=200, deadline=None)
@given(jobs=jobs_strategy, budget=st.integers(300, 4096))
def test_while_they_fit_every_waiting_holder_has_an_input_in_every_pass(jobs, budget):
    """Inputs of 300 tokens at most and a budget of at least one: up to budget // 300 holders fit a pass."""
    queue = EmbeddingQueue(budget)
    for holder, lengths in jobs:
        queue.add(job(holder, lengths))
    while queue:
        waiting = set(queue._holders)
        taken = queue.next_pass()
        if len(waiting) <= budget // 300:
            assert {j.holder for j, _ in taken} == waiting


def test_a_one_text_request_behind_two_thousand_inputs_runs_in_the_next_pass():
    queue = EmbeddingQueue(4096)
    big = job("alice", [252] * 2048)
    queue.add(big)
    first = queue.next_pass()
    assert len(first) == 16 and {j.holder for j, _ in first} == {"alice"}  # 16 x 252 <= 4096
    small = job("bob", [9])
    queue.add(small)
    second = queue.next_pass()
    assert (small, 0) in second and len(second) == 16  # bob's one input beside 15 of alice's
    # The same holder's requests take turns too (a server without keys has one holder).
    late = job("alice", [12, 30])
    queue.add(late)
    assert sum(j is late for j, _ in queue.next_pass()) == 2


def test_a_request_s_shortest_inputs_go_first_and_holders_start_passes_in_turn():
    queue = EmbeddingQueue(1000)
    queue.add(job("alice", [100, 5, 50]))
    queue.add(job("bob", [7, 7]))
    first = queue.next_pass()
    assert [(j.holder, len(j.inputs[i])) for j, i in first] == [("alice", 5), ("bob", 7), ("alice", 50), ("bob", 7),
                                                                 ("alice", 100)]
    queue = EmbeddingQueue(3)  # three one-token inputs a pass: the holder who starts gets two
    queue.add(job("alice", [1] * 30))
    queue.add(job("bob", [1] * 30))
    assert [queue.next_pass()[0][0].holder for _ in range(4)] == ["alice", "bob", "alice", "bob"]


def test_cancelled_and_failed_requests_are_dropped_before_the_next_pass():
    queue = EmbeddingQueue(64)
    cancelled, failed, kept = job("alice", [8] * 100), job("bob", [8] * 100), job("carol", [8] * 3)
    for each in (cancelled, failed, kept):
        queue.add(each)
    queue.next_pass()
    assert cancelled.future.cancel()
    failed.future.set_exception(RuntimeError("the pass failed"))
    queue.drop_finished()
    assert {j.holder for taken in run(queue) for j, _ in taken} == {"carol"}


def test_a_job_collects_its_vectors_in_its_inputs_order():
    import numpy as np

    queue = EmbeddingQueue(100)
    each = job("alice", [3, 1, 2])
    queue.add(each)
    taken = queue.next_pass()
    assert [index for _, index in taken] == [1, 2, 0]
    done = [each.put(index, np.full(4, index, dtype=np.float32)) for _, index in taken]
    assert done == [False, False, True] and each.vectors[:, 0].tolist() == [0, 1, 2]
