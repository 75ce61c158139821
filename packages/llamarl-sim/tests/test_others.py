"""`others`: other systems' published speed-ups predicted with the paper's assumptions frozen."""

from __future__ import annotations

import math

import pytest

from llamarl.sim import others
from llamarl.sim.cli import main
from llamarl.sim.hardware import Efficiency


@pytest.fixture(scope="module")
def predictions() -> list[others.Prediction]:
    return [others.predict(case) for case in others.CASES]


def test_at_least_three_stated_setups_each_with_a_source_and_a_number() -> None:
    systems = {case.system.split(",")[0] for case in others.CASES}
    assert len(others.CASES) >= 3 and {"verl fully async", "AReaL"} <= systems
    for case in others.CASES:
        assert "section" in case.source and case.published > 1 and case.lengths_note
        assert (
            case.gpus == case.generator_gpus + (case.gpus - case.generator_gpus)
            and case.generator_gpus < case.gpus
        )


def test_the_assumptions_are_frozen_at_the_papers(predictions: list[others.Prediction]) -> None:
    frozen = [others.predict(case, Efficiency()) for case in others.CASES]
    assert [p.speedup for p in predictions] == [p.speedup for p in frozen]
    for p in predictions:
        assert math.isfinite(p.speedup) and p.speedup > 0


def test_each_system_runs_as_its_source_describes_it(predictions: list[others.Prediction]) -> None:
    for p in predictions:
        fast, sync = p.fast, p.sync
        assert fast.partial_rollout and not fast.colocated and fast.generator_gpus == p.case.generator_gpus
        assert fast.generator.tp == sync.generator.tp == p.case.generator_tp
        assert not sync.partial_rollout and sync.recompute_logprobs == p.case.sync_recomputes
        if p.case.baseline == "colocated_offload":  # verl: colocated, state offloaded while generating
            assert sync.colocated and not sync.trainer_state_resident and p.sync_times.offload_s > 0
        else:  # AReaL: the same split taking turns, waiting for the longest sequence
            assert not sync.colocated and sync.generator_gpus == fast.generator_gpus


def test_partial_rollouts_beat_waiting_for_the_tail_on_the_same_split(
    predictions: list[others.Prediction],
) -> None:
    for p in predictions:
        if p.case.baseline == "split_sync":
            assert p.fast_times.generate_s < p.sync_times.generate_s


def test_others_prints_the_table_the_misses_and_what_is_left_out(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["others"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| ") and "x |" in line]
    assert len(rows) == len(others.CASES)
    assert any(line.startswith("Missed by more than 25%") for line in out)
    assert any("Laminar" in line for line in out) and any("ROLL Flash" in line for line in out)
    assert out[-1].startswith("Out-of-sample error: median")
