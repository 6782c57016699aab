"""Telemetry of every mesh process, off unless configured and free then.

tracing.py  OpenTelemetry set-up from the standard environment, spans, context
            carried in gRPC metadata (``tracing.ENABLED`` is read at each use:
            import the module, not the flag)
metrics.py  the metric instruments, named once
"""
