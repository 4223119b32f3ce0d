"""Keep the objects alive at start-up out of the garbage collector's walks, for the engine's steps."""

from __future__ import annotations

import atexit
import gc


def freeze_startup_objects() -> None:
    """Move every object alive now (torch's, transformers', the model's: hundreds of thousands) out
    of the cyclic garbage collector's sight, as vLLM's engine does after loading. Left in, the
    collections that a step's own small objects set off kept walking them: at 512 sequences, 3 ms
    of a 10 ms step (benchmarks/host.py). At exit they are handed back, so the interpreter's last
    collection frees them (triton's bindings report every object still alive then as a leak)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many engines a process builds
    atexit.register(gc.unfreeze)
