"""The KV block pool: ref-counted blocks, block tables, and the automatic prefix cache.

A full block is named by a hash chained on its parent block's hash and its own token ids, so
equal prefixes get equal names. A request's cache salt (its tenant) joins the chain at its
first block, or after the blocks of a prefix shared on purpose (`num_shared_prefix_tokens`):
from there on only requests with the same salt can find its blocks.
A block whose last user leaves keeps its name and stays findable in the free list until it is
reused; the free list hands out plain blocks first, then named ones least recently freed
first (so the blocks of conversations active lately go last).

With a host tier (`num_host_blocks` > 0, host_tier.py), a named block pushed out of the pool is
kept on the host, and a prompt whose chain of names runs on there gets it copied back.

Plain Python: the runner owns the tensors, this module only hands out block numbers.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from chatd.engine.core.host_tier import HostTier
from chatd.engine.core.sequence import Sequence


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """The name of a full block: a 128-bit digest of its parent's name and its token ids."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    """Hands out KV blocks to sequences, shares equal prefixes, and counts prefix-cache hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        if num_host_blocks and not enable_prefix_caching:
            raise ValueError("a host KV tier keeps blocks by their prefix names: it needs prefix caching on")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached_blocks: dict[bytes, int] = {}  # name -> block, for live and free-but-findable blocks
        # Blocks nobody uses, in eviction order: plain blocks at the front, then named ones LRU.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found (on the device or the host)
        self.host = HostTier(num_host_blocks)  # named blocks kept in host RAM (0 blocks: none)

    # -- counters -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (free blocks that still cache a prefix count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation -----------------------------------------------------------------------

    def allocate(self, seq: Sequence) -> None:
        """Admit a sequence holding no blocks: take the longest cached chain of its full blocks
        (on the device, and where the device's end, on the host: copied back into fresh blocks).

        At least one token is left to compute, because the model must run on the last token to
        produce the next one. A sequence still wanting its prompt's logprobs computes every token.
        Sets `num_computed_tokens` and `num_cached_tokens`.
        """
        assert not seq.block_table, f"{seq} already holds blocks"
        seq.block_hashes = []
        if self.enable_prefix_caching and not seq.wants_prompt_logprobs:
            parent = b""
            max_blocks = (seq.num_tokens - 1) // self.block_size
            for i in range(max_blocks):
                name = self._block_name(seq, i, parent)
                block = self.cached_blocks.get(name)
                if block is not None:
                    self._take(block)
                elif name in self.host and self.free_blocks:
                    block = self._restore_from_host(name)
                    if block is None:
                        break
                    self.host.num_hits += self.block_size
                else:
                    break
                seq.block_table.append(block)
                seq.block_hashes.append(name)
                parent = name
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += len(seq.block_table) * self.block_size
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens

    def _restore_from_host(self, name: bytes) -> int | None:
        """A fresh device block for a block kept on the host, named, held once, its copy back
        queued; None when the host let it go to make room (a one-slot host tier)."""
        slot = self.host.use(name)  # used now: the eviction just below takes another slot
        block = self._pop_free_block()
        if self.host.slots.get(name) != slot:
            self.free_blocks[block] = None
            self.free_blocks.move_to_end(block, last=False)
            return None
        self.ref_counts[block] = 1
        self.block_hashes[block] = name
        self.cached_blocks[name] = block
        self.host.copy_back(block, slot)
        return block

    def can_allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more computed tokens; False (and no change) if the pool is short."""
        if seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
            return True  # its last block has room (most decode steps)
        if not self.can_allocate_slots(seq, num_new_tokens):
            return False
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            block = self._pop_free_block()
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past a sequence's computed tokens: those a verify step took for
        proposed tokens that were rejected, so it holds what it would have without them. They hold
        no name (only blocks full of computed tokens are named) and nobody shares them."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            assert self.ref_counts[block] == 1 and self.block_hashes[block] is None, f"block {block} is not {seq}'s alone"
            self.ref_counts[block] = 0
            self.free_blocks[block] = None
            self.free_blocks.move_to_end(block, last=False)

    def fork(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Let `child` share the first `num_blocks` computed blocks of `parent` (for `n > 1` choices)."""
        assert not child.block_table and num_blocks * self.block_size <= parent.num_computed_tokens
        for block in parent.block_table[:num_blocks]:
            self.ref_counts[block] += 1
        child.block_table = parent.block_table[:num_blocks]
        child.block_hashes = parent.block_hashes[:num_blocks]
        child.num_computed_tokens = child.num_cached_tokens = num_blocks * self.block_size

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks. Named blocks stay findable; the chain's tail is evicted first."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                if self.block_hashes[block] is None or not self.enable_prefix_caching:
                    self.free_blocks.move_to_end(block, last=False)  # nothing worth keeping: reuse first
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def cache_blocks(self, seq: Sequence) -> None:
        """Name the sequence's blocks that became full of computed tokens, so later requests find them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else b""
        for i in range(len(seq.block_hashes), num_full):
            name = self._block_name(seq, i, parent)
            seq.block_hashes.append(name)
            block = seq.block_table[i]
            # Another sequence may have computed the same block at the same time; the first keeps the name.
            if self.block_hashes[block] is None and name not in self.cached_blocks:
                self.block_hashes[block] = name
                self.cached_blocks[name] = block
            parent = name

    # -- internals ------------------------------------------------------------------------

    def _block_name(self, seq: Sequence, index: int, parent: bytes) -> bytes:
        """The name of the sequence's block `index`, whose parent block is named `parent` (b"" for the first)."""
        if seq.cache_salt and index == seq.num_shared_prefix_tokens // self.block_size:
            parent += seq.cache_salt.encode()  # every later name inherits the salt through the chain
        return hash_block(parent, seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def _pop_free_block(self) -> int:
        """The next free block to reuse, its name forgotten (and its contents kept on the host first)."""
        block, _ = self.free_blocks.popitem(last=False)
        name = self.block_hashes[block]
        if name is not None:
            if self.host.num_blocks:
                self.host.keep(name, block)
            del self.cached_blocks[name]
            self.block_hashes[block] = None
        return block
