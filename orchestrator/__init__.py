"""The orchestrator side: watchdog, pipeline config, router, server, client, CLI, launcher.

It talks to stages only through the contract in protos/ (services.mesh), never
by importing stage or engine code.
"""
