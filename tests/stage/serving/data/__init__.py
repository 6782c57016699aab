"""Tests of a stage's data plane (services/stage/serving/: inputs, transforms,
content, tensor_io): tensors and media in and out."""
