"""Never lose a run: checkpoints, resume, and real kills (SIGKILL) of ranks, end to end.

Every run here learns something, so that "the same weights" means something: the tiny model below is
rigged to answer "3" or "4" (about half each) to questions whose answer is 3, so rewards differ within
every group, advantages are not zero, and the weights move at every step along a path that depends on
the sampled tokens (the generator's RNG) and on the prompt order. Each fault test then compares its
final weights bitwise with those of an uninterrupted run of the same seed (fp32, sync mode).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from stream_checks import assert_every_prompt_trained_at_most_once_and_none_skipped

REPO = Path(__file__).resolve().parents[1]
STEPS = 4


def run_app(
    *args: str, env: dict[str, str] | None = None, timeout: float = 400
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    full_env.pop("LLAMARL_FAULT", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(REPO / "apps" / "gsm8k_rl"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def answers_three(tmp_path_factory) -> Path:
    """GSM8K-schema data whose every answer is 3."""
    path = tmp_path_factory.mktemp("threes")
    for split, n in (("train", 16), ("test", 4)):
        rows = [
            {"question": f"Question {split} {i}: what is {i} - {i} + 3?", "answer": "#### 3"}
            for i in range(n)
        ]
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def three_or_four_model(tmp_path_factory) -> Path:
    """A 2-layer Llama (SmolLM2's tokenizer) that samples the token "3" or "4", about half each.

    Residual dimension 0 holds a constant (large in every embedding, never written by attention or
    MLP outputs), so after the final norm it is a constant positive feature; only the output rows of
    "3" and "4" read it, so those two tokens dominate every softmax whatever the context.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from llamarl.exec.models import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        for digit in ("3", "4"):
            (token,) = tokenizer.encode(digit, add_special_tokens=False)
            model.lm_head.weight[token, 0] = 5.0
    path = tmp_path_factory.mktemp("three_or_four")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def args_for(model: Path, data: Path, out: Path, *extra: str, mode: str = "sync") -> list[str]:
    return [
        "--model", str(model), "--data", str(data), "--output-dir", str(out), "--mode", mode,
        "--steps", str(STEPS), "--prompts-per-step", "2", "--samples-per-prompt", "4",
        "--max-new-tokens", "1", "--eval-size", "2", "--lr", "1e-3", "--seed", "7",
        # float32, whatever the CPU: the sharded run must equal the single-rank one to 1e-6, and the
        # generator's log-probs the trainer's (DAPO's first loss is 0 but for rounding)
        "--trainer.precision", "fp32", "--generator.precision", "fp32", *extra,
    ]  # fmt: skip


def final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "final_model" / "model.safetensors")


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    different = [name for name in a if not (a[name] == b[name]).all()]
    assert not different, f"weights differ: {different}"


def steps_logged(out: Path) -> list[int]:
    return [r["step"] for r in step_metrics(out)]


def step_metrics(out: Path) -> list[dict]:
    """The training steps' records of metrics.jsonl, in order."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/reward_mean" in r]


def samples(out: Path, rank: int = 1) -> list[str]:
    """The lines of a generator rank's samples log (prompt, completion, reward, policy version)."""
    return (out / f"samples.rank{rank}.jsonl").read_text().splitlines()


def checkpoint_names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


# The async kill test runs (and its own reference run) with these instead of AIPO and the group-mean
# baseline: each shows in a value only it gives (see there).
ALGORITHM_FLAGS = (
    "--loss", "dapo", "--loss-arg", "clip_high=0.3", "--advantage", "rloo",
    "--mismatch-is", "token_truncate", "--mismatch-cap", "1.0",
)  # fmt: skip


def reference_run(model: Path, data: Path, out: Path, mode: str, *extra: str) -> Path:
    """The reference: STEPS steps in one go, no checkpoints."""
    result = run_app(*args_for(model, data, out, *extra, mode=mode), "--no-wandb")
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def uninterrupted(three_or_four_model, answers_three, tmp_path_factory) -> Path:
    return reference_run(three_or_four_model, answers_three, tmp_path_factory.mktemp("uninterrupted"), "sync")


def test_the_reference_run_learns(uninterrupted, three_or_four_model):
    """Guards the other tests: identical weights must not come from weights that never move."""
    from safetensors.torch import load_file

    rewards = [
        json.loads(line)["reward"]
        for line in (uninterrupted / "samples.rank1.jsonl").read_text().splitlines()
    ]
    assert 0 < sum(rewards) < len(rewards), rewards  # both right and wrong answers: advantages are not 0
    start = load_file(three_or_four_model / "model.safetensors")
    end = final_weights(uninterrupted)
    assert any(not (start[k] == end[k]).all() for k in start), "training did not change the weights"


@pytest.mark.timeout(900)
def test_a_run_stopped_and_resumed_ends_with_the_same_weights_and_the_same_w_and_b_run(
    uninterrupted, three_or_four_model, answers_three, tmp_path
):
    out = tmp_path / "resumed"
    half = args_for(three_or_four_model, answers_three, out, "--checkpoint-every", "1")
    half[half.index("--steps") + 1] = str(STEPS // 2)
    result = run_app(*half)
    assert result.returncode == 0, result.stderr[-4000:]
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step_00000001", "step_00000002"]  # keep 2 (the default)
    result = run_app(
        *args_for(three_or_four_model, answers_three, out, "--checkpoint-every", "1", "--resume")
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from" in result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == STEPS // 2 and summary["final_policy_version"] == STEPS
    assert summary["steps"] == STEPS  # the metrics history came back with the checkpoint
    assert_bitwise_equal(final_weights(out), final_weights(uninterrupted))
    # Same prompts in the same order, each completion once: the samples log matches line for line.
    assert (out / "samples.rank1.jsonl").read_text().splitlines() == (
        uninterrupted / "samples.rank1.jsonl"
    ).read_text().splitlines()
    assert steps_logged(out) == list(range(1, STEPS + 1))
    # The W&B run continues: both offline run folders carry the same run id.
    run_ids = {p.name.rsplit("-", 1)[1] for p in (out / "wandb").glob("offline-run-*")}
    assert len(list((out / "wandb").glob("offline-run-*"))) == 2 and len(run_ids) == 1, run_ids


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("mode", "rank"),
    [("sync", 0), ("async", 1)],
    ids=["trainer", "async-generator"],
)
def test_a_killed_rank_is_restarted_by_torch_elastic_and_the_run_resumes_by_itself(
    uninterrupted, three_or_four_model, answers_three, tmp_path, mode, rank
):
    """Torch elastic restarts every rank (the trainer reloads its state from the checkpoint too).

    In async mode checkpoint 2 also holds the batch the generator made at tick 2 and had not sent yet:
    it is trained on once, after the restart, as in the uninterrupted run. The async runs use another
    loss, advantage and mismatch correction (ALGORITHM_FLAGS), each checked by a value only it gives.
    """
    algorithm = ALGORITHM_FLAGS if mode == "async" else ()
    reference = uninterrupted
    if mode == "async":
        reference = reference_run(
            three_or_four_model, answers_three, tmp_path / "reference", mode, *algorithm
        )
    out = tmp_path / "restarted"
    args = args_for(
        three_or_four_model, answers_three, out, *algorithm,
        "--checkpoint-every", "2", "--keep-checkpoints", "1", "--max-restarts", "1", "--no-wandb", mode=mode,
    )  # fmt: skip
    # SIGKILL at the start of tick 3: step 3 is lost, checkpoint 2 is the latest.
    result = run_app(*args, env={"LLAMARL_FAULT": f"{rank}:3:kill"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads((out / "errors" / "injected_fault.json").read_text())["tick"] == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["final_policy_version"] == STEPS
    # Nothing lost, nothing done twice: each step logged once, each rollout sampled once, same weights.
    assert steps_logged(out) == list(range(1, STEPS + 1))
    assert samples(out) == samples(reference)
    assert_bitwise_equal(final_weights(out), final_weights(reference))
    # --keep-checkpoints 1: only the newest checkpoint is left (the default keeps two).
    assert checkpoint_names(out) == ["step_00000004"]
    if mode == "async":
        assert_algorithm_flags_applied(step_metrics(reference), step_metrics(uninterrupted))


def assert_algorithm_flags_applied(picked: list[dict], default: list[dict]) -> None:
    """ALGORITHM_FLAGS' values, against the same run with AIPO and the group-mean baseline (sync mode:
    its first step trains on the same batch, sampled by the same initial weights, as async's first)."""
    first, first_default = picked[0], default[0]
    assert first["train/reward_mean"] == first_default["train/reward_mean"]  # the same batch
    assert 0 < first["train/reward_mean"] < 1
    # RLOO's baseline leaves out the sample itself: with 4 samples per prompt every advantage is 4/3 of
    # the group-mean one.
    assert first["train/advantage_abs_mean"] == pytest.approx(
        first_default["train/advantage_abs_mean"] * 4 / 3, rel=1e-6
    )
    # DAPO's loss is -mean(weight * A * ratio) with ratios and weights of 1 on the policy that sampled
    # the batch: 0 but for rounding, as the advantages of a group sum to 0. AIPO's, -mean(weight * A *
    # log pi), is not (small here: the rigged model gives "3" and "4" nearly the same log-prob); and the
    # clip's metric replaces AIPO's truncation one.
    assert abs(first["train/loss"]) < 1e-5 < abs(first_default["train/loss"])
    assert "train/clipped_fraction" in first and "train/truncated_fraction" not in first
    # The mismatch weights pi_old / mu are truncated at --mismatch-cap 1.0: once the weights move, the
    # tokens the last step made likelier come out at exactly 1.0.
    assert "train/mismatch_weight_max" not in first_default
    later = picked[1:]
    assert max(m["train/mismatch_weight_max"] for m in later) == 1.0
    assert any(m["train/mismatch_corrected_fraction"] > 0 for m in later)


@pytest.mark.timeout(900)
def test_a_sharded_trainer_checkpoints_its_shards_and_resumes_to_the_same_weights(
    uninterrupted, three_or_four_model, answers_three, tmp_path
):
    """Two FSDP2 trainer ranks: each saves and loads its own shards; resumed == uninterrupted, and both
    equal the single-rank run's weights (to float summation order: each rank sums half the batch)."""
    sharded = ("--num-trainers", "2", "--checkpoint-every", "2", "--no-wandb")
    reference = tmp_path / "reference_sharded"
    result = run_app(*args_for(three_or_four_model, answers_three, reference, *sharded))
    assert result.returncode == 0, result.stderr[-4000:]
    # The same samples as the single-rank run (the generator, rank 2 here, is seeded by its index), and
    # the final model gathered from the shards holds the single-rank run's weights.
    assert samples(reference, rank=2) == samples(uninterrupted)
    single, gathered = final_weights(uninterrupted), final_weights(reference)
    assert sorted(single) == sorted(gathered)
    for name, tensor in single.items():
        torch.testing.assert_close(gathered[name], tensor, rtol=0, atol=1e-6, msg=name)
    halfway = f"step_{STEPS // 2:08d}"
    shards = sorted(p.name for p in (reference / "checkpoints" / halfway / "trainer").glob("*.distcp"))
    assert len(shards) == 2, shards  # one file of model and optimizer state per trainer rank
    # The run as it stood at its halfway checkpoint (what a run stopped there leaves), resumed.
    out = tmp_path / "resumed"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("final_model", "summary.json"))
    for later in (out / "checkpoints").iterdir():
        if later.name != halfway:
            shutil.rmtree(later)
    result = run_app(*args_for(three_or_four_model, answers_three, out, *sharded, "--resume"))
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == STEPS // 2
    assert_bitwise_equal(final_weights(out), final_weights(reference))


# ---------------------------------------------------------------------------------------------------------
# Stream mode: checkpoints hold the work in flight (the buffer's groups, the generators' partial
# completions), so a run killed anywhere resumes without losing or repeating a prompt.

STREAM_STEPS = 6


def stream_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model", str(model), "--data", str(data), "--output-dir", str(out), "--mode", "stream",
        "--steps", str(STREAM_STEPS), "--prompts-per-step", "2", "--samples-per-prompt", "2",
        "--max-new-tokens", "16", "--eval-size", "2", "--no-save-model", "--seed", "3",
        "--checkpoint-every", "1", "--max-restarts", "1", *extra,
    ]  # fmt: skip


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("fault", "num_generators", "resumed_from"),
    [("0:3:kill", 1, 3), ("2:4:kill", 2, None), ("0:3:kill:checkpoint", 2, 3)],
    ids=["trainer", "generator", "inside-a-checkpoint-write"],
)
def test_a_stream_run_killed_anywhere_resumes_its_work_in_flight_and_trains_every_prompt_once(
    tiny_model_dir, gsm8k_dir, tmp_path, fault, num_generators, resumed_from
):
    """SIGKILL of the trainer at the start of step 3 (checkpoint 3 is the latest), of generator rank 2
    at the start of its request 4, or of the trainer inside the write of checkpoint 4 (after its files
    are written, before the commit: checkpoint 3 is the latest complete one). Torch elastic restarts
    every rank, which resume from that checkpoint with the buffered groups and the partial completions
    in flight; the run ends at its step with every prompt trained at most once and none skipped."""
    out = tmp_path / "stream"
    args = stream_args(tiny_model_dir, gsm8k_dir, out, "--num-generators", str(num_generators), "--wandb")
    result = run_app(*args, env={"LLAMARL_FAULT": fault}, timeout=850)
    assert result.returncode == 0, result.stderr[-4000:]
    struck = json.loads((out / "errors" / "injected_fault.json").read_text())
    assert struck["rank"] == int(fault.split(":")[0])
    summary = json.loads((out / "summary.json").read_text())
    if resumed_from is not None:
        assert summary["resumed_from_step"] == resumed_from, summary["resumed_from_step"]
    if fault.endswith(":checkpoint"):  # killed inside the write: that checkpoint was never chosen
        assert struck["phase"] == "checkpoint"
        names = sorted(p.name for p in (out / "checkpoints").iterdir())
        assert not any(n.endswith(".tmp") for n in names), names  # the broken write was replaced
        assert all((out / "checkpoints" / n / "complete").exists() for n in names), names
    else:  # a generator's request 4 comes at a step that depends on timing: any checkpoint before it
        assert 1 <= summary["resumed_from_step"] < STREAM_STEPS
    assert_every_prompt_trained_at_most_once_and_none_skipped(
        out,
        steps=STREAM_STEPS,
        prompts_per_step=2,
        num_generators=num_generators,
    )
    # The metrics and the W&B run continue: each step logged once, one run id over both attempts.
    assert steps_logged(out) == list(range(1, STREAM_STEPS + 1))
    run_ids = {p.name.rsplit("-", 1)[1] for p in (out / "wandb").glob("offline-run-*")}
    assert len(list((out / "wandb").glob("offline-run-*"))) == 2 and len(run_ids) == 1, run_ids
