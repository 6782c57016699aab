"""``KvBudget``: the stage's KV memory plan as the text runners' padded cache spends
it, which decides whether a batch fits (the scheduler asks through the runner's
``fits``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.engines.transformers.text_request import TextRequest


@dataclass(frozen=True)
class KvBudget:
    """The stage's KV memory plan, ``pages`` of ``page_size`` token positions, as this
    cache spends it: the cache is padded (every row as wide as its batch's widest), so
    a batch costs its rows times its widest row's pages."""

    pages: int
    page_size: int

    def fits(self, members: Sequence[TextRequest]) -> bool:
        if not members:
            return True
        widest = max(math.ceil(s.final_length / self.page_size) for s in members)
        return len(members) * widest <= self.pages
