"""chatd's one SQLite file: tenants, API keys, conversations with their messages, and usage.

The store knows nothing of HTTP or the engine; it takes and returns plain values and frozen
dataclasses, so it is tested on a real file without a server.
"""
