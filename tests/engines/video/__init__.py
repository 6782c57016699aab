"""Tests of the video engine (services/engines/video/)."""
