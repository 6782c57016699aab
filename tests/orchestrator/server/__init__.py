"""Tests of the orchestrator server (orchestrator/server/). At this folder's top, the
whole server as its clients see it (server.py, servicer.py, front_door.py, the
pipeline file, content parts): status, input budget, security; below it, one folder
per subpackage (requests/, stages/, scaling/)."""
