"""The stage side of Omni Mesh: shared plumbing, the stage service, engines."""
