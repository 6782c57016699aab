"""Tests of moving requests (orchestrator/server/requests/): lanes, windows, sinks,
routing, shared stage streams, telemetry, what crosses each seam."""
