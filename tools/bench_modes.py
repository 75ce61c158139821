"""llamarl's schedules, precisions and generators against TRL's GRPOTrainer on the same work:
`uv run tools/bench_modes.py`.

Runs the GSM8K app once per (generator, precision, mode), and TRL's GRPOTrainer training loop once per
precision (tools/bench_trl.py, through `uv run --with trl==...`: TRL is not a project dependency), one
after the other on this machine, with the same model, prompts and lengths. Prints per run: seconds per
step, completion tokens trained per second and its ratio to TRL's at the same precision, the generate
and train time per batch, the weight sync, the best step time the schedule can reach with those phase
times (max(generate, train) + sync when they overlap, their sum in sync mode) and the step time over it,
the train time over the bf16 FLOP floor of the step, the staleness figures, and the memory of every
process of the run (ranks, engines, reward workers, launcher) against TRL's, two ways
(`llamarl.control.launch.memory`): the sum of per-process peak RSS (each process counts the library pages it
shares with the others in full) and the largest PSS of them all at once (shared pages counted once).

The bf16 FLOP floor of a training step: 6 x parameters x tokens forwarded (each group's prompt once plus
every completion token) over the rate of a bf16 matrix product of the trainer's shapes measured here
with the trainer's threads (all cores in sync mode, their share otherwise).

Defaults are the benchmark's work: SmolLM2-135M-Instruct, 4 prompts x 4 samples x 128 new tokens, 6 steps,
no evaluation; TRL as it ships (bf16, gradient checkpointing), without gradient checkpointing, and in
fp32; and first a row "defaults" that names no mode, generator or precision: what a user gets (its
generator is chosen by `generator.backend` auto, and the line it printed is shown). The defaults row is
compared with TRL's fastest setting of the run, and its memory with TRL's at its defaults. The CPU (model,
cores, the flags that decide the kernels) is printed first. Figures need an otherwise idle machine;
`uptime` before and after (printed) says whether it was.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRECISION_FLAGS = {"fp32": "fp32", "bf16": "bf16"}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_llamarl(
    mode: str | None, generator: str | None, precision: str | None, args: argparse.Namespace, out: Path
) -> dict:
    """One run of the GSM8K app on the benchmark's work; None for mode, generator or precision leaves that
    setting at its default (the "defaults" row: what a user who names none of them runs)."""
    command = [
        sys.executable, str(REPO / "apps" / "gsm8k_rl"),
        "--output-dir", str(out), "--steps", str(args.steps),
        "--prompts-per-step", str(args.prompts_per_step),
        "--samples-per-prompt", str(args.samples_per_prompt),
        "--max-new-tokens", str(args.max_new_tokens), "--eval-size", "0", "--no-wandb", "--no-save-model",
        "--max-policy-lag", str(args.max_policy_lag),
    ]  # fmt: skip
    if mode is not None:
        command += ["--mode", mode]
    if generator is not None:
        command += ["--generator", generator]
    if precision is not None:
        command += ["--trainer.precision", precision, "--generator.precision", precision]
    if args.model:
        command += ["--model", args.model]
    if args.data:
        command += ["--data", args.data]
    command += args.extra
    name = " ".join(x or "default" for x in (mode, generator, precision))
    log(f"llamarl {name}: {' '.join(command[1:])}")
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "WANDB_SILENT": "true"}
    )
    if result.returncode != 0:
        raise SystemExit(f"llamarl {name} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    # The choice is the last such line (a probe or a build, when one ran, is said first).
    chose = [line for line in result.stdout.splitlines() if line.startswith("generator: ")]
    summary["generator_line"] = chose[-1] if chose else ""
    log(f"llamarl {name}: done in {summary['wall_s']:.0f} s {summary['generator_line']}")
    return summary


TRL_SETTINGS = {
    "bf16": ["--precision", "bf16"],  # as it ships: bf16 autocast, gradient checkpointing
    "bf16-no-checkpointing": ["--precision", "bf16", "--no-gradient-checkpointing"],
    "fp32": ["--precision", "fp32"],
}


def run_trl(setting: str, args: argparse.Namespace, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    command = [
        "uv", "run", "--with", f"trl=={args.trl_version}", str(REPO / "tools" / "bench_trl.py"),
        *TRL_SETTINGS[setting], "--steps", str(args.steps),
        "--prompts-per-step", str(args.prompts_per_step),
        "--samples-per-prompt", str(args.samples_per_prompt),
        "--max-new-tokens", str(args.max_new_tokens), "--json", str(out / "figures.json"),
    ]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    if args.data:
        command += ["--data", args.data]
    log(f"TRL {setting}: {' '.join(command)}")
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"TRL {setting} failed:\n{result.stderr[-3000:]}")
    figures = json.loads((out / "figures.json").read_text())
    log(f"TRL {setting}: done, loop {figures['loop_s']:.0f} s")
    return figures


def matmul_gflops(dtype_name: str, threads: int, seconds: float = 1.0) -> float:
    """GFLOP/s of a [2048, 576] x [576, 1536] product (SmolLM2's MLP shape) with `threads` threads."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(2048, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        a @ b  # warm up
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        return 2 * 2048 * 576 * 1536 * count / (time.perf_counter() - start) / 1e9
    finally:
        torch.set_num_threads(previous)


class FlopFloor:
    """The bf16 FLOP floor of a run's training step (see the module doc)."""

    def __init__(self, model: str) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
        self.parameters = sum(p.numel() for p in meta.parameters())  # tied weights once: the head's
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self._rates: dict[int, float] = {}

    def rate(self, threads: int) -> float:
        if threads not in self._rates:
            self._rates[threads] = matmul_gflops("bf16", threads)
        return self._rates[threads]

    def prompt_tokens_per_step(self, out: Path) -> float:
        """Each group's prompt once, from the questions the generators logged (chat template applied)."""
        groups = set()
        for path in out.glob("samples.rank*.jsonl"):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                groups.add((row["tick"], path.name, row["question"]))
        if not groups:
            return 0.0
        # The logged question is the prompt as the user message holds it.
        lengths = [self._prompt_length([{"role": "user", "content": q}]) for *_, q in groups]
        steps = len({(tick, name) for tick, name, _ in groups})
        return sum(lengths) / steps

    def _prompt_length(self, messages: list[dict[str, str]]) -> int:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)  # (a BatchEncoding in transformers 5)

    def seconds(self, summary: dict, out: Path, threads: int) -> float:
        tokens = summary["num_completion_tokens"] / max(summary["steps"], 1) + self.prompt_tokens_per_step(
            out
        )
        return 6 * self.parameters * tokens / (self.rate(threads) * 1e9)


def figures(summary: dict, out: Path, args: argparse.Namespace) -> dict[str, float]:
    """The headline figures of one llamarl run (seconds per batch of `prompts_per_step` prompts)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/reward_mean" in r]
    generate_total = sum(r["time/generate_s"] for r in steps)
    groups_total = sum(r.get("sampling/groups", args.prompts_per_step) for r in steps)
    # A stream generator samples continuously (some groups are dropped as stale): its time per batch
    # is its generate time per group sampled, times the groups of a batch.
    generate_per_batch = generate_total / groups_total * args.prompts_per_step
    if summary["mode"] == "sync":
        bound = generate_per_batch + summary["train_s_mean"] + summary["weight_sync_s"]
    else:
        bound = max(generate_per_batch, summary["train_s_mean"]) + summary["weight_sync_s"]
    return {
        "step_s": summary["step_time_s"],
        "tokens_per_s": summary["gen_tokens_per_s"],
        "generate_s": generate_per_batch,
        "train_s": summary["train_s_mean"],
        "sync_s": summary["weight_sync_s"],
        "bound_s": bound,
        "step_over_bound": summary["step_time_s"] / bound,
        "lag_max": summary["policy_lag_max"],
        "dropped": summary.get("stream", {}).get("dropped_stale_groups", 0),
        "peak_gb": summary["peak_rss_mb_total"] / 1024,
        "peak_pss_gb": summary["peak_pss_mb_total"] / 1024,
    }


def cpu_line() -> str:
    """This machine's CPU: model, cores and the flags that decide the kernels (printed with every table)."""
    from llamarl.exec.generate.choice import this_hardware

    return this_hardware(cuda=False).describe()


def fastest(trl: dict[str, dict]) -> dict | None:
    """TRL's setting with the most completion tokens a second in this run (its name under "setting")."""
    if not trl:
        return None
    setting = max(trl, key=lambda k: trl[k]["gen_tokens_per_s"])
    return {**trl[setting], "setting": setting}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--modes", nargs="+", default=["sync", "async", "stream"], choices=["sync", "async", "stream"]
    )
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=list(PRECISION_FLAGS))
    p.add_argument("--generators", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--no-trl", dest="trl", action="store_false", help="llamarl only")
    p.add_argument("--trl-version", default="1.16.0")
    p.add_argument(
        "--trl-settings", nargs="+", default=list(TRL_SETTINGS), choices=list(TRL_SETTINGS),
        help="TRL as it ships (bf16), without gradient checkpointing, in fp32",
    )  # fmt: skip
    p.add_argument(
        "--no-defaults", dest="defaults", action="store_false",
        help="leave out the row that runs what a user gets (no mode, generator or precision named)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-policy-lag", type=int, default=1)
    p.add_argument("--model", help="model folder (default: the app's)")
    p.add_argument("--data", help="GSM8K folder (default: the app's)")
    p.add_argument("--output-dir", type=Path, default=Path("runs/bench_modes"))
    p.add_argument("--json", type=Path, help="also write every run's figures here")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more app flags for every llamarl run")
    args = p.parse_args(argv)
    args.extra = [a for a in args.extra if a != "--"]
    print(cpu_line(), flush=True)
    load_before = os.getloadavg()
    trl: dict[str, dict] = {}
    if args.trl:
        for setting in args.trl_settings:
            trl[setting] = run_trl(setting, args, args.output_dir / f"trl_{setting}")
    from llamarl.exec import smollm2_path

    floor = FlopFloor(args.model or str(smollm2_path()))
    cores = os.cpu_count() or 1
    runs = [(mode, gen, prec) for gen in args.generators for prec in args.precisions for mode in args.modes]
    if args.defaults:
        runs.insert(0, (None, None, None))
    rows: dict[str, dict] = {}
    for mode, generator, precision in runs:
        name = "defaults" if mode is None else f"{mode} {generator} {precision}"
        out = args.output_dir / name.replace(" ", "_")
        summary = run_llamarl(mode, generator, precision, args, out)
        row = figures(summary, out, args)
        row["generator_line"] = summary["generator_line"]
        threads = (
            cores
            if summary.get("mode", mode) == "sync"
            else max(1, cores // (summary["num_trainers"] + summary["num_generators"]))
        )
        row["floor_s"] = floor.seconds(summary, out, threads)
        row["train_over_floor"] = row["train_s"] / row["floor_s"]
        # Against TRL at the same precision; the defaults against TRL's fastest setting of the run.
        base = trl.get(precision) if precision else fastest(trl)
        row["x_trl_tokens"] = row["tokens_per_s"] / base["gen_tokens_per_s"] if base else float("nan")
        row["x_trl_memory"] = row["peak_gb"] * 1024 / base["peak_rss_mb_total"] if base else float("nan")
        row["x_trl_pss"] = row["peak_pss_gb"] * 1024 / base["peak_pss_mb_total"] if base else float("nan")
        if precision is None and "bf16" in trl:  # memory: at most TRL's at its defaults
            row["x_trl_pss_defaults"] = row["peak_pss_gb"] * 1024 / trl["bf16"]["peak_pss_mb_total"]
        row["memory_per_process"] = summary["memory_per_process"]
        rows[name] = row
    load_after = os.getloadavg()
    print(f"\nload average before: {' '.join(f'{x:.1f}' for x in load_before)}; after: "
          f"{' '.join(f'{x:.1f}' for x in load_after)}; bf16 matmul GFLOP/s by threads: "
          f"{ {t: round(r) for t, r in floor._rates.items()} }")  # fmt: skip
    print("\n| run | s/step | completion tok/s | x TRL tok/s | peak GB (sum of peak RSS) | x TRL "
          "| peak GB (PSS at once) | x TRL |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for setting, t in trl.items():
        print(f"| TRL GRPOTrainer {setting} | {t['step_s']:.1f} | {t['gen_tokens_per_s']:.1f} | 1.00 | "
              f"{t['peak_rss_mb_total'] / 1024:.1f} | 1.00 | "
              f"{t['peak_pss_mb_total'] / 1024:.1f} | 1.00 |")  # fmt: skip
    for name, r in rows.items():
        print(f"| llamarl {name} | {r['step_s']:.1f} | {r['tokens_per_s']:.1f} | {r['x_trl_tokens']:.2f} | "
              f"{r['peak_gb']:.1f} | {r['x_trl_memory']:.2f} | "
              f"{r['peak_pss_gb']:.1f} | {r['x_trl_pss']:.2f} |")  # fmt: skip
    print("\n| run | generate s | train s | sync s | bound s | step / bound | bf16 floor s | train / floor "
          "| max lag | dropped groups |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['generate_s']:.1f} | {r['train_s']:.1f} | {r['sync_s']:.2f} | "
              f"{r['bound_s']:.1f} | "
              f"{r['step_over_bound']:.2f} | {r['floor_s']:.1f} | {r['train_over_floor']:.2f} | "
              f"{r['lag_max']:.0f} | {r['dropped']:.0f} |")  # fmt: skip
    print("\npeak memory per process (GB):")
    for name, t in [*((f"TRL {p}", t) for p, t in trl.items()), *rows.items()]:
        parts = ", ".join(f"{m['process']} {m['peak_rss_mb'] / 1024:.2f}" for m in t["memory_per_process"])
        print(f"  {name}: {parts}")
    if "defaults" in rows:
        r = rows["defaults"]
        base = fastest(trl)
        print(f"\ndefaults: {r['generator_line']}")
        if base:
            print(f"defaults: {r['x_trl_tokens']:.2f}x the fastest TRL setting's tokens/s "
                  f"({base['setting']}); PSS {r.get('x_trl_pss_defaults', float('nan')):.2f}x TRL's "
                  f"at its defaults; step / bound {r['step_over_bound']:.2f}")  # fmt: skip
    if args.json:
        record = {
            "cpu": cpu_line(),
            "args": vars(args),
            "trl": trl,
            "llamarl": rows,
            "load": [load_before, load_after],
        }
        args.json.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
