"""A generation's trip, shared by every generating route: the pipeline of named stages
(pipeline.py: pick, check, screen, render, grammar, admit, launch), and stored turns generated in
the background that clients follow (turns.py; message_turn.py for conversations, response_turn.py
for the Responses API, their prompts from history.py).

Imports of chatd/http: errors.py and every package below routes/ (telemetry/, tools/, openai/,
admission/, models/, server/).
"""
