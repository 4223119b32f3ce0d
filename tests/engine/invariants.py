"""The block manager's bookkeeping checked against the sequences alive (an oracle for tests)."""

from __future__ import annotations

from chatd.engine.core.block_manager import BlockManager
from chatd.engine.core.sequence import Sequence


def check_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    """Assert the pool's bookkeeping agrees with the given live sequences."""
    expected = [0] * bm.num_blocks
    for seq in seqs:
        for block in seq.block_table:
            expected[block] += 1
    assert expected == bm.ref_counts, "ref counts disagree with block tables"
    assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if bm.ref_counts[b] == 0}
    for name, block in bm.cached_blocks.items():
        assert bm.block_hashes[block] == name
    assert sum(h is not None for h in bm.block_hashes) == len(bm.cached_blocks)
    bm.host.check_invariants()
