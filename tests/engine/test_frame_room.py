"""with_frame_room: frames called inside it never map a new chunk of CPython's frame stack.

A step's frames that start a chunk map it (and fault its pages in) on every call, and unmap it
on return (frame_room.py). Page faults are what a test can count: a frame bigger than a 16 KiB
chunk starts one wherever it is called from, unless it is called inside `with_frame_room`.
"""

from __future__ import annotations

import resource
from types import FunctionType

from chatd.engine.frame_room import with_frame_room


def _leaf() -> int:
    return 1


# A 20 KiB frame: too big for a 16 KiB chunk, well inside the room with_frame_room leaves.
_big_frame = FunctionType(_leaf.__code__.replace(co_stacksize=2500), _leaf.__globals__)
CALLS = 300


def _calls() -> int:
    return sum(_big_frame() for _ in range(CALLS))


def _page_faults(function) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    function()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_big_frames_map_a_chunk_each_call_but_not_inside_the_room():
    _calls()  # warm: anything the loop itself allocates once
    assert _page_faults(_calls) >= CALLS  # each call mapped a fresh chunk and wrote to it
    assert _page_faults(lambda: with_frame_room(_calls)) < CALLS // 10


def test_the_room_returns_what_its_function_returns():
    assert with_frame_room(_calls) == CALLS
