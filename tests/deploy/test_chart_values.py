"""Values the chart refuses, each naming the value: its schema
(values.schema.json) and the cross-references its templates check."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tests.deploy.chart import merge, render
from tests.deploy.manifests import GROUP

REFUSED = [
    # values.schema.json
    ({"stages": {"thinker": {"gpus": -1}}}, "/stages/thinker/gpus"),
    ({"stages": {"thinker": {"engine": "tensorrt"}}}, "/stages/thinker/engine"),
    ({"stages": {"thinker": {"replicas": "two"}}}, "/stages/thinker/replicas"),
    ({"stages": {"thinker": {"port": 70000}}}, "/stages/thinker/port"),
    ({"stages": {"thinker": {"gpu": 1}}}, "'gpu'"),
    ({"stages": {"Thinker_2": {"engine": "transformers", "port": 50060}}}, "'Thinker_2'"),
    ({"stages": {"thinker": {"settings": {"model": "x"}}}}, "/stages/thinker/settings/model"),
    ({"securityContext": {"runAsUser": 0}}, "/securityContext/runAsUser"),
    ({"modelCache": {"type": "hostPath"}}, "/modelCache/type"),
    ({"meshId": "Mesh_1"}, "/meshId"),
    ({"groups": {"pair": {"replicas": -1}}}, "/groups/pair/replicas"),
    ({"probes": {"periodSeconds": 0}}, "/probes/periodSeconds"),
    # cross-references the templates check
    ({"stages": {"renderer": {"port": 50051}}}, "stages.thinker.port: 50051 is already taken"),
    ({"orchestrator": {"port": 50051}}, "stages.thinker.port: 50051 is already taken"),
    (
        {"stages": {"renderer": {"port": 51051}}},
        "health port 51051 (port + probes.healthPortOffset) is already taken by stage renderer",
    ),
    (
        {"stages": {"renderer": {"port": 65000}}},
        "health port 66000 (port + probes.healthPortOffset) is above 65535",
    ),
    (merge(GROUP, {"stages": {"thinker": {"replicas": 2}}}), "stages.thinker.replicas"),
    (merge(GROUP, {"groups": {"pair": {"replicas": 2}}}), "groups.pair.replicas"),
    ({"groups": {"lonely": {}}}, "groups.lonely: no stage names this group"),
    ({"stages": {"renderer": {"group": "thinker"}}}, "stages.renderer.group"),
    ({"pipeline": {"edges": [{"from": "thinker", "to": "rendrer"}]}}, "pipeline.edges.0.to"),
    ({"pipeline": {"outputs": ["talker"]}}, "pipeline.outputs.0"),
]


@pytest.mark.parametrize(("values", "named"), REFUSED, ids=[n for _, n in REFUSED])
def test_bad_values_are_refused_naming_the_value(values: dict[str, Any], named: str) -> None:
    with pytest.raises(helm_python.HelmError) as refused:
        render(values)
    assert named in str(refused.value)
