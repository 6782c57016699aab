"""Which replica of a stage a new request goes to: the routing policy and affinity.

Among the replicas that take requests (READY and still listed): the one with
the least outstanding work (this orchestrator's requests in flight, and those of
other clients it says it holds; ties between idle ones to the one given a request
least recently, between busy ones to the one that finished a request last), or
each in turn (``round_robin``, for comparison). With affinity,
a conversation's requests go to the replica its last one went to, while that
one takes requests; the ``MAX_AFFINITY_KEYS`` most recent conversations are
remembered. Waiting until some replica takes requests is the ReplicaSet's
(``replicas``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from typing import Literal

from orchestrator.server.stages.replica import Replica

Routing = Literal["least_outstanding", "round_robin"]
MAX_AFFINITY_KEYS = 65536  # conversations remembered per stage


class ReplicaChooser:
    """One stage's choice of replica: by ``routing``, per conversation with ``affinity``."""

    def __init__(self, routing: Routing, affinity: bool) -> None:
        self._routing = routing
        self._by_conversation = affinity
        self._turn = itertools.count()
        self._picks = itertools.count(1)  # when each replica was last given a request
        # Conversation -> the address its requests go to, the least recently used first.
        self._affinity: OrderedDict[str, str] = OrderedDict()

    def pick_now(self, replicas: Mapping[str, Replica], affinity: str = "") -> Replica | None:
        """The replica a new request goes to now (``affinity``: its conversation's
        key), None if none takes requests."""
        key = affinity if self._by_conversation else ""
        kept = replicas.get(self._affinity.get(key, "")) if key else None
        if kept is not None and kept.takes_requests:
            self._affinity.move_to_end(key)
            return kept
        replica = self.choose(replicas.values())
        if replica is not None and key:
            self._affinity[key] = replica.address
            while len(self._affinity) > MAX_AFFINITY_KEYS:
                self._affinity.popitem(last=False)
        return replica

    def choose(
        self, replicas: Iterable[Replica], exclude: Collection[Replica] = ()
    ) -> Replica | None:
        """The replica that takes requests a request goes to now (``routing``),
        None if there is none."""
        ready = [r for r in replicas if r.takes_requests and r not in exclude]
        if not ready:
            return None
        if self._routing == "round_robin":
            ready.sort(key=lambda r: r.address)
            return ready[next(self._turn) % len(ready)]
        # Ties between idle replicas go to the one given a request least recently, so
        # requests one at a time still visit every replica. Ties between busy ones go
        # to the one that finished a request last: one held by a long answer has not,
        # and a request sent there would queue behind it.
        chosen = min(
            ready, key=lambda r: (r.outstanding, -r.finished_at if r.outstanding else r.picked)
        )
        chosen.picked = next(self._picks)
        return chosen
