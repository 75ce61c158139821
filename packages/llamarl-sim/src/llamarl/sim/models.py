"""Transformer shapes the simulator prices: parameters, FLOPs per token and KV-cache bytes per token.

Dense decoder-only models (Llama 3 and SmolLM2 shapes), grouped-query attention, gated MLP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a dense decoder-only transformer."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # width of the gated MLP
    vocab: int
    tied_embeddings: bool = False

    @property
    def layer_params(self) -> float:
        """Parameters of one block: q, k, v, o projections, a gated MLP (three matrices), two norms."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.ffn + 2 * self.hidden

    @property
    def params(self) -> float:
        """Every parameter, embeddings included."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params + embeddings + self.hidden

    @property
    def matmul_params(self) -> float:
        """Parameters that multiply every token (blocks and the output head): 2 FLOPs each, forward.

        The input embedding is a lookup, so it costs no FLOPs and is not read whole per decoding step.
        """
        return self.layers * self.layer_params + self.vocab * self.hidden

    def forward_flops_per_token(self, context: float) -> float:
        """FLOPs of one token's forward pass when it attends to `context` earlier tokens on average."""
        attention = 4 * self.layers * self.heads * self.head_dim * context  # QK^T and AV
        return 2 * self.matmul_params + attention

    def kv_bytes_per_token(self, bytes_per_value: float) -> float:
        """KV-cache bytes of one token across all layers (keys and values of every KV head)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


# Llama 3.1 shapes (the paper's 8B, 70B, 405B) and SmolLM2-135M (the model runs here use).
LLAMA3_8B = ModelSpec("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256)
LLAMA3_70B = ModelSpec("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256)
LLAMA3_405B = ModelSpec("llama3-405b", 126, 16384, 128, 8, 128, 53248, 128256)
SMOLLM2_135M = ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tied_embeddings=True)

MODELS: dict[str, ModelSpec] = {
    "8b": LLAMA3_8B,
    "70b": LLAMA3_70B,
    "405b": LLAMA3_405B,
    "smollm2-135m": SMOLLM2_135M,
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
    )
