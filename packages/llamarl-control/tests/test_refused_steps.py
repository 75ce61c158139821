"""Refused updates (`llamarl.control.run.refused_steps`): a step the trainer skipped for a non-finite
value is said in one line, and too many in a row stop the run in one line naming where to resume."""

from __future__ import annotations

import pytest
import torch
from test_channels import make_batch

from llamarl.control.launch.failures import is_user_error
from llamarl.control.outputs.timeline import Timeline
from llamarl.control.run.refused_steps import RefusedSteps, TrainingStopped
from llamarl.control.run.trainer_loop import TrainerLoop


class RefusingTrainer:
    """A trainer whose updates are refused at the steps in `refuse` (as PolicyTrainer reports them)."""

    def __init__(self, refuse: set[int]) -> None:
        self.policy_version = 0
        self.refuse = refuse

    def train_step(self, batch) -> dict[str, float | str]:
        self.policy_version += 1  # a skipped step still makes a version (the previous weights)
        if self.policy_version in self.refuse:
            return {
                "loss": float("nan"),
                "skipped_nonfinite": 1.0,
                "nonfinite_cause": "grad of lm_head.weight",
            }
        return {"loss": 0.5, "skipped_nonfinite": 0.0}


def _loop(refuse: set[int], limit: int = 3) -> TrainerLoop:
    return TrainerLoop(
        trainer=RefusingTrainer(refuse),
        send_weights=lambda version: None,
        max_policy_lag=100,
        timeline=Timeline(),
        refused=RefusedSteps(limit, lambda: "the last checkpoint is ckpt/step_00000002 (policy_version 2)"),
    )


def test_a_refused_step_is_one_line_and_its_record_holds_only_numbers():
    loop = _loop(refuse={2})
    batch = make_batch(0, num_sequences=4, prompt_len=3, completion_len=5)
    batch.policy_version_B = torch.zeros(4, dtype=torch.int64)
    first = loop.train(batch)
    assert loop.refusal is None and first["train/skipped_nonfinite"] == 0.0
    second = loop.train(batch)
    assert loop.refusal == (
        "step 2: update skipped, non-finite grad of lm_head.weight; the weights are those of step 1 "
        "(1 in a row, the run stops at 3)"
    )
    assert second["train/skipped_nonfinite"] == 1.0
    assert all(isinstance(v, float) for v in second.values())  # metrics.jsonl and W&B take numbers only
    loop.train(batch)
    assert loop.refusal is None and loop.refused.in_a_row == 0 and loop.refused.total == 1


def test_refusals_in_a_row_stop_the_run_in_one_line_naming_where_to_resume():
    loop = _loop(refuse={2, 3, 4, 5})
    batch = make_batch(0, num_sequences=4, prompt_len=3, completion_len=5)
    batch.policy_version_B = torch.zeros(4, dtype=torch.int64)
    loop.train(batch)
    loop.train(batch)
    loop.train(batch)
    with pytest.raises(TrainingStopped) as stopped:
        loop.train(batch)
    assert str(stopped.value) == (
        "3 updates in a row skipped for non-finite values (the last: grad of lm_head.weight, step 4): check "
        "the rewards and the data; the last checkpoint is ckpt/step_00000002 (policy_version 2)"
    )
    assert is_user_error(stopped.value)  # shown as that one line, not a traceback
