"""The run's generator when it names none (`generator.backend` auto), chosen before any rank starts.

`choose_generator` shows the rule (`llamarl.exec.generate.choice`) this machine, the run's decoding work
and vLLM's environment, runs the probe or the build the rule asks for, prints its one line
("generator: vllm (2.8x the hf generator here ...)") and returns the config with the backend chosen, which
the launcher writes to OUTPUT_DIR/config.toml: `--config OUTPUT_DIR/config.toml` reruns the same run,
without choosing again. A run that names its generator never probes or builds anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from llamarl.control.config import RunConfig, replace_in
from llamarl.control.launch.devices import generation_dtype, uses_cuda
from llamarl.control.launch.threads import rank_threads
from llamarl.exec.generate.choice import Rates, Situation, Workload, model_parameters, resolve, this_hardware
from llamarl.exec.generate.probe import ProbeCache, build_env, env_state, measure, probe_key


def choose_generator(config: RunConfig, *, say: Callable[[str], None] = print) -> RunConfig:
    """`config` with `generator.backend` auto replaced by the backend the rule chooses (said through
    `say`, with the probe or build it takes first); any other config as it is."""
    if config.generator.backend != "auto":
        return config
    cuda = uses_cuda(config)
    env, python = env_state(config.generator.vllm_python, cuda=cuda)
    workload = run_workload(config)
    hardware = this_hardware(cuda=cuda)
    situation = Situation(hardware, workload, env, obstacle=vllm_obstacle(config, cuda=cuda))
    cache = ProbeCache()
    if python is not None and situation.obstacle is None and not cuda:
        situation = replace(situation, probe=cache.get(probe_key(hardware, config.model, workload, python)))

    def probe() -> Rates:
        assert python is not None, "probed without vLLM's environment"
        rates = measure(config.model, workload, python)
        cache.put(probe_key(hardware, config.model, workload, python), rates)
        return rates

    def build() -> bool:
        nonlocal python
        python = build_env()
        return python is not None

    decision = resolve(situation, probe=probe, build=build, say=lambda line: say(line))
    say(decision.line())
    return replace_in(config, **{"generator.backend": decision.backend})


def run_workload(config: RunConfig) -> Workload:
    """What the run asks each generator to decode: its share of every step's sequences, and of the
    evaluations (before and after training, and every eval.every steps), greedy and sampled."""
    sampling, evaluation = config.sampling, config.eval
    evaluations = 0
    if evaluation.size:
        evaluations = 2 + ((config.schedule.steps - 1) // evaluation.every if evaluation.every else 0)
    eval_sequences = math.ceil(evaluation.size / config.ranks.num_generators) * (1 + evaluation.samples)
    local = Path(config.model, "config.json").is_file()
    return Workload(
        parameters=model_parameters(Path(config.model)) if local else 0,
        dtype=generation_dtype(config.generator.precision, torch.device("cpu")),
        threads=rank_threads(config),
        sequences=config.request_sequences,
        samples_per_prompt=sampling.samples_per_prompt,
        new_tokens=sampling.max_new_tokens,
        steps=config.schedule.steps,
        tokens_per_step=config.request_sequences * sampling.max_new_tokens,
        fixed_tokens=evaluations * eval_sequences * sampling.max_new_tokens,
    )


def is_mixture_of_experts(folder: Path) -> bool:
    """Whether the model folder's config.json describes a mixture of experts."""
    from llamarl.exec.models import read_model_config
    from llamarl.exec.moe.routes import num_experts

    return bool(num_experts(read_model_config(folder)))


def vllm_obstacle(config: RunConfig, *, cuda: bool) -> str | None:
    """Why a vLLM engine cannot serve this run (one line), or None."""
    from llamarl.control.launch.launcher import under_torchrun

    if config.trainer.lora.rank:
        return "trainer.lora.rank > 0: the vLLM engine takes no LoRA adapters yet"
    if not Path(config.model, "config.json").is_file():
        return f"vLLM serves a local model folder; {config.model} is not one"
    if is_mixture_of_experts(Path(config.model)):
        return "a mixture of experts: the vLLM generator takes neither its weight syncs nor its routes yet"
    if not cuda and (config.launch.nnodes > 1 or under_torchrun()):
        return (
            "several machines on the CPU would each choose by themselves (launch.nnodes > 1 or torchrun): "
            "--generator vllm names it"
        )
    return None
