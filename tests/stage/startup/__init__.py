"""Tests of a stage's start-up (services/stage/startup/): device lock, init bus,
InitStatus events."""
