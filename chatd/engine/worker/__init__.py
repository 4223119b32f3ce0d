"""The engine's torch side: loading.py builds a ModelRunner (runner.py), which runs each step's forward,
samples (sampler.py) and replays CUDA graphs for decodes (cuda_graphs.py)."""
