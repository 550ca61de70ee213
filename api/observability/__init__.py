"""What the server tells operators: `health` (/health), `metrics` (/metrics), `request_log` (one
line per request, the record metrics read), `tracing` and `trace_spans` (OpenTelemetry)."""
