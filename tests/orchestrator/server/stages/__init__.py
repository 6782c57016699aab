"""Tests of knowing the stages (orchestrator/server/stages/): monitors, the init
watchdog, health after a stage loss."""
