"""Calibrate the GPU efficiencies from a trace of a GPU run (what `tools/gpu_check.py` writes).

`from-run` on a CPU run calibrates host figures only; everything `paper` and `plan` assume about a GPU
(`Efficiency`) is a stated guess until a GPU run measures it. A trace (`gpu_trace.json`, format
`llamarl-gpu-trace/1`) holds the model's shape, decoding steps timed at several batch sizes (eager,
and with CUDA graphs where they were captured) and timed training steps. From it:

- decode time against batch, per launch mode: a straight line t(b) = a + k b fitted by least
  squares. With CUDA graphs, a is reading the weights plus the little launch cost graphs leave
  (`layer_overhead_us`, kept as stated: one model size cannot separate the two), which gives
  `decode_bandwidth_eff`; eager minus graphs at batch 0 is the eager launch cost per layer
  (`eager_layer_overhead_us`). Without a graphs series the bandwidth is taken as stated.
- the per-sequence slope k, reported as is (KV reads and matmul rows; at the small batches a check
  can afford it is an upper bound on the compute cost).
- training MFU: the step's FLOPs (`training.train_flops`) over its seconds at the device's bf16 peak.

The fitted figures hold for the traced model on the traced device; a small model reaches a lower MFU
and a larger launch share than the 8B-405B models `paper` prices, so they bound those from below
rather than replace them. The report prints them as flags for `paper` and `plan`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from llamarl.sim.hardware import GPUS, Efficiency, GpuSpec
from llamarl.sim.models import ModelSpec
from llamarl.sim.training import train_flops

TRACE_FORMAT = "llamarl-gpu-trace/1"
TRACE_NAME = "gpu_trace.json"


class TraceError(ValueError):
    """A trace that cannot be read or fitted (the message says why)."""


@dataclass(frozen=True)
class LineFit:
    """t(b) = intercept_s + slope_s x b, fitted to `points` (batch, seconds)."""

    intercept_s: float
    slope_s: float
    points: int


@dataclass
class GpuCalibration:
    """What a trace says about the device, and the `Efficiency` fields it sets."""

    device: str
    gpu: GpuSpec
    model: ModelSpec
    decode: dict[str, LineFit] = field(default_factory=dict)  # by launch mode: eager, graphs
    fitted: dict[str, float] = field(default_factory=dict)  # Efficiency field -> value
    notes: list[str] = field(default_factory=list)

    def efficiency(self, base: Efficiency | None = None) -> Efficiency:
        """`base` (default: the stated assumptions) with the fitted fields replaced."""
        return (base or Efficiency()).model_copy(update=self.fitted)

    def flags(self) -> str:
        """The fitted fields as command-line flags for `paper` and `plan`."""
        return " ".join(f"--efficiency.{k.replace('_', '-')} {v:.4g}" for k, v in self.fitted.items())


def fit_line(points: list[tuple[float, float]]) -> LineFit:
    """Least-squares line through (batch, seconds) points (at least two distinct batches)."""
    if len({b for b, _ in points}) < 2:
        raise TraceError("a decode series needs steps timed at two batch sizes or more")
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    sxx = sum((b - mean_b) ** 2 for b, _ in points)
    sxy = sum((b - mean_b) * (t - mean_t) for b, t in points)
    slope = sxy / sxx
    return LineFit(mean_t - slope * mean_b, slope, n)


def model_of(shape: dict) -> ModelSpec:
    """The traced model's shape (the trace writes the transformers config's numbers)."""
    try:
        return ModelSpec(
            name=str(shape.get("name", "traced")),
            layers=int(shape["layers"]),
            hidden=int(shape["hidden"]),
            heads=int(shape["heads"]),
            kv_heads=int(shape["kv_heads"]),
            head_dim=int(shape["head_dim"]),
            ffn=int(shape["ffn"]),
            vocab=int(shape["vocab"]),
            tied_embeddings=bool(shape.get("tied", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"the trace's model shape lacks {e}") from None


def gpu_named(device: str, default: GpuSpec | None = None) -> GpuSpec:
    """The datasheet of a device by its CUDA name (H100, H200, H800, H20), else `default` or H100."""
    upper = device.upper()
    for key in ("h200", "h800", "h20", "h100"):
        if key.upper() in upper and key in GPUS:
            return GPUS[key]
    return default or GpuSpec()


def read_trace(path: Path) -> dict:
    """A trace file's contents, checked for its format."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no GPU trace")
    data = json.loads(path.read_text())
    if data.get("format") != TRACE_FORMAT:
        raise TraceError(f"{path}: format {data.get('format')!r}, expected {TRACE_FORMAT!r}")
    return data


def calibrate(trace: dict, gpu: GpuSpec | None = None, stated: Efficiency | None = None) -> GpuCalibration:
    """Fits the decode lines and the training MFU of `trace` (see the module doc)."""
    stated = stated or Efficiency()
    device = str(trace.get("device", "unknown device"))
    cal = GpuCalibration(device, gpu or gpu_named(device), model_of(trace.get("model", {})))
    by_mode: dict[str, list[tuple[float, float]]] = {}
    for record in trace.get("decode", []):
        by_mode.setdefault(str(record["mode"]), []).append((float(record["batch"]), float(record["step_s"])))
    for mode, points in sorted(by_mode.items()):
        cal.decode[mode] = fit_line(points)
    _fit_decode(cal, stated)
    _fit_training(cal, trace.get("train", []))
    cal.notes += [str(note) for note in trace.get("notes", [])]
    return cal


def _fit_decode(cal: GpuCalibration, stated: Efficiency) -> None:
    layers = cal.model.layers
    weights_s = cal.model.matmul_params * 2 / cal.gpu.memory_bandwidth  # bf16 at the datasheet rate
    bandwidth_eff = stated.decode_bandwidth_eff
    graphs = cal.decode.get("graphs")
    if graphs is not None:
        reading = graphs.intercept_s - layers * stated.layer_overhead_us * 1e-6
        if reading > 0:
            bandwidth_eff = min(1.0, weights_s / reading)
            cal.fitted["decode_bandwidth_eff"] = bandwidth_eff
        else:
            cal.notes.append(
                "CUDA-graph steps faster than the stated launch cost allows: bandwidth not fitted"
            )
    else:
        cal.notes.append("no CUDA-graph series: decode bandwidth kept as stated")
    eager = cal.decode.get("eager")
    if eager is not None:
        base = graphs.intercept_s if graphs is not None else weights_s / bandwidth_eff
        if graphs is None:
            base += layers * stated.layer_overhead_us * 1e-6
        per_layer_us = 1e6 * (eager.intercept_s - base) / layers + stated.layer_overhead_us
        if per_layer_us > 0:
            cal.fitted["eager_layer_overhead_us"] = per_layer_us


def _fit_training(cal: GpuCalibration, records: list[dict]) -> None:
    mfus = []
    for record in records:
        lengths = [int(record["completion_tokens"])] * int(record["sequences"])
        flops = train_flops(cal.model, int(record["prompt_tokens"]), lengths)
        mfus.append(flops / (float(record["step_s"]) * cal.gpu.peak_flops("bf16")))
    if mfus:
        cal.fitted["train_mfu"] = min(1.0, statistics.median(mfus))
    else:
        cal.notes.append("no timed training step: train MFU kept as stated")


def report(cal: GpuCalibration, stated: Efficiency | None = None) -> list[str]:
    """The calibration's lines for `from-run`."""
    stated = stated or Efficiency()
    lines = [
        f"GPU trace: {cal.device} (datasheet {cal.gpu.name}), model {cal.model.params / 1e6:.1f}M parameters "
        f"({cal.model.layers} layers, hidden {cal.model.hidden})",
    ]
    for mode, fit in cal.decode.items():
        lines.append(
            f"  decode [{mode}]: {1e3 * fit.intercept_s:.2f} ms + {1e3 * fit.slope_s:.3f} ms per sequence "
            f"({fit.points} timed batch sizes)"
        )
    lines.append("  | assumption | stated | fitted |")
    lines.append("  |---|---|---|")
    for name, value in cal.fitted.items():
        lines.append(f"  | efficiency.{name} | {getattr(stated, name):g} | {value:.4g} |")
    lines += [f"  note: {note}" for note in cal.notes]
    lines.append(
        "  These hold for the traced model on the traced device (a small model: lower MFU and a larger "
        "launch share than 8B-405B); as flags: " + (cal.flags() or "(nothing fitted)")
    )
    return lines
