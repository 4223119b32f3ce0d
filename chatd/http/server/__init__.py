"""The server's own plumbing: what every handler shares (state.py: the models, the store, the
limits, readiness), reading bodies and writing streams (wire.py, heartbeats.py), who is calling
(auth.py), CORS (cors.py), the request log (request_log.py), Idempotency-Key (idempotency.py),
the safety pipeline around a generation (safety.py), and the start and stop as probes see them
(starting.py).

Imports of chatd/http: errors.py, telemetry/, tools/, openai/, admission/ and models/.
"""
