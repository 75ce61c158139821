"""What a mixture-of-experts model costs beyond its active parameters.

- Weights read per decoding step: a batch of b tokens routes each to k of E experts per layer, so it
  touches E (1 - (1 - k / E)^b) distinct experts on average (uniform routing): one token reads about
  k experts, a large batch reads them all. Attention, router and output head are read whole.
- Expert all-to-all: with experts spread over `ep` devices, every MoE layer sends each token's hidden
  state to the devices of its k experts and brings the results back (dispatch and combine); a share
  (ep - 1) / ep of it leaves the device. Training pays it in the forward pass, the recomputation
  (activation checkpointing) and the backward pass.
- Routing replay (R3, arXiv 2510.11370): the generator records the top-k expert ids of every token in
  every MoE layer and the trainer replays them, so the rollouts carry tokens x layers x k ids (one byte
  each up to 256 experts, two beyond).

Dense models (`experts == 0`) cost nothing here: `decode_read_params` is `matmul_params`, and the
all-to-all and replay bytes are zero.
"""

from __future__ import annotations

from llamarl.sim.hardware import Efficiency, GpuSpec
from llamarl.sim.models import ModelSpec

ACTIVATION_BYTES = 2  # bf16 hidden states on the wire


def experts_touched(model: ModelSpec, tokens: float) -> float:
    """Expected distinct experts one layer uses for `tokens` tokens (uniform top-k routing)."""
    if not model.is_moe or tokens <= 0:
        return 0.0
    miss = (1.0 - model.experts_per_token / model.experts) ** tokens
    return model.experts * (1.0 - miss)


def decode_read_params(model: ModelSpec, tokens: float) -> float:
    """Matmul parameters one decoding step of `tokens` sequences reads (all of them when dense)."""
    if not model.is_moe:
        return model.matmul_params
    untouched = model.experts - experts_touched(model, tokens)
    return model.matmul_params - model.layers * untouched * model.expert_params


def all_to_all_s(model: ModelSpec, tokens: float, ep: int, bandwidth: float, latency_s: float) -> float:
    """Seconds of one MoE layer's dispatch and combine for `tokens` tokens on one of `ep` devices."""
    if not model.is_moe or ep <= 1 or tokens <= 0:
        return 0.0
    leaving = tokens * model.experts_per_token * model.hidden * ACTIVATION_BYTES * (ep - 1) / ep
    return 2 * (latency_s + leaving / bandwidth)


def train_all_to_all_s(model: ModelSpec, tokens: float, gpus: int, gpu: GpuSpec, eff: Efficiency) -> float:
    """Seconds a training step spends in expert all-to-alls, not overlapped with compute (a stated
    choice): `tokens` spread over `gpus` devices, experts over the devices of a node (expert
    parallelism inside NVLink), three passes per layer (forward, recomputation, backward)."""
    if not model.is_moe:
        return 0.0
    ep = min(model.experts, gpu.gpus_per_node, gpus)
    bandwidth = gpu.link_bandwidth(crosses_nodes=False) * eff.link_eff
    per_layer = all_to_all_s(model, tokens / gpus, ep, bandwidth, eff.allreduce_latency_intra_us * 1e-6)
    return 3 * model.layers * per_layer


def routing_replay_bytes(model: ModelSpec, tokens: float) -> float:
    """Bytes of the recorded top-k expert ids of `tokens` tokens (routing replay)."""
    if not model.is_moe:
        return 0.0
    id_bytes = 1 if model.experts <= 256 else 2
    return tokens * model.layers * model.experts_per_token * id_bytes
