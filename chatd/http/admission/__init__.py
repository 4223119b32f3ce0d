"""Admission: whether a tenant's request may start now under its tier's limits. limits.py is
the entry (Limits, Lease) and the only module that calls the others; it goes down into
tier_checks.py (the checks, in order) and comes back once. Below: buckets.py (token buckets, in
memory or in Redis), queued_work.py (the prompt work waiting for a first token), refusals.py (how
a refusal is worded). None of these call back up.

Imports of chatd/http: errors.py and telemetry/.
"""
