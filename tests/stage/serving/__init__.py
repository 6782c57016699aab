"""Tests of a stage serving requests (services/stage/serving/): admission,
budgets, limits, per-request credit, batching."""
