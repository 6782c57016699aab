"""The ``omni`` command (console script ``orchestrator.cli.main:main``).

``main``       argument parsing: a thin dispatcher to the subcommands
``commands``   what ``omni stage``, ``omni orchestrator serve`` and ``omni generate`` do
``up``         ``omni up``: one pipeline on this machine, from start-up to stop
``launcher``   starts, restarts and stops ``omni up``'s stage processes, and its orchestrator
``processes``  our servers as child processes (stages, the orchestrator, the gateway)
``progress``   the start-up view ``omni up`` draws from the stage monitors
``mesh_pki``   ``omni up``'s trust: mesh token, tokens file, a throwaway CA for ``--tls``
``outputs``    a request's tensor and image outputs written to files (``omni generate``)

It sits on the server and the client library; neither imports it (import-linter).
"""
