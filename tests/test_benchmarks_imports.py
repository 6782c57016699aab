"""The benchmarks run from an installed package: none imports ``tests`` (or names a
module of it for a stage to load) or edits ``sys.path``, and the package list that
``pip install`` reads ships them and what they share with the tests
(``services.testing``). lint-imports checks the imports too (pyproject); this also
sees imports inside functions and a stage's ``engine:`` string."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((REPO / "benchmarks").glob("*.py"))


def reaches_outside(source: str) -> list[str]:
    """What in ``source`` imports ``tests``, names a module of it, or touches
    ``sys.path``; one line each, by line number."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.startswith("tests.") else []
        elif isinstance(node, ast.Attribute) and node.attr == "path":
            value = node.value
            names = ["sys.path"] if isinstance(value, ast.Name) and value.id == "sys" else []
        else:
            continue
        found += [
            (node.lineno, name)
            for name in names
            if name == "sys.path" or name == "tests" or name.startswith("tests.")
        ]
    return [f"{line}: {name}" for line, name in sorted(found)]


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_a_benchmark_reaches_nothing_outside_the_installed_packages(path: Path) -> None:
    assert reaches_outside(path.read_text()) == []


def test_the_installed_packages_hold_the_benchmarks_and_the_shared_helpers() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = set(find_packages(str(REPO), include=include))
    assert {"benchmarks", "services.testing", "services", "orchestrator"} <= shipped
    assert not any(p == "tests" or p.startswith("tests.") for p in shipped)


def test_the_checker_finds_each_way_out() -> None:
    source = (
        "import sys\n"
        "import tests.helpers.stage\n"
        "from tests.helpers import stage\n"
        "from tests import helpers\n"
        "sys.path.insert(0, '.')\n"
        "def later():\n"
        "    from tests.hostile.idle_flood import IdleFlood\n"
        "config = {'engine': 'tests.helpers.media_engine:MediaEngine'}\n"
        "from testsuite import x\n"
        "from . import tests\n"
        "import os.path\n"
    )
    assert reaches_outside(source) == [
        "2: tests.helpers.stage",
        "3: tests.helpers",
        "4: tests",
        "5: sys.path",
        "7: tests.hostile.idle_flood",
        "8: tests.helpers.media_engine:MediaEngine",
    ]
