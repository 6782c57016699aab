"""Knowing the stages: how each one comes up and stays up.

``monitor``      one StageMonitor per stage: InitStatus and health, READY/FAILED/DOWN
``watchdog``     the pausable init watchdog each monitor drives (plain, fake-clock tested)
``init_clock``   the watchdog's time: counted and paused seconds, the stall timer
``health_probe`` a stage's grpc health: serving or not, and watching a READY one
``resolver``     the replicas a stage's address names (``ipv4:`` lists, ``dns:`` names)
``kube_source``  a stage's ready Pods, watched through the Kubernetes API (``pods:``)
``replicas``     every replica of a stage: found, health-polled; picks one (ReplicaSet)
``replica``      one replica: its channel, its state from its health, its load
``routing``      which replica a new request goes to: least outstanding, round robin,
                 affinity per conversation
``status_feed``  who hears of a stage's status: callbacks and ``changes()`` readers
"""
