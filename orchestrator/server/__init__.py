"""The Orchestrator process: one mesh's stages behind one gRPC service.

``server``          OrchestratorServer: the gRPC server, the stage monitors, the router;
                    ``start()``, ``wait()``, ``stop()``
``servicer``        the Orchestrator service's methods, thin adapters over those
``peers``           the other orchestrators over the same stages: calls passed on
``pipeline``        the pipeline file, validated once into frozen models
``pipeline_graph``  its graph checks: names, edges, one entry, no cycles
``front_door``      its ``runtime:`` section: what clients may hold
``stages/``         knowing the stages: monitors, the init watchdog, replicas
``requests/``       moving requests: router, flow, submits, windows, sinks
``scaling/``        what each stage is asked for, told to KEDA

It never imports the client library or the CLI (import-linter).
"""
