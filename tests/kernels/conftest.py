"""The kernels under test, once per variant the build has: each test that takes the
``variant`` fixture runs on that variant (``kernels.using``), and one this CPU lacks
is skipped, naming what it lacks. Without the library every test here is skipped
saying why, and fails under CI=true: a CI run never passes without the fast path."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from services import kernels
from services.kernels import library

VARIANTS = library.build_variants()


@pytest.fixture(autouse=True)
def _built() -> None:
    why = kernels.unavailable()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI: {why}")
        pytest.skip(why)


@pytest.fixture(params=VARIANTS or ["none"])
def variant(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test on one variant of the kernels."""
    name = request.param
    if name not in kernels.runnable():
        pytest.skip(f"the {name} kernels cannot run here: this CPU lacks {library.lacks(name)}")
    with kernels.using(name):
        yield name
