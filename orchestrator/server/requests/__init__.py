"""Moving requests: from the client's first Submit to its one Done.

``router``          requests in flight: start, abort, pause, stage loss
``gate``            a request waits (bounded) for the stages it needs to be READY
``flow``            one request through the pipeline's stages
``submits``         the Submits a request sends a stage: built and completed in one place
``errors``          what ends a request inside the orchestrator, each with its status
``stage_mux``       requests over the shared streams of every replica: which
                    stream a request joins, reopened, retired, moved on a break
``replica_stream``  one long-lived Generate stream to one replica: its writer,
                    its reader handing each output to its request by id
``request_stream``  one request's share of a replica's stream: its outputs, its credit
``lanes``           one edge of one request: the windows in flight and the watermarks
``windows``         one edge of one request: -1 / N window state over segments
``sink``            the bounded queue of events for one client stream
``client_event``    a stage's output as its client gets it (its id, no edge's hidden states)
``client_input``    what a client sends (Generate, GenerateStream) onto the router
``observe``         spans and metrics of requests (telemetry)
"""
