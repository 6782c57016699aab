"""Render charts/ offline with real Helm (helm-python-sdk: the Helm v4 Go SDK) for
tests and for local play under podman.

    python -m tests.deploy.chart -f charts/ci/podman-values.yaml > rendered.yaml

prints the manifests as one multi-document YAML in Helm's install order
(claims and ConfigMaps before the workloads that mount them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import helm_python
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "charts"
# Helm's own install order for the kinds this chart renders.
KIND_ORDER = (
    "NetworkPolicy",
    "PodDisruptionBudget",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "PersistentVolumeClaim",
    "Role",
    "RoleBinding",
    "Service",
    "Deployment",
)


def load_values(*paths: str | Path) -> dict[str, Any]:
    """Values files merged in order, later keys winning (as `helm -f a -f b`)."""
    merged: dict[str, Any] = {}
    for path in paths:
        merged = merge(merged, yaml.safe_load(Path(path).read_text()) or {})
    return merged


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def render(
    values: Mapping[str, Any] | None = None, *, name: str = "omni", namespace: str = "default"
) -> list[dict[str, Any]]:
    """Every rendered manifest, parsed, in install order."""
    chart = helm_python.Chart.load(CHART_DIR)
    rendered = chart.render(values=dict(values or {}), name=name, namespace=namespace)
    docs = [
        doc
        for path, text in sorted(rendered.items())
        if path.endswith((".yaml", ".yml"))
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    rank = {kind: i for i, kind in enumerate(KIND_ORDER)}
    return sorted(docs, key=lambda d: rank.get(d["kind"], len(rank)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render charts/ with real Helm, offline.")
    parser.add_argument("-f", "--values", action="append", default=[], help="a values file")
    parser.add_argument("--name", default="omni", help="the release name")
    parser.add_argument("--namespace", default="default")
    args = parser.parse_args(argv)
    docs = render(load_values(*args.values), name=args.name, namespace=args.namespace)
    sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
