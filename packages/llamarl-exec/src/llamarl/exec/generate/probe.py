"""Both generators measured on this machine for a model, once: what `llamarl.exec.generate.choice` decides by.

`measure` runs `python -m llamarl.exec.generate.probe` in a child process (the caller, a launcher, keeps
none of the models' memory): it starts the hf generator, then a vLLM engine, each with the run's dtype,
threads and batch of sequences, times the decoding of `PROBE_TOKENS` new tokens on random prompts with
each (`_tokens_per_s`), and prints the rates and start times as one line of JSON. About 30 s on the 2-core
machine here, most of it the engine's start. `ProbeCache` keeps each result under the machine, the model's
architecture (its config.json), the dtype, threads and batch, in
~/.cache/llamarl/generator_probes.json ($LLAMARL_CACHE_DIR overrides the folder): a machine probes a model
once. `env_state` says whether vLLM's environment is there or can be built (`build_env`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from llamarl.exec.generate.choice import EnvState, Hardware, Rates, Workload

PROBE_TOKENS = 24
"""New tokens per sequence the longer of the two timed generates adds to the shorter one's."""
SHORT_TOKENS = 4
"""New tokens per sequence of the first call and of the shorter timed one."""
TYPICAL_PROMPT_TOKENS = 128
"""A prompt's tokens with its chat template, as the probe counts them (GSM8K's: 100-200)."""
DEADLINE_S = 300.0
"""The probe's child process is stopped after this long (a vLLM start has 300 s in a run too)."""
SETUP_SCRIPT = Path(__file__).resolve().parents[6] / "tools" / "setup_vllm_env.sh"
"""The script that builds vLLM's CPU environment, in a checkout of the repository (absent from a wheel)."""
CACHE_FILE = "generator_probes.json"


class ProbeFailed(RuntimeError):
    """The probe did not measure both generators; the message says why in one line."""


def probe_key(hardware: Hardware, model: str, workload: Workload, vllm_python: str) -> str:
    """What a probe's result belongs to: machine, architecture, dtype, threads, batch, both environments."""
    import torch

    architecture = hashlib.sha1(Path(model, "config.json").read_bytes()).hexdigest()[:12]
    return " | ".join(
        [
            hardware.fingerprint,
            f"model {architecture}",
            workload.dtype,
            f"{workload.threads} threads",
            f"{workload.sequences} x {workload.new_tokens} tokens",
            f"torch {torch.__version__}",
            f"vllm at {vllm_python}",
        ]
    )


class ProbeCache:
    """Probes measured on this machine, by `probe_key`, in one JSON file (replaced whole at each write)."""

    def __init__(self, folder: Path | None = None) -> None:
        from llamarl.exec.generate.vllm.env import cache_dir

        self.path = (folder or cache_dir()) / CACHE_FILE

    def get(self, key: str) -> Rates | None:
        entry = self._read().get(key)
        return None if entry is None else Rates(**entry)

    def put(self, key: str, rates: Rates) -> None:
        entries = {**self._read(), key: dataclasses.asdict(rates)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text(json.dumps(entries, indent=1) + "\n")
        os.replace(partial, self.path)  # a reader sees the old file or the new one, never half of one

    def _read(self) -> dict[str, dict]:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self.path.read_text())
        return {}


def env_state(explicit: str | None, *, cuda: bool) -> tuple[EnvState, str | None]:
    """(state, interpreter) of vLLM's environment: ready (its interpreter), buildable (this checkout's
    tools/setup_vllm_env.sh and the torch wheel it installs are here: CPU only), or absent."""
    from llamarl.exec.generate.vllm.env import VLLMEnvironmentError, find_vllm_python

    try:
        return "ready", find_vllm_python(explicit, cuda=cuda)
    except VLLMEnvironmentError:
        pass
    if cuda or explicit or os.environ.get("LLAMARL_VLLM_PYTHON") or not SETUP_SCRIPT.is_file():
        return "absent", None
    wheels = os.environ.get("PIP_FIND_LINKS", "/opt/wheels")
    return ("buildable" if glob.glob(os.path.join(wheels, "torch-2.13.0+cpu-*.whl")) else "absent"), None


def build_env() -> str | None:
    """Builds vLLM's CPU environment with tools/setup_vllm_env.sh; its interpreter, or None when the build
    failed (its log's last lines go to stderr)."""
    result = subprocess.run(["bash", str(SETUP_SCRIPT), "--quiet"], capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-3000:])
        return None
    return result.stdout.strip().splitlines()[-1]


def measure(model: str, workload: Workload, vllm_python: str, *, deadline_s: float = DEADLINE_S) -> Rates:
    """Both generators' rates on `workload` here, measured in a child process (see the module doc).
    Raises ProbeFailed (one line) when it fails or outlasts `deadline_s`."""
    command = [
        sys.executable, "-m", "llamarl.exec.generate.probe", "--model", model,
        "--dtype", workload.dtype, "--threads", str(workload.threads),
        "--sequences", str(workload.sequences), "--vllm-python", vllm_python,
        "--samples", str(workload.samples_per_prompt),
        "--context", str(TYPICAL_PROMPT_TOKENS + workload.new_tokens // 2),
    ]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=deadline_s)
    except subprocess.TimeoutExpired:
        raise ProbeFailed(f"the probe of both generators took more than {deadline_s:.0f} s") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ProbeFailed(f"the probe of both generators failed: {last}")
    return Rates(**json.loads(result.stdout.strip().splitlines()[-1]))


def _setup_s(generator) -> float:
    """Seconds `generator.setup()` takes."""
    start = time.perf_counter()
    generator.setup()
    return time.perf_counter() - start


def _tokens_per_s(generator, prompts: list[list[int]], samples: int) -> float:
    """Decoding tokens/s on `samples` completions of each of `prompts`: the completion tokens
    `PROBE_TOKENS` more new tokens add, over the seconds they add (the prompts' prefill and each call's
    own costs cancel out: the run's long completions amortize them), after a first call (allocations,
    kernel choices)."""
    generator.generate(prompts, samples_per_prompt=samples, max_new_tokens=SHORT_TOKENS)
    tokens, seconds = [], []
    for new_tokens in (SHORT_TOKENS, SHORT_TOKENS + PROBE_TOKENS):
        start = time.perf_counter()
        batch = generator.generate(prompts, samples_per_prompt=samples, max_new_tokens=new_tokens)
        tokens.append(batch.num_completion_tokens)
        seconds.append(time.perf_counter() - start)
    return (tokens[1] - tokens[0]) / max(seconds[1] - seconds[0], 1e-6)


def _probe(args: argparse.Namespace) -> Rates:
    """Measures both generators from this process (see the module doc)."""
    import torch

    from llamarl.exec.config import GeneratorConfig, SamplingConfig
    from llamarl.exec.generate.hf import HFGenerator
    from llamarl.exec.generate.vllm.generator import VLLMGenerator

    torch.set_num_threads(args.threads)
    vocab = json.loads(Path(args.model, "config.json").read_text()).get("vocab_size", 1000)
    seeded = torch.Generator().manual_seed(0)
    # As long as a sequence is halfway through the run's completions: a decoding step costs more as the
    # context grows (the hf generator's: 140 tokens/s at 70 tokens of context, 80 over a GSM8K batch).
    shape = (args.sequences // args.samples, args.context)
    prompts = torch.randint(100, max(101, vocab - 100), shape, generator=seeded)
    sampling = SamplingConfig(max_new_tokens=PROBE_TOKENS)
    vllm = VLLMGenerator(
        args.model, sampling, GeneratorConfig(backend="vllm", vllm_python=args.vllm_python),
        dtype=args.dtype, seed=0, num_threads=args.threads, batch_sequences=args.sequences,
        in_flight_updates=False,
    )  # fmt: skip
    hf = HFGenerator(args.model, sampling, dtype=args.dtype, seed=0)
    # One after the other: a vLLM engine starting beside the hf generator's timing took half its speed
    # (hf 39 tokens/s instead of 80 on the 2-core machine here).
    try:
        hf_start_s = _setup_s(hf)
        hf_rate = _tokens_per_s(hf, prompts.tolist(), args.samples)
    finally:
        hf.close()
    try:
        vllm_start_s = _setup_s(vllm)
        vllm_rate = _tokens_per_s(vllm, prompts.tolist(), args.samples)
    finally:
        vllm.close()
    when = time.strftime("%Y-%m-%d")
    return Rates(hf_rate, vllm_rate, hf_start_s, vllm_start_s, measured=f"probed {when}, cached")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measures the hf and vLLM generators on a model here.")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4, help="per prompt (divides --sequences)")
    parser.add_argument("--context", type=int, default=TYPICAL_PROMPT_TOKENS + 64, help="prompt tokens")
    parser.add_argument("--vllm-python", required=True)
    args = parser.parse_args(argv)
    print(json.dumps(dataclasses.asdict(_probe(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
