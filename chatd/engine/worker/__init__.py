"""The engine's torch side: a scheduled step run on the model, and its tokens sampled.

The core: runner.py (ModelRunner: the KV tensors; a step's one flat forward, then sampling),
forward_inputs.py (the step as the forward's inputs), sampling_rows.py (each sequence's sampler
row and RNG) and sampler.py (logits -> tokens: greedy's argmax). build.py makes a runner from a
config, on every rank. Around them: full_sampling.py (any step beyond a plain argmax), penalties.py, sampling_choices.py (temperature, top-k/p, min-p, batched),
host_sampling.py (the same, row by row on a CPU), logprobs.py, prompt_logprobs.py and
grammar_masks.py (structured output's masks) for sampling beyond greedy; verify_rows.py (speculative
decoding's verify rows); kv_memory.py (sizing the KV pool on a GPU) and heap.py (a CPU step's memory
kept); host_kv.py (the host KV tier's tensors); fast_steps/ (compiled steps, CUDA graphs, step
costs); parallel.py and parallel_worker.py (tensor
parallel ranks, each a process, started and supervised). Imports: core, attention, models, params.
"""
