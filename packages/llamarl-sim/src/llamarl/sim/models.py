"""Transformer shapes the simulator prices: parameters, FLOPs per token and KV-cache bytes per token.

Decoder-only models with grouped-query attention and gated MLPs: dense (Llama 3, Qwen2.5, SmolLM2
shapes) or mixture-of-experts (Qwen3 MoE shapes: every layer routes each token to `experts_per_token`
of `experts` gated MLPs). A MoE model stores all its experts (memory, weight sync) but multiplies
each token by the chosen ones only (FLOPs); a decoding step reads the experts its batch touches
(`llamarl.sim.moe`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer (derived sizes are cached: pricing asks for them often)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # width of the gated MLP
    vocab: int
    tied_embeddings: bool = False
    experts: int = 0  # routed experts per layer; 0: a dense model (every layer has the `ffn` MLP)
    experts_per_token: int = 0  # top-k: experts each token goes through in every layer
    expert_ffn: int = 0  # width of one expert's gated MLP

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @cached_property
    def attention_params(self) -> float:
        """q, k, v and o projections of one block."""
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @cached_property
    def expert_params(self) -> float:
        """One expert's gated MLP (three matrices)."""
        return 3 * self.hidden * self.expert_ffn

    @cached_property
    def layer_params(self) -> float:
        """Parameters of one block: attention, a gated MLP (three matrices) or, MoE, every expert and
        the router, two norms."""
        mlp = (
            self.experts * self.expert_params + self.hidden * self.experts
            if self.is_moe
            else 3 * self.hidden * self.ffn
        )
        return self.attention_params + mlp + 2 * self.hidden

    @cached_property
    def active_layer_params(self) -> float:
        """Parameters of one block that multiply a token: MoE blocks count the chosen experts only."""
        if not self.is_moe:
            return self.layer_params
        routed = self.experts_per_token * self.expert_params + self.hidden * self.experts
        return self.attention_params + routed + 2 * self.hidden

    @cached_property
    def params(self) -> float:
        """Every parameter, embeddings included (what memory and a weight sync hold)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params + embeddings + self.hidden

    @cached_property
    def matmul_params(self) -> float:
        """Parameters that multiply tokens (blocks and the output head), all experts included: what a
        decoding step reads when its batch touches every expert.

        The input embedding is a lookup, so it costs no FLOPs and is not read whole per decoding step.
        """
        return self.layers * self.layer_params + self.vocab * self.hidden

    @cached_property
    def active_matmul_params(self) -> float:
        """Parameters that multiply one token: 2 FLOPs each, forward (dense: `matmul_params`)."""
        return self.layers * self.active_layer_params + self.vocab * self.hidden

    def forward_flops_per_token(self, context: float) -> float:
        """FLOPs of one token's forward pass when it attends to `context` earlier tokens on average."""
        attention = 4 * self.layers * self.heads * self.head_dim * context  # QK^T and AV
        return 2 * self.active_matmul_params + attention

    def kv_bytes_per_token(self, bytes_per_value: float) -> float:
        """KV-cache bytes of one token across all layers (keys and values of every KV head)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


# Llama 3.1 shapes (the paper's 8B, 70B, 405B) and SmolLM2-135M (the model runs here use).
LLAMA3_8B = ModelSpec("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256)
LLAMA3_70B = ModelSpec("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256)
LLAMA3_405B = ModelSpec("llama3-405b", 126, 16384, 128, 8, 128, 53248, 128256)
SMOLLM2_135M = ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tied_embeddings=True)
# The out-of-sample cases' models (`others`): Qwen2.5 shapes (q, k, v biases left out: 0.01%).
QWEN25_7B = ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064)
QWEN25_1_5B = ModelSpec("qwen2.5-1.5b", 28, 1536, 12, 2, 128, 8960, 151936)
# Qwen3 MoE shapes: every layer routes each token to 8 of 128 experts.
QWEN3_30B_A3B = ModelSpec(
    "qwen3-30b-a3b", 48, 2048, 32, 4, 128, 0, 151936, experts=128, experts_per_token=8, expert_ffn=768
)
QWEN3_235B_A22B = ModelSpec(
    "qwen3-235b-a22b", 94, 4096, 64, 4, 128, 0, 151936, experts=128, experts_per_token=8, expert_ffn=1536
)

MODELS: dict[str, ModelSpec] = {
    "8b": LLAMA3_8B,
    "70b": LLAMA3_70B,
    "405b": LLAMA3_405B,
    "smollm2-135m": SMOLLM2_135M,
    "qwen2.5-7b": QWEN25_7B,
    "qwen2.5-1.5b": QWEN25_1_5B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3-235b-a22b": QWEN3_235B_A22B,
}


def model_named(name: str) -> ModelSpec:
    """A known model by short name (8b, 70b, 405b, smollm2-135m) or a transformers folder's shape."""
    key = name.lower().removeprefix("llama3-").removeprefix("llama-3-")
    if key in MODELS:
        return MODELS[key]
    if Path(name, "config.json").is_file():
        return model_from_hf_config(Path(name, "config.json"))
    raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)} or a transformers folder")


def model_from_hf_config(path: Path) -> ModelSpec:
    """The shape of a Llama-like model from its transformers `config.json`."""
    c = json.loads(Path(path).read_text())
    heads = int(c["num_attention_heads"])
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    return ModelSpec(
        name=Path(path).parent.name,
        layers=int(c["num_hidden_layers"]),
        hidden=int(c["hidden_size"]),
        heads=heads,
        kv_heads=int(c.get("num_key_value_heads", heads)),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        ffn=int(c["intermediate_size"]),
        vocab=int(c["vocab_size"]),
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        experts=experts,
        experts_per_token=int(c.get("num_experts_per_tok") or 0) if experts else 0,
        expert_ffn=int(c.get("moe_intermediate_size") or c["intermediate_size"]) if experts else 0,
    )
