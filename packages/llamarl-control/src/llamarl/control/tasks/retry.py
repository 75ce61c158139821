"""A multi-turn task with feedback: one-digit sums, three tries. A wrong answer gets "That is not
right. Try again." and another turn; the score is 1 / the try that got it right (0 after three wrong).

The rows are the built-in arith task's (held-out questions on operand pairs never trained on); the
environment checks each turn's final number with the same rule as the single-turn task.
"""

from __future__ import annotations

import dataclasses

from llamarl.control.tasks.arith import ARITH
from llamarl.exec.multiturn.environments import Finish, ModelTurn, Reply
from llamarl.exec.reward.functions import gsm8k_answer

MAX_TRIES = 3
TRY_AGAIN = "That is not right. Try again."


class RetryEnvironment:
    """One episode: checks each answer; a wrong one gets feedback and another try."""

    def start(self, row: dict) -> None:
        self.row = row

    def step(self, turn: ModelTurn) -> Reply | Finish:
        if gsm8k_answer([], turn.text, self.row) == 1.0:
            return Finish(reward=1.0 / (turn.index + 1))
        if turn.index + 1 >= MAX_TRIES:
            return Finish(reward=0.0)
        return Reply([{"role": "user", "content": TRY_AGAIN}])


# Right when some try got it (the environment's reward is above 0), whichever try that was.
RETRY = dataclasses.replace(ARITH, name="retry", environment=RetryEnvironment, correct=0.0)
