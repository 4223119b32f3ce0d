"""Test-suite wide rules: `gpu`-marked tests skip where CUDA is absent; triton kernels are interpreted there."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, triton runs its kernels on CPU tensors in its interpreter, so the kernel
    # tests run in CI too. It must be set before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
