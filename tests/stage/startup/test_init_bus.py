from __future__ import annotations

import asyncio
import threading

from services.mesh.pb.omni.v1 import stage_pb2
from services.stage.startup.init_bus import InitBus


async def test_replays_history_then_follows_live_events_and_ends_at_ready() -> None:
    ticks = iter(range(100))
    bus = InitBus("s", asyncio.get_running_loop(), clock=lambda: float(next(ticks)))
    bus.publish(stage_pb2.STARTING)
    bus.publish(stage_pb2.DOWNLOAD_START, source="x")

    early = bus.follow()
    # The history first, then it waits for what comes live.
    seen = [(await anext(early)).phase for _ in range(2)]
    waiting = asyncio.ensure_future(anext(early))
    # Publishing from another thread, as the model fetch does.
    worker = threading.Thread(target=bus.publish, args=(stage_pb2.DOWNLOAD_DONE,))
    worker.start()
    worker.join()
    seen.append((await asyncio.wait_for(waiting, 1)).phase)
    bus.publish(stage_pb2.READY)
    bus.publish(stage_pb2.LOAD_START)  # after READY: never delivered to followers
    seen += [e.phase async for e in early]
    expected = [
        stage_pb2.STARTING,
        stage_pb2.DOWNLOAD_START,
        stage_pb2.DOWNLOAD_DONE,
        stage_pb2.READY,
    ]
    assert seen == expected
    late = [e async for e in bus.follow()]  # a late follower gets the same replay
    assert [e.phase for e in late] == expected
    assert all(e.stage == "s" and e.wall_time.seconds > 0 for e in late)
    assert [e.monotonic_s for e in late] == sorted(e.monotonic_s for e in late)
    assert bus.phase == stage_pb2.LOAD_START
