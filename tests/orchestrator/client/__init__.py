"""Tests of the Python client library (orchestrator/client/)."""
