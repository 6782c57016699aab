"""Tests of the orchestrator as its clients see it (server.py, servicer.py,
front_door.py, content.py): status, input budget, content parts, security."""
