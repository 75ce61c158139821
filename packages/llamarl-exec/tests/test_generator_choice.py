"""`generator.backend` auto: the rule (`llamarl.exec.generate.choice.decide`) on each kind of machine and
run, `resolve` doing the build and the probe it asks for, and the probe cache. The rule is a function of
what it is shown, so every branch is checked here whatever CPU runs the suite."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from llamarl.exec.generate.choice import (
    BUILD_S,
    PROBE_S,
    Hardware,
    Rates,
    Situation,
    Workload,
    decide,
    model_parameters,
    prior,
    prior_rates,
    resolve,
)
from llamarl.exec.generate.probe import ProbeCache

NO_AMX = Hardware(cuda=False, cpu_model="AMD EPYC", cores=2, avx512_bf16=True)
AMX = Hardware(cuda=False, cpu_model="Intel Xeon", cores=2, avx512_bf16=True, amx=True)
AVX2 = Hardware(cuda=False, cpu_model="old CPU", cores=2)


def smollm2_run(steps: int, dtype: str = "bfloat16") -> Workload:
    """bench_modes.py's work: 135M parameters, 16 sequences x 128 tokens a step, one thread."""
    return Workload(135_000_000, dtype, 1, 16, 4, 128, steps, 16 * 128)


def test_an_obstacle_or_a_missing_engine_is_hf_with_its_reason() -> None:
    lora = Situation(NO_AMX, smollm2_run(100), "ready", obstacle="trainer.lora.rank > 0: no adapters")
    assert decide(lora).action == "hf" and "lora" in decide(lora).reason
    absent = decide(Situation(NO_AMX, smollm2_run(100), "absent"))
    assert absent.action == "hf" and "not installed" in absent.reason
    cuda = Hardware(cuda=True)
    assert decide(Situation(cuda, smollm2_run(1), "ready")).action == "vllm"
    assert decide(Situation(cuda, smollm2_run(1), "absent")).action == "hf"


def test_a_cached_probe_decides_by_the_time_the_run_saves() -> None:
    fast = Rates(80.0, 200.0, hf_start_s=2.0, vllm_start_s=12.0, measured="probed")
    long_run = decide(Situation(NO_AMX, smollm2_run(50), "ready", probe=fast))
    assert long_run.action == "vllm" and "2.5x the hf generator here" in long_run.line()
    # 10 s more to start than the hf generator: a run that decodes 1,000 tokens saves 7.5 s of decoding.
    short = decide(Situation(NO_AMX, replace(smollm2_run(1), tokens_per_step=1000), "ready", probe=fast))
    assert short.action == "hf" and "too short" in short.reason
    slower = decide(Situation(NO_AMX, smollm2_run(50), "ready", probe=replace(fast, vllm_tokens_per_s=70)))
    assert slower.action == "hf" and "0.9x" in slower.reason


def test_without_a_probe_a_long_enough_run_probes_and_a_short_one_does_not() -> None:
    # At the 2.4x measured on this CPU kind, 3 steps save less than the 30 s probe costs, 5 steps more.
    assert decide(Situation(NO_AMX, smollm2_run(5), "ready")).action == "probe"
    short = decide(Situation(NO_AMX, smollm2_run(3), "ready"))
    assert short.action == "hf" and f"{PROBE_S:.0f} s probe" in short.reason
    # Where vLLM was measured no faster (AMX), no run is worth a probe.
    assert decide(Situation(AMX, smollm2_run(1000), "ready")).action == "hf"
    # A CPU kind never measured is weighed at the fastest kind's ratio.
    assert decide(Situation(AVX2, smollm2_run(1000), "ready")).action == "probe"


def test_an_unbuilt_environment_is_built_only_where_the_run_pays_for_it() -> None:
    long_run = decide(Situation(NO_AMX, smollm2_run(200), "buildable"))
    assert long_run.action == "build" and f"about {BUILD_S:.0f} s once" in long_run.reason
    short = decide(Situation(NO_AMX, smollm2_run(2), "buildable"))
    assert short.action == "hf"
    # The line names the run length from which a build pays: one step fewer does not, that many does.
    steps = int(short.reason.split("runs of ")[1].split("+")[0])
    assert decide(Situation(NO_AMX, smollm2_run(steps), "buildable")).action == "build"
    assert decide(Situation(NO_AMX, smollm2_run(steps - 1), "buildable")).action == "hf"
    # Never measured on this CPU kind, or measured no faster: never built for.
    assert decide(Situation(AVX2, smollm2_run(10_000), "buildable")).action == "hf"
    assert decide(Situation(AMX, smollm2_run(10_000), "buildable")).action == "hf"


def test_resolve_builds_then_probes_then_chooses_and_a_failed_probe_is_hf() -> None:
    said: list[str] = []
    done: list[str] = []

    def build() -> bool:
        done.append("build")
        return True

    def probe() -> Rates:
        done.append("probe")
        return Rates(80.0, 200.0, measured="probed")

    decision = resolve(
        Situation(NO_AMX, smollm2_run(200), "buildable"), probe=probe, build=build, say=said.append
    )
    assert done == ["build", "probe"] and decision.backend == "vllm"
    assert said[0].startswith("generator: building") and said[1].startswith("generator: measuring")

    def failing_probe() -> Rates:
        raise RuntimeError("the engine did not start")

    failed = resolve(
        Situation(NO_AMX, smollm2_run(200), "ready"), probe=failing_probe, build=build, say=said.append
    )
    assert failed.backend == "hf" and "the engine did not start" in failed.reason
    unbuilt = resolve(
        Situation(NO_AMX, smollm2_run(200), "buildable"), probe=probe, build=lambda: False, say=said.append
    )
    assert unbuilt.backend == "hf" and "not installed" in unbuilt.reason


def test_the_priors_predict_the_decode_rates_they_were_measured_at() -> None:
    # 34 GFLOP/s on one thread, 2 x 135M FLOPs a token: the hf generator's 126 tokens/s on the 2-core EPYC.
    rates = prior_rates(NO_AMX, smollm2_run(1), prior(NO_AMX, "bfloat16").vllm_ratio)
    assert rates.hf_tokens_per_s == pytest.approx(126, rel=0.01)
    assert rates.ratio == pytest.approx(2.4)
    assert prior(AVX2, "bfloat16").vllm_ratio is None
    flagged = Hardware(
        cuda=False, cpu_model="AMD EPYC", cores=2, avx512_bf16=True, flags=("avx2", "avx512_bf16")
    )
    assert flagged.describe() == "CPU: AMD EPYC, 2 cores, flags avx2 avx512_bf16"


def test_model_parameters_are_read_from_the_safetensors_headers(tiny_model_dir) -> None:
    from safetensors import safe_open

    stored = 0
    for path in tiny_model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            stored += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (not a dict: no __iter__)
    assert stored > 0 and model_parameters(tiny_model_dir) == stored


def test_the_probe_cache_keeps_each_machine_and_models_rates(tmp_path) -> None:
    cache = ProbeCache(tmp_path)
    assert cache.get("a") is None
    cache.put("a", Rates(80.0, 200.0, measured="probed"))
    cache.put("b", Rates(90.0, 90.0))
    assert ProbeCache(tmp_path).get("a") == Rates(80.0, 200.0, measured="probed")
    assert set(json.loads((tmp_path / "generator_probes.json").read_text())) == {"a", "b"}
    (tmp_path / "generator_probes.json").write_text("{ half a file")
    assert ProbeCache(tmp_path).get("a") is None  # a broken cache is an empty one: the probe runs again
