"""OpenAI's wire formats: request bodies in (protocol.py for chat and text completions,
chat_messages.py, items.py for the Responses and Conversations APIs, response_request.py,
conversation_request.py), response shapes out (openai_format.py). Parsing and building only:
nothing here holds a server, a model or a connection.

Imports of chatd/http: errors.py and tools/.
"""
