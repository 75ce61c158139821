"""`paper` and `plan`: the published table reproduced under one set of assumptions, and a plan."""

from __future__ import annotations

import math

import pytest

from llamarl.sim import paper, plan
from llamarl.sim.cli import main
from llamarl.sim.hardware import Efficiency, GpuSpec
from llamarl.sim.models import LLAMA3_8B
from llamarl.sim.workload import Workload


@pytest.fixture(scope="module")
def rows() -> list[paper.Row]:
    return paper.table(paper.PaperSetup())


def test_every_published_step_time_within_15_percent(rows: list[paper.Row]) -> None:
    assert [r.size for r in rows] == ["8b", "70b", "405b"]
    assert paper.largest_error(rows) < 0.15


def test_the_baseline_is_squeezed_and_llamarl_is_not(rows: list[paper.Row]) -> None:
    for row in rows:
        assert row.baseline.colocated and row.baseline.generator.weight_dtype == "bf16"
        assert not row.llamarl.colocated and row.llamarl.generator.weight_dtype == "fp8"
        assert row.llamarl.total_gpus == row.gpus == row.baseline.total_gpus
        # The generator gets far more KV cache per device on devices of its own.
        assert row.llamarl_times.detail["kv_gb_per_gpu"] > row.baseline_times.detail["kv_gb_per_gpu"]


@pytest.mark.parametrize("size", paper.SIZES)
def test_attribution_multiplies_to_the_speed_up(size: str, rows: list[paper.Row]) -> None:
    stages = paper.attribution(size, paper.PaperSetup())
    row = next(r for r in rows if r.size == size)
    assert stages[0].step_s == pytest.approx(row.sync_s)
    assert stages[-1].step_s == pytest.approx(row.llamarl_s)
    assert math.prod(s.factor for s in stages) == pytest.approx(row.sync_s / row.llamarl_s)
    assert stages[-1].change.startswith("overlap") and 1.0 <= stages[-1].factor <= 2.0


def test_paper_command_prints_the_table_and_ends_with_the_largest_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["paper"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("| 405B | 384 |") for line in out)
    assert any("efficiency.train_mfu = 0.4" in line for line in out)  # assumptions are printed
    assert out[-1].startswith("Largest relative error:")


def test_plan_recommends_a_split_for_8b_on_64_devices() -> None:
    found = plan.candidates(LLAMA3_8B, 64, Workload(), GpuSpec(), Efficiency())
    best = plan.best_per_mode(found)
    assert best[0].mode in ("async", "stream") and math.isfinite(best[0].step_s)
    by_mode = {c.mode: c for c in best}
    assert by_mode["async"].step_s < by_mode["sync"].step_s  # overlap beats taking turns on a split
    d = by_mode["async"].deployment
    assert d.generator_gpus + d.trainer_gpus == 64 and d.generator_gpus % 8 == 0
