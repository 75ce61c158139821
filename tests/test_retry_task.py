"""The retry app's environment (apps/retry_rl, the CPU multi-turn learning recipe;
llamarl.control.tasks.retry): each wrong answer
gets feedback and another try, the score is 1 / the right try, 0 after three wrong ones."""

from __future__ import annotations

from llamarl.control.tasks import load_rows
from llamarl.control.tasks.retry import MAX_TRIES, TRY_AGAIN, RetryEnvironment
from llamarl.control.tasks.retry import RETRY as TASK
from llamarl.exec.multiturn.environments import Finish, ModelTurn, Reply


def turn(text: str, index: int) -> ModelTurn:
    return ModelTurn(text=text, tool_calls=[], index=index)


def test_a_right_answer_scores_one_over_its_try_and_a_wrong_one_gets_another_try():
    row = {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"}
    env = RetryEnvironment()
    env.start(row)
    assert env.step(turn("#### 7", 0)) == Finish(reward=1.0)
    env.start(row)
    assert env.step(turn("#### 8", 0)) == Reply([{"role": "user", "content": TRY_AGAIN}])
    assert env.step(turn("Sorry.\n#### 7", 1)) == Finish(reward=0.5)
    env.start(row)
    for index in range(MAX_TRIES - 1):
        assert isinstance(env.step(turn("#### 1", index)), Reply)
    assert env.step(turn("#### 1", MAX_TRIES - 1)) == Finish(reward=0.0)


def test_the_task_is_the_arith_task_with_the_environment():
    assert TASK.environment is RetryEnvironment and TASK.name == "retry"
    test = load_rows(TASK, None, "test")
    assert len(test) >= 100 and all("####" in row["answer"] for row in test)
