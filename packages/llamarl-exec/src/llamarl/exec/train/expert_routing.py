"""A mixture of experts in the trainer: routing replay on the policy and its KL reference, the step's
routing figures, and the routers' load-balancing loss.

The hooks themselves are `llamarl.exec.moe.routes.RouteReplay`; `PolicyLogprobs` lays the recorded routes
out for each forward of a model that has one (`replays`). The reference replays the same routes as the
policy, so that its KL term compares weights, not routes (without it an untouched policy showed a
nonzero KL: prompt positions routed apart by bf16).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llamarl.exec.config import AlgorithmConfig
from llamarl.exec.moe.routes import RouteReplay, find_routers
from llamarl.exec.train.parallel import all_reduce_sum


class ExpertRouting:
    """The trainer's routers: `replays` for `PolicyLogprobs`, a step's figures and loss terms."""

    def __init__(
        self, policy: torch.nn.Module, reference: torch.nn.Module | None, algorithm: AlgorithmConfig
    ) -> None:
        replaying = algorithm.routing_replay != "off"
        self.aux_coef = algorithm.router_aux_coef
        self.policy = RouteReplay(policy, replaying=replaying)
        self.replays = {policy: self.policy}
        if reference is not None:
            # (no load-balancing loss of a model that never trains)
            self.replays[reference] = RouteReplay(reference, replaying=replaying, measures_load=False)

    @classmethod
    def of(
        cls, policy: torch.nn.Module, reference: torch.nn.Module | None, algorithm: AlgorithmConfig
    ) -> ExpertRouting | None:
        """The routing of a mixture of experts; None for a dense model."""
        return cls(policy, reference, algorithm) if find_routers(policy) else None

    def start_step(self) -> None:
        """Forgets what forwards before this step counted (compute_logprobs, a check)."""
        self.policy.take_counts()
        self.policy.take_load()

    def add_load(
        self,
        loss: torch.Tensor,
        loss_metrics: dict[str, torch.Tensor],
        micro_tokens: int,
        num_valid_tokens: int,
    ) -> torch.Tensor:
        """The micro-batch's load-balancing loss into its metrics (router_aux_loss, averaged over the
        step's tokens like the others) and, weighted by `router_aux_coef` and the micro-batch's share
        of the step's tokens (`micro_tokens` of `num_valid_tokens`), into its `loss`."""
        aux = self.policy.take_load().loss()
        if aux is None:
            return loss
        loss_metrics["router_aux_loss"] = aux.detach()
        if not self.aux_coef:
            return loss
        return loss + self.aux_coef * (micro_tokens / max(num_valid_tokens, 1)) * aux

    def step_metrics(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """routing_mismatch: the sampled tokens whose experts here differed from the generator's in some
        layer (before replay), over every trainer rank; nan when the batch carried no routes."""
        counts = self.policy.take_counts()
        compared, differing = all_reduce_sum([counts.compared, counts.differing], group)
        return {"routing_mismatch": differing / compared if compared else float("nan")}
