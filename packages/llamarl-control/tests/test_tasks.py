"""Dataset loading and validation for the math tasks, on the shared local copies and on broken files."""

from __future__ import annotations

import json
import re

import pytest

from llamarl.control.tasks import GSM8K, MATH, DataError, load_examples
from llamarl.exec.testing import shared_data_dir


def _shared(name: str) -> str:
    try:
        return str(shared_data_dir(__file__) / name)
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


def test_loads_local_gsm8k_with_references():
    examples = load_examples(GSM8K, _shared("gsm8k"), "test")
    assert len(examples) == 1319
    assert all("####" in e.reference for e in examples)
    assert examples[0].question.startswith("Janet")


def test_loads_local_math_answer_column():
    examples = load_examples(MATH, _shared("math"), "test")
    assert len(examples) == 5000
    assert all(e.reference for e in examples)


def test_math_falls_back_to_last_boxed_of_solution(tmp_path):
    row = {"problem": "1+1?", "solution": "We get $\\boxed{\\frac{1}{2}}$ then \\boxed{2}."}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    [example] = load_examples(MATH, str(tmp_path), "train")
    assert example.reference == "2"


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
        load_examples(GSM8K, str(tmp_path), "train")


def test_missing_file_says_what_is_expected(tmp_path):
    with pytest.raises(DataError, match=r"train\.jsonl and test\.jsonl"):
        load_examples(GSM8K, str(tmp_path), "train")


def test_rows_without_a_usable_answer_are_skipped_with_a_warning(tmp_path, caplog):
    rows = [
        {"question": "q1", "answer": "x #### 1"},
        {"question": "q2", "answer": "no final marker"},
        {"question": "q3", "answer": ""},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING"):
        examples = load_examples(GSM8K, str(tmp_path), "train")
    assert [e.question for e in examples] == ["q1"]
    assert "skipped 2 row(s)" in caplog.text and "train.jsonl:2" in caplog.text


def test_a_file_of_only_unusable_rows_is_an_error(tmp_path):
    (tmp_path / "train.jsonl").write_text(
        json.dumps({"problem": "p", "answer": "", "solution": "\\boxed{}"}) + "\n"
    )
    with pytest.raises(DataError, match="no rows with a usable reference answer"):
        load_examples(MATH, str(tmp_path), "train")


def test_shared_math_copy_loads_despite_its_empty_answer_rows(caplog):
    with caplog.at_level("WARNING"):
        assert len(load_examples(MATH, _shared("math"), "train")) == 7496
    assert "skipped 2 row(s)" in caplog.text


def test_arithmetic_task_holds_out_whole_operand_pairs():
    from llamarl.control.tasks import ARITH
    from llamarl.exec.rewards import gsm8k_reward

    train, test = load_examples(ARITH, None, "train"), load_examples(ARITH, None, "test")
    assert (len(train), len(test)) == (400, 100)
    pairs = {
        s: {tuple(re.findall(r"\d+", e.question)) for e in split}
        for s, split in (("train", train), ("test", test))
    }
    assert len(pairs["test"]) == 20 and not pairs["train"] & pairs["test"]
    a, b = next(iter(pairs["test"]))
    example = next(e for e in test if tuple(re.findall(r"\d+", e.question)) == (a, b))
    assert gsm8k_reward(f"{a} + {b} = {int(a) + int(b)}", example.reference) == 1.0
    assert load_examples(ARITH, None, "test") == test  # the split does not move between calls


def test_gzip_copies_load_like_the_plain_files(tmp_path):
    import gzip

    rows = [
        {"question": "What is 2 + 3?", "answer": "#### 5"},
        {"question": "And 4 + 4?", "answer": "#### 8"},
    ]
    with gzip.open(tmp_path / "test.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    examples = load_examples(GSM8K, str(tmp_path), "test")
    assert [e.reference for e in examples] == ["#### 5", "#### 8"]
    (tmp_path / "bad").mkdir()
    with gzip.open(tmp_path / "bad" / "test.jsonl.gz", "wt") as f:
        f.write("{not json\n")
    with pytest.raises(DataError, match=r"test.jsonl.gz:1: not valid JSON"):
        load_examples(GSM8K, str(tmp_path / "bad"), "test")


def test_the_apps_embedded_copies_hold_the_full_datasets():
    from pathlib import Path

    embedded = Path(__file__).resolve().parents[3] / "apps" / "data"
    # Two MATH training rows have an empty reference and are skipped, as from the shared copy.
    for task, name, sizes in ((GSM8K, "gsm8k", (7473, 1319)), (MATH, "math", (7496, 5000))):
        for split, size in zip(("train", "test"), sizes, strict=True):
            assert (embedded / name / f"{split}.jsonl.gz").stat().st_size < 2 << 20
            assert len(load_examples(task, str(embedded / name), split)) == size


def test_offline_mode_is_reported_without_touching_the_network(monkeypatch):
    from llamarl.control.tasks import hub_unavailable_reason

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_unavailable_reason() == "offline mode is set (HF_HUB_OFFLINE)"
