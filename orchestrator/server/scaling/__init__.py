"""Stages that grow with their queue: what each stage is asked for, told to an autoscaler.

``demand``   per stage: requests waiting for it and in flight at its replicas
``trigger``  what a KEDA trigger's metadata asks: which stage, what target per replica
``keda``     KEDA's external-scaler gRPC service (protos/externalscaler), on the
             orchestrator's own port
"""
