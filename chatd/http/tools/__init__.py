"""Tool calling and structured output: the `tools` and `response_format` a client asks for
(tools.py, structured.py), and the tool calls read back out of what a model writes, per model
family (tool_calls.py) and as it streams (tool_stream.py).

Imports of chatd/http: errors.py only. The wire formats (openai/) and the models (models/) use it.
"""
