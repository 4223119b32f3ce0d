"""chatd: a self-hosted LLM chat server you can read end to end.

The engine (`chatd.engine`) knows nothing of HTTP or SQLite; `chatd.cli` composes the parts.
"""

__version__ = "0.1.0"
