"""The aiohttp front end: OpenAI-compatible routes, SSE streaming, health and metrics."""
