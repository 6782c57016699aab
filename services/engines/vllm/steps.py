"""How many requests each of vLLM's scheduler steps ran, from its stat loggers.

vLLM hands every step's ``SchedulerStats`` to the stat loggers an engine is built
with; ``StepCounts`` keeps the running-request count of the last steps, so that
batching is seen as the scheduler did it (requests per step), not guessed from when
tokens arrive. vLLM is imported only inside ``factory``: it is not in the main venv.
"""

from __future__ import annotations

from collections import deque
from typing import Any

KEPT = 4096  # steps remembered


class StepCounts:
    def __init__(self) -> None:
        self.running: deque[int] = deque(maxlen=KEPT)

    def factory(self) -> Any:
        """A vLLM ``StatLoggerFactory`` recording into this."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        counts = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any
            ) -> None:
                if scheduler_stats is not None:
                    counts.running.append(int(scheduler_stats.num_running_reqs))

            def log_engine_initialized(self) -> None:
                pass

        return _Logger
