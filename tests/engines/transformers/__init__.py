"""Tests of the transformers engine (services/engines/transformers/)."""
