"""The handlers, one module per API: chat and text completions, conversations, responses,
embeddings, tokenize, feedback, moderations, the operator's admin routes, status and the chat page.
Each registers its own routes; app.py mounts them.

Imports of chatd/http: every package but openapi/ (which describes the routes) and the top level
(app.py, serve.py). A route module may import another route module (responses.py reuses
conversations.py's move).
"""
