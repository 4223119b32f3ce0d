"""keep_freed_memory: a buffer a step frees is reused by the next step, not faulted in again.

Page faults are what a user pays for (each one is a trip into the kernel to map and zero 4 KiB),
and what a test can count. The setting is process-wide, so it is measured in a child process:
the same loop of tensors made and freed on a thread (as the engine thread does), before and after.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import json, resource, threading, torch
from chatd.engine.worker.heap import keep_freed_memory

STEPS = 20

def faults_per_step():
    # A step's buffers, of the sizes a 2048-token prefill chunk of SmolLM2 makes (float32): three of
    # its gate and up projections' (25 MB) and one of its gate's (12 MB), all alive at once.
    def step():
        buffers = [torch.empty(2048, 3072).fill_(1.0) for _ in range(3)]
        buffers.append(torch.empty(2048, 1536).fill_(2.0))
        del buffers
    def steps(faults):
        for _ in range(5):  # anything the thread's heap takes the first time
            step()
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(STEPS):
            step()
        faults.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / STEPS)
    faults = []
    thread = threading.Thread(target=steps, args=(faults,))  # as the engine thread runs steps
    thread.start(); thread.join()
    return faults[0]

default = faults_per_step()
kept = keep_freed_memory()
print(json.dumps({"default": default, "kept": kept, "with": faults_per_step()}))
"""

PAGES_PER_STEP = (3 * 2048 * 3072 + 2048 * 1536) * 4 // 4096  # 21504


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_a_freed_step_buffer_is_reused_without_faulting_it_in_again():
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, cwd=repo)
    result = json.loads(child.stdout)
    if not result["kept"]:
        pytest.skip("not glibc")
    # glibc's own thresholds: part of every step's memory is new (3073 pages of 21504, glibc 2.36)
    assert result["default"] > PAGES_PER_STEP / 10
    assert result["with"] < PAGES_PER_STEP / 1000  # kept: a step writes memory it already has
