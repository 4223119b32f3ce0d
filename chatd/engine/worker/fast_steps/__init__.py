"""Faster steps, the same tokens: decode and prefill steps through torch.compile, and CUDA graphs.

compiled.py compiles decode-only steps (on a CPU, a step for each batch size up to a few rows, kept
on disk for later starts), compiled_prefill.py steps of many tokens, compile_job.py compiles them on
a thread while eager steps serve, cuda_graphs.py captures decode batches on a GPU and replays them.
fast_steps.py holds what a runner enabled (`FastSteps`, which the runner (worker/runner.py) asks
once per step, else it runs the step eagerly), enables them, and measures what a step of several
rows costs. Nothing in the core path needs them to be read. Imports: worker/ and below.
"""
