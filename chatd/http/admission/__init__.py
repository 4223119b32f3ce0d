"""Admission: whether a tenant's request may start now under its tier's limits. limits.py is
the entry (Limits, Lease); below it buckets.py (token buckets, in memory or in Redis),
queued_work.py (the prompt work waiting for a first token) and refusals.py (how a refusal is
worded).

Imports of chatd/http: errors.py and telemetry/.
"""
