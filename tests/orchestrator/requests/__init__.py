"""Tests of moving requests (orchestrator/requests/): lanes, windows, sinks,
routing, shared stage streams, telemetry, what crosses each seam."""
