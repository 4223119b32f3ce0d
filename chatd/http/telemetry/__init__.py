"""What the server tells its operator about itself while it runs: Prometheus metrics (metrics.py,
on the collectors of metric_collectors.py) and OpenTelemetry traces (tracing.py, exported by
trace_export.py, which is imported only when [tracing] names an endpoint).

Imports of chatd/http: errors.py only. Everything above counts and traces through it.
"""
