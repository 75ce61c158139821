"""Phase-1 path: one trainer rank, whole tensors, several receivers; failures are errors, never hangs."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from llamarl.comm import WeightReceiver, WeightSender, WeightSyncEndpoint, WeightSyncError, WeightSyncGroup
from llamarl.comm.testing import TRANSPORTS, run_distributed, transport_kwargs, wait_until

pytestmark = pytest.mark.timeout(120)


class TinyLM(torch.nn.Module):
    """A few layers of the usual kinds, tied embedding, a persistent and a non-persistent buffer."""

    def __init__(self, vocab: int = 50, hidden: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.mlp = torch.nn.Linear(hidden, 3 * hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.big = torch.nn.Linear(128, 640, bias=False)  # 320 KiB: goes zero-copy (a direct bucket)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: sent once
        self.register_buffer("step_count", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)


def _model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM()
    with torch.no_grad():
        model.step_count.copy_(torch.tensor([seed, 2, 3]))
    return model


def _group(rank: int, world_size: int, rdv, transport: str, timeout_s: float = 30.0) -> WeightSyncGroup:
    return WeightSyncGroup(
        WeightSyncEndpoint(
            host=rdv.host, port=rdv.port, rank=rank, world_size=world_size, timeout_s=timeout_s
        ),
        **transport_kwargs(transport),
    )


def _sync_worker(rank: int, world_size: int, rdv, transport: str, bucket_bytes: int):
    group = _group(rank, world_size, rdv, transport)
    if rank == 0:
        model = _model(seed=1)
        sender = WeightSender(group, model, bucket_bytes=bucket_bytes)
        out = []
        for version in (3, 4):
            stats = sender.send(version)
            out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            assert stats.bytes > 0 and stats.buckets >= 1 and stats.policy_version == version
            with torch.no_grad():  # the optimizer would do this between syncs
                for p in model.parameters():
                    p.add_(1.0)
                # and a parameter may move to new memory (``.data`` swapped, as FSDP2 does with shards):
                # the sender's cached views of the old memory must not be sent
                model.big.weight.data = model.big.weight.data * 2.0
        # Each receiver reports the version it holds once its receive returned, which may be after this
        # send returned: wait for both reports (this rank hosts the store they go to).
        wait_until(
            sender.held_versions, lambda held: held == {1: 4, 2: 4}, timeout_s=30, what="both held versions"
        )
        return out
    model = _model(seed=100 + rank)  # different weights: must be overwritten
    receiver = WeightReceiver(group, model)
    assert receiver.policy_version is None
    out = []
    for version in (3, 4):
        assert receiver.receive() == version
        assert receiver.policy_version == version
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


@pytest.mark.parametrize("bucket_bytes", [64 << 20, 256])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_sender_two_receivers_bitwise(transport: str, bucket_bytes: int) -> None:
    results = run_distributed(_sync_worker, 3, transport, bucket_bytes, timeout_s=90)
    sent = results[0]
    for rank in (1, 2):
        for version_i in range(2):
            for name, tensor in sent[version_i].items():
                got = results[rank][version_i][name]
                assert got.dtype == tensor.dtype and torch.equal(
                    got.view(-1).view(torch.uint8) if False else got, tensor
                ), name
    # the non-persistent buffer is not synced, the tied weight is
    assert "inv_freq" not in sent[0]
    assert torch.equal(results[1][1]["lm_head.weight"], sent[1]["embed.weight"])


def _load_fn_worker(rank: int, world_size: int, rdv, transport: str):
    group = _group(rank, world_size, rdv, transport)
    if rank == 0:
        model = _model(seed=7)
        WeightSender(group, model, bucket_bytes=1024).send(11)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.device("meta"):
        spec = TinyLM()  # shapes only: the engine owns the real storage
    loaded: dict[str, torch.Tensor] = {}

    def load_fn(weights):
        for name, tensor in weights:
            loaded[name] = tensor.clone()

    receiver = WeightReceiver(group, spec, load_fn=load_fn)
    assert receiver.receive() == 11
    return loaded


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_load_fn_receives_pairs(transport: str) -> None:
    sent, loaded = run_distributed(_load_fn_worker, 2, transport, timeout_s=60)
    assert sent.keys() - {"lm_head.weight"} == loaded.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, sent[name]), name


def _mismatch_worker(rank: int, world_size: int, rdv, transport: str):
    group = _group(rank, world_size, rdv, transport, timeout_s=20)
    try:
        if rank == 0:
            WeightSender(group, {"w": torch.zeros(4, 4), "b": torch.zeros(4)})
        else:
            WeightReceiver(group, {"w": torch.zeros(4, 5), "b": torch.zeros(4)})
    except WeightSyncError as exc:
        # Rank 0 hosts the store: keep it up until the other side has seen its own error.
        if rank == 0:
            group.get("test/done", timeout_s=20)
        else:
            group.put("test/done", True)
        return str(exc)
    raise AssertionError("no error on a manifest mismatch")


def test_manifest_mismatch_fails_clearly() -> None:
    for message in run_distributed(_mismatch_worker, 2, "gloo", timeout_s=60):
        assert "'w'" in message and "(4, 4)" in message, message


def _corrupt_worker(rank: int, world_size: int, rdv, transport: str, direct_min_bytes: int):
    group = _group(rank, world_size, rdv, transport, timeout_s=10.0)
    torch.manual_seed(0)
    named = {"w": torch.randn(256, 256), "b": torch.randn(64)}
    if rank == 0:
        from llamarl.comm import buckets

        sender = WeightSender(group, named, bucket_bytes=64 << 10, direct_min_bytes=direct_min_bytes)
        # Fault injection on the sending side: every checksum it sends is off by one, so the bytes
        # that arrive disagree with their trailer exactly as a torn or corrupted transfer would. The
        # worker process is reused by later tests: the honest checksum is put back whatever happens.
        honest = buckets.Checksummer.__call__
        buckets.Checksummer.__call__ = lambda self, phase=0: honest(self, phase) + 1
        try:
            sender.send(1)
            blamed = None
        except WeightSyncError as exc:  # the receiver refused an early bucket and dropped the group
            blamed = exc.peer
        finally:
            buckets.Checksummer.__call__ = honest
        group.get("test/receiver-done", timeout_s=30)  # host the store until the receiver is done
        return blamed
    return _receive_expecting_refusal(
        group, named, "buckets whose checksums disagree with their bytes were accepted"
    )


@pytest.mark.parametrize("direct_min_bytes", [0, 1 << 30], ids=["in-place", "packed"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_corrupted_bucket_is_refused(transport: str, direct_min_bytes: int) -> None:
    blamed, got = run_distributed(_corrupt_worker, 2, transport, direct_min_bytes, timeout_s=60)
    assert blamed in (None, 1)
    assert "checksum mismatch" in got["message"] and got["peer"] == 0 and got["bucket"] is not None, got
    assert got["held"] is None  # the receiver does not claim a version it did not get whole


class _FlipOneByteInTransit:
    """A sending side's process group that flips one byte of one payload on its way (the sender's own
    memory untouched): the `index`-th message of at least `min_bytes`, at byte `len - back` of it."""

    def __init__(self, pg, *, index: int, back: int, min_bytes: int = 1024) -> None:
        self._pg, self._index, self._back, self._min_bytes = pg, index, back, min_bytes
        self._large = 0

    def send(self, tensors, dst, tag=0):
        (tensor,) = tensors
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes >= self._min_bytes:
            if self._large == self._index:
                tensor = tensor.clone()
                tensor.view(-1).view(torch.uint8)[nbytes - self._back] ^= 0x10
            self._large += 1
        return self._pg.send([tensor], dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._pg.recv(tensors, src, tag)


def _flipped_byte_worker(rank: int, world_size: int, rdv, transport: str, direct_min_bytes: int):
    from llamarl.comm.buckets import TRAILER_BYTES

    torch.manual_seed(0)
    named = {"w": torch.randn(256, 256), "b": torch.randn(64)}
    kwargs = transport_kwargs(transport)
    if rank == 0:
        inner = kwargs.get("process_group_factory") or torch.distributed.ProcessGroupGloo
        # A byte in the middle of the second bucket's payload: packed buckets carry their trailer
        # after it, direct ones send it later in their stream's manifest.
        payload_bytes = 64 << 10
        back = payload_bytes // 2 + (TRAILER_BYTES if direct_min_bytes else 0)

        def flipping(store, rank_, world_size_, timeout):
            return _FlipOneByteInTransit(inner(store, rank_, world_size_, timeout), index=1, back=back)

        group = WeightSyncGroup(
            WeightSyncEndpoint(
                host=rdv.host, port=rdv.port, rank=rank, world_size=world_size, timeout_s=10.0
            ),
            process_group_factory=flipping,
        )
        sender = WeightSender(
            group, named, bucket_bytes=payload_bytes, direct_min_bytes=direct_min_bytes, checksum_stride=1
        )
        original = {k: v.clone() for k, v in named.items()}
        with contextlib.suppress(WeightSyncError):  # the receiver refused a bucket, dropped the group
            sender.send(1)
        group.get("test/receiver-done", timeout_s=30)  # host the store until the receiver is done
        return {"untouched": all(torch.equal(named[k], original[k]) for k in named)}
    group = _group(rank, world_size, rdv, transport, timeout_s=10.0)
    return _receive_expecting_refusal(group, named, "a bucket whose payload changed in transit was accepted")


@pytest.mark.parametrize("direct_min_bytes", [0, 1 << 30], ids=["in-place", "packed"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_payload_byte_flipped_in_transit_is_refused_naming_its_bucket(
    transport: str, direct_min_bytes: int
) -> None:
    """The checksum covers the bytes that travel, not only the trailer: one bit of bucket 1's payload
    changed on the wire, and the receiver refuses that bucket by its index and holds no version."""
    sender, got = run_distributed(_flipped_byte_worker, 2, transport, direct_min_bytes, timeout_s=60)
    assert sender["untouched"]
    assert got["peer"] == 0 and got["bucket"] == 1, got
    assert "checksum mismatch in bucket 1 of stream" in got["message"], got["message"]
    assert got["held"] is None


def _receiver_then_die(host: str, port: int, named: dict, transport: str, group_kwargs: dict) -> None:
    group = WeightSyncGroup(
        WeightSyncEndpoint(host=host, port=port, rank=1, world_size=2, **group_kwargs),
        **transport_kwargs(transport),
    )
    WeightReceiver(group, {k: torch.zeros_like(v) for k, v in named.items()})
    os._exit(0)  # dies without a word, holding its connections


def _dead_receiver_worker(
    rank: int, world_size: int, rdv, transport: str, mode: str, sender_timeout_s: float = 4.0,
    heartbeat: dict | None = None,
):  # fmt: skip
    """The sender sends once; the receiver died before (killed) or is alive but never receives
    (stalled). Returns the sender's error (rank 0) and the dead receiver's exit code (rank 1)."""
    named = {"w": torch.ones(64, 64), "b": torch.ones(64)}
    receiver_gone = os.path.join(rdv.tmpdir, "receiver_gone")
    sender_done = os.path.join(rdv.tmpdir, "sender_done")
    heartbeat = heartbeat or {}
    receiver_kwargs = {"timeout_s": max(sender_timeout_s, 4.0), **heartbeat}
    if rank == 0:
        group = WeightSyncGroup(
            WeightSyncEndpoint(
                host=rdv.host, port=rdv.port, rank=0, world_size=world_size, timeout_s=sender_timeout_s,
                **heartbeat,
            ),
            **transport_kwargs(transport),
        )  # fmt: skip
        sender = WeightSender(group, named, bucket_bytes=4096)
        if mode == "killed":  # send once the receiver is dead (its parent saw it exit)
            wait_until(lambda: os.path.exists(receiver_gone), timeout_s=30, what="the receiver's exit")
        start = time.monotonic()
        try:
            sender.send(1)
            result = None
        except WeightSyncError as exc:
            result = {"peer": exc.peer, "message": str(exc), "seconds": time.monotonic() - start}
        open(sender_done, "w").close()
        group.close()
        assert result is not None, "send to a dead receiver succeeded"
        return result
    if mode == "killed":
        # A real process that dies: forked from this rank, so no second torch import.
        child = mp.get_context("fork").Process(
            target=_receiver_then_die, args=(rdv.host, rdv.port, named, transport, receiver_kwargs)
        )
        child.start()
        child.join(timeout=30)
        open(receiver_gone, "w").close()
        return child.exitcode
    group = WeightSyncGroup(
        WeightSyncEndpoint(host=rdv.host, port=rdv.port, rank=1, world_size=world_size, **receiver_kwargs),
        **transport_kwargs(transport),
    )
    WeightReceiver(group, {k: torch.zeros_like(v) for k, v in named.items()})
    # Alive but never receives, until the sender gave up: it must not wait past its deadline.
    wait_until(lambda: os.path.exists(sender_done), timeout_s=30, what="the sender's error")
    group.close()
    return None


@pytest.mark.parametrize("mode", ["killed", "stalled"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dead_receiver_is_a_clear_error(transport: str, mode: str) -> None:
    result, exitcode = run_distributed(_dead_receiver_worker, 2, transport, mode, timeout_s=60)
    assert result["peer"] == 1 and "peer rank 1" in result["message"], result
    assert result["seconds"] < 4.0 + 2.0, result  # one deadline, not a hang
    if mode == "killed":
        assert exitcode == 0


HEARTBEAT = {"heartbeat_s": 0.2, "dead_after_s": 1.0}  # beats 5 times a second, gone after 1 s still


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_receiver_is_told_from_a_slow_one_by_its_heartbeat(transport: str) -> None:
    """A receiver that died between syncs: the send fails once its heartbeat has stood still for
    dead_after_s (1 s), not at the 30 s deadline. One alive but silent for 3 s (over dead_after_s) is
    waited for until the deadline: slow is not dead."""
    result, exitcode = run_distributed(
        _dead_receiver_worker, 2, transport, "killed", 30.0, HEARTBEAT, timeout_s=60
    )
    assert exitcode == 0
    assert result["peer"] == 1 and "peer rank 1 is gone: its heartbeat stopped" in result["message"], result
    assert result["seconds"] < 1.0 + 3.0, result  # dead_after_s and a margin, far below the 30 s deadline

    result, _ = run_distributed(_dead_receiver_worker, 2, transport, "stalled", 3.0, HEARTBEAT, timeout_s=60)
    assert result["peer"] == 1 and "waited 3.0s for peer rank 1" in result["message"], result
    assert 3.0 <= result["seconds"] < 3.0 + 2.0, result


FAULT_TIMEOUT_S = 30.0  # the deadline of every wait in the mid-sync fault tests: never reached


def _fault_in_the_middle(host: str, port: int, named: dict, transport: str, fault: str) -> None:
    """Rank 1 (of a chain 0 -> 1 -> 2) takes part in a sync until its first receive, where it freezes
    (SIGSTOP: its connections open, its heartbeat still, as a hung or unreachable process) or raises
    (it stays alive and beating, and its sync fails); "freeze-in-transfer": it freezes at its first
    wait for a transfer instead, once it has posted its receives and told rank 0 so, as the bytes flow."""
    group = WeightSyncGroup(
        WeightSyncEndpoint(
            host=host, port=port, rank=1, world_size=3, timeout_s=FAULT_TIMEOUT_S, **HEARTBEAT
        ),
        **transport_kwargs(transport),
    )
    where = "wait" if fault == "freeze-in-transfer" else "recv"
    original = getattr(group, where)

    def fault_then_go_on(*args, **kwargs):
        if fault == "raise":
            raise RuntimeError("a fault injected at rank 1's first receive")
        os.kill(os.getpid(), signal.SIGSTOP)
        return original(*args, **kwargs)

    setattr(group, where, fault_then_go_on)
    with contextlib.suppress(RuntimeError):  # the injected fault
        WeightReceiver(group, {k: torch.zeros_like(v) for k, v in named.items()}).receive()
    time.sleep(60)  # alive (and beating) until killed


def _mid_sync_fault_worker(rank: int, world_size: int, rdv, transport: str, fault: str, delta: bool):
    """Rank 0 sends along the chain 0 -> 1 -> 2; rank 1 meets `fault` (see `_fault_in_the_middle`).
    Returns ranks 0 and 2's errors and how long their syncs took (rank 1: the exit code of its process,
    killed once the others are done). `delta`: a group of changed-only syncs (each bucket a header,
    then its payload)."""
    # Frozen in transfer, rank 1 must leave rank 0's sends waiting: more bytes than a loopback
    # socket's buffers take in (gloo's send completes once its bytes are in the socket).
    side = 1024 if fault == "freeze-in-transfer" else 64
    named = {f"w{i}": torch.full((side, side), float(i)) for i in range(8)}
    over = os.path.join(rdv.tmpdir, "over")
    if rank == 1:
        child = mp.get_context("fork").Process(
            target=_fault_in_the_middle, args=(rdv.host, rdv.port, named, transport, fault)
        )
        child.start()
        wait_until(
            lambda: os.path.isdir(over) and len(os.listdir(over)) == 2, timeout_s=60, what="the others"
        )
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
        return child.exitcode
    group = WeightSyncGroup(
        WeightSyncEndpoint(
            host=rdv.host, port=rdv.port, rank=rank, world_size=3, timeout_s=FAULT_TIMEOUT_S, **HEARTBEAT
        ),
        **transport_kwargs(transport),
    )
    start = time.monotonic()
    try:
        if rank == 0:
            WeightSender(group, named, bucket_bytes=4096, delta=delta).send(1)
        else:
            WeightReceiver(group, {k: torch.zeros_like(v) for k, v in named.items()}).receive()
        result = None
    except WeightSyncError as exc:
        result = {"peer": exc.peer, "message": str(exc), "seconds": time.monotonic() - start}
    os.makedirs(over, exist_ok=True)
    open(os.path.join(over, str(rank)), "w").close()
    wait_until(lambda: len(os.listdir(over)) == 2, timeout_s=60, what="the other live rank")
    group.close()
    return result


@pytest.mark.parametrize(
    ("fault", "delta"),
    [("freeze", False), ("freeze-in-transfer", False), ("raise", False), ("freeze-in-transfer", True),
     ("raise", True)],
    ids=["freeze", "freeze-in-transfer", "raise", "freeze-in-transfer-delta", "raise-delta"],
)  # fmt: skip
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_fault_mid_sync_ends_the_sync_of_every_member_in_seconds(
    transport: str, fault: str, delta: bool
) -> None:
    """Rank 1, in the middle of the chain 0 -> 1 -> 2, freezes or raises at its first receive, or
    freezes as the bytes flow. NCCL never fails a transfer whose peer hangs or died, gloo only once the
    peer's socket closes (never for a frozen process), and a failed member leaves its peers' transfers
    waiting. Frozen: ranks 0 and 2 end their waits on it, for a message in the store or a transfer,
    once its heartbeat has stood still for dead_after_s (1 s). Raised: rank 1 abandons the group's
    generation, and rank 0, waiting for rank 1 to say it is ready, ends at its next look at the store
    (every 0.2 s). None waits out the 30 s deadline."""
    sender, exitcode, tail = run_distributed(_mid_sync_fault_worker, 3, transport, fault, delta, timeout_s=90)
    assert exitcode == -signal.SIGKILL  # still frozen, or alive, when the others were done
    for rank, result in ((0, sender), (2, tail)):
        assert result is not None, f"rank {rank} finished a sync that rank 1 never took part in"
        assert result["peer"] == 1, result
        if fault != "raise":
            assert "peer rank 1 is gone: its heartbeat stopped" in result["message"], result
            assert result["seconds"] < 1.0 + 4.0 < FAULT_TIMEOUT_S, result
        else:
            # (Rank 2 may hear of it first from its gloo pair to rank 1, which rank 1 closed.)
            if rank == 0:
                assert "abandoned by rank 1: RuntimeError: a fault injected" in result["message"], result
            assert result["seconds"] < 4.0 < FAULT_TIMEOUT_S, result


def _receiver_sees_dead_sender(rank: int, world_size: int, rdv, transport: str):
    """The trainer dies after announcing a sync: the engine gets an error naming it, within the deadline."""
    named = {"w": torch.ones(256, 256)}
    group = _group(rank, world_size, rdv, transport, timeout_s=4.0)
    if rank == 0:
        WeightSender(group, named, bucket_bytes=4096)
        group.put("sync/1", {"generation": 0, "policy_version": 1})  # announce, then never send
        group.get("test/done", timeout_s=20)
        return None
    receiver = WeightReceiver(group, {"w": torch.zeros(256, 256)})
    start = time.monotonic()
    try:
        receiver.receive()
    except WeightSyncError as exc:
        group.put("test/done", True)
        return {
            "peer": exc.peer,
            "bucket": exc.bucket,
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    raise AssertionError("received from a silent sender")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_silent_sender_is_a_clear_error(transport: str) -> None:
    _, result = run_distributed(_receiver_sees_dead_sender, 2, transport, timeout_s=60)
    assert result["peer"] == 0 and result["bucket"] == 0 and "peer rank 0 (bucket 0)" in result["message"], (
        result
    )
    assert result["seconds"] < 4.0 + 2.0, result


def _wire_worker(rank: int, world_size: int, rdv, transport: str, wire: str):
    group = _group(rank, world_size, rdv, transport)
    torch.manual_seed(0)
    named = {"w": torch.randn(300, 256), "norm": torch.randn(256)}  # w: a direct bucket if raw
    if rank == 0:
        WeightSender(group, named, wire_dtype=getattr(torch, wire), bucket_bytes=32 << 10).send(2)
        return named
    served = {
        "w": torch.zeros(300, 256, dtype=torch.bfloat16),
        "norm": torch.zeros(256, dtype=torch.bfloat16),
    }
    receiver = WeightReceiver(group, served)
    assert receiver.receive() == 2
    return served


@pytest.mark.parametrize("wire", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_lower_precision_on_the_wire_end_to_end(transport: str, wire: str) -> None:
    sent, served = run_distributed(_wire_worker, 2, transport, wire, timeout_s=60)
    assert torch.equal(served["norm"], sent["norm"].to(torch.bfloat16))  # 1-d tensors: bf16 either way
    if wire == "bfloat16":
        assert torch.equal(served["w"], sent["w"].to(torch.bfloat16))
    else:
        row_max = sent["w"].abs().amax(dim=1, keepdim=True)
        assert ((served["w"].float() - sent["w"]).abs() / row_max).max() <= 2**-4 + 2**-8


def _strided_worker(rank: int, world_size: int, rdv, transport: str):
    group = _group(rank, world_size, rdv, transport)
    torch.manual_seed(0)
    base = torch.randn(256, 300)
    # A parameter that is a transposed view: its boxes are not runs of memory, whatever the plan says.
    named = {"w_t": base.t(), "b": torch.randn(300)}
    if rank == 0:
        WeightSender(group, named, bucket_bytes=64 << 10, direct_min_bytes=0).send(4)
        return {k: v.contiguous() for k, v in named.items()}
    served = {"w_t": torch.zeros(300, 256), "b": torch.zeros(300)}
    receiver = WeightReceiver(group, served)
    assert receiver.receive() == 4
    return served


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_strided_parameter_is_packed_and_arrives_bitwise(transport: str) -> None:
    sent, served = run_distributed(_strided_worker, 2, transport, timeout_s=60)
    for name in sent:
        assert torch.equal(served[name], sent[name]), name


def _receive_expecting_refusal(group, named: dict[str, torch.Tensor], accepted: str) -> dict:
    """The receiver's side of a sync it must refuse: the error's peer, bucket and message, and the
    version it holds after; tells the sender's rank it is done either way."""
    receiver = WeightReceiver(group, {k: torch.zeros_like(v) for k, v in named.items()})
    try:
        receiver.receive()
    except WeightSyncError as exc:
        return {"peer": exc.peer, "bucket": exc.bucket, "message": str(exc), "held": receiver.policy_version}
    finally:
        group.put("test/receiver-done", True)
    raise AssertionError(accepted)
