"""The hf generator's expert routes: what its forwards recorded, laid out as the batch's positions.

A `generate` of a mixture-of-experts policy runs, with `llamarl.exec.moe.routes.RouteRecorder` open:
the shared prompt prefill (every prompt's tokens but its last, once per prompt: `kv_cache`), then one
forward per step of one token per row (the last prompt token first, then each drawn token but the
last). Laid end to end per row they are the routes of the prompt and completion positions.

Shape legend: B rows, G prompts (B / samples_per_prompt), P prompt length, C completion length,
S positions (P + C), L MoE layers, K experts per token.
"""

from __future__ import annotations

import contextlib

import torch

from llamarl.exec.moe.routes import RouteRecorder, blank_routes, find_routers, no_route, num_experts
from llamarl.exec.types import RolloutBatch


class GeneratorRoutes:
    """The hf generator's routes: its model's recorder (none for a dense model, whose batches carry
    no routes), open around each generate's forwards, and the batch they go with."""

    def __init__(self, model: torch.nn.Module) -> None:
        routers = find_routers(model)
        self.recorder = RouteRecorder(routers, num_experts(model.config)) if routers else None

    def recording(self) -> contextlib.AbstractContextManager[object]:
        """Records the routes of the forwards inside (a mixture of experts), else nothing."""
        return self.recorder.recording() if self.recorder is not None else contextlib.nullcontext()

    def attach(self, batch: RolloutBatch) -> RolloutBatch:
        """`batch` with the routes of the last `recording()` (see `attach_routes`)."""
        if self.recorder is None:
            return batch
        # (`kv_cache.shared_prompt_cache` prefills every prompt but one-token ones)
        shared_prefill = batch.prompt_ids_BP.shape[1] >= 2
        return attach_routes(
            batch, self.recorder.forwards(), shared_prefill=shared_prefill, dtype=self.recorder.dtype
        )


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
