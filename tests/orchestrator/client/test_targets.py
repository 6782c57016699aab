"""Where a client of the orchestrator dials (orchestrator/client/targets.py): one address,
several joined into one gRPC target, or a refusal naming the one that cannot join."""

from __future__ import annotations

import json

import pytest

from orchestrator.client import Client
from orchestrator.client.targets import ATTEMPTS, client_options, target


@pytest.mark.parametrize(
    ("given", "dialled"),
    [
        ("127.0.0.1:50050", "127.0.0.1:50050"),
        ("omni-orchestrator:50050", "omni-orchestrator:50050"),
        (
            "dns:///omni-orchestrator-peers.ns.svc:50050",
            "dns:///omni-orchestrator-peers.ns.svc:50050",
        ),
        ("ipv4:10.0.0.5:1,10.0.0.6:1", "ipv4:10.0.0.5:1,10.0.0.6:1"),
        ("10.0.0.5:50050,10.0.0.6:50050", "ipv4:10.0.0.5:50050,10.0.0.6:50050"),
        (" 10.0.0.5:1 , 10.0.0.6:2 ", "ipv4:10.0.0.5:1,10.0.0.6:2"),
        (["10.0.0.5:1", "10.0.0.6:2"], "ipv4:10.0.0.5:1,10.0.0.6:2"),
        (["[::1]:1", "[fe80::1]:2"], "ipv6:[::1]:1,[fe80::1]:2"),
        (["10.0.0.5:1"], "10.0.0.5:1"),
    ],
)
def test_addresses_become_one_target(given: str | list[str], dialled: str) -> None:
    assert target(given) == dialled


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ("omni-a:50050,omni-b:50050", "'omni-a:50050': several orchestrators are given as IP:PORT"),
        ("10.0.0.5:1,[::1]:2", "expected IPv4 addresses only or IPv6 only"),
        ("10.0.0.5:1,10.0.0.6", "'10.0.0.6'"),
        ([], "expected an orchestrator address"),
    ],
)
def test_addresses_that_cannot_join_are_refused_by_name(given: str | list[str], named: str) -> None:
    with pytest.raises(ValueError) as refused:
        target(given)
    assert named in str(refused.value)


def test_calls_are_dealt_in_turn_and_tried_again_only_when_unavailable() -> None:
    config = json.loads(dict(client_options())["grpc.service_config"])  # type: ignore[arg-type]
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method,) = config["methodConfig"]
    assert method["name"] == [{"service": "omni.v1.Orchestrator"}]
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert method["retryPolicy"]["maxAttempts"] == ATTEMPTS


def test_the_clients_dial_the_joined_target() -> None:
    with Client("127.0.0.1:1,127.0.0.1:2") as client:
        assert client.address == "ipv4:127.0.0.1:1,127.0.0.1:2"
