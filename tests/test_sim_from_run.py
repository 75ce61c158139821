"""`from-run`: reading a run's output folder and re-pricing it for other modes and rank counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamarl.control.outputs.timeline import Span, write_chrome_trace
from llamarl.sim.cli import main
from llamarl.sim.from_run import HostAssumptions, Target, predict, predictions
from llamarl.sim.measured_run import RunReadError, read_run, share_tokens

GEN, SCORE, MOVE, TRAIN, SYNC = 10.0, 0.0, 0.1, 6.0, 0.5


def write_sync_run(path: Path, *, steps: int = 4, prompts: int = 2, samples: int = 2) -> Path:
    """A sync run's output folder with constant phases: every step generates, moves, trains, syncs."""
    path.mkdir(parents=True, exist_ok=True)
    trainer, generator, records, samples_out = [], [], [], []
    t = 0.0
    for tick in range(steps):
        generator.append(Span("generate", t, t + GEN, tick))
        generator.append(Span("score", t + GEN, t + GEN + SCORE, tick))
        t += GEN + SCORE
        generator.append(Span("rollouts", t, t + MOVE, tick))
        trainer.append(Span("rollouts", t - GEN - SCORE, t + MOVE, tick))
        t += MOVE
        trainer.append(Span("train", t, t + TRAIN, tick))
        t += TRAIN
        trainer.append(Span("weight_sync", t, t + SYNC, tick))
        generator.append(Span("weight_sync", t - TRAIN, t + SYNC, tick))
        t += SYNC
        step_s = GEN + SCORE + MOVE + TRAIN + SYNC if tick else float("nan")
        records.append(
            {
                "step": tick + 1,
                "time/step_s": step_s,
                "time/train_s": TRAIN,
                "train/num_completion_tokens": 40.0,
            }
        )
        for p in range(prompts):
            for _ in range(samples):
                samples_out.append({"tick": tick, "question": f"q{tick}.{p}", "completion": "x" * 10})
    write_chrome_trace(path / "trace.json", [trainer, generator], ["trainer", "generator 1"])
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "samples.rank1.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples_out))
    summary = {
        "mode": "sync",
        "model": "smollm2-135m",
        "steps": steps,
        "num_trainers": 1,
        "num_generators": 1,
        "step_time_s": GEN + SCORE + MOVE + TRAIN + SYNC,
    }
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_read_run(tmp_path: Path) -> None:
    run = read_run(write_sync_run(tmp_path / "run"))
    assert (run.mode, run.steps, run.samples_per_prompt, run.prompts_per_step) == ("sync", 4, 2, 2)
    assert run.generate_s[2] == {0: pytest.approx(GEN)}
    assert run.train_s[3] == pytest.approx(TRAIN)
    assert run.weight_sync_s == [pytest.approx(SYNC)] * 4
    assert run.move_s == [pytest.approx(MOVE)] * 4  # the sending side, not the trainer's wait
    assert run.lengths[0] == [10, 10, 10, 10]  # 40 tokens over four equal completions


def test_share_tokens_respects_the_cap() -> None:
    assert share_tokens([10, 20, 30, 0], 100, 40) == [20, 39, 40, 1]
    assert sum(share_tokens([5, 7, 11], 230, None)) == pytest.approx(230, abs=2)


def test_missing_files_are_reported(tmp_path: Path) -> None:
    with pytest.raises(RunReadError, match=r"summary\.json"):
        read_run(tmp_path)
    assert main(["from-run", str(tmp_path)]) == 2


def test_same_threads_give_the_closed_forms(tmp_path: Path) -> None:
    run = read_run(write_sync_run(tmp_path / "run"))
    # Phases that do not speed up with threads, on a machine with cores to spare.
    host = HostAssumptions(cores=2, generate_parallel_frac=0.0, train_parallel_frac=0.0)
    assert predict(run, Target("sync", 1), host).step_s == pytest.approx(run.step_time_s)
    expected_async = MOVE + SYNC + max(GEN + SCORE, TRAIN)
    assert predict(run, Target("async", 1), host).step_s == pytest.approx(expected_async)


def test_fewer_threads_per_rank_slow_each_phase(tmp_path: Path) -> None:
    run = read_run(write_sync_run(tmp_path / "run"))
    # Perfectly parallel phases: the sync run had 2 threads per rank, async ranks get 1 each.
    host = HostAssumptions(cores=2, generate_parallel_frac=1.0, train_parallel_frac=1.0)
    assert predict(run, Target("async", 1), host).step_s == pytest.approx(MOVE + SYNC + 2 * GEN)


def test_two_generators_halve_the_rows_and_share_the_cores(tmp_path: Path) -> None:
    run = read_run(write_sync_run(tmp_path / "run"))
    # All decoding time per row (no weight reads): half the rows, half the time, on 1 thread each;
    # three one-thread ranks on two cores run at 2/3 speed while all are busy.
    host = HostAssumptions(
        cores=2, generate_parallel_frac=0.0, train_parallel_frac=0.0, memory_gbs=1e12, gflops=1e-3
    )
    result = predict(run, Target("async", 2), host)
    gen_alone = GEN / 2
    both_busy = gen_alone * 3 / 2  # the three ranks share two cores until the generators finish
    train_left = TRAIN - both_busy * 2 / 3  # then the trainer runs alone
    expected = MOVE + 2 * SYNC + both_busy + train_left
    assert result.step_times[1] == pytest.approx(expected)  # the last tick only trains


def test_predictions_pair_compared_runs(tmp_path: Path) -> None:
    run = read_run(write_sync_run(tmp_path / "a"))
    other = read_run(write_sync_run(tmp_path / "b"))
    host = HostAssumptions(cores=2, generate_parallel_frac=0.0, train_parallel_frac=0.0)
    found = predictions(run, host, [other], [Target("async", 1)])
    by_mode = {p.target.mode: p for p in found}
    assert by_mode["sync"].measured_path == other.path  # a compared run replaces the source's pairing
    assert by_mode["sync"].error == pytest.approx(0.0)
    assert by_mode["async"].measured_s is None


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = write_sync_run(tmp_path / "run")
    assert main(["from-run", str(run_dir), "--host.cores", "2", "--generators", "1"]) == 0
    out = capsys.readouterr().out
    assert "| async | 1 + 1 |" in out and "calibration run" in out


def test_two_trainer_ranks_split_the_step(tmp_path: Path) -> None:
    run = read_run(write_sync_run(tmp_path / "run"))
    # Sync, three ranks on four cores with every core per rank: no sharing while one phase runs.
    host = HostAssumptions(
        cores=4, generate_parallel_frac=0.0, train_parallel_frac=0.0, trainer_scaling_eff=0.8
    )
    result = predict(run, Target("sync", 1, trainers=2), host)
    assert result.step_s == pytest.approx(GEN + SCORE + MOVE + TRAIN / (2 * 0.8) + SYNC)
