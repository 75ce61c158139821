"""A mixture of experts made from a dense Llama-architecture model ("sparse upcycling"), no download.

Each MLP becomes `experts` copies of itself behind a router (a Mixtral: Llama's attention, norms and
embeddings under the same names, its MLP as the experts). The router is random and small, so tokens
spread over the experts, and its top-k probabilities are renormalised to sum to one: every expert being
the same MLP, each token's output is that MLP's, and the upcycled model computes what the dense one does
(to float rounding). Training then moves the copies apart, and the router with them.

While the copies are the same, which experts a token goes to changes nothing it computes: routing is
moot. `expert_noise` makes each copy a little different (its weights times 1 + noise x N(0, 1)), so
that routing matters from the first step (for measuring routing replay), at the cost of the exact match.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

_NOT_MIXTRAL = ("architectures", "model_type", "mlp_bias", "pretraining_tp", "transformers_version", "dtype")


def upcycle(
    dense: torch.nn.Module,
    *,
    experts: int = 4,
    top_k: int = 2,
    router_std: float = 0.02,
    expert_noise: float = 0.0,
    seed: int = 0,
) -> torch.nn.Module:
    """A MixtralForCausalLM whose every MLP is `experts` copies of `dense`'s (a LlamaForCausalLM), `top_k`
    of them per token, its routers drawn from N(0, router_std) with `seed`, each copy's weights times
    1 + expert_noise x N(0, 1) (see the module doc); in `dense`'s dtype."""
    from transformers import MixtralConfig, MixtralForCausalLM

    if dense.config.model_type != "llama":
        raise ValueError(f"upcycling takes a Llama-architecture model, not {dense.config.model_type}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be within 1..experts ({experts}), got {top_k}")
    settings = {k: v for k, v in dense.config.to_dict().items() if k not in _NOT_MIXTRAL}
    config = MixtralConfig(
        **settings, num_local_experts=experts, num_experts_per_tok=top_k, router_jitter_noise=0.0
    )
    dtype = next(dense.parameters()).dtype
    moe = MixtralForCausalLM(config)  # (its random weights are all replaced below)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in dense.state_dict().items():
        if ".mlp." not in name:
            state[name] = tensor
    for index, layer in enumerate(dense.model.layers):
        mlp, prefix = layer.mlp, f"model.layers.{index}.mlp"
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()  # [2I, H]: gate, then up
        down = mlp.down_proj.weight.detach()
        for name, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
            copies = weight.expand(experts, *weight.shape).clone()
            if expert_noise:
                noise = torch.randn(copies.shape, generator=generator).to(copies.dtype)
                copies.mul_(1 + expert_noise * noise)
            state[f"{prefix}.experts.{name}"] = copies
        router = torch.randn(experts, config.hidden_size, generator=generator) * router_std
        state[f"{prefix}.gate.weight"] = router.to(dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    moe.load_state_dict(state, strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        moe.tie_weights()
    return moe.to(dtype)


def upcycle_folder(dense_folder: str | os.PathLike[str], out: str | os.PathLike[str], **settings) -> Path:
    """Upcycles the dense model saved in `dense_folder` (see `upcycle`) into a transformers folder at
    `out`, its tokenizer files beside it; returns `out`."""
    import shutil

    from llamarl.exec.models import load_model_and_tokenizer

    dense, _ = load_model_and_tokenizer(dense_folder, dtype=torch.float32, with_tokenizer=False)
    dtype = dense.config.dtype if isinstance(dense.config.dtype, torch.dtype) else torch.float32
    moe = upcycle(dense.to(dtype), **settings)
    out = Path(out)
    moe.save_pretrained(out)
    for path in Path(dense_folder).iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(path, out / path.name)
    if (Path(dense_folder) / "generation_config.json").is_file():
        shutil.copy(Path(dense_folder) / "generation_config.json", out / "generation_config.json")
    return out
