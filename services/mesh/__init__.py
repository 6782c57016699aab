"""Plumbing shared by stages and the orchestrator: stubs, errors, tensor codec."""
