"""Learning-rate schedules: warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import pytest

from llamarl.exec.train.lr_schedules import lr_factor


def test_warmup_then_each_schedule():
    def factors(schedule: str) -> list[float]:
        return [lr_factor(s, schedule=schedule, warmup_steps=3, total_steps=7) for s in range(9)]

    warmup = [0.25, 0.5, 0.75]
    assert factors("constant") == pytest.approx([*warmup] + [1.0] * 6)
    assert factors("linear") == pytest.approx([*warmup, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert factors("cosine") == pytest.approx([*warmup, 1.0, 0.8535534, 0.5, 0.1464466, 0.0, 0.0])


def test_no_warmup_starts_at_full_rate_and_bad_settings_fail():
    assert lr_factor(0, schedule="cosine", warmup_steps=0, total_steps=10) == 1.0
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_factor(0, schedule="step", warmup_steps=0, total_steps=1)
    with pytest.raises(ValueError):
        lr_factor(0, schedule="linear", warmup_steps=-1, total_steps=1)
