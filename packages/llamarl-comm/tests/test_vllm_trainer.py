"""The trainer side of the `llamarl` vLLM backend from an FSDP2 trainer, against a worker's receiving end.

Three processes over gloo, no vLLM: trainer ranks 0 and 1 hold a model sharded by FSDP2 (DTensor
Shard(0) parameters over their own default group) and each build a `LlamarlTrainerWeightTransferEngine`;
rank 2 is an engine worker (`WorkerWeights`, what the backend's engine delegates to, with a loader that
keeps what it is given). Rank 0 drives the worker through a client with vLLM's four calls, carried by
files in the rendezvous folder (what `HTTPWeightSyncClient` carries over HTTP): the worker joins with
the init info rank 0 makes, pulls each sync after `start_weight_update`, and loads it at
`update_weights`, checked against the version sent. The worker receives the whole tensors, assembled
from both trainer ranks' shards without a gather.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from llamarl.comm import WeightSyncEndpoint
from llamarl.comm.adapters.checkpoint import TensorSpec
from llamarl.comm.adapters.vllm_trainer import LlamarlTrainerInitInfo, LlamarlTrainerWeightTransferEngine
from llamarl.comm.adapters.vllm_worker import WorkerWeights
from llamarl.comm.testing import run_distributed, wait_until

pytestmark = pytest.mark.timeout(180)

NUM_TRAINERS = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank: the worker knows what to expect
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))


def _step(tensors) -> None:
    """An optimizer step's worth of change, in place (on local shards on the trainer ranks)."""
    with torch.no_grad():
        for t in tensors:
            t.mul_(-0.5).add_(0.25)


class FileClient:
    """vLLM's weight-sync calls from trainer rank 0 to the worker, as files in `folder`."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.calls: list[str] = []
        self.updates = 0

    def _post(self, name: str, body: dict) -> None:
        partial = self.folder / f".{name}"
        partial.write_text(json.dumps(body))
        partial.replace(self.folder / name)

    def _answered(self, name: str) -> None:
        wait_until(lambda: (self.folder / name).exists(), timeout_s=60, what=f"the worker's {name}")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append("init")
        self._post("init", init_info)
        self._answered("joined")

    def start_weight_update(self) -> None:
        self.calls.append("start")
        self.updates += 1
        self._post(f"start.{self.updates}", {})

    def update_weights(self, update_info: dict) -> None:
        self.calls.append("update")
        self._post(f"update.{self.updates}", update_info)
        self._answered(f"updated.{self.updates}")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish {weight_version}")


def _trainer(rank: int, rdv) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"file://{rdv.tmpdir}/fsdp", rank=rank, world_size=NUM_TRAINERS
    )
    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (NUM_TRAINERS,)))
    endpoint = WeightSyncEndpoint(host=rdv.host, port=rdv.port, rank=rank, world_size=NUM_TRAINERS + 1)
    client = FileClient(rdv.tmpdir)
    engine = LlamarlTrainerWeightTransferEngine.trainer_init(
        LlamarlTrainerInitInfo(endpoint=endpoint, first_engine_rank=NUM_TRAINERS), client=client, source=model
    )
    reports = [engine.send_weights()]
    _step(p.to_local() for p in model.parameters())
    reports.append(engine.send_weights())
    wait_until(lambda: os.path.exists(f"{rdv.tmpdir}/done"), timeout_s=60, what="the worker")
    engine.sender.group.close()
    dist.destroy_process_group()
    return {
        "versions": [r.policy_version for r in reports],
        "pause_s": [r.pause_s for r in reports],
        "bytes": [r.stats.bytes for r in reports],
        "calls": client.calls,
    }


def _worker(rdv) -> dict:
    folder = Path(rdv.tmpdir)
    expected = {name: p.detach().clone() for name, p in _model().named_parameters()}
    loads: list[dict[str, torch.Tensor]] = []
    wait_until(lambda: (folder / "init").exists(), timeout_s=60, what="the trainer's init")
    info = json.loads((folder / "init").read_text())
    specs = {name: TensorSpec(shape=tuple(t.shape), dtype=t.dtype) for name, t in expected.items()}
    weights = WorkerWeights(
        WeightSyncEndpoint.from_json(info["endpoint"]),
        specs=specs,
        device=torch.device("cpu"),
        load_fn=lambda pairs: loads.append({n: t.clone() for n, t in pairs}),
    )
    (folder / "joined").touch()
    out: dict = {"rank": weights.group.rank, "served": [], "matches": []}
    for n in (1, 2):
        wait_until(lambda n=n: (folder / f"start.{n}").exists(), timeout_s=60, what="start_weight_update")
        weights.start()
        wait_until(lambda n=n: (folder / f"update.{n}").exists(), timeout_s=60, what="update_weights")
        update = json.loads((folder / f"update.{n}").read_text())
        out["served"].append(weights.swap(expected_version=update["policy_version"]))
        (folder / f"updated.{n}").touch()
        out["matches"].append(all(torch.equal(loads[-1][name], t) for name, t in expected.items()))
        _step(expected.values())
    (folder / "done").touch()
    weights.close()
    return out


def _ranks(rank: int, world_size: int, rdv) -> dict:
    return _trainer(rank, rdv) if rank < NUM_TRAINERS else _worker(rdv)


def test_an_fsdp2_trainer_updates_a_worker_through_vllms_four_calls():
    sender, other, worker = run_distributed(_ranks, NUM_TRAINERS + 1, timeout_s=150)
    assert worker["rank"] == NUM_TRAINERS  # joined as the init info's first engine rank
    assert worker["served"] == [1, 2] and worker["matches"] == [True, True]
    assert sender["versions"] == other["versions"] == [1, 2]
    # Rank 0 alone drives the engine, in vLLM's order, and times the engine's pause around the swap.
    assert sender["calls"] == ["init", "start", "update", "finish 1", "start", "update", "finish 2"]
    assert other["calls"] == [] and other["pause_s"] == [None, None]
    assert all(p is not None and p > 0 for p in sender["pause_s"])
    # Each trainer rank sent its own shard's bytes (no gather to rank 0).
    assert sender["bytes"][0] > 0 and other["bytes"][0] > 0


def test_the_http_client_posts_json_and_a_server_error_is_one_line():
    import http.server
    import threading

    from llamarl.comm import free_port
    from llamarl.comm.adapters.vllm_trainer import HTTPWeightSyncClient, VLLMServerError

    seen: list[tuple[str, dict]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            if self.path.startswith("/update_weights"):
                self.send_response(500)
                self.end_headers()
                self.wfile.write(b'{"error": "the pull\\nfailed"}')
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"success": false}' if "reset" in self.path else b"")

        def log_message(self, *args) -> None:  # (quiet)
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = HTTPWeightSyncClient(f"http://127.0.0.1:{server.server_address[1]}/", timeout_s=10)
        client.init_weight_transfer_engine({"endpoint": {"rank": 1}})
        client.pause("keep")
        client.finish_weight_update("3")
        assert client.reset_prefix_cache() is False
        with pytest.raises(VLLMServerError, match=r"update_weights: HTTP 500: .*the pull\\nfailed") as error:
            client.update_weights({"policy_version": 3})
        assert "\n" not in str(error.value)
    finally:
        server.shutdown()
    assert seen == [
        ("/init_weight_transfer_engine", {"init_info": {"endpoint": {"rank": 1}}}),
        ("/pause?mode=keep", {}),
        ("/finish_weight_update", {"weight_version": "3"}),
        ("/reset_prefix_cache", {}),
        ("/update_weights", {"update_info": {"policy_version": 3}}),
    ]
    with pytest.raises(VLLMServerError, match="no answer"):
        HTTPWeightSyncClient(f"http://127.0.0.1:{free_port()}", timeout_s=5).start_weight_update()


def _dying_worker_ranks(rank: int, world_size: int, rdv) -> dict | None:
    """Rank 0 trains alone; rank 1, the worker, joins and dies before pulling the first sync."""
    folder = Path(rdv.tmpdir)
    if rank == 1:
        wait_until(lambda: (folder / "init").exists(), timeout_s=60, what="the trainer's init")
        info = json.loads((folder / "init").read_text())
        specs = {n: TensorSpec(shape=tuple(p.shape), dtype=p.dtype) for n, p in _model().named_parameters()}
        WorkerWeights(
            WeightSyncEndpoint.from_json(info["endpoint"]),
            specs=specs,
            device=torch.device("cpu"),
            load_fn=print,
        )
        (folder / "joined").touch()
        wait_until(lambda: (folder / "start.1").exists(), timeout_s=60, what="start_weight_update")
        os._exit(0)  # an engine that crashes: no goodbye
    # (timeout 30 s: forming the group on a loaded machine took over 10 s once; the dead worker is
    # caught by its heartbeat, dead_after_s, long before)
    endpoint = WeightSyncEndpoint(
        host=rdv.host, port=rdv.port, rank=0, world_size=2, timeout_s=30, dead_after_s=3
    )
    client = FileClient(rdv.tmpdir)
    client.update_weights = lambda info: client.calls.append(
        f"update {sorted(info)}"
    )  # (no worker to answer)
    engine = LlamarlTrainerWeightTransferEngine.trainer_init(
        LlamarlTrainerInitInfo(endpoint=endpoint), client=client, source=_model()
    )
    try:
        engine.send_weights()
        error = None
    except Exception as exc:
        error = type(exc).__name__
    engine.sender.group.close()
    return {"error": error, "calls": client.calls}


def test_a_failed_send_still_ends_the_update_the_engine_started():
    """vLLM refuses a start while an update is active: after a send that failed (the worker died), rank 0
    still calls update_weights, which ends the started update on the engine's side."""
    trainer, _ = run_distributed(_dying_worker_ranks, 2, timeout_s=120, may_die=(1,))
    assert trainer["error"] == "WeightSyncError"
    assert trainer["calls"] == ["init", "start", "update ['timeout_s']"]
