from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from orchestrator.cli.processes import StageProcess
from orchestrator.server.pipeline import Edge, PipelineConfig, load_pipeline, parse_pipeline
from services.mesh.config_files import ConfigError

ROOT = Path(__file__).resolve().parents[3]

TWO = """\
name: omni-demo
stages:
  - name: thinker
    address: 127.0.0.1:50051
  - name: renderer
    address: 127.0.0.1:50052
edges:
  - from: thinker
    to: renderer
    window: 4
    transform: hidden_states_to_prompt_embeds
"""


def three() -> dict[str, Any]:
    """thinker -> talker -> vocoder, plus thinker -> renderer: a tree with two leaves."""
    stages = [{"name": n, "address": f"127.0.0.1:{5000 + i}"} for i, n in enumerate("tarv")]
    return {
        "name": "tree",
        "stages": stages,
        "edges": [
            {"from": "t", "to": "a", "window": 1},
            {"from": "t", "to": "r"},
            {"from": "a", "to": "v", "window": 8, "high_watermark": 8, "low_watermark": 2},
        ],
    }


def test_two_stage_file(tmp_path: Path) -> None:
    path = tmp_path / "pipe.yaml"
    path.write_text(TWO)
    config = load_pipeline(path)
    edge = config.edges[0]
    assert (edge.from_, edge.to, edge.window) == ("thinker", "renderer", 4)
    assert edge.transform == "hidden_states_to_prompt_embeds"
    assert (edge.high_watermark, edge.low_watermark) == (64, 16)
    assert config.entry == "thinker" and config.order == ("thinker", "renderer")
    assert config.outputs == ("renderer",)
    assert config.children("thinker") == (edge,) and config.children("renderer") == ()
    assert config.incoming("renderer") is edge and config.incoming("thinker") is None
    assert config.stage("thinker").init_timeout_s == 600.0
    assert config.watchdog.paused_phases == {"download"}
    with pytest.raises(KeyError, match="unknown stage 'nope'"):
        config.stage("nope")
    with pytest.raises(ValueError, match="frozen"):
        config.stages[0].address = "x:1"  # type: ignore[misc]


def test_three_stage_tree_order_children_and_outputs() -> None:
    config = parse_pipeline(three())
    assert config.entry == "t"
    assert config.order == ("t", "a", "r", "v")
    assert [e.to for e in config.children("t")] == ["a", "r"]
    assert config.outputs == ("r", "v")  # leaves, in order
    assert parse_pipeline({**three(), "outputs": ["v", "t"]}).outputs == ("v", "t")


def test_single_stage_is_its_own_entry_and_output() -> None:
    config = parse_pipeline({"name": "solo", "stages": [{"name": "s", "address": "h:1"}]})
    assert (config.entry, config.order, config.outputs) == ("s", ("s",), ("s",))


def test_from_alias_round_trips() -> None:
    edge = Edge.model_validate({"from": "a", "to": "b"})
    assert edge.from_ == "a" and edge.model_dump(by_alias=True)["from"] == "a"
    assert edge.window == -1 and edge.transform == ""


def test_launch_paths_resolve_against_the_pipeline_file(tmp_path: Path) -> None:
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "thinker.yaml").write_text("name: thinker\n")
    path = tmp_path / "pipe.yaml"
    data = yaml.safe_load(TWO)
    data["stages"][0] = {"name": "thinker", "launch": "stages/thinker.yaml"}
    path.write_text(yaml.safe_dump(data))
    config = load_pipeline(path)
    assert config.stage("thinker").launch == (tmp_path / "stages" / "thinker.yaml").resolve()
    assert config.stage("thinker").address is None
    with pytest.raises(ValueError, match="'thinker' has no address yet"):
        config.stage("thinker").require_address()

    launched = config.with_addresses({"thinker": "127.0.0.1:41000"})
    assert launched is not config
    assert launched.stage("thinker").require_address() == "127.0.0.1:41000"
    assert config.stage("thinker").address is None  # the original is untouched
    assert launched.stage("renderer") == config.stage("renderer")
    with pytest.raises(ValueError, match="host:port"):
        config.with_addresses({"thinker": "nowhere"})
    with pytest.raises(KeyError):
        config.with_addresses({"ghost": "h:1"})


def test_missing_launch_file_names_where_it_looked(tmp_path: Path) -> None:
    path = tmp_path / "pipe.yaml"
    data = yaml.safe_load(TWO)
    data["stages"][1]["launch"] = "stages/renderer.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_pipeline(path)
    message = str(err.value)
    assert message.startswith(f"{path}: stages.1.launch: expected a stage file")
    assert str(tmp_path / "stages" / "renderer.yaml") in message


def test_transform_names_are_names_and_the_stages_say_which_exist(tmp_path: Path) -> None:
    path = tmp_path / "pipe.yaml"
    path.write_text(TWO.replace("hidden_states_to_prompt_embeds", "Hidden States!"))
    with pytest.raises(ConfigError) as err:
        load_pipeline(path)
    assert str(err.value).startswith(f"{path}: edges.0.transform:")
    # A well-formed name the file cannot know about: the consuming stage's
    # Describe decides once it is up (tests/orchestrator/server/requests/test_routing.py).
    path.write_text(TWO.replace("hidden_states_to_prompt_embeds", "hidden_to_embeds"))
    assert load_pipeline(path).edges[0].transform == "hidden_to_embeds"


def test_a_stage_alone_is_on_no_edge_and_listed_last() -> None:
    # The renderer leaves the tree for a side of its own (the default pipeline's
    # recogniser): reached by its name alone, never a request's entry or output.
    data = three()
    data["edges"].pop(1)
    data["stages"][2]["alone"] = True
    data["stages"].insert(0, data["stages"].pop(2))  # listed first in the file
    config = parse_pipeline(data, "pipe.yaml")
    assert config.entry == "t" and config.order == ("t", "a", "v")
    assert config.outputs == ("v",) and config.listed == ("t", "a", "v", "r")


def edit(change: Any) -> dict[str, Any]:
    data = three()
    change(data)
    return data


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            edit(lambda d: d["edges"][1].update(to="rendrer")),
            "edges.1.to: unknown stage; expected one of t, a, r, v (got 'rendrer')",
        ),
        (
            edit(lambda d: d["edges"][0].update({"from": "x"})),
            "edges.0.from: unknown stage; expected one of t, a, r, v (got 'x')",
        ),
        (
            edit(lambda d: d["stages"][2].update(name="t")),
            "stages.2.name: duplicate stage name (first at stages.0) (got 't')",
        ),
        (
            edit(lambda d: d["stages"][1].update(name="-a")),
            "stages.1.name: String should match pattern",
        ),
        (
            edit(lambda d: d["stages"][0].pop("address")),
            "stages.0.address: expected host:port, or a launch file to start the stage (got None)",
        ),
        (
            edit(lambda d: d["stages"][0].update(address="127.0.0.1:70000")),
            "stages.0.address: expected host:port with a port in 1-65535 (got '127.0.0.1:70000')",
        ),
        (
            edit(lambda d: d["stages"][0].update(address="127.0.0.1")),
            "stages.0.address: expected host:port",
        ),
        (
            edit(lambda d: d["edges"].append({"from": "r", "to": "r"})),
            "edges.3.to: expected another stage (no self-edges) (got 'r')",
        ),
        (
            edit(lambda d: d["edges"].append({"from": "a", "to": "r"})),
            "edges.3.to: expected at most one edge into a stage, and edges.1 already leads here "
            "(fan-in is not supported yet) (got 'r')",
        ),
        (
            # t -> a -> v -> t: no stage is left without an incoming edge.
            edit(lambda d: d["edges"].extend([{"from": "v", "to": "t"}])),
            "edges.3.to: expected no cycles, found t -> a -> v -> t (got 't')",
        ),
        (
            edit(lambda d: d["edges"].pop(1)),
            "stages.2.name: stage is not reachable from the entry stage 't'; expected an edge "
            "leading to it (a pipeline has exactly one entry), or alone: true (got 'r')",
        ),
        (
            edit(lambda d: d["stages"][2].update(alone=True)),
            "edges.1.to: a stage alone is on no edge (requests reach it by its name) (got 'r')",
        ),
        (
            edit(
                lambda d: (
                    d["edges"].pop(1),
                    d["stages"][2].update(alone=True),
                    d.update(outputs=["v", "r"]),
                )
            ),
            "outputs.1: a stage alone is on no request's path (its own requests reach the "
            "client) (got 'r')",
        ),
        (
            edit(lambda d: d["edges"][2].update(low_watermark=8)),
            "edges.2.low_watermark: expected less than high_watermark (8) (got 8)",
        ),
        (
            edit(lambda d: d["edges"][0].update(window=0)),
            "edges.0.window: expected -1 (full trigger) or a window of at least 1 item (got 0)",
        ),
        (
            edit(lambda d: d.update(outputs=["v", "w"])),
            "outputs.1: unknown stage; expected one of t, a, r, v (got 'w')",
        ),
        (edit(lambda d: d.update(outputs=["v", "v"])), "outputs.1: expected each stage once"),
        (
            edit(lambda d: d.update(watchdog={"paused_phases": ["download", "warmup"]})),
            "watchdog.paused_phases.1: Input should be 'download' or 'load' (got 'warmup')",
        ),
        (edit(lambda d: d["edges"][0].update(form="t")), "edges.0.form: unknown key"),
        (edit(lambda d: d.update(stages=[])), "stages: Tuple should have at least 1 item"),
        (edit(lambda d: d.update(outputs=[])), "outputs: Tuple should have at least 1 item"),
    ],
)
def test_errors_name_the_file_and_the_path(data: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_pipeline(data, "pipe.yaml")
    assert f"pipe.yaml: {expected}" in str(err.value).splitlines()[0]


def test_a_cycle_beside_the_entry_is_reported_once() -> None:
    # t -> a and r <-> v: r and v both have a parent, so t stays the only root.
    data = edit(
        lambda d: d.update(
            edges=[{"from": "t", "to": "a"}, {"from": "r", "to": "v"}, {"from": "v", "to": "r"}]
        )
    )
    with pytest.raises(ConfigError) as err:
        parse_pipeline(data, "pipe.yaml")
    expected = "pipe.yaml: edges.2.to: expected no cycles, found r -> v -> r (got 'r')"
    assert str(err.value) == expected


def test_every_problem_in_a_group_is_reported() -> None:
    data = edit(lambda d: (d["edges"][0].update(to="x"), d["edges"][1].update(to="y")))
    with pytest.raises(ConfigError) as err:
        parse_pipeline(data, "pipe.yaml")
    lines = str(err.value).splitlines()
    assert [line.split(":")[1].strip() for line in lines] == ["edges.0.to", "edges.1.to"]


def test_models_built_in_python_are_checked_the_same_way() -> None:
    assert PipelineConfig.model_validate(three()).entry == "t"
    with pytest.raises(ValidationError) as err:
        PipelineConfig.model_validate(edit(lambda d: d["edges"][1].update(to="t")))
    assert err.value.errors()[0]["loc"] == ("edges", 1, "to")


def test_first_window_belongs_to_a_window_of_n(tmp_path: Path) -> None:
    path = tmp_path / "pipe.yaml"
    path.write_text(TWO.replace("window: 4", "window: -1\n    first_window: 2"))
    with pytest.raises(ConfigError) as err:
        load_pipeline(path)
    assert str(err.value).startswith(f"{path}: edges.0.first_window: expected a window of N")
    path.write_text(TWO.replace("window: 4", "window: 8\n    first_window: 2"))
    edge = load_pipeline(path).edges[0]
    assert (edge.window, edge.first_window) == (8, 2)


def test_a_stage_runs_under_the_python_its_pipeline_names(tmp_path: Path) -> None:
    (tmp_path / "thinker.yaml").write_text("name: thinker\nengine: nope\n")  # refused: exit 2
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    said = tmp_path / "argv.txt"
    python = venv / "python"  # a stand-in venv Python: says how it was run, then runs
    python.write_text(f'#!/bin/sh\necho "$0 $*" > {said}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    data = {"name": "p", "stages": [{"name": "thinker", "launch": "thinker.yaml"}]}
    data["stages"][0]["python"] = "venv/bin/python"  # relative to the pipeline file
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(data))
    stage = load_pipeline(tmp_path / "pipe.yaml").stage("thinker")
    assert stage.python == python
    process = StageProcess(
        stage.launch or Path(), python=stage.python, env={"PYTHONPATH": str(ROOT)}
    )
    with pytest.raises(RuntimeError, match="exited with 2 before binding"):
        asyncio.run(process.start(timeout_s=60))
    assert said.read_text().startswith(f"{python} -m services.stage serve --config ")

    data["stages"][0]["python"] = "nowhere/bin/python"
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"stages\.0\.python: expected an executable Python"):
        load_pipeline(tmp_path / "pipe.yaml")
