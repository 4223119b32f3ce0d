"""Faster steps, the same tokens: decode and prefill steps through torch.compile, and CUDA graphs.

compiled.py compiles decode-only steps (on a CPU, a step for each batch size up to a few rows, kept
on disk for later starts), compiled_prefill.py steps of many tokens, compile_job.py compiles them on
a thread while eager steps serve, cuda_graphs.py captures decode batches on a GPU and replays them.
The runner (worker/runner.py) runs a step through one of these where it was enabled, else eagerly;
nothing in the core path needs them to be read. Imports: worker/ and below.
"""
