"""Reusable test helpers: real servers on loopback."""
