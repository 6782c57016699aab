"""A blocking Hugging Face ``generate`` run in a thread, its steps read as they come.

The thinker's tokens (a streamer's ``put``) and the talker's codes (a forward
hook) are produced inside ``generate``; ``Steps`` carries each one to the
engine's async generator on the event loop, then the call's result or its
error. Closing the reader (``aclosing``: a nested async generator left by a
closed one is otherwise closed later, by the loop) stops the thread at its next
step (a stopping criterion) and waits for it, so a cancelled request neither
runs on to max_tokens nor overlaps the next one on the model.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable
from typing import Any

from services.engines.loop_post import loop_post

_DONE = object()


class Steps:
    def __init__(self) -> None:
        self._post = loop_post(asyncio.get_running_loop())
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.stopped = threading.Event()
        self.result: Any = None

    def put(self, item: Any) -> None:
        """From the generating thread: one step's output."""
        self._post.post(self._queue.put_nowait, item)

    def stop_requested(self, *_: Any, **__: Any) -> bool:
        """A stopping criterion for ``generate``: the reader went away."""
        return self.stopped.is_set()

    async def run(self, call: Callable[[], Any]) -> AsyncGenerator[Any, None]:
        """Each step ``call`` puts, in order; then ``self.result`` holds its return."""

        def work() -> None:
            try:
                self.result = call()
                self.put(_DONE)
            except BaseException as exc:  # handed to the reader, raised there
                self.put(exc)

        task = asyncio.create_task(asyncio.to_thread(work))
        try:
            while (item := await self._queue.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.stopped.set()
            await asyncio.shield(task)
