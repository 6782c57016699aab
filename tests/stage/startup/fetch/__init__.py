"""Tests of model fetch (services/stage/startup/fetch/): local, HTTP, the Hub,
a download stopped."""
