"""Test-suite wide rules: `gpu`-marked tests skip where CUDA is absent; triton kernels are interpreted there;
torch.compile is off unless a test turns it on."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, triton runs its kernels on CPU tensors in its interpreter, so the kernel
    # tests run in CI too. It must be set before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Compiling decode steps at start (chatd's CPU default, worker/fast_steps/compiled.py) costs 5-12 s per engine
# for the demo model; the suite starts dozens. Off for engines made in this process and for the
# servers it starts (they inherit the environment); tests/engine/test_compiled.py and
# tests/http/test_compiled_serve.py turn it back on and check the compiled path itself.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
