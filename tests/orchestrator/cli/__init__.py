"""Tests of the omni CLI (orchestrator/cli/: main.py, commands.py, up.py, outputs.py,
the start-up view) and the example pipelines it runs."""
