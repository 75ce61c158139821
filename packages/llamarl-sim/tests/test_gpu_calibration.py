"""The GPU calibration of `from-run`: synthetic traces made from known efficiencies are fitted back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamarl.sim import gpu_calibration as gc
from llamarl.sim.cli import main
from llamarl.sim.hardware import GpuSpec
from llamarl.sim.models import ModelSpec
from llamarl.sim.training import train_flops

SHAPE = {
    "layers": 12,
    "hidden": 1024,
    "heads": 16,
    "kv_heads": 8,
    "head_dim": 64,
    "ffn": 2816,
    "vocab": 32000,
}
MODEL = gc.model_of(SHAPE)
GPU = GpuSpec()


def synthetic_trace(*, bandwidth_eff: float, eager_us: float, mfu: float, graphs: bool = True) -> dict:
    """Step times as a device with these efficiencies would give them (graphs cost the stated 5 us)."""
    weights_s = MODEL.matmul_params * 2 / GPU.memory_bandwidth / bandwidth_eff
    per_row_s = 2e-5
    decode = []
    for batch in (1, 8, 32, 64):
        decode.append(
            {
                "mode": "eager",
                "batch": batch,
                "context": 256,
                "step_s": weights_s + 12 * eager_us * 1e-6 + per_row_s * batch,
            }
        )
        if graphs:
            decode.append(
                {
                    "mode": "graphs",
                    "batch": batch,
                    "context": 264,
                    "step_s": weights_s + 12 * 5e-6 + per_row_s * batch,
                }
            )
    flops = train_flops(MODEL, 64, [192] * 16)
    train = [
        {
            "sequences": 16,
            "prompt_tokens": 64,
            "completion_tokens": 192,
            "step_s": flops / (GPU.bf16_tflops * 1e12 * mfu),
        }
    ]
    return {
        "format": gc.TRACE_FORMAT,
        "device": "NVIDIA H100 80GB HBM3",
        "model": SHAPE,
        "decode": decode,
        "train": train,
    }


def test_a_line_is_fitted_exactly_through_points_on_it() -> None:
    fit = gc.fit_line([(1, 3.0), (2, 5.0), (4, 9.0)])
    assert fit.intercept_s == pytest.approx(1.0) and fit.slope_s == pytest.approx(2.0) and fit.points == 3
    with pytest.raises(gc.TraceError, match="two batch sizes"):
        gc.fit_line([(8, 1.0), (8, 1.1)])


def test_bandwidth_eager_launch_cost_and_mfu_come_back_from_a_synthetic_trace() -> None:
    cal = gc.calibrate(synthetic_trace(bandwidth_eff=0.6, eager_us=150.0, mfu=0.33))
    assert cal.gpu.name.startswith("H100") and cal.model == MODEL
    assert cal.fitted["decode_bandwidth_eff"] == pytest.approx(0.6)
    assert cal.fitted["eager_layer_overhead_us"] == pytest.approx(150.0)
    assert cal.fitted["train_mfu"] == pytest.approx(0.33)
    assert cal.decode["eager"].slope_s == pytest.approx(2e-5)
    eff = cal.efficiency()
    assert eff.train_mfu == pytest.approx(0.33) and eff.layer_overhead_us == 5.0  # unfitted fields stay
    assert "--efficiency.train-mfu 0.33" in cal.flags()


def test_without_graphs_the_bandwidth_stays_stated_and_the_eager_cost_uses_it() -> None:
    cal = gc.calibrate(synthetic_trace(bandwidth_eff=0.75, eager_us=90.0, mfu=0.2, graphs=False))
    assert "decode_bandwidth_eff" not in cal.fitted
    assert cal.fitted["eager_layer_overhead_us"] == pytest.approx(90.0)  # 0.75 is the stated bandwidth
    assert any("no CUDA-graph series" in note for note in cal.notes)


def test_the_device_is_recognised_by_name() -> None:
    assert gc.gpu_named("NVIDIA H200").name.startswith("H200")
    assert gc.gpu_named("NVIDIA H800").nvlink_gbs == 200.0
    assert gc.gpu_named("cpu").name.startswith("H100")  # the default datasheet


def test_a_bad_trace_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / gc.TRACE_NAME
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(gc.TraceError, match="expected 'llamarl-gpu-trace/1'"):
        gc.read_trace(path)
    with pytest.raises(gc.TraceError, match="model shape lacks"):
        gc.model_of({"layers": 2})


def test_from_run_on_a_gpu_check_folder_prints_the_calibration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / gc.TRACE_NAME).write_text(
        json.dumps(synthetic_trace(bandwidth_eff=0.7, eager_us=120.0, mfu=0.3))
    )
    assert main(["from-run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| efficiency.train_mfu | 0.4 | 0.3 |" in out and "--efficiency.decode-bandwidth-eff 0.7" in out


def test_model_of_matches_a_model_spec() -> None:
    assert ModelSpec("traced", 12, 1024, 16, 8, 64, 2816, 32000) == MODEL
