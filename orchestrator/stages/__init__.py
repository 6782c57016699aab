"""Knowing the stages: how each one comes up, stays up and is started.

``monitor``   one StageMonitor per stage: InitStatus and health, READY/FAILED/DOWN
``watchdog``  the pausable init watchdog each monitor drives (plain, fake-clock tested)
``progress``  the start-up view ``omni up`` draws from the monitors
``launcher``  starts, restarts and stops stage processes for ``omni up``
``processes`` our servers as child processes (stages and the orchestrator)
"""
