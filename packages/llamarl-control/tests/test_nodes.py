"""Naming a lost machine: heartbeats through a real TCPStore, machines that stop beating, a store gone."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from llamarl.comm.testing import free_port
from llamarl.control.launch.nodes import Node, NodeWatch, describe_lost


def env(node: int, port: int, *, num_nodes: int = 3, ranks_per_node: int = 2) -> dict[str, str]:
    """Torch elastic's variables on the first rank of machine `node`."""
    return {
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(num_nodes),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": str(ranks_per_node),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "job",
    }


def test_the_machine_whose_heartbeat_stops_is_named_with_its_ranks():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    watches = [NodeWatch(env(g, port)) for g in range(3)]
    for watch in watches:
        watch.start()
    try:
        assert watches[0].lost_nodes(wait_s=1.5) == []  # every machine beats
        watches[2].stop()  # machine 2 dies
        lost = watches[0].lost_nodes(wait_s=1.5)
        assert [(n.index, n.first_rank, n.num_ranks) for n in lost] == [(2, 4, 2)]
        assert lost[0].describe().startswith("node 2 (") and lost[0].describe().endswith(", ranks 4-5)")
        assert [n.index for n in watches[1].lost_nodes(wait_s=1.5)] == [2]
    finally:
        for watch in watches:
            watch.stop()
    del store


def test_when_the_store_is_gone_its_machine_is_named():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    watch = NodeWatch(env(1, port, num_nodes=2, ranks_per_node=1))
    watch.start()
    del store  # the first rank's machine, which hosts the store, went away
    try:
        assert watch.lost_nodes(wait_s=0.5) == [Node(0, "127.0.0.1", 0, 1)]
    finally:
        watch.stop()


def test_one_machine_has_no_heartbeat_and_nothing_to_lose():
    watch = NodeWatch({"GROUP_WORLD_SIZE": "1", "MASTER_PORT": "1"})
    watch.start()
    assert watch.lost_nodes(wait_s=10) == []  # returns at once
    watch.stop()


def test_the_message_is_one_line():
    line = describe_lost([{"index": 1, "host": "gpu-7", "first_rank": 8, "num_ranks": 8}])
    assert line.startswith("node 1 (gpu-7, ranks 8-15) was lost: ") and "\n" not in line
