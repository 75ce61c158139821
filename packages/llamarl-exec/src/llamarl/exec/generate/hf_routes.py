"""The hf generator's expert routes: what its forwards recorded, laid out as the batch's positions.

A `generate` of a mixture-of-experts policy runs, with `llamarl.exec.moe.routes.RouteRecorder` open:
the shared prompt prefill (every prompt's tokens but its last, once per prompt: `kv_cache`), then one
forward per step of one token per row (the last prompt token first, then each drawn token but the
last). Laid end to end per row they are the routes of the prompt and completion positions.

Shape legend: B rows, G prompts (B / samples_per_prompt), P prompt length, C completion length,
S positions (P + C), L MoE layers, K experts per token.
"""

from __future__ import annotations

import torch

from llamarl.exec.moe.routes import blank_routes, no_route
from llamarl.exec.types import RolloutBatch


def attach_routes(
    batch: RolloutBatch, forwards: list[torch.Tensor], *, shared_prefill: bool, dtype: torch.dtype
) -> RolloutBatch:
    """Sets `batch`'s prompt and completion routes from the recorded `forwards` ([N, L, K] each, in
    order; the first is the shared prompt prefill when `shared_prefill`); positions no forward covered
    or that are padding get none. Returns `batch`."""
    if not forwards:
        return batch
    B, P = batch.prompt_ids_BP.shape
    C = batch.completion_ids_BC.shape[1]
    layers, top_k = forwards[0].shape[1:]
    pieces = []
    for index, routes_NLK in enumerate(forwards):
        if index == 0 and shared_prefill:
            prompts = B // batch.group_size
            routes_GTLK = routes_NLK.view(prompts, -1, layers, top_k)
            pieces.append(routes_GTLK.repeat_interleave(batch.group_size, 0))
        else:
            pieces.append(routes_NLK.view(B, -1, layers, top_k))
    routes_BSLK = torch.cat(pieces, 1)[:, : P + C]
    missing = P + C - routes_BSLK.shape[1]
    if missing:
        routes_BSLK = torch.cat(
            [routes_BSLK, blank_routes(B, missing, layers=layers, top_k=top_k, dtype=dtype)], 1
        )
    blank = no_route(dtype)
    batch.prompt_routes_BPLK = routes_BSLK[:, :P].masked_fill(
        batch.prompt_mask_BP[:, :, None, None] == 0, blank
    )
    batch.completion_routes_BCLK = routes_BSLK[:, P:].masked_fill(
        batch.completion_mask_BC[:, :, None, None] == 0, blank
    )
    return batch
