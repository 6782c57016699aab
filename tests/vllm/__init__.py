"""Tests of the vllm engine (services/engines/vllm/), without vLLM and on a GPU."""
