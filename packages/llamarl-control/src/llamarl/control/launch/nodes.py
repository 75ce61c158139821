"""The machines (nodes) of a job: which ranks each holds, and which of them are gone.

Torch elastic spreads the ranks over the machines in order: node g holds global ranks g*L..g*L+L-1 (L
ranks per machine). When a machine dies, the ranks elsewhere see only a closed connection to some peer,
which does not say which machine went away. So the first rank of every machine beats a counter in the
job's store (`MASTER_ADDR:MASTER_PORT`) a few times a second, next to its host name; a rank that fails
reads the counters twice, `LOST_AFTER_S` apart, and names the machines whose counter stood still (or the
store's own machine, if the store is gone). Counters, not clocks: the machines' clocks never meet.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

BEAT_S = 0.5  # how often a machine beats
LOST_AFTER_S = 3.0  # a machine whose counter stood still this long is lost
_STORE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Node:
    """One machine of the job, as the failure message names it."""

    index: int  # torch elastic's group rank
    host: str
    first_rank: int
    num_ranks: int

    def describe(self) -> str:
        """E.g. "node 1 (gpu-7, ranks 8-15)"."""
        last = self.first_rank + self.num_ranks - 1
        ranks = f"rank {last}" if self.num_ranks == 1 else f"ranks {self.first_rank}-{last}"
        return f"node {self.index} ({self.host}, {ranks})"


class NodeWatch:
    """This rank's view of the job's machines; on a machine's first rank, its heartbeat too.

    Built from torch elastic's environment (GROUP_RANK, GROUP_WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID); `start()` begins beating on local rank 0, `stop()`
    ends it, `lost_nodes()` names the machines gone silent.
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        self.node = int(env.get("GROUP_RANK", 0))
        self.num_nodes = int(env.get("GROUP_WORLD_SIZE", 1))
        self.local_rank = int(env.get("LOCAL_RANK", 0))
        self.ranks_per_node = int(env.get("LOCAL_WORLD_SIZE", 1))
        self.store_host = env.get("MASTER_ADDR", "127.0.0.1")
        self.store_port = int(env.get("MASTER_PORT", 0))
        self.prefix = f"llamarl/nodes/{env.get('TORCHELASTIC_RUN_ID', 'run')}/"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Beats for this machine (its local rank 0 only) until `stop()`; a no-op on one machine."""
        if self.num_nodes == 1 or self.local_rank != 0 or not self.store_port:
            return
        store = self._store()
        store.set(f"{self.prefix}node{self.node}/host", socket.gethostname())
        self._thread = threading.Thread(target=self._beat, args=(store,), name="node-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * BEAT_S)

    def _beat(self, store: dist.Store) -> None:
        key = f"{self.prefix}node{self.node}/beats"
        while not self._stop.is_set():
            try:
                store.add(key, 1)
            except Exception:  # the store's machine is gone: nothing left to beat to
                return
            self._stop.wait(BEAT_S)

    def lost_nodes(self, wait_s: float = LOST_AFTER_S) -> list[Node]:
        """The other machines whose heartbeat stood still for `wait_s` (the store's machine, node 0,
        when the store itself cannot be reached); [] on one machine."""
        if self.num_nodes == 1 or not self.store_port:
            return []
        others = [g for g in range(self.num_nodes) if g != self.node]
        store_lost = [] if self.node == 0 else [self._node(0, self.store_host)]
        # A plain connection first: the store's client logs a stack trace for every failed attempt.
        if not _reachable(self.store_host, self.store_port):
            return store_lost
        try:
            store = self._store()
            before = {g: self._beats(store, g) for g in others}
            time.sleep(wait_s)
            after = {g: self._beats(store, g) for g in others}
            hosts = {g: self._host(store, g) for g in others}
        except Exception:  # the store is gone: its host, the first rank's machine, went with it
            return store_lost
        return [self._node(g, hosts[g]) for g in others if after[g] == before[g]]

    def _node(self, index: int, host: str) -> Node:
        return Node(index, host, index * self.ranks_per_node, self.ranks_per_node)

    def _beats(self, store: dist.Store, node: int) -> int:
        return store.add(f"{self.prefix}node{node}/beats", 0)

    def _host(self, store: dist.Store, node: int) -> str:
        key = f"{self.prefix}node{node}/host"
        return store.get(key).decode() if store.check([key]) else "host unknown"

    def _store(self) -> dist.Store:
        # A connection of its own: the heartbeat thread never shares a socket with the process groups.
        return dist.TCPStore(
            self.store_host,
            self.store_port,
            is_master=False,
            timeout=timedelta(seconds=_STORE_TIMEOUT_S),
        )


def _reachable(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether something accepts connections at host:port (the store's server is alive)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def nodes_as_records(nodes: list[Node]) -> list[dict[str, Any]]:
    """`nodes` as JSON-ready dicts (a failed rank's record)."""
    return [asdict(n) for n in nodes]


def describe_lost(records: list[dict[str, Any]]) -> str:
    """One line naming the lost machines of a failed rank's record."""
    names = ", ".join(Node(**r).describe() for r in records)
    verb = "was" if len(records) == 1 else "were"
    return (
        f"{names} {verb} lost: its ranks stopped answering (the machine went down, or its ranks were "
        "killed or failed: its own output says which)"
    )
