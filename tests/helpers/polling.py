"""Polling with a deadline, instead of fixed sleeps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T]],
    accept: Callable[[T], bool] = bool,
    *,
    timeout: float = 30.0,  # noqa: ASYNC109 (the name the brief gives every caller)
    every: float = 0.1,
) -> T:
    """``await probe()`` until ``accept`` takes its value (returned); AssertionError
    with the last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if accept(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s; last: {value!r}")
        await asyncio.sleep(every)
