"""chatd: a self-hosted LLM chat server you can read end to end.

`from chatd import LLM, SamplingParams` for offline generation (as `from vllm import ...`).
The engine (`chatd.engine`) knows nothing of HTTP or SQLite; `chatd.cli` composes the parts.
Importing chatd loads nothing of the engine until one of its names is used.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name in __all__:
        import chatd.engine

        return getattr(chatd.engine, name)
    raise AttributeError(f"module 'chatd' has no attribute {name!r}")
