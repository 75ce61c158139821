"""Tasks: the built-in ones' rows on the shared local copies and on broken files, and the Task API."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from llamarl.control.tasks import DataError, load_rows
from llamarl.control.tasks.gsm8k import GSM8K
from llamarl.control.tasks.math import MATH
from llamarl.exec.testing import shared_data_dir


def _shared(name: str) -> str:
    try:
        return str(shared_data_dir(__file__) / name)
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


def test_loads_local_gsm8k_with_references():
    examples = load_rows(GSM8K, _shared("gsm8k"), "test")
    assert len(examples) == 1319
    assert all("####" in e["answer"] for e in examples)
    assert examples[0]["question"].startswith("Janet")


def test_loads_local_math_answer_column():
    examples = load_rows(MATH, _shared("math"), "test")
    assert len(examples) == 5000
    assert all(e["answer"] for e in examples)


def test_math_falls_back_to_last_boxed_of_solution(tmp_path):
    row = {"problem": "1+1?", "solution": "We get $\\boxed{\\frac{1}{2}}$ then \\boxed{2}."}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    [example] = load_rows(MATH, str(tmp_path), "train")
    assert example["answer"] == "2"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "train.jsonl:2: not valid JSON"),
        ('{"answer": "#### 3"}', "train.jsonl:2: missing or empty field 'question'"),
        ('{"question": "q", "solution": "x"}', "train.jsonl:2: no reference answer"),
        ("[1, 2]", "train.jsonl:2: expected a JSON object"),
    ],
)
def test_malformed_rows_name_file_line_and_problem(tmp_path, line, message):
    good = json.dumps({"question": "q", "answer": "x #### 1"})
    (tmp_path / "train.jsonl").write_text(good + "\n" + line + "\n")
    with pytest.raises(DataError, match=re.escape(message)):
        load_rows(GSM8K, str(tmp_path), "train")


def test_missing_file_says_what_is_expected(tmp_path):
    with pytest.raises(DataError, match=r"train\.jsonl and test\.jsonl"):
        load_rows(GSM8K, str(tmp_path), "train")


def test_rows_without_a_usable_answer_are_skipped_with_a_warning(tmp_path, caplog):
    rows = [
        {"question": "q1", "answer": "x #### 1"},
        {"question": "q2", "answer": "no final marker"},
        {"question": "q3", "answer": ""},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING"):
        examples = load_rows(GSM8K, str(tmp_path), "train")
    assert [e["question"] for e in examples] == ["q1"]
    assert "skipped 2 row(s)" in caplog.text and "train.jsonl:2" in caplog.text


def test_a_file_of_only_unusable_rows_is_an_error(tmp_path):
    (tmp_path / "train.jsonl").write_text(
        json.dumps({"problem": "p", "answer": "", "solution": "\\boxed{}"}) + "\n"
    )
    with pytest.raises(DataError, match="no usable rows"):
        load_rows(MATH, str(tmp_path), "train")


def test_shared_math_copy_loads_despite_its_empty_answer_rows(caplog):
    with caplog.at_level("WARNING"):
        assert len(load_rows(MATH, _shared("math"), "train")) == 7496
    assert "skipped 2 row(s)" in caplog.text


def test_arithmetic_task_holds_out_whole_operand_pairs():
    from llamarl.control.tasks.arith import ARITH
    from llamarl.exec.reward.functions import gsm8k_reward

    question = lambda e: e["question"]  # noqa: E731
    train, test = load_rows(ARITH, None, "train"), load_rows(ARITH, None, "test")
    assert (len(train), len(test)) == (400, 100)
    pairs = {
        s: {tuple(re.findall(r"\d+", question(e))) for e in split}
        for s, split in (("train", train), ("test", test))
    }
    assert len(pairs["test"]) == 20 and not pairs["train"] & pairs["test"]
    a, b = next(iter(pairs["test"]))
    example = next(e for e in test if tuple(re.findall(r"\d+", question(e))) == (a, b))
    assert gsm8k_reward(f"{a} + {b} = {int(a) + int(b)}", example["answer"]) == 1.0
    assert load_rows(ARITH, None, "test") == test  # the split does not move between calls


def test_gzip_copies_load_like_the_plain_files(tmp_path):
    import gzip

    rows = [
        {"question": "What is 2 + 3?", "answer": "#### 5"},
        {"question": "And 4 + 4?", "answer": "#### 8"},
    ]
    with gzip.open(tmp_path / "test.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    examples = load_rows(GSM8K, str(tmp_path), "test")
    assert [e["answer"] for e in examples] == ["#### 5", "#### 8"]
    (tmp_path / "bad").mkdir()
    with gzip.open(tmp_path / "bad" / "test.jsonl.gz", "wt") as f:
        f.write("{not json\n")
    with pytest.raises(DataError, match=r"test.jsonl.gz:1: not valid JSON"):
        load_rows(GSM8K, str(tmp_path / "bad"), "test")


def test_the_apps_embedded_copies_hold_the_full_datasets():
    from pathlib import Path

    embedded = Path(__file__).resolve().parents[3] / "apps" / "data"
    # Two MATH training rows have an empty reference and are skipped, as from the shared copy.
    for task, name, sizes in ((GSM8K, "gsm8k", (7473, 1319)), (MATH, "math", (7496, 5000))):
        for split, size in zip(("train", "test"), sizes, strict=True):
            assert (embedded / name / f"{split}.jsonl.gz").stat().st_size < 2 << 20
            assert len(load_rows(task, str(embedded / name), split)) == size


def test_offline_mode_is_reported_without_touching_the_network(monkeypatch):
    from llamarl.control.tasks import hub_unavailable_reason

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_unavailable_reason() == "offline mode is set (HF_HUB_OFFLINE)"


# -- the Task API ------------------------------------------------------------------------------------

USER_TASK = """
from llamarl.control import Task

def matches(prompt, completion, row):
    return float(completion.strip() == row["word"].upper())

TASK = Task(
    name="shout",
    rows={"train": [{"word": "cat"}, {"word": "dog"}], "test": [{"word": "owl"}]},
    prompt="Write '{word}' in capitals.",
    system="Answer with one word.",
    rewards=[matches],
    fields=("word",),
)

def make_task():
    return TASK

NOT_A_TASK = 3
"""


def test_a_users_module_task_loads_by_file_and_checks_its_rows(tmp_path):
    from llamarl.control.tasks.registry import load_task

    (tmp_path / "shout_task.py").write_text(USER_TASK)
    task = load_task(None, f"{tmp_path / 'shout_task.py'}:TASK")
    assert task.name == "shout" and not task.multi_turn
    assert load_task(None, f"{tmp_path / 'shout_task.py'}:make_task") is task
    assert [r["word"] for r in load_rows(task, None, "train")] == ["cat", "dog"]
    assert task.messages({"word": "owl"}) == [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "Write 'owl' in capitals."},
    ]
    with pytest.raises(DataError, match=r"shout\[train\]\[0\]: missing or empty field 'word'"):
        task.check_row({}, where="shout[train][0]")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_pkg.tasks:TASK", "cannot import 'no_such_pkg.tasks' (ModuleNotFoundError"),
        ("shout_task.py:MISSING", "defines no 'MISSING'"),
        ("shout_task.py:NOT_A_TASK", "NOT_A_TASK is a int, not a llamarl Task"),
        ("shout_task", "expected 'package.module:NAME'"),
    ],
)
def test_a_bad_task_module_is_one_line_before_any_rank_starts(tmp_path, monkeypatch, spec, message):
    from llamarl.control.config import ConfigError, RunConfig, replace_in

    (tmp_path / "shout_task.py").write_text(USER_TASK)
    monkeypatch.chdir(tmp_path)
    config = RunConfig(task="arith")
    with pytest.raises(ConfigError) as info:
        replace_in(config, **{"task.module": spec})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_module_task_names_the_run(tmp_path):
    from llamarl.control.config import RunConfig

    (tmp_path / "shout_task.py").write_text(USER_TASK)
    config = RunConfig(task={"module": f"{tmp_path / 'shout_task.py'}:TASK"})
    assert config.task.name == "shout" and config.output_dir.name == "shout_rl"


def test_a_lambda_reward_is_refused_with_the_fix():
    from llamarl.control.tasks import Task, TaskError

    task = Task(name="t", rows={"train": [{"q": "x"}]}, rewards=[lambda p, c, r: 1.0])
    with pytest.raises(
        TaskError, match=r"rewards\[0\] \(<lambda>\) cannot be sent to worker processes.*module level"
    ):
        task.check()


def test_rows_from_a_function_and_weighted_rewards():
    from llamarl.control.tasks import Task
    from llamarl.exec.reward.functions import Reward, score_samples
    from llamarl.exec.testing import length_reward

    task = Task(
        name="arith_copy",
        rows=arithmetic_rows_for_test,
        prompt="{question}",
        rewards=[(length_reward, 2.0), Reward(length_reward, weight=-1.0, batched=True, name="short")],
    )
    rows = load_rows(task, None, "test")
    assert len(rows) == 100
    [total], [error] = score_samples(task.reward_functions[1:], [[]], ["abc"], [rows[0]])
    assert total == pytest.approx(-0.25) and error is None
    [total], [error] = score_samples(task.reward_functions[:1], [[]], ["abc"], [rows[0]])
    assert total == 0.0 and "not a number" in error  # a batched function called per sample: counted


def arithmetic_rows_for_test(split):
    from llamarl.control.tasks.arith import arithmetic_rows

    return arithmetic_rows(split)


def test_reasoning_gym_tasks_by_name_make_rows_offline_and_score_with_its_verifier():
    from llamarl.control.tasks.registry import load_task

    task = load_task("reasoning_gym:basic_arithmetic")
    train, test = load_rows(task, None, "train"), load_rows(task, None, "test")
    assert len(train) == 2000 and len(test) == 200
    assert {r["question"] for r in test[:50]} != {r["question"] for r in train[:50]}
    row = test[0]
    [reward] = task.reward_functions
    assert reward.fn([], f"I think <answer>{row['answer']}</answer>", row) == 1.0
    assert reward.fn([], "no tags", row) == 0.0
    assert "<answer>" in task.messages(row)[-1]["content"]


# -- what a task's own code can get wrong, found before any rank starts ------------------------------


def test_a_row_without_a_field_the_prompt_names_is_one_line_naming_the_row(tmp_path):
    from llamarl.control.tasks import Task

    task = Task(name="t", prompt="{question} (in {unit:>{width}})", rewards=[gsm8k_answer_for_test])
    rows = [{"question": "q", "unit": "m", "width": 3}, {"question": "q", "width": 3}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as info:
        load_rows(task, str(tmp_path), "train")
    assert str(info.value) == f"{tmp_path / 'train.jsonl'}:2: missing field 'unit' (the prompt names it)"
    in_code = dataclasses.replace(task, rows={"train": [rows[0], {"unit": "m", "width": 2}]})
    with pytest.raises(
        DataError, match=r"^t\[train\]\[1\]: missing field 'question' \(the prompt names it\)$"
    ):
        load_rows(in_code, None, "train")


def test_a_prompt_function_that_fails_on_a_row_is_one_line_naming_the_row():
    from llamarl.control.tasks import Task

    task = Task(
        name="t",
        rows={"train": [{"q": "x"}, {"r": "y"}]},
        prompt=prompt_of_q,
        rewards=[gsm8k_answer_for_test],
    )
    with pytest.raises(DataError) as info:
        load_rows(task, None, "train")
    assert str(info.value) == "t[train][1]: the prompt function raised KeyError: 'q'"


def test_a_prompt_that_is_not_a_format_string_of_row_fields_is_refused_when_checked():
    from llamarl.control.tasks import Task, TaskError

    for prompt, message in [
        ("Solve {}.", "the prompt's field {} is positional"),
        ("Solve {0}.", "the prompt's field {0} is positional"),
        ("Solve {question.", "expected '}' before end of string"),
    ]:
        with pytest.raises(TaskError, match=re.escape(f"task 't': {message}")):
            Task(name="t", prompt=prompt, rewards=[gsm8k_answer_for_test]).check()


def test_a_tool_whose_docstring_misses_an_argument_is_one_line_when_checked(tmp_path):
    from llamarl.control.tasks import Task, TaskError
    from llamarl.control.tasks.registry import load_task

    task = Task(name="t", rewards=[gsm8k_answer_for_test], tools=[undocumented_tool])
    with pytest.raises(TaskError) as info:
        task.check()
    assert str(info.value) == (
        "task 't': tool 'undocumented_tool': its docstring has no Args: entry for the argument 'unit'"
    )
    with pytest.raises(TaskError, match="tool 'untyped_tool': the argument 'city' has no type hint"):
        dataclasses.replace(task, tools=[untyped_tool]).check()
    # A task module is checked when it is loaded, before any rank starts.
    (tmp_path / "tool_task.py").write_text(TOOL_TASK)
    with pytest.raises(
        TaskError, match="tool 'distance': its docstring has no Args: entry for the argument 'to'"
    ):
        load_task(None, f"{tmp_path / 'tool_task.py'}:TASK")


TOOL_TASK = '''
from llamarl.control import Task
from llamarl.exec.reward.functions import gsm8k_answer

def distance(frm: str, to: str) -> str:
    """The distance between two cities.

    Args:
        frm: where from
    """
    return "12 km"

TASK = Task(name="trip", rows={"train": [{"question": "q"}]}, rewards=[gsm8k_answer], tools=[distance])
'''


def gsm8k_answer_for_test(prompt, completion, row):
    return 0.0


def prompt_of_q(row):
    return f"Say {row['q']}."


def undocumented_tool(city: str, unit: str) -> str:
    """The temperature of a city.

    Args:
        city: its name
    """
    return "20"


def untyped_tool(city) -> str:
    """The temperature of a city.

    Args:
        city: its name
    """
    return "20"


# -- correctness -------------------------------------------------------------------------------------


def test_built_in_tasks_say_when_a_sample_is_right():
    from llamarl.control.tasks.arith import ARITH
    from llamarl.control.tasks.calc import CALC
    from llamarl.control.tasks.retry import RETRY

    row = {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"}
    for task in (GSM8K, ARITH, CALC):
        assert (
            task.is_correct([], "So 3 + 4 = 7.\n#### 7", row, reward=0.0) is True
        )  # the checker, not the reward
        assert task.is_correct([], "#### 8", row, reward=1.0) is False
    assert MATH.is_correct([], "so \\boxed{\\frac{1}{2}}", {"answer": "0.5"}, reward=0.0) is True
    assert MATH.is_correct([], "so \\boxed{2}", {"answer": "0.5"}, reward=1.0) is False
    # retry: right on any try (its environment's reward 1, 1/2 or 1/3), wrong after three misses (0)
    assert [RETRY.is_correct([], "", row, reward=r) for r in (1.0, 0.5, 1 / 3, 0.0)] == [
        True,
        True,
        True,
        False,
    ]


def test_a_task_of_ones_own_defines_correctness_by_a_function_or_a_threshold():
    from llamarl.control.tasks import Task, TaskError

    by_function = Task(name="t", rewards=[gsm8k_answer_for_test], correct=shouted)
    assert by_function.is_correct([], "CAT!", {"word": "cat"}, reward=0.0) is True
    assert by_function.is_correct([], "cat", {"word": "cat"}, reward=1.0) is False
    by_threshold = Task(name="t", rewards=[gsm8k_answer_for_test], correct=0.5)
    assert [by_threshold.is_correct([], "", {}, reward=r) for r in (0.5, 0.75)] == [False, True]
    assert Task(name="t", rewards=[gsm8k_answer_for_test]).is_correct([], "", {}, reward=1.0) is None
    with pytest.raises(TaskError, match="correct must be a function"):
        Task(name="t", rewards=[gsm8k_answer_for_test], correct="yes")
    with pytest.raises(TaskError, match="correct cannot be sent to worker processes"):
        Task(name="t", rewards=[gsm8k_answer_for_test], correct=lambda p, c, r: True).check()


def shouted(prompt, completion, row):
    return row["word"].upper() in completion
