"""Tests of knowing the stages (orchestrator/stages/): monitors, the init
watchdog, health after a stage loss, the start-up view."""
