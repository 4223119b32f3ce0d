"""The engine's torch side: build.py makes a ModelRunner (runner.py), which turns a step into one
forward's inputs (forward_inputs.py), runs it, samples (sampler.py), replays CUDA graphs for decodes
(cuda_graphs.py), computes the prompt logprobs a request asked for (prompt_logprobs.py) and moves
blocks between the device pool and the host KV tier (host_kv.py). Under tensor parallelism
parallel.py starts and supervises the other ranks, each a process running parallel_worker.py."""
