"""Which generator a run samples with when it names none (`generator.backend` auto): the rule.

The rule is `decide`, a pure function of what it is shown (`Situation`), so that it is tested as a function
of its inputs on any machine; `resolve` runs it, doing what it asks for first (a probe, a build). Stated:

1. Something rules vLLM out (LoRA adapters, a model that is not a local folder, several machines on the
   CPU, where each machine would decide alone): hf.
2. CUDA: vLLM where it is installed (nothing is measured there), else hf.
3. CPU, a probe of this machine and model is cached (`probe.ProbeCache`): vLLM when the decoding it saves
   over the run, `tokens x (1 / hf_rate - 1 / vllm_rate)`, is more than its engine's longer start.
4. CPU, no probe yet, vLLM's environment built: the probe runs (about 30 s, once per machine and model)
   when vLLM as fast as measured on CPUs of this kind (`PRIORS`; on a kind never measured, the fastest
   kind's ratio) saves this run more than the probe costs; a shorter run takes hf without probing.
5. CPU, vLLM's environment not built (`tools/setup_vllm_env.sh` builds it): it is built, then probed, when
   the saving at the ratio measured on CPUs of this kind (`PRIORS`) pays for the build and the probe
   within this run; otherwise hf, and the line says what a build costs, what it would save, and from how
   many steps on a run pays for it. A CPU kind never measured is never built for.

The saving counts decoding time. In async and stream modes a step lasts max(generate, train), so where
the trainer is the slower side a step saves less than that: the estimate is an upper bound there.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

Backend = Literal["hf", "vllm"]
EnvState = Literal["ready", "buildable", "absent"]

VLLM_START_S = 12.0
"""Seconds a vLLM CPU engine takes to start (import, load, KV cache) before a probe measured it: 11.0-12.5 s
for SmolLM2-135M on the 2-core AMD EPYC (avx512_bf16, no AMX), 2026-12-07."""
HF_START_S = 2.0
"""Seconds the hf generator takes to load the same model there (0.9-2.1 s)."""
BUILD_S = 75.0
"""Seconds `tools/setup_vllm_env.sh` takes to build vLLM's CPU environment (40-75 s measured here)."""
PROBE_S = 30.0
"""Seconds a probe takes (`probe.measure`: both generators started and timed on a short batch)."""


@dataclass(frozen=True)
class Prior:
    """What was measured on a CPU kind before any probe of this machine."""

    hf_gflops: float
    """the hf generator's decode rate on one thread: 2 x parameters x tokens/s, GFLOP/s"""
    vllm_ratio: float | None
    """vLLM's decode tokens/s over the hf generator's (None: never measured on this kind)"""
    source: str


PRIORS: dict[tuple[str, str], Prior] = {
    ("avx512_bf16", "bfloat16"): Prior(
        34.0, 2.4, "GSM8K benchmark, 16 x 128 tokens, 1 thread, AMD EPYC (avx512_bf16, no AMX), 2026-12"
    ),
    ("avx512_bf16", "float32"): Prior(51.0, 0.9, "the same machine and batch, float32, 2026-12-07"),
    ("amx", "bfloat16"): Prior(73.0, 1.0, "README's table, 2026-12-07: async hf 8.9 s/step, vLLM 9.0"),
    ("amx", "float32"): Prior(40.0, 1.0, "README's table, 2026-12-07: async hf 17.7 s/step, vLLM 18.6"),
}
UNKNOWN_PRIOR = Prior(20.0, None, "no measurement on this CPU kind")


@dataclass(frozen=True)
class Hardware:
    """The machine, as far as the rule needs it."""

    cuda: bool
    cpu_model: str = "unknown CPU"
    cores: int = 1
    avx512_bf16: bool = False
    amx: bool = False
    flags: tuple[str, ...] = ()  # of `NOTABLE_FLAGS`, those /proc/cpuinfo lists

    @property
    def kind(self) -> str:
        """amx (bf16 matrix tiles), avx512_bf16 (bf16 dot products), or other."""
        return "amx" if self.amx else "avx512_bf16" if self.avx512_bf16 else "other"

    @property
    def fingerprint(self) -> str:
        """What a probe's result belongs to: the CPU, its cores and its kind."""
        return f"{self.cpu_model} x{self.cores} {self.kind}"

    def describe(self) -> str:
        """One line for a benchmark's output: "CPU: AMD EPYC, 2 cores, flags avx2 avx512f avx512_bf16"."""
        return f"CPU: {self.cpu_model}, {self.cores} cores, flags {' '.join(self.flags) or 'none of note'}"


NOTABLE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The CPU flags that decide which kernels run (bf16 dot products, bf16 matrix tiles)."""


def this_hardware(*, cuda: bool) -> Hardware:
    """This machine: its CPU's model name and flags (Linux's /proc/cpuinfo, else torch's own probes)."""
    import torch

    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    bf16 = "avx512_bf16" in flags or getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    amx = "amx_bf16" in flags or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    notable = tuple(f for f in NOTABLE_FLAGS if f in flags)
    return Hardware(
        cuda=cuda, cpu_model=model, cores=os.cpu_count() or 1, avx512_bf16=bf16, amx=amx, flags=notable
    )


def model_parameters(folder: Path) -> int:
    """The parameters of the model in `folder`, from its safetensors files' headers (nothing loaded); from
    its weight files' sizes at 2 bytes a parameter where it has none."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    if total:
        return total
    return sum(p.stat().st_size for p in folder.glob("*.bin")) // 2


@dataclass(frozen=True)
class Workload:
    """What a run asks each generator to decode."""

    parameters: int
    dtype: str  # "bfloat16" or "float32"
    threads: int  # each generator's
    sequences: int  # in one generate call
    samples_per_prompt: int  # of those sequences, completions of one prompt (divides sequences)
    new_tokens: int  # at most, per sequence
    steps: int
    tokens_per_step: int  # decoded by one generator in a training step (at most)
    fixed_tokens: int = 0  # decoded outside the steps: evaluations

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step + self.fixed_tokens


@dataclass(frozen=True)
class Rates:
    """Both generators on a workload on this machine: decode tokens/s and seconds to start."""

    hf_tokens_per_s: float
    vllm_tokens_per_s: float
    hf_start_s: float = HF_START_S
    vllm_start_s: float = VLLM_START_S
    measured: str = ""  # when and where, for the printed line

    @property
    def ratio(self) -> float:
        return self.vllm_tokens_per_s / self.hf_tokens_per_s

    def saving_s(self, tokens: int) -> float:
        """Seconds vLLM saves over the hf generator decoding `tokens`, less its longer start."""
        decode = tokens / self.hf_tokens_per_s - tokens / self.vllm_tokens_per_s
        return decode - (self.vllm_start_s - self.hf_start_s)


@dataclass(frozen=True)
class Situation:
    """Everything `decide` looks at."""

    hardware: Hardware
    workload: Workload
    env: EnvState  # vLLM's environment: ready, buildable (tools/setup_vllm_env.sh), absent
    obstacle: str | None = None  # why vLLM cannot serve this run at all (None: nothing)
    probe: Rates | None = None  # this machine and model's cached probe


@dataclass(frozen=True)
class Decision:
    """What `decide` says: a backend, or a probe or a build to do first, and why (one line)."""

    action: Literal["hf", "vllm", "probe", "build"]
    reason: str

    @property
    def backend(self) -> Backend:
        assert self.action in ("hf", "vllm"), f"not a choice yet: {self.action}"
        return "vllm" if self.action == "vllm" else "hf"

    def line(self) -> str:
        """What a run prints: `generator: vllm (2.4x the hf generator here, ...)`."""
        return f"generator: {self.action} ({self.reason})"


def prior(hardware: Hardware, dtype: str) -> Prior:
    """What was measured on this CPU kind at this dtype (`UNKNOWN_PRIOR` where nothing was)."""
    return PRIORS.get((hardware.kind, dtype), UNKNOWN_PRIOR)


def prior_rates(hardware: Hardware, workload: Workload, ratio: float) -> Rates:
    """The rates a CPU kind's measurements predict, with vLLM `ratio` x as fast as the hf generator."""
    known = prior(hardware, workload.dtype)
    hf = known.hf_gflops * 1e9 * workload.threads / (2 * max(workload.parameters, 1))
    return Rates(hf, hf * ratio, measured=known.source)


def decide(situation: Situation) -> Decision:
    """The rule of the module doc, on `situation`."""
    if situation.obstacle is not None:
        return Decision("hf", situation.obstacle)
    if situation.hardware.cuda:
        if situation.env == "ready":
            return Decision("vllm", "CUDA, and vLLM is installed: its engine is the faster one there")
        return Decision("hf", "CUDA, but vLLM is not installed here (llamarl-exec[vllm] installs it)")
    if situation.probe is not None:
        return _by_probe(situation.probe, situation.workload)
    if situation.env == "ready":
        return _probe_or_hf(situation.hardware, situation.workload)
    return _build_or_hf(situation)


def _by_probe(rates: Rates, workload: Workload) -> Decision:
    saving = rates.saving_s(workload.tokens)
    measured = f"{rates.ratio:.1f}x the hf generator here ({rates.measured})"
    if rates.ratio > 1 and saving > 0:
        return Decision("vllm", f"{measured}: about {saving:.0f} s of this run's decoding saved")
    if rates.ratio <= 1:
        return Decision("hf", f"vLLM decodes at {measured}")
    start = rates.vllm_start_s - rates.hf_start_s
    return Decision(
        "hf",
        f"vLLM decodes at {measured}, but this run is too short to pay for its {start:.0f} s longer start",
    )


def _probe_or_hf(hardware: Hardware, workload: Workload) -> Decision:
    known = prior(hardware, workload.dtype)
    best = known.vllm_ratio or max(p.vllm_ratio or 0.0 for p in PRIORS.values())
    hf_s = workload.tokens / prior_rates(hardware, workload, 1.0).hf_tokens_per_s
    if prior_rates(hardware, workload, best).saving_s(workload.tokens) > PROBE_S:
        return Decision("probe", f"measuring both generators on this model once (about {PROBE_S:.0f} s)")
    return Decision(
        "hf",
        f"this run decodes about {hf_s:.0f} s with it: too little for vLLM's engine to pay for its start "
        f"and a {PROBE_S:.0f} s probe",
    )


def _build_or_hf(situation: Situation) -> Decision:
    hardware, workload = situation.hardware, situation.workload
    known = prior(hardware, workload.dtype)
    if situation.env == "absent" or known.vllm_ratio is None or known.vllm_ratio <= 1:
        why = "vLLM is not installed here" if situation.env == "absent" else "its environment is not built"
        ratio = "never measured" if known.vllm_ratio is None else f"{known.vllm_ratio:.1f}x the hf generator"
        return Decision("hf", f"{why}; on CPUs of this kind ({hardware.kind}) vLLM decodes at {ratio}")
    rates = prior_rates(hardware, workload, known.vllm_ratio)
    saving = rates.saving_s(workload.tokens)
    cost = BUILD_S + PROBE_S
    if saving > cost:
        return Decision(
            "build",
            f"building vLLM's environment (tools/setup_vllm_env.sh, about {BUILD_S:.0f} s once): at the "
            f"{known.vllm_ratio:.1f}x measured on CPUs of this kind it saves about {saving:.0f} s of this "
            "run",
        )
    paying = _paying_steps(rates, workload, cost)
    return Decision(
        "hf",
        f"vLLM's environment is not built: building it (tools/setup_vllm_env.sh, about {BUILD_S:.0f} s "
        f"once) and a {PROBE_S:.0f} s probe would save about {max(saving, 0):.0f} s of this run at the "
        f"{known.vllm_ratio:.1f}x measured on CPUs of this kind; runs of {paying}+ steps pay for it",
    )


def _paying_steps(rates: Rates, workload: Workload, cost_s: float) -> int:
    """The fewest steps of this workload whose saving pays `cost_s`."""
    per_step = rates.saving_s(workload.tokens_per_step) - rates.saving_s(0)
    fixed = rates.saving_s(workload.fixed_tokens)
    return max(workload.steps + 1, math.ceil((cost_s - fixed) / per_step)) if per_step > 0 else 0


def resolve(
    situation: Situation,
    *,
    probe: Callable[[], Rates],
    build: Callable[[], bool],
    say: Callable[[str], None],
) -> Decision:
    """`decide`, after doing what it asks for first: `probe()` measures both generators here (and caches
    the result; it raises to say it failed), `build()` builds vLLM's environment (False: it failed).
    `say` tells the user of each before it starts (they take seconds to a minute)."""
    for _ in range(3):  # at most a build, then a probe, then the choice
        decision = decide(situation)
        if decision.action == "probe":
            say(f"generator: {decision.reason}")
            try:
                situation = replace(situation, probe=probe())
            except Exception as e:
                return Decision("hf", f"the probe of vLLM failed here: {e}")
        elif decision.action == "build":
            say(f"generator: {decision.reason}")
            situation = replace(situation, env="ready" if build() else "absent")
        else:
            return decision
    raise AssertionError(f"the generator rule did not settle: {decision}")
