"""`WeightSyncEndpoint`: one value says where a member joins; bad values are one-line errors; it crosses
a process boundary as JSON and a group is built from it whole."""

from __future__ import annotations

import json

import pytest
import torch

from llamarl.comm import WeightReceiver, WeightSender, WeightSyncEndpoint, WeightSyncError, WeightSyncGroup
from llamarl.comm.testing import run_distributed

pytestmark = pytest.mark.timeout(120)


def test_an_endpoint_crosses_a_process_boundary_as_json_and_names_one_member():
    endpoint = WeightSyncEndpoint(
        host="10.0.0.1", port=29500, rank=1, world_size=4, backend="nccl", timeout_s=30.0, src_rank=0
    )
    again = WeightSyncEndpoint.from_json(json.loads(json.dumps(endpoint.to_json())))
    assert again == endpoint
    worker = endpoint.for_rank(3)  # an engine's second worker, one rank on
    assert worker.rank == 3
    assert {k: v for k, v in worker.to_json().items() if k != "rank"} == {
        k: v for k, v in endpoint.to_json().items() if k != "rank"
    }
    with pytest.raises(ValueError, match=r"unknown weight-sync endpoint fields \['colour'\]"):
        WeightSyncEndpoint.from_json({**endpoint.to_json(), "colour": "blue"})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rank": 2, "world_size": 2}, "rank 2 is outside a group of world_size 2"),
        ({"src_rank": 5}, "src_rank 5 is outside a group of world_size 2"),
        ({"backend": "mpi"}, "backend must be one of"),
        ({"timeout_s": 0.0}, "timeout_s must be positive"),
        ({"dead_after_s": -1.0}, "dead_after_s must be positive"),
    ],
)
def test_a_bad_endpoint_is_a_one_line_error(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        WeightSyncEndpoint(**({"host": "127.0.0.1", "port": 1, "rank": 0, "world_size": 2} | fields))
    assert "\n" not in str(error.value)


def _join(rank: int, world_size: int, rdv, src_rank: int) -> dict:
    """Both members build their group from the same endpoint but for the rank; the receiver names
    `src_rank` as its source (a wrong one: it refuses to join, and the sender's group never forms)."""
    endpoint = WeightSyncEndpoint(
        host=rdv.host, port=rdv.port, rank=0, world_size=world_size, timeout_s=5.0, src_rank=src_rank
    )
    group = WeightSyncGroup(endpoint.for_rank(rank))
    out: dict = {"timeout_s": group.timeout_s, "rank": group.rank}
    try:
        if rank == 0:
            WeightSender(group, {"w": torch.full((4, 4), 3.0)}).send(2)
        else:
            out["version"] = WeightReceiver(group, {"w": torch.zeros(4, 4)}).receive()
    except WeightSyncError as exc:
        out["error"] = str(exc)
    if rank == 0:
        group.get("test/done", timeout_s=30)  # host the store until the receiver is through
    else:
        group.put("test/done", True)
    group.close()
    return out


@pytest.mark.parametrize("src_rank", [0, 1])
def test_a_group_joins_from_its_endpoint_and_a_receiver_checks_its_source_rank(src_rank: int):
    sender, receiver = run_distributed(_join, 2, src_rank, timeout_s=90)
    assert (sender["rank"], receiver["rank"]) == (0, 1) and receiver["timeout_s"] == 5.0
    if src_rank == 0:
        assert "error" not in sender and receiver["version"] == 2, (sender, receiver)
    else:  # rank 1 is the receiver itself, not a source: it refuses, and the group never forms
        assert "src_rank 1 is not a source; sources are (0,)" in receiver["error"], receiver
        assert "ranks that never joined: [1]" in sender["error"], sender
