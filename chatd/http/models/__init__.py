"""The chat models a server serves: one model and its engine (served_model.py), the fleet that
picks which model serves a request and which stay loaded (fleet.py), an escalating alias's
small-then-large choice (escalation.py), and canary ramps moved by measurement (canary.py).

Imports of chatd/http: errors.py, telemetry/ and tools/ (a model's tool-call format).
"""
