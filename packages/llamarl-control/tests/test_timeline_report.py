"""Per-rank phase timing, the Chrome trace it is written to, and the report picture drawn from a run."""

from __future__ import annotations

import json
import time

import pytest

from llamarl.control.outputs.report import figure, load_run, memory_line, phase_seconds_per_tick, write_report
from llamarl.control.outputs.timeline import Span, Timeline, read_chrome_trace, write_chrome_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_a_phase_records_its_wall_time_even_when_it_raises():
    timeline = Timeline()
    with timeline.phase("generate", tick=3):
        time.sleep(0.01)
    with pytest.raises(KeyError), timeline.phase("train", tick=4):
        raise KeyError("boom")
    first, second = timeline.spans
    assert (first.name, first.tick, second.name, second.tick) == ("generate", 3, "train", 4)
    assert first.end - first.start >= 0.01
    assert second.start >= first.end


def test_chrome_trace_has_a_lane_per_rank_and_round_trips(tmp_path):
    t0 = 1_000.0
    spans = [
        [Span("train", t0 + 1.0, t0 + 3.0, 1), Span("weight_sync", t0 + 3.0, t0 + 3.5, 2)],
        [Span("generate", t0 + 0.5, t0 + 2.5, 1)],
    ]
    path = tmp_path / "trace.json"
    write_chrome_trace(path, spans, ["trainer", "generator 1"])
    events = json.loads(path.read_text())["traceEvents"]
    boxes = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in boxes} == {0, 1}
    generate = next(e for e in boxes if e["name"] == "generate")
    assert generate["ts"] == 0 and generate["dur"] == pytest.approx(2e6)  # microseconds from the first box
    read, roles = read_chrome_trace(path)
    assert roles == {0: "rank 0 trainer", 1: "rank 1 generator 1"}
    assert [(s.name, s.tick) for s in read[0]] == [("train", 1), ("weight_sync", 2)]
    assert read[0][0].end - read[0][0].start == pytest.approx(2.0)


def test_phase_split_counts_waiting_as_idle_and_leaves_out_common_evaluation(tmp_path):
    # Two ticks of 10 s each. The trainer trains 8 s and syncs 1 s per tick; the generator generates
    # 4 s per tick. Between them an evaluation: the generator starts it 2 s early, then both are in it
    # for 5 s (left out of the loop); those 2 s are the generator's own eval time.
    spans = [
        [
            Span("train", 0, 8, 0), Span("weight_sync", 8, 9, 0),
            Span("eval", 12, 17, 1),
            Span("train", 17, 25, 1), Span("weight_sync", 25, 26, 1),
        ],
        [
            Span("generate", 0, 4, 0), Span("weight_sync", 8, 9, 0),
            Span("eval", 10, 17, 1),
            Span("generate", 17, 21, 1), Span("weight_sync", 25, 26, 1),
        ],
    ]  # fmt: skip
    path = tmp_path / "trace.json"
    write_chrome_trace(path, spans, ["trainer", "generator 1"])
    split = phase_seconds_per_tick(path)
    loop_per_tick = (26 - 5) / 2
    trainer, generator = split["rank 0 trainer"], split["rank 1 generator 1"]
    assert trainer["train"] == 8 and trainer["weight_sync"] == 1 and trainer["eval"] == 0
    assert trainer["idle"] == pytest.approx(loop_per_tick - 9)
    assert generator["generate"] == 4 and generator["eval"] == 1  # 2 s over 2 ticks
    assert generator["idle"] == pytest.approx(loop_per_tick - 4 - 1 - 1)


def _fake_run(out, steps: int = 6):
    out.mkdir()
    records = [{"step": 0, "eval/accuracy": 0.2, "eval/sampled_accuracy": 0.1, "eval/policy_version": 0}]
    for step in range(1, steps + 1):
        records.append(
            {
                "step": step, "train/reward_mean": 0.1 * step, "time/step_s": 2.0,
                "time/generate_s": 1.5, "time/train_s": 1.8, "policy/version": step,
            }
        )  # fmt: skip
    records.append(
        {"step": steps, "eval/accuracy": 0.6, "eval/sampled_accuracy": 0.5, "eval/policy_version": 6}
    )
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"task": "arith", "mode": "async", "steps": steps, "step_time_s": 2.0,
               "eval_accuracy_start": 0.2, "eval_accuracy_end": 0.6}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary))
    spans = [[Span("train", t * 2.0, t * 2.0 + 1.8, t) for t in range(steps)],
             [Span("generate", t * 2.0, t * 2.0 + 1.5, t) for t in range(steps)]]  # fmt: skip
    write_chrome_trace(out / "trace.json", spans, ["trainer", "generator 1"])


def test_report_is_drawn_from_the_files_of_a_run(tmp_path):
    out = tmp_path / "run"
    _fake_run(out)
    run = load_run(out)
    assert len(run.steps) == 6 and len(run.evals) == 2
    assert run.phase_s_per_tick["rank 1 generator 1"]["generate"] == pytest.approx(1.5)
    path = write_report(out)
    assert path == out / "report.png"
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    assert not list(out.glob("*.tmp*"))


def _busy_run_memory() -> list[dict]:
    """The processes of a run on 2 trainers and 2 generators, whose trainers compile (g++, cc1plus, ld
    each time) and whose generators each have a vLLM engine with helpers and 4 reward workers."""
    processes = []
    for rank in range(4):
        role = "trainer" if rank < 2 else "generator"
        processes.append({"process": f"rank {rank} {role}", "peak_rss_mb": 4000.0, "kind": "main"})
        if role == "trainer":
            for tool in ("g++", "cc1plus", "as", "ld") * 6:
                processes.append(
                    {"process": f"rank {rank} trainer child ({tool})", "peak_rss_mb": 50.0, "kind": "helper"}
                )
        else:
            processes.append(
                {"process": f"rank {rank} generator vllm engine", "peak_rss_mb": 3000.0, "kind": "engine"}
            )
            processes.append(
                {"process": f"rank {rank} generator engine helper", "peak_rss_mb": 20.0, "kind": "helper"}
            )
            for _ in range(4):
                processes.append(
                    {
                        "process": f"rank {rank} generator reward worker",
                        "peak_rss_mb": 100.0,
                        "kind": "worker",
                    }
                )
    processes.append({"process": "launcher", "peak_rss_mb": 600.0, "kind": "main"})
    return processes


def test_the_report_lists_ranks_engines_and_workers_and_its_title_fits_the_picture(tmp_path):
    processes = _busy_run_memory()
    summary = {"memory_per_process": processes, "peak_rss_mb_total": sum(p["peak_rss_mb"] for p in processes)}
    line = memory_line(summary)
    for tool in ("g++", "cc1plus", "ld"):
        assert tool not in line, line
    assert "rank 2 generator reward worker x4 0.4" in line and "rank 3 generator vllm engine 2.9" in line
    assert line.endswith("launcher 0.6, 50 helper processes 2.4"), line  # nothing uncounted
    out = tmp_path / "run"
    _fake_run(out)
    fig = figure([load_run(out)], "arith async: 6 steps\n" + line)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title = fig.get_suptitle() and fig._suptitle.get_window_extent(renderer)
    assert title.x0 >= 0 and title.x1 <= fig.bbox.x1 and title.y1 <= fig.bbox.y1, (title, fig.bbox)
    top_of_panels = max(ax.get_tightbbox(renderer).y1 for ax in fig.axes)
    assert top_of_panels <= title.y0  # the panels start below the title's last line


def test_a_folder_without_a_finished_run_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no summary\.json"):
        load_run(tmp_path)


def test_overlap_fraction_counts_shared_time_once():
    from llamarl.control.outputs.timeline import Span, overlap_fraction

    scoring = [Span("reward_model", 0.0, 4.0, 0), Span("reward_model", 10.0, 12.0, 1)]
    # 1..3 and 2..3.5 overlap each other: 1..3.5 shared with the first span; 11..20 with the second
    generating = [
        Span("generate", 1.0, 3.0, 0),
        Span("generate", 2.0, 3.5, 0),
        Span("generate", 11.0, 20.0, 1),
    ]
    assert overlap_fraction(scoring, generating) == pytest.approx((2.5 + 1.0) / 6.0)
    assert overlap_fraction(scoring, []) == 0.0
    assert overlap_fraction([], generating) != overlap_fraction([], generating)  # nan
