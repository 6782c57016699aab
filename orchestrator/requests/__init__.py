"""Moving requests: from the client's first Submit to its one Done.

``router``   requests in flight: start, abort, pause, stage loss
``flow``     one request through the pipeline's stages
``lanes``    one edge of one request: the windows in flight and the watermarks
``windows``  one edge of one request: -1 / N window state over segments
``sink``     the bounded queue of events for one client stream
``streams``  GenerateStream: a client's input stream onto the router
"""
