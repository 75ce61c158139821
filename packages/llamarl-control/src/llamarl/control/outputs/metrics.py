"""Metrics on the logging rank: W&B (offline without an API key), a JSONL file and a progress bar."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from tqdm import tqdm


def _wandb_mode() -> str:
    # An explicit WANDB_MODE wins; without an API key nothing can reach the server, so stay offline.
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class MetricsLogger:
    """Writes each step's metrics to OUTPUT_DIR/metrics.jsonl, to W&B, and to a console progress bar."""

    def __init__(
        self,
        *,
        output_dir: Path,
        total_steps: int,
        config: dict[str, Any],
        wandb_project: str | None,
        wandb_id: str | None = None,
        initial_step: int = 0,
    ) -> None:
        """`wandb_id` continues that W&B run (a resumed job); `initial_step` starts the progress bar."""
        self.output_dir = output_dir
        self._jsonl = (output_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self._bar = tqdm(
            total=total_steps, initial=initial_step, desc="rl steps", unit="step", dynamic_ncols=True
        )
        self._wandb_run = None
        if wandb_project:
            self._wandb_run = _start_wandb(wandb_project, output_dir, config, wandb_id)

    @property
    def wandb_id(self) -> str | None:
        """The W&B run id (saved in checkpoints so that a resumed job continues the same run)."""
        return None if self._wandb_run is None else str(self._wandb_run.id)

    def jsonl_bytes(self) -> int:
        """The length of metrics.jsonl so far (a resumed job cuts it back to this)."""
        self._jsonl.flush()
        return self._jsonl.tell()

    @property
    def wandb_dir(self) -> str | None:
        return None if self._wandb_run is None else str(self._wandb_run.dir)

    def log(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        """Records `metrics` for `step`; `advance` moves the progress bar by one step."""
        clean = {k: float(v) for k, v in metrics.items() if v is not None and not math.isnan(float(v))}
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(clean, step=step)
        if advance:
            shown = {
                "reward": clean.get("train/reward_mean"),
                "step_s": clean.get("time/step_s"),
                "gen_tok/s": clean.get("throughput/generated_tokens_per_s"),
                "lag": clean.get("policy/lag"),
            }
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items() if v is not None}, refresh=False)
            self._bar.update(1)

    def write(self, message: str) -> None:
        """Prints a line above the progress bar."""
        self._bar.write(message)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self._bar.close()
        self._jsonl.close()
        if self._wandb_run is not None:
            if summary:
                for key, value in summary.items():
                    self._wandb_run.summary[key] = value
            self._wandb_run.finish()
            self._wandb_run = None


def _start_wandb(project: str, output_dir: Path, config: dict[str, Any], run_id: str | None):
    import wandb  # heavy import, only on the logging rank

    return wandb.init(
        project=project,
        dir=str(output_dir),
        config=config,
        id=run_id,
        resume="allow" if run_id else None,
        mode=_wandb_mode(),
        settings=wandb.Settings(console="off", silent=True),
    )
