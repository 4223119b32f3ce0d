"""Keep the memory a CPU step frees for the next step, rather than handing it back to the kernel.

A prefill step on a CPU makes and frees tensors of tens of megabytes: SmolLM2-135M's gate and up
projections of a 2048-token chunk are 25 MB as float32. glibc's malloc maps a buffer that big on
its own (mmap) and unmaps it when it is freed, or, once its threshold has risen past that size,
takes it from a heap but gives the heap's free top back to the kernel when it passes twice that
size, and drops a thread's extra heap (64 MiB) when it empties. Whichever it does, the next step's
buffers are new memory, and every 4 KiB page of them is faulted in and zeroed by the kernel before
the step can write it. Measured on the 2-core machine (64 prompts of 100-300 words prefilled
through `LLM`, SmolLM2's Q4_1 file, alternating): 3.4 million page faults and 23.5-26.5 s of
prefill steps, against 19-21 thousand faults and 19.3-19.9 s with the settings below.

`keep_freed_memory()` has glibc take every buffer up to 32 MiB (the most it allows) from a heap,
keep what is freed at a heap's top up to 1 GiB, and keep 64 MiB spare at the top, which also keeps
a thread's extra heaps from being dropped. The process then holds its largest step's working set
once it has run it, as PyTorch's CUDA allocator does on a GPU. Larger buffers (the KV pool, a big
model's weights) keep mappings of their own. It is called after the weights are loaded, so what
loading freed has gone back already. Outside glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger("chatd.engine")

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

KEPT_AT_TOP_BYTES = 1 << 30  # free memory at a heap's top beyond this is still given back
HEAPED_UP_TO_BYTES = 32 << 20  # glibc's largest mmap threshold: larger buffers are mapped on their own
SPARE_AT_TOP_BYTES = 64 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse (process-wide, once); False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it; musl's mallopt accepts and ignores these
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # A heap's free top is trimmed only past the pad, and a thread's emptied extra heap is dropped
    # only when the heap before it has more than the pad free: neither happens with 64 MiB.
    kept = (mallopt(M_MMAP_THRESHOLD, HEAPED_UP_TO_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, KEPT_AT_TOP_BYTES) == 1
            and mallopt(M_TOP_PAD, SPARE_AT_TOP_BYTES) == 1)
    if not kept:
        log.warning("glibc refused the settings that keep freed memory: CPU steps will fault their buffers in again")
    return kept
