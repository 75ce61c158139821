"""The precision settings resolved for the device: bf16 exactly where the hardware computes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llamarl.control.config import RunConfig
from llamarl.control.launch.devices import (
    bf16_is_fast,
    resolve_precision,
    trainer_compute_dtype,
    weight_wire_dtype,
)

CPU = torch.device("cpu")


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (an independent source from torch's probes)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    pytest.fail("/proc/cpuinfo lists no flags")


def test_bf16_is_detected_from_the_cpu_flags():
    flags = _cpu_flags()
    assert bf16_is_fast(CPU) == bool({"avx512_bf16", "amx_bf16"} & flags)


def test_auto_is_bf16_where_fast_and_explicit_settings_win():
    expected = "bfloat16" if bf16_is_fast(CPU) else "float32"
    assert resolve_precision("auto", CPU) == expected
    assert resolve_precision("bf16", CPU) == "bfloat16" and resolve_precision("fp32", CPU) == "float32"
    assert trainer_compute_dtype("fp32", CPU) is None and trainer_compute_dtype("bf16", CPU) == "bfloat16"
    assert weight_wire_dtype("bfloat16") == torch.bfloat16 and weight_wire_dtype("float32") is None


def test_precision_is_a_setting_of_both_sections_defaulting_to_auto():
    config = RunConfig(task="gsm8k")
    assert config.trainer.precision == "auto" and config.generator.precision == "auto"
    with pytest.raises(ValueError, match="precision"):
        RunConfig(task="gsm8k", trainer={"precision": "fp16"})


def test_lora_is_a_nested_trainer_setting_and_refused_with_vllm_in_one_line():
    from llamarl.control.cli import parse_run_config
    from llamarl.control.config import ConfigError

    config = parse_run_config(
        ["--trainer.lora.rank", "8", "--trainer.lora.targets", '["q_proj","v_proj"]'],
        task="gsm8k",
        prog="gsm8k_rl",
        description="",
    )
    assert config.trainer.lora.rank == 8 and config.trainer.lora.targets == ["q_proj", "v_proj"]
    assert config.trainer.lora.scale_alpha == 16
    with pytest.raises(ConfigError, match=r"trainer\.lora\.rank > 0 needs generator\.backend hf"):
        parse_run_config(
            ["--trainer.lora.rank", "8", "--generator", "vllm"], task="gsm8k", prog="gsm8k_rl", description=""
        )


def test_compile_on_is_refused_with_several_trainer_ranks_in_one_line():
    from llamarl.control.cli import parse_run_config
    from llamarl.control.config import ConfigError

    config = parse_run_config(["--trainer.compile", "off"], task="gsm8k", prog="gsm8k_rl", description="")
    assert config.trainer.compile == "off"
    with pytest.raises(ConfigError, match=r"trainer\.compile on is not supported with FSDP2"):
        parse_run_config(
            ["--trainer.compile", "on", "--ranks.num-trainers", "2"],
            task="gsm8k",
            prog="gsm8k_rl",
            description="",
        )
