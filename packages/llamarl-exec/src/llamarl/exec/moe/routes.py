"""Routing replay for mixture-of-experts policies: record the experts each token went to, replay them.

The generator and the trainer route every token to its top-k experts separately; tiny numerical
differences (bf16 decoding against the trainer's own kernels, a KV cache against a full forward) flip
top-k choices, and the trainer then scores a sampled token through experts that never produced it
(about 10% of router decisions on Qwen3-30B-A3B). Routing replay ("R3", rollout routing replay) has the
generator record each token's experts in every MoE layer and the trainer use those instead of its own,
while the router still gets its gradient through the probabilities of the replayed experts.

Routers handled: the softmax top-k routers of transformers' Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE
(`ROUTER_NORMALISES`): each is a module `mlp.gate` whose forward returns (logits [N, E], scores [N, K],
experts [N, K]). A MoE whose router is of another kind (sigmoid, grouped, biased: DeepSeek-V3, GLM)
has no recorder here, and a run with it stops before any rank starts (`check_routing`).

Shape legend:
    N  tokens of one forward (its batch x sequence positions, in the input's order)
    L  MoE layers (routers, in model order), K  experts per token, E  experts
Stored routes are uint8 (int16 above 255 experts) with `NO_ROUTE` where a position has none (padding, a
multi-turn episode's environment tokens, a completion's last token, which is never fed back); the trainer
routes such positions itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

ROUTER_NORMALISES: dict[str, Callable[[torch.nn.Module], bool]] = {
    "MixtralTopKRouter": lambda router: True,
    "Qwen2MoeTopKRouter": lambda router: bool(router.norm_topk_prob),
    "Qwen3MoeTopKRouter": lambda router: bool(router.norm_topk_prob),
    "OlmoeTopKRouter": lambda router: bool(router.norm_topk_prob),
}
"""Router classes whose choices can be recorded and replayed, by class name -> whether the router
renormalises its top-k probabilities to sum to one (what replay must then do too)."""

_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def num_experts(config: Any) -> int:
    """Routed experts per MoE layer of a transformers config (0 for a dense model)."""
    for key in _EXPERT_COUNT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def router_class_names(architecture: str) -> list[str]:
    """The router classes transformers' module of `architecture` (e.g. "MixtralForCausalLM") defines,
    read from its source (importing a modeling module costs seconds, before any rank starts)."""
    import importlib.util
    import re

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = next(
        (t for t, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if name == architecture), None
    )
    if model_type is None:
        return []
    spec = importlib.util.find_spec(f"transformers.models.{model_type}.modeling_{model_type}")
    if spec is None or spec.origin is None:
        return []
    with open(spec.origin, encoding="utf-8") as source:
        return re.findall(r"^class (\w+Router)\b", source.read(), flags=re.MULTILINE)


def check_routing(config: Any, replay: str, *, model: str) -> str | None:
    """Raises ValueError (one line) for `algorithm.routing_replay` (`replay`: auto, off or r3) that
    cannot work with `config`: replay asked of a dense model, a MoE whose router has no recorder here.
    Returns "r3" or None: what the run does."""
    if not num_experts(config):
        if replay == "r3":
            raise ValueError(
                f"algorithm.routing_replay r3: {model} is not a mixture of experts (nothing to replay)"
            )
        return None
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    routers = router_class_names(architecture)
    if replay != "off" and (not routers or any(name not in ROUTER_NORMALISES for name in routers)):
        known = ", ".join(sorted(n.removesuffix("TopKRouter") for n in ROUTER_NORMALISES))
        raise ValueError(
            f"{model}: {architecture}'s router has no route recorder here (recorded: {known}); "
            "pass --algorithm.routing-replay off to train it without routing replay"
        )
    return None if replay == "off" else "r3"


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's recordable routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_NORMALISES]


def route_dtype(experts: int) -> torch.dtype:
    """The stored routes' dtype: uint8 up to 255 experts (255 is `NO_ROUTE`), else int16."""
    return torch.uint8 if experts < 255 else torch.int16


def no_route(dtype: torch.dtype) -> int:
    """The stored value of a position without a route (`NO_ROUTE` in that dtype)."""
    return 255 if dtype == torch.uint8 else -1


NO_ROUTE = -1
"""A position without a route, once read (`read_routes`)."""


def read_routes(stored: torch.Tensor) -> torch.Tensor:
    """int64 routes from stored ones, `NO_ROUTE` (-1) where there is none."""
    routes = stored.long()
    if stored.dtype == torch.uint8:
        routes[routes == 255] = NO_ROUTE
    return routes


def blank_routes(*leading: int, layers: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored routes [*leading, L, K] with no route anywhere."""
    return torch.full((*leading, layers, top_k), no_route(dtype), dtype=dtype)


class RouteRecorder:
    """Records every router's chosen experts ([N, K] per call) while `recording()` is open."""

    def __init__(self, routers: list[torch.nn.Module], experts: int) -> None:
        self.routers = routers
        self.dtype = route_dtype(experts)
        self._calls: list[list[torch.Tensor]] = [[] for _ in routers]

    @contextmanager
    def recording(self) -> Iterator[RouteRecorder]:
        """Records the routers' choices of the forwards run inside; `forwards()` reads them."""
        self._calls = [[] for _ in self.routers]
        handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, layer: int) -> Callable[..., None]:
        def record(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> None:
            self._calls[layer].append(output[2].detach().to(self.dtype))

        return record

    def forwards(self) -> list[torch.Tensor]:
        """Stored routes [N, L, K] of each forward recorded, in order (every router runs once in each)."""
        count = min(len(calls) for calls in self._calls)
        return [torch.stack([calls[i] for calls in self._calls], 1).cpu() for i in range(count)]


@dataclass
class RouteCounts:
    """Tokens whose recorded routes were compared with the trainer's own, and those that differ in at
    least one layer."""

    compared: int = 0
    differing: int = 0


class RouterLoad:
    """How a forward's tokens loaded the experts, over every MoE layer, for the load-balancing loss:
    E x sum_e f_e P_e, f_e the share of (token, k) choices that went to expert e and P_e its mean router
    probability (transformers' `load_balancing_loss_func`, over the experts actually used: the
    replayed ones under replay). P_e carries the router's gradient."""

    def __init__(self) -> None:
        self.chosen_E: torch.Tensor | None = None  # choices per expert, summed over layers
        self.probs_E: torch.Tensor | None = None  # router probabilities, summed over layers and tokens
        self.tokens = 0  # tokens, summed over layers

    def add(self, probs_NE: torch.Tensor, chosen_NK: torch.Tensor) -> None:
        counts_E = torch.bincount(chosen_NK.reshape(-1), minlength=probs_NE.shape[1]).to(probs_NE.dtype)
        probs_E = probs_NE.sum(0)
        self.chosen_E = counts_E if self.chosen_E is None else self.chosen_E + counts_E
        self.probs_E = probs_E if self.probs_E is None else self.probs_E + probs_E
        self.tokens += probs_NE.shape[0]

    def loss(self) -> torch.Tensor | None:
        """The load-balancing loss (a scalar with the routers' gradient), None when nothing was routed."""
        if self.probs_E is None or not self.tokens:
            return None
        experts = self.probs_E.shape[0]
        return experts * ((self.chosen_E / self.tokens) * (self.probs_E / self.tokens)).sum()


class RouteReplay:
    """Replays recorded routes in a model's routers (the trainer's), from the next forward on.

    `set(routes_NLK, counted_N)` before a forward: each router then uses the recorded experts of every
    position that has them (its own choice where `NO_ROUTE`), with scores from its own softmax at those
    experts, so the router keeps its gradient. The routes stay set until the next `set`, so the
    recompute of an activation-checkpointed layer in backward replays the same ones. With
    `replaying=False` the routers route themselves and only the comparison is made. Positions in
    `counted_N` (the sampled tokens) count towards `counts`: recorded, and recorded but not what this
    model chose in at least one layer. With `measures_load`, the forwards after a `set` also add to the
    `RouterLoad` that `take_load` hands over (a recompute in backward, after it, adds nothing: it was
    counted once).
    """

    def __init__(self, model: torch.nn.Module, *, replaying: bool, measures_load: bool = True) -> None:
        self.routers = find_routers(model)
        self.replaying = replaying
        self.measures_load = measures_load
        self.counts = RouteCounts()
        self._routes_NLK: torch.Tensor | None = None
        self._counted_N: torch.Tensor | None = None
        self._differs_N: torch.Tensor | None = None
        self._load: RouterLoad | None = None  # collecting since the last `set`, until `take_load`
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def set(self, routes_NLK: torch.Tensor | None, counted_N: torch.Tensor | None = None) -> None:
        """Routes for the next forward (read: int64, `NO_ROUTE` where none; None: route naturally), and
        which of its positions count towards `counts` (default: every recorded one)."""
        self._tally()
        if routes_NLK is not None and routes_NLK.shape[1] != len(self.routers):
            raise ValueError(
                f"routes of {routes_NLK.shape[1]} MoE layers given to a model with {len(self.routers)}"
            )
        self._routes_NLK = routes_NLK
        self._counted_N = counted_N
        self._differs_N = None
        if self._load is None and self.measures_load:
            self._load = RouterLoad()

    def take_load(self) -> RouterLoad:
        """How the forwards since the last `take_load` loaded the experts; later ones (until the next
        `set`) are not collected."""
        load, self._load = self._load or RouterLoad(), None
        return load

    def take_counts(self) -> RouteCounts:
        """The counts since the last `take_counts` (the last forward's included)."""
        self._tally()
        counts, self.counts = self.counts, RouteCounts()
        return counts

    def _tally(self) -> None:
        if self._differs_N is None or self._routes_NLK is None:
            return
        recorded_N = (self._routes_NLK[:, 0, 0] >= 0).cpu()
        if self._counted_N is not None:
            recorded_N &= self._counted_N.cpu().bool()
        self.counts.compared += int(recorded_N.sum())
        self.counts.differing += int((recorded_N & self._differs_N.cpu()).sum())
        self._differs_N = None

    def _hook(self, layer: int) -> Callable[..., tuple[torch.Tensor, ...] | None]:
        def replay(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, ...]):
            logits_NE, scores_NK, natural_NK = output
            replaced_N, wanted_NK = self._compare(layer, natural_NK)
            replacing = replaced_N is not None and self.replaying and bool(replaced_N.any())
            # (decided by settings, not by whether a load is being collected: an activation-checkpointed
            # layer's recompute must save the same tensors for backward as its forward did)
            if not replacing and not self.measures_load:
                return None  # the router's own output, bitwise (its own float steps)
            chosen_NK = torch.where(replaced_N[:, None], wanted_NK, natural_NK) if replacing else natural_NK
            probs_NE = torch.softmax(logits_NE.float(), dim=-1)
            if self._load is not None:
                self._load.add(probs_NE, chosen_NK)
            if not replacing:
                return None
            top_NK = probs_NE.gather(-1, chosen_NK)
            if ROUTER_NORMALISES[type(module).__name__](module):
                top_NK = top_NK / top_NK.sum(-1, keepdim=True)
            # Tokens whose recorded experts are the router's own keep its scores, bit for bit.
            scores_NK = torch.where(replaced_N[:, None], top_NK.to(scores_NK.dtype), scores_NK)
            return logits_NE, scores_NK, chosen_NK

        return replay

    def _compare(
        self, layer: int, natural_NK: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Which of the forward's tokens have recorded experts other than the router's own choice in
        `layer` ([N] bool; the same experts in another order are the same routing), and those recorded
        experts ([N, K]); (None, None) without routes. Counted on the way (`counts`)."""
        routes_NLK = self._routes_NLK
        if routes_NLK is None:
            return None, None
        if routes_NLK.shape[0] != natural_NK.shape[0]:
            raise ValueError(
                f"routes for {routes_NLK.shape[0]} tokens replayed on a forward of {natural_NK.shape[0]}"
            )
        wanted_NK = routes_NLK[:, layer].to(natural_NK.device)
        recorded_N = wanted_NK[:, 0] >= 0
        with torch.no_grad():
            differs_N = (wanted_NK.sort(-1).values != natural_NK.sort(-1).values).any(-1) & recorded_N
            self._differs_N = differs_N if self._differs_N is None else self._differs_N | differs_N
        return differs_N, wanted_NK
