"""Colocated sync across real processes on the CPU: shared-memory files stand in for CUDA IPC (the CUDA
path itself has not run on a GPU; only its handle's JSON round trip is tested here)."""

from __future__ import annotations

import json

import pytest
import torch

from llamarl.comm import WeightSyncEndpoint, WeightSyncError, WeightSyncGroup
from llamarl.comm.colocated import ColocatedReceiver, ColocatedSender
from llamarl.comm.shared_memory import cuda_args_from_json, cuda_args_to_json
from llamarl.comm.testing import run_distributed

pytestmark = pytest.mark.timeout(120)


def test_cuda_ipc_handle_fields_round_trip_as_json() -> None:
    """The fields of torch's rebuild_cuda_tensor arguments survive JSON; the device becomes the local
    index of the same GPU, classes are never taken from the peer."""
    args = (
        torch.nn.Parameter,
        torch.Size([4, 3]),
        (3, 1),
        5,
        torch.storage.TypedStorage,
        torch.bfloat16,
        0,  # the exporter's device index
        b"\x00\x01ipc-handle\xff",
        4096,
        512,
        True,
        b"/ref-counter",
        7,
        b"\x10event",
        True,
    )
    desc = json.loads(json.dumps(cuda_args_to_json(args, "GPU-1234")))
    assert desc["gpu_uuid"] == "GPU-1234"
    back = cuda_args_from_json(desc, device_index=3)
    assert back[0] is torch.Tensor and back[4] is torch.storage.TypedStorage
    assert back[6] == 3 and back[10] is False  # this process's index; an engine only reads
    assert back[1:4] == args[1:4] and back[5] == args[5]
    assert back[7:10] == args[7:10] and back[11:] == args[11:]


def _group(rank: int, world_size: int, rdv, timeout_s: float = 30.0) -> WeightSyncGroup:
    return WeightSyncGroup(
        WeightSyncEndpoint(
            host=rdv.host, port=rdv.port, rank=rank, world_size=world_size, timeout_s=timeout_s
        )
    )


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(
        40, generator=g
    )  # two tensors in one storage, at offsets (as an optimizer's flat buffer)
    return {
        "w": flat[:32].view(4, 8),
        "b": flat[32:],
        "emb": torch.randn(6, 4, generator=g).to(torch.bfloat16),
    }


def _sync_worker(rank: int, world_size: int, rdv):
    group = _group(rank, world_size, rdv)
    if rank == 0:
        weights = _weights(0)
        sender = ColocatedSender(group, weights)
        sent = []
        for version in (1, 2, 3):
            stats = sender.send(version)
            assert stats.policy_version == version and stats.buckets == 3
            sent.append({n: t.clone() for n, t in weights.items()})
            for t in weights.values():  # an optimizer step, in place
                t.mul_(-2).add_(1)
        # A receiver reports what it holds after acknowledging the sync (which is what send waits for):
        # read once each receiver is done.
        for r in (1, 2):
            group.get(f"test/done/{r}")
        return {"sent": sent, "held": sender.held_versions()}
    if rank == 1:  # in place
        weights = {n: torch.zeros_like(t) for n, t in _weights(0).items()}
        receiver = ColocatedReceiver(group, weights)
        got = []
        for version in (1, 2, 3):
            assert receiver.receive() == version
            got.append({n: t.clone() for n, t in weights.items()})
    else:  # through an engine's loader: meta tensors, no staging
        spec = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in _weights(0).items()}
        got = []

        def load_fn(pairs) -> None:
            pairs = list(pairs)
            assert all(t.is_shared() for _, t in pairs)  # the trainer's memory itself, mapped
            got.append({n: t.clone() for n, t in pairs})

        receiver = ColocatedReceiver(group, spec, load_fn=load_fn)
        for version in (1, 2, 3):
            assert receiver.receive() == version
    group.put(f"test/done/{rank}", True)
    return got


def test_colocated_receivers_read_each_sync_in_place_and_through_a_loader() -> None:
    trainer, in_place, loaded = run_distributed(_sync_worker, 3, timeout_s=90)
    assert trainer["held"] == {1: 3, 2: 3}
    for got in (in_place, loaded):
        for version_i, sent in enumerate(trainer["sent"]):
            for name, want in sent.items():
                assert got[version_i][name].dtype == want.dtype and torch.equal(got[version_i][name], want)


def _failure_worker(rank: int, world_size: int, rdv, mode: str):
    group = _group(rank, world_size, rdv, timeout_s=3.0)
    weights = _weights(0)
    if rank == 0:
        try:
            ColocatedSender(group, weights).send(1)
        except WeightSyncError as exc:  # at construction when the receiver never joined
            group.get("test/done", timeout_s=30)
            return {"peer": exc.peer, "message": str(exc)}
        raise AssertionError("a sync no receiver loaded succeeded")
    if mode == "shape":
        weights["w"] = torch.zeros(8, 4)
        try:
            ColocatedReceiver(group, weights)
        except WeightSyncError as exc:
            return str(exc)
        finally:
            group.put("test/done", True)
        raise AssertionError("a shape mismatch was accepted")

    def failing_load(pairs) -> None:
        raise RuntimeError("the engine's loader failed")

    receiver = ColocatedReceiver(group, weights, load_fn=failing_load)
    if mode == "loader":
        with pytest.raises(RuntimeError, match="loader failed"):
            receiver.receive()
        assert receiver.policy_version is None
    group.put("test/done", True)  # mode "silent": joined, never receives
    return None


@pytest.mark.parametrize("mode", ["loader", "silent"])
def test_a_failed_or_silent_receiver_is_a_clear_error(mode: str) -> None:
    trainer, _ = run_distributed(_failure_worker, 2, mode, timeout_s=60)
    assert trainer["peer"] == 1, trainer
    expected = "the engine's loader failed" if mode == "loader" else "peer rank 1"
    assert expected in trainer["message"], trainer


def test_a_mismatched_receiver_fails_at_construction() -> None:
    _, message = run_distributed(_failure_worker, 2, "shape", timeout_s=60)
    assert "w: shared as [[4, 8], 'float32'], expected [[8, 4], 'float32']" in message, message
