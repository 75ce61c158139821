"""What device failures cost: a restart from the last checkpoint against trainer replica recovery.

At a stated failure rate (default: Llama 3 405B pretraining saw 419 unexpected interruptions in 54
days on 16,384 GPUs; "The Llama 3 Herd of Models", section 3.3.4) a cluster of N devices fails every
1 / (rate x N) seconds on average.

- Restart from the last checkpoint: the whole job stops, restarts (`restart_s`: reschedule, load the
  checkpoint, start the engines) and redoes the work since the last checkpoint, half an interval on
  average; checkpoints every sqrt(2 x save x MTBF) seconds (Young's interval, which minimises the
  two costs together), each costing `checkpoint_save_s`.
- Trainer replica recovery (torchft-style: the trainer is `replicas` data-parallel groups, a quorum
  per step): a failure in a trainer replica loses that replica's share of the step in progress; the
  others commit without it while a replacement starts (`rejoin_s`) and heals from a live peer's state
  (its shard of weights, gradients and optimizer state over the network). A failure in a generator
  replica loses its share of the step's generation while it restarts. No job-wide restart, no
  checkpoint on the critical path (checkpoints still go to storage, off the step).

Both are reported as seconds of whole-cluster time lost per failure and as a share of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, Field

from llamarl.sim.hardware import Efficiency, GpuSpec
from llamarl.sim.models import ModelSpec


class FailureModel(BaseModel):
    """The failure rate and what each way of recovering takes (stated inputs)."""

    interruptions: float = Field(
        419, gt=0, description="unexpected interruptions observed (Llama 3 405B pretraining, 54 days)"
    )
    days: float = Field(54, gt=0, description="over this many days")
    observed_gpus: int = Field(16384, ge=1, description="on this many devices")
    restart_s: float = Field(
        600, ge=0, description="a job restart: reschedule, load the checkpoint, start engines (s)"
    )
    checkpoint_save_s: float = Field(
        30, ge=0, description="writing one sharded checkpoint, training paused (s)"
    )
    rejoin_s: float = Field(
        120, ge=0, description="a replacement replica's start (process, CUDA, communicators, engine) (s)"
    )

    @property
    def per_device_s(self) -> float:
        """Failures per device-second."""
        return self.interruptions / (self.days * 86400 * self.observed_gpus)


@dataclass(frozen=True)
class RecoveryCost:
    """Expected losses of one cluster under one failure model."""

    mtbf_s: float  # mean time between failures of the whole cluster
    checkpoint_every_s: float  # Young's interval
    restart_lost_s: float  # per failure, whole-cluster seconds, restart from the last checkpoint
    restart_share: float  # of the run, checkpoint writes included
    replica_lost_s: float  # per failure, whole-cluster seconds, replica recovery
    replica_share: float
    heal_s: float  # a replacement trainer replica copying a live peer's state


def recovery_cost(
    model: ModelSpec,
    *,
    trainer_gpus: int,
    generator_gpus: int,
    trainer_replicas: int,
    generator_replicas: int,
    step_s: float,
    gpu: GpuSpec,
    eff: Efficiency,
    failures: FailureModel,
) -> RecoveryCost:
    """Losses per failure and over a run for a cluster of `trainer_gpus + generator_gpus` devices whose
    steps take `step_s`, its trainer split into `trainer_replicas` data-parallel replicas and its
    generators into `generator_replicas`."""
    devices = trainer_gpus + generator_gpus
    mtbf = 1.0 / (failures.per_device_s * devices)
    every = math.sqrt(2 * failures.checkpoint_save_s * mtbf) if failures.checkpoint_save_s else step_s
    restart_lost = failures.restart_s + every / 2
    restart_share = failures.checkpoint_save_s / every + restart_lost / mtbf
    # A replacement trainer replica copies one shard of state from its peer, every device at once.
    replica_gpus = trainer_gpus / trainer_replicas
    state = model.params * eff.trainer_bytes_per_param / replica_gpus
    heal = state / (gpu.link_bandwidth(crosses_nodes=True) * eff.link_eff)
    # Whichever replica fails, it is out for the step in progress and its restart; the cluster loses
    # its share of the work meanwhile (a generator replica's share of the generators, a trainer
    # replica's of the trainer), weighted by where the failing device sits.
    trainer_loss = (step_s + failures.rejoin_s + heal) / trainer_replicas
    generator_share = 1.0 / max(1, generator_replicas)
    generator_loss = (step_s + failures.rejoin_s) * generator_share
    replica_lost = (trainer_gpus * trainer_loss + generator_gpus * generator_loss) / devices
    return RecoveryCost(
        mtbf_s=mtbf,
        checkpoint_every_s=every,
        restart_lost_s=restart_lost,
        restart_share=restart_share,
        replica_lost_s=replica_lost,
        replica_share=replica_lost / mtbf,
        heal_s=heal,
    )


def describe(cost: RecoveryCost, failures: FailureModel, trainer_replicas: int) -> list[str]:
    """Lines for `plan`: the failure rate, then each way of recovering."""
    per_hours = 1.0 / (failures.per_device_s * 3600)
    return [
        f"  Failures: {failures.interruptions:g} in {failures.days:g} days on {failures.observed_gpus} "
        f"devices (Llama 3 405B pretraining) is one per {per_hours:,.0f} device-hours: one every "
        f"{cost.mtbf_s / 3600:.1f} h on this cluster.",
        f"  Restart from the last checkpoint: {cost.restart_lost_s:.0f} s lost per failure "
        f"({failures.restart_s:.0f} s restart + half of a {cost.checkpoint_every_s / 60:.0f}-minute "
        f"checkpoint interval); {cost.restart_share:.3%} of the run with the checkpoint writes.",
        f"  Trainer replica recovery ({trainer_replicas} replicas, a replacement heals from a live peer in "
        f"{cost.heal_s:.1f} s after a {failures.rejoin_s:.0f} s start): {cost.replica_lost_s:.0f} s of "
        f"whole-cluster time per failure; {cost.replica_share:.3%} of the run.",
    ]
