"""Tests of the stage service."""
