"""Waiting for a condition in tests: poll with a deadline, never a fixed sleep."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    predicate: Callable[[], T | Awaitable[T]],
    timeout_s: float,
    *,
    interval: float = 0.1,
    message: str | Callable[[], str] = "",
) -> T:
    """``predicate()`` (awaited if it is a coroutine) once it is truthy, polled every
    ``interval`` seconds; AssertionError (with ``message``, or what it returns then)
    when it is not within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            said = message() if callable(message) else message
            raise AssertionError(f"not true within {timeout_s:g}s" + (f": {said}" if said else ""))
        await asyncio.sleep(interval)
