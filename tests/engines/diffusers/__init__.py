"""Tests of the diffusers engine (services/engines/diffusers/)."""
