"""Changed-only syncs between real processes, over gloo and under NCCL's rules: receivers hold bitwise
what a full sync would give them after 50 syncs of random sparse updates (dense, LoRA-only, fp8 on the
wire), a full sync every `anchor_every`; a damaged or misapplied delta is refused and answered by a full
sync; a restarted receiver gets a full sync. (FSDP2 -> tensor-parallel and relay chains:
test_resharding.py.)"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
from functools import partial

import pytest
import torch

from llamarl.comm import WeightReceiver, WeightSender, WeightSyncEndpoint, WeightSyncError, WeightSyncGroup
from llamarl.comm._staging import wire_len
from llamarl.comm.buckets import bucket_packer, bucket_unpacker
from llamarl.comm.testing import TRANSPORTS, run_distributed, transport_kwargs, wait_until

pytestmark = pytest.mark.timeout(120)

NUM_SYNCS = 50
ANCHOR_EVERY = 10
DENSITIES = (0.0, 0.005, 0.02, 0.3, 1.0)  # share of a tensor's elements moved at one sync


def _group(
    rank: int, world_size: int, rdv, transport: str, timeout_s: float = 30.0, dead_after_s: float = 10.0
) -> WeightSyncGroup:
    where = {"host": rdv.host, "port": rdv.port, "rank": rank, "world_size": world_size}
    endpoint = WeightSyncEndpoint(
        **where, timeout_s=timeout_s, dead_after_s=dead_after_s, heartbeat_s=min(1.0, dead_after_s / 4)
    )
    return WeightSyncGroup(endpoint, **transport_kwargs(transport))


# case -> (the trainer's tensors, their dtype, the wire dtype, the receiver's dtype)
SMALL_MODEL = {"w": (96, 64), "emb": (300, 32), "b": (7,)}
LORA_ADAPTERS = {  # A: rank x in, B: out x rank (starting at zero)
    f"layers.{i}.{m}.lora_{ab}.weight": shape
    for i in range(2)
    for m in ("q_proj", "v_proj")
    for ab, shape in (("A", (4, 48)), ("B", (48, 4)))
}
CASES = {
    # float32 master weights cast to bf16 on the wire, into bf16 tensors: packed buckets, each rebuilt
    # from the receiver's own tensors before a delta applies
    "bf16-wire": (SMALL_MODEL, torch.float32, torch.bfloat16, torch.bfloat16),
    # bf16 weights as they are: large ones sent from the trainer's memory and received in place, where
    # the delta applies
    "bf16-in-place": (SMALL_MODEL, torch.bfloat16, None, torch.bfloat16),
    # LoRA adapters only, into float32 tensors (through an engine's loader)
    "lora": (LORA_ADAPTERS, torch.float32, torch.bfloat16, torch.float32),
    # fp8 on the wire (a float32 scale per row): receivers keep a shadow of their wire bytes
    "fp8": (SMALL_MODEL, torch.float32, torch.float8_e4m3fn, torch.bfloat16),
}


def _initial(case: str) -> dict[str, torch.Tensor]:
    shapes, dtype, _, _ = CASES[case]
    g = torch.Generator().manual_seed(0)
    out = {name: torch.randn(shape, generator=g).to(dtype) for name, shape in shapes.items()}
    for name, t in out.items():
        if "lora_B" in name:
            t.zero_()
    return out


def _sparse_update(tensors: dict[str, torch.Tensor], sync: int) -> None:
    """Moves a random share of each tensor's elements (from none to all, cycling), as an optimizer
    step at a small learning rate would, with some moves below the wire's precision."""
    g = torch.Generator().manual_seed(1000 + sync)
    for i, t in enumerate(tensors.values()):
        density = DENSITIES[(sync + i) % len(DENSITIES)]
        mask = torch.rand(t.shape, generator=g) < density
        step = torch.randn(t.shape, generator=g) * 10.0 ** torch.randint(-4, -1, t.shape, generator=g)
        t.add_((step * mask).to(t.dtype))


def _wire_copy(sender: WeightSender, dst_like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a full sync delivers from the sender's tensors now: every bucket packed to its wire bytes
    and unpacked into tensors like the receiver's."""
    out = {name: torch.zeros_like(t) for name, t in dst_like.items()}
    for stream in sender.plan.streams:
        for bucket in stream.buckets:
            buf = torch.empty(bucket.payload_bytes, dtype=torch.uint8)
            bucket_packer(buf, bucket, sender._locals()).run()
            bucket_unpacker(buf, bucket, out).run()
    return out


def _shadows_are_the_wire_bytes(sender: WeightSender) -> bool:
    """The sender's copy of what it sent last equals its tensors' wire bytes now."""
    staging = sender._membership.staging
    for stream in sender.plan.streams:
        for bucket in stream.buckets:
            shadow = staging.shadow(stream, bucket)
            buf = torch.empty(bucket.payload_bytes, dtype=torch.uint8)
            bucket_packer(buf, bucket, sender._locals()).run()
            if not torch.equal(buf[: shadow.numel()], shadow):
                return False
    return True


def _receiver_tensors(case: str) -> dict[str, torch.Tensor]:
    shapes, _, _, dst_dtype = CASES[case]
    return {name: torch.full(shape, 7.0, dtype=dst_dtype) for name, shape in shapes.items()}


def _many_syncs_worker(rank: int, world_size: int, rdv, transport: str, case: str):
    group = _group(rank, world_size, rdv, transport)
    _, _, wire, _ = CASES[case]
    if rank == 0:
        tensors = _initial(case)
        sender = WeightSender(
            group,
            tensors,
            bucket_bytes=4096,
            wire_dtype=wire,
            direct_min_bytes=4096,
            anchor_every=ANCHOR_EVERY,
        )
        out = {"stats": [], "expected": []}
        for sync in range(1, NUM_SYNCS + 1):
            _sparse_update(tensors, sync)
            out["stats"].append(sender.send(sync))
            out["expected"].append(_wire_copy(sender, _receiver_tensors(case)))
        out["shadows"] = _shadows_are_the_wire_bytes(sender)
        out["shadow_bytes"] = sender._membership.staging.shadow_bytes()
        out["sent_bytes"] = sum(wire_len(b) for s in sender.plan.streams for b in s.buckets)
        out["kinds"] = {(b.direct, b.src_copy) for s in sender.plan.streams for b in s.buckets}
        group.get("test/done", timeout_s=30)
        return out
    dst = _receiver_tensors(case)
    loaded: dict[str, torch.Tensor] = {}
    if case == "lora":  # through an engine's loader: the receiver's staging copy is its base
        receiver = WeightReceiver(
            group, dst, load_fn=lambda pairs: loaded.update((n, t.clone()) for n, t in pairs)
        )
    else:
        receiver = WeightReceiver(group, dst)
    got = []
    for sync in range(1, NUM_SYNCS + 1):
        assert receiver.receive() == sync
        got.append({n: t.clone() for n, t in (loaded if case == "lora" else dst).items()})
    group.put("test/done", True)
    return {
        "got": got,
        "stats": receiver.last_stats,
        "shadow_bytes": receiver._membership.staging.shadow_bytes(),
    }


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fifty_delta_syncs_leave_the_receiver_bitwise_equal(transport: str, case: str) -> None:
    trainer, engine = run_distributed(_many_syncs_worker, 2, transport, case, timeout_s=110)
    stats = trainer["stats"]
    # The first sync and every ANCHOR_EVERY-th one are full, the others deltas.
    assert [s.delta for s in stats] == [i % ANCHOR_EVERY != 0 for i in range(NUM_SYNCS)]
    for i, (want, got) in enumerate(zip(trainer["expected"], engine["got"], strict=True)):
        for name, tensor in want.items():
            assert torch.equal(got[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), (
                i,
                name,
            )
    assert trainer["shadows"]
    if case == "bf16-in-place":
        assert (True, False) in trainer["kinds"]  # some buckets went from memory into the tensors
    deltas = [s for s in stats if s.delta]
    assert sum(s.bytes for s in deltas) < 0.6 * sum(s.full_bytes for s in deltas)
    assert all(s.changed_bytes is not None and s.changed_bytes <= s.full_bytes for s in deltas)
    assert engine["stats"].delta and engine["stats"].bytes == stats[-1].bytes
    # Memory: the sender keeps one copy of what it sends; the receiver none, but with fp8 on the wire
    # (its tensors cannot give the fp8 bytes back), a copy of what it receives.
    assert trainer["shadow_bytes"] == trainer["sent_bytes"]
    assert engine["shadow_bytes"] == (trainer["sent_bytes"] if case == "fp8" else 0)


class _Waited:
    """A gloo work waited by a thread of its own, so that it can be polled: gloo's say they are complete
    only once waited on (the group does this itself for a plain gloo group, not for a wrapper)."""

    def __init__(self, work) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._wait, args=(work,), daemon=True)
        self._thread.start()

    def _wait(self, work) -> None:
        try:
            work.wait()
        except BaseException as exc:  # re-raised by `wait`
            self._error = exc

    def is_completed(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout=None) -> bool:
        self._thread.join(None if timeout is None else timeout.total_seconds())
        if self._error is not None:
            raise self._error
        return True


class _FlipInSecondSync:
    """A sending side's process group that flips one byte of the first payload of the second sync on
    its way (the sender's memory untouched). Each bucket is a header (80 bytes), then a payload; the
    headers tell which sync a payload belongs to (``buckets``: how many a sync has, set once known)."""

    def __init__(self, pg) -> None:
        self._pg = pg
        self.buckets = 0
        self._headers = 0
        self._flipped = False

    def send(self, tensors, dst, tag=0):
        (tensor,) = tensors
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 80:
            self._headers += 1
        elif not self._flipped and self._headers > self.buckets:
            tensor = tensor.clone()
            tensor.view(-1).view(torch.uint8)[nbytes // 2] ^= 0x10
            self._flipped = True
        return _Waited(self._pg.send([tensor], dst, tag))

    def recv(self, tensors, src, tag=0):
        return _Waited(self._pg.recv(tensors, src, tag))


def _one_percent_moved(named: dict[str, torch.Tensor]) -> None:
    named["w"].view(-1)[::97] += 0.05  # a sparse delta: one bucket's payload is positions and values


def _damaged_worker(rank: int, world_size: int, rdv, transport: str, damage: str):
    """Sync 1 full, sync 2 a delta damaged on the way (`transit`) or applied to weights that changed
    on the receiver since sync 1 (`base`): refused; sync 3 is then full, and right."""
    g = torch.Generator().manual_seed(0)
    named = {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}
    kwargs = transport_kwargs(transport)
    if rank == 0:
        inner = kwargs.get("process_group_factory") or torch.distributed.ProcessGroupGloo
        flippers = []

        def flipping(store, rank_, world_size_, timeout):
            pg = inner(store, rank_, world_size_, timeout)
            if damage != "transit" or flippers:  # (only the first generation's group damages)
                return pg
            flippers.append(_FlipInSecondSync(pg))
            return flippers[0]

        endpoint = WeightSyncEndpoint(host=rdv.host, port=rdv.port, rank=0, world_size=2, timeout_s=10.0)
        group = WeightSyncGroup(endpoint, process_group_factory=flipping)
        sender = WeightSender(
            group, named, bucket_bytes=16 << 10, wire_dtype=torch.bfloat16, checksum_stride=1
        )
        for flipper in flippers:
            flipper.buckets = sender.plan.num_buckets()
        out = {"stats": [sender.send(1)]}
        _one_percent_moved(named)
        group.get("test/receiver-ready", timeout_s=30)
        try:
            out["stats"].append(sender.send(2))
        except WeightSyncError as exc:  # the receiver refused an early bucket, dropped the group
            out["stats"].append(str(exc))
        _one_percent_moved(named)
        out["stats"].append(sender.send(3))
        out["expected"] = {k: v.to(torch.bfloat16) for k, v in named.items()}
        group.get("test/done", timeout_s=30)
        return out
    group = _group(rank, world_size, rdv, transport, timeout_s=10.0)
    dst = {name: torch.zeros(t.shape, dtype=torch.bfloat16) for name, t in named.items()}
    receiver = WeightReceiver(group, dst)
    assert receiver.receive() == 1
    if damage == "base":
        dst["w"][100, 3] += 1.0  # the engine wrote into its weights: the sender's delta base is gone
    group.put("test/receiver-ready", True)
    out = {}
    try:
        receiver.receive()
        out["refusal"] = None
    except WeightSyncError as exc:
        out["refusal"] = {"message": str(exc), "peer": exc.peer, "held": receiver.policy_version}
    out["third"] = receiver.receive()
    out["weights"] = {k: v.clone() for k, v in dst.items()}
    group.put("test/done", True)
    return out


@pytest.mark.parametrize("damage", ["transit", "base"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_damaged_or_misapplied_delta_is_refused_and_answered_by_a_full_sync(
    transport: str, damage: str
) -> None:
    trainer, engine = run_distributed(_damaged_worker, 2, transport, damage, timeout_s=90)
    refusal = engine["refusal"]
    assert refusal is not None and refusal["peer"] == 0 and refusal["held"] is None, refusal
    what = "in the payload" if damage == "transit" else "in the rebuilt bytes"
    assert f"checksum mismatch {what}" in refusal["message"] and "peer rank 0" in refusal["message"], refusal
    first, second, third = trainer["stats"]
    assert not first.delta and not third.delta and engine["third"] == 3
    assert isinstance(second, str) or second.delta  # the sender may be done before the refusal
    for name, want in trainer["expected"].items():
        assert torch.equal(engine["weights"][name], want), name


def _gap_worker(rank: int, world_size: int, rdv, transport: str):
    """The receiver loses its copy of sync 1's weights (`close` drops them, as a receiver that missed
    or failed a sync has none): sync 2, a delta against sync 1, is refused by it at once, naming it;
    the sender's sync fails within a heartbeat, and sync 3 is a full one."""
    g = torch.Generator().manual_seed(0)
    named = {"w": torch.randn(64, 64, generator=g)}
    group = _group(rank, world_size, rdv, transport, timeout_s=20.0, dead_after_s=2.0)
    if rank == 0:
        sender = WeightSender(group, named, bucket_bytes=4096, wire_dtype=torch.bfloat16)
        out = {"stats": [sender.send(1)]}
        group.get("test/lost", timeout_s=30)
        for version in (2, 3):
            named["w"].view(-1)[version::50] += 0.1
            try:
                out["stats"].append(sender.send(version))
            except WeightSyncError as exc:
                out["stats"].append({"message": str(exc)})
        out["expected"] = named["w"].to(torch.bfloat16)
        group.get("test/done", timeout_s=30)
        return out
    dst = {"w": torch.zeros(64, 64, dtype=torch.bfloat16)}
    receiver = WeightReceiver(group, dst)
    assert receiver.receive() == 1
    receiver.close()
    group.put("test/lost", True)
    try:
        receiver.receive()
        refusal = None
    except WeightSyncError as exc:
        refusal = str(exc)
    third = receiver.receive()
    group.put("test/done", True)
    return {"refusal": refusal, "third": third, "delta": receiver.last_stats.delta, "w": dst["w"].clone()}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_receiver_without_the_deltas_base_refuses_it_and_the_next_sync_is_full(transport: str) -> None:
    trainer, engine = run_distributed(_gap_worker, 2, transport, timeout_s=90)
    assert "rank 1: sync 2 sends only what changed since sync 1" in engine["refusal"], engine["refusal"]
    first, second, third = trainer["stats"]
    assert not first.delta and "rank 1" in second["message"], second
    assert not third.delta and engine["third"] == 3 and not engine["delta"]
    assert torch.equal(engine["w"], trainer["expected"])


TIMEOUT_S = 10.0


def _engine_life(
    host: str, port: int, tmpdir: str, out_path: str, transport: str, syncs: int, die: bool
) -> None:
    """One life of the engine at rank 1: join (or rejoin), receive `syncs` syncs, save what it got."""
    endpoint = WeightSyncEndpoint(
        host=host, port=port, rank=1, world_size=2, timeout_s=TIMEOUT_S, dead_after_s=2.0, heartbeat_s=0.5
    )
    group = WeightSyncGroup(endpoint, **transport_kwargs(transport))
    dst = {"w": torch.zeros(64, 32, dtype=torch.bfloat16), "emb": torch.zeros(300, 64, dtype=torch.bfloat16)}
    receiver = WeightReceiver(group, dst)
    got = []
    for _ in range(syncs):
        version = receiver.receive(timeout_s=60)
        got.append({"version": version, "delta": receiver.last_stats.delta})
    torch.save({"got": got, "rejoined": receiver.rejoined, "weights": dst}, out_path)
    if not die:  # stay in the group until the trainer has read the version this life holds
        wait_until(lambda: os.path.exists(os.path.join(tmpdir, "done")), timeout_s=60, what="the trainer")
    os._exit(0)  # (the first life: a crash, no goodbye to anyone)


def _restart_worker(rank: int, world_size: int, rdv, transport: str):
    if rank == 0:
        group = _group(0, 2, rdv, transport, timeout_s=TIMEOUT_S, dead_after_s=2.0)
        g = torch.Generator().manual_seed(0)
        weights = {"w": torch.randn(64, 32, generator=g), "emb": torch.randn(300, 64, generator=g)}
        sender = WeightSender(group, weights, bucket_bytes=16 << 10, wire_dtype=torch.bfloat16)
        stats = []
        for version in (1, 2):
            _sparse_update(weights, version)
            stats.append(sender.send(version))
        first_life_over = os.path.join(rdv.tmpdir, "first-life-over")
        wait_until(lambda: os.path.exists(first_life_over), timeout_s=90, what="the first life")
        _sparse_update(weights, 3)
        with contextlib.suppress(WeightSyncError):
            sender.send(3)  # the engine is dead
        open(os.path.join(rdv.tmpdir, "sync3-over"), "w").close()
        # 4 re-forms the group with the new engine: a full sync. So may 5: had the new engine asked for
        # a generation after 4 was announced, 5 forms that one (the rejoin protocol). 6 is a delta.
        for version in (4, 5, 6):
            _sparse_update(weights, version)
            stats.append(sender.send(version))
        wait_until(sender.held_versions, lambda held: held == {1: 6}, timeout_s=30, what="held version 6")
        expected = {k: v.to(torch.bfloat16) for k, v in weights.items()}
        open(os.path.join(rdv.tmpdir, "done"), "w").close()
        return {"delta": [s.delta for s in stats], "expected": expected}
    fork = mp.get_context("fork")  # real processes, without a second torch import
    lives = []
    for life, (syncs, die) in enumerate(((2, True), (3, False))):
        path = os.path.join(rdv.tmpdir, f"life{life}.pt")
        args = (rdv.host, rdv.port, rdv.tmpdir, path, transport, syncs, die)
        proc = fork.Process(target=_engine_life, args=args)
        proc.start()
        proc.join(timeout=90)
        assert proc.exitcode == 0, proc.exitcode
        lives.append(torch.load(path))
        if life == 0:
            open(os.path.join(rdv.tmpdir, "first-life-over"), "w").close()
            sync3_over = os.path.join(rdv.tmpdir, "sync3-over")
            wait_until(partial(os.path.exists, sync3_over), timeout_s=90, what="the failed sync 3")
    return lives


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_restarted_receiver_gets_a_full_sync_then_deltas(transport: str) -> None:
    trainer, lives = run_distributed(_restart_worker, 2, transport, timeout_s=110)
    first, second = lives
    assert trainer["delta"][:3] == [False, True, False] and trainer["delta"][-1], trainer["delta"]
    assert [g["delta"] for g in first["got"]] == [False, True] and not first["rejoined"]
    assert [g["version"] for g in second["got"]] == [4, 5, 6] and second["rejoined"]
    assert not second["got"][0]["delta"] and second["got"][-1]["delta"]
    for name, want in trainer["expected"].items():
        assert torch.equal(second["weights"][name], want), name
