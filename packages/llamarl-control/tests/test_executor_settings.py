"""Settings of the command line reach the executors a rank builds, and act there: the sides build their
trainer and generator from the parsed command line (as a run does), and each setting shows in a value
that only it gives (a loss value, advantages, a clipped gradient, a metric name, a count)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from llamarl.algo import dapo_loss, group_mean_advantages, ppo_clip_loss, rloo_advantages
from llamarl.control.cli import parse_run_config
from llamarl.control.run.generator_side import GeneratorSide
from llamarl.control.run.trainer_side import TrainerSide
from llamarl.exec import VLLMGenerator
from llamarl.exec.models import tiny_model
from llamarl.exec.types import RolloutBatch

pytestmark = pytest.mark.timeout(120)

VOCAB = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model(VOCAB, seed=0).save_pretrained(path)
    return path


def trainer_from_command_line(model_dir: Path, out: Path, *flags: str):
    """The PolicyTrainer that rank 0 of a run with these flags builds (set up: the model loaded)."""
    config = parse_run_config(
        ["--model", str(model_dir), "--output-dir", str(out), *flags],
        task="gsm8k",
        prog="app",
        description="",
    )
    side = TrainerSide(config, [], [], rank=0)
    side.device = torch.device("cpu")
    side.build_executors()
    return side.trainer


def a_batch() -> RolloutBatch:
    """Two prompts x 4 samples of 3 tokens, rewards that differ within each group."""
    g = torch.Generator().manual_seed(0)
    rows = 8
    return RolloutBatch(
        prompt_ids_BP=torch.randint(3, VOCAB, (rows, 4), generator=g),
        prompt_mask_BP=torch.ones(rows, 4, dtype=torch.int64),
        completion_ids_BC=torch.randint(3, VOCAB, (rows, 3), generator=g),
        completion_mask_BC=torch.ones(rows, 3, dtype=torch.int64),
        behavior_logprobs_BC=torch.full((rows, 3), -math.log(VOCAB)),
        rewards_B=torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
        policy_version_B=torch.zeros(rows, dtype=torch.int64),
        group_size=4,
    )


def losses_at(loss_fn, ratios: list[float], advantages: list[float]):
    """`loss_fn` on one token per sequence whose ratio pi / mu is each of `ratios`."""
    behavior = torch.full((len(ratios), 1), -1.0, dtype=torch.float64)
    logprobs = (behavior + torch.tensor(ratios, dtype=torch.float64).log()[:, None]).requires_grad_()
    return loss_fn(
        logprobs,
        behavior,
        torch.tensor(advantages, dtype=torch.float64),
        torch.ones_like(behavior, dtype=torch.int64),
        num_valid_tokens=len(ratios),
        num_sequences=len(ratios),
    )


def test_loss_advantage_kl_and_clipping_flags_act_in_the_trainer(model_dir, tmp_path):
    trainer = trainer_from_command_line(
        model_dir, tmp_path, "--loss", "dapo", "--loss-arg", "clip_high=0.3", "--advantage", "rloo",
        "--kl-coef", "0.1", "--kl-estimator", "k2", "--max-grad-norm", "0.25",
        "--no-activation-checkpointing", "--pack-tokens", "0",
    )  # fmt: skip
    # DAPO with clip_high 0.3: a token at ratio 1.29 with a positive advantage is inside the clip range
    # (DAPO's default 0.28 and PPO's 0.2 clip it), one at 0.7 with a negative one is clipped (0.8).
    ratios, advantages = [1.29, 0.7, 1.0], [1.0, -1.0, 0.5]
    loss, metrics = losses_at(trainer.loss_fn, ratios, advantages)
    expected, _ = losses_at(lambda *a, **k: dapo_loss(*a, clip_high=0.3, **k), ratios, advantages)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-12)
    for other in (dapo_loss, ppo_clip_loss):
        assert float(loss.detach()) != pytest.approx(
            float(losses_at(other, ratios, advantages)[0].detach()), rel=1e-6
        )
    assert float(metrics["clipped_fraction"]) == pytest.approx(1 / 3)
    # RLOO: each sample's baseline is the mean of the other samples of its group.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    torch.testing.assert_close(trainer.advantage_fn(rewards, 4), rloo_advantages(rewards, 4))
    assert not torch.allclose(trainer.advantage_fn(rewards, 4), group_mean_advantages(rewards, 4))
    # Activation checkpointing (on by default) is off; the KL penalty uses k2 against a frozen reference.
    assert not trainer.model.is_activation_checkpointing and trainer.ref_model is not None
    applied: list[float] = []
    trainer.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: applied.append(
            float(torch.nn.utils.get_total_norm([p.grad for p in trainer.model.parameters()]))
        )
    )
    metrics = trainer.train_step(a_batch())
    assert "kl_k2" in metrics and "kl_k3" not in metrics
    # The gradient the optimizer applied was clipped to --max-grad-norm.
    assert metrics["grad_norm"] > 0.25 and applied == [pytest.approx(0.25, rel=1e-4)]


def test_mismatch_flags_weight_the_loss_with_their_mode_and_cap(model_dir, tmp_path):
    trainer = trainer_from_command_line(
        model_dir, tmp_path, "--mismatch-is", "token_mask", "--mismatch-cap", "1.5"
    )
    # pi_old / mu of 1.6 is over the cap and masked; 1.4 and 0.5 are kept (the default cap 2 keeps all).
    _, metrics = losses_at(trainer.loss_fn, [1.6, 1.4, 0.5], [1.0, 1.0, -1.0])
    assert float(metrics["mismatch_corrected_fraction"]) == pytest.approx(1 / 3)
    assert float(metrics["mismatch_weight_max"]) == pytest.approx(1.4)
    assert "policy_kl" in metrics and "truncated_fraction" in metrics  # AIPO inside the correction


def test_engine_flags_reach_the_vllm_generator(tmp_path):
    config = parse_run_config(
        ["--generator", "vllm", "--vllm-python", "/opt/vllm/bin/python", "--max-engine-restarts", "5",
         "--output-dir", str(tmp_path)],
        task="gsm8k", prog="app", description="",
    )  # fmt: skip
    side = GeneratorSide(config, [], [], rank=1)
    side.device = torch.device("cpu")
    generator = side._build_generator()  # built, not started: no engine process
    assert isinstance(generator, VLLMGenerator)
    assert generator.engine.max_engine_restarts == 5
    assert generator.engine.vllm_python == "/opt/vllm/bin/python"
