"""The stage service: gRPC server, init-phase bus, model fetch, segmenter, intake."""
