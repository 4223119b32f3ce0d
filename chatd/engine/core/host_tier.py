"""The host KV tier's bookkeeping: which named blocks host slots hold, and the copies to make.

A named block pushed out of the device pool is kept in a host slot under the same name (least
recently used slots are reused first); a prompt whose chain of names runs on there gets it copied
back into a fresh device block (block_manager.py decides when). Each copy is queued, in order, as a
KVCopy; the runner makes them before the step's forward (worker/host_kv.py holds the host's
tensors). Plain Python: slot numbers and names, no tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCopy:
    """One block copied between the pools: device block -> host slot (`to_host`) or back."""

    to_host: bool
    device_block: int
    host_slot: int


class HostTier:
    """Host slots by block name, least recently used first, and the copies queued since the last step."""

    def __init__(self, num_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # name -> host slot, least recently used first
        self.free_slots: list[int] = list(range(num_blocks - 1, -1, -1))  # slots holding nothing
        self.pending_copies: list[KVCopy] = []  # in the order they must be made
        self.num_hits = 0  # tokens of prompts copied back from the host instead of recomputed
        self.num_blocks_to_host = 0  # blocks copied out to the host, in all
        self.num_blocks_from_host = 0  # blocks copied back, in all

    def __contains__(self, name: bytes) -> bool:
        return name in self.slots

    def use(self, name: bytes) -> int:
        """The slot holding a block, marked as used now (the last to be reused)."""
        self.slots.move_to_end(name)
        return self.slots[name]

    def keep(self, name: bytes, block: int) -> None:
        """Copy a named block leaving the device to a host slot (the least recently used one when full)."""
        if name in self.slots:  # restored from there and never changed: the host copy is the same
            self.slots.move_to_end(name)
            return
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            _, slot = self.slots.popitem(last=False)
        self.slots[name] = slot
        self.pending_copies.append(KVCopy(True, block, slot))
        self.num_blocks_to_host += 1

    def copy_back(self, block: int, slot: int) -> None:
        """Queue the copy of a host slot into a fresh device block."""
        self.pending_copies.append(KVCopy(False, block, slot))
        self.num_blocks_from_host += 1

    def take_copies(self) -> list[KVCopy]:
        """The copies between the pools queued since the last call, in the order they must be made."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_invariants(self) -> None:
        """Assert every slot is either held by one name or free (for tests)."""
        slots = list(self.slots.values()) + self.free_slots
        assert sorted(slots) == list(range(self.num_blocks)), "host slots lost or shared"
