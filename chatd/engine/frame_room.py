"""Room on CPython's frame stack for a decode step, so that no step maps and unmaps memory.

CPython (3.11 and later) keeps Python frames in chunks of 16 KiB. A frame that does not fit in
what is left of the current chunk starts a new one (mmap), and that chunk is unmapped again when
the frame returns. A compiled decode step's frames are big: for SmolLM2-135M the traced step
takes 6 KB and inductor's wrapper 8 KB (it holds every weight as a local), and each layer adds
one. So wherever a step is called from, one of its frames is likely to start a chunk, and then
every step maps and unmaps one, or, where the boundary falls at the per-layer frames, one per
layer. Each new chunk faults its pages in again, and unmapping one makes the other cores flush
their TLBs, which stalls the step's own threads. Measured on the 2-core machine (SmolLM2's Q4_1
file, its compiled step called from the depth where this was worst, and from inside
`with_frame_room`, alternating in one process): 34 page faults a step and 9.8 ms, against 0.25
and 8.6 ms.

`with_frame_room(function)` calls `function` from a frame too big for any 16 KiB chunk, so it
gets a chunk of its own, and CPython sizes that chunk with room to spare (the frame's size plus
at least 1000 slots, rounded up to a power of two): 128 KiB of it are left for the frames that
`function` calls. A thread that runs its steps inside it keeps that chunk for as long as it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FunctionType
from typing import TypeVar

T = TypeVar("T")

# The frame's own size, in 8-byte slots: 128 KiB, which CPython places in a chunk of 256 KiB.
ROOM_SLOTS = 16 * 1024


def _call(function: Callable[[], T]) -> T:
    return function()


# The same function with an evaluation stack of ROOM_SLOTS slots: it uses two, but CPython sizes
# its frame (and so the chunk it starts) by what the code object declares.
_call_in_own_chunk = FunctionType(_call.__code__.replace(co_stacksize=ROOM_SLOTS), _call.__globals__, "with_frame_room")


def with_frame_room(function: Callable[[], T]) -> T:
    """`function()`, called with at least 128 KiB of CPython's frame stack free above it."""
    return _call_in_own_chunk(function)
