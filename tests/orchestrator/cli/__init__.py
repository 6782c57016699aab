"""Tests of the omni CLI (cli.py, commands.py, up.py, outputs.py) and the
example pipelines it runs."""
