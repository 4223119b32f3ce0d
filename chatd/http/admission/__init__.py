"""Admission: whether a tenant's request may start now under its tier's limits. limits.py is the
entry (Limits, Lease). It goes down into tier_checks.py (every check, in order; a refusal worded
by refusals.py), then into the holder's Budget (buckets.py: token buckets, in memory or in Redis)
to take, then into queued_work.py (the prompt work waiting for a first token) to queue, and
comes back from each once: no module here calls back up into limits.py.

Imports of chatd/http: errors.py and telemetry/.
"""
