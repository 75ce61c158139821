"""The hf generator's sampling: each token drawn from softmax(logits / T) with its log-probability
recorded (`BehaviorLogprobRecorder`, `draw_tokens`), and transformers' output as a RolloutBatch
(`rollout_batch`).

Shape legend:
    B  sequences (num_prompts x samples_per_prompt, the samples of one prompt contiguous)
    P  prompt length (left-padded), C  completion length (right-padded), V  vocabulary size

The behaviour log-probs must be those of the distribution the tokens were actually sampled from,
log softmax(logits / temperature), because AIPO divides by them. So sampling is pinned to plain
temperature sampling (top-k, top-p, min-p, repetition penalties and the model's own generation defaults
all switched off): a logits processor draws each token itself from that distribution and records its
log-prob during `generate` (which then decodes greedily over the processor's scores), holding one B x V
float32 step at a time rather than every step's logits (B x C x V).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llamarl.exec.padding import completion_mask
from llamarl.exec.types import RolloutBatch

__all__ = ["BehaviorLogprobRecorder", "draw_tokens", "rollout_batch"]


def draw_tokens(scaled_BV: torch.Tensor, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(scaled_BV) (float [B, V], the logits over the temperature), and
    its log-probability: (int64 [B], float [B]).

    By the inverse of the cumulative distribution, one uniform number per row, in two levels: the
    row's blocks of `block` entries first, then the entries of the block drawn. transformers'
    `torch.multinomial` draws an exponential variate per vocabulary entry (24 ms a step for 16 x 49k on
    one CPU thread); a log-softmax, its exp and a cumulative sum over the whole row took 3.7 ms, this
    1.0 ms. The random numbers come from torch's global generator (seeded by `HFGenerator.setup`).
    `scaled_BV` is overwritten (with exp(scaled - row max)): a fresh B x V tensor a step costs more than
    the exp (1.3 ms for 16 x 49k beside the decoding, whose weights leave it no cache).
    """
    num_rows, vocab = scaled_BV.shape
    max_B1 = scaled_BV.amax(-1, keepdim=True)
    weights_BV = scaled_BV.sub_(max_B1).exp_()  # probabilities up to the row's sum, in [0, 1]
    if vocab % block:
        weights_BV = torch.nn.functional.pad(weights_BV, (0, block - vocab % block))
    weights_BNK = weights_BV.view(num_rows, -1, block)
    cdf_BN = weights_BNK.sum(-1).cumsum(-1)
    total_B1 = cdf_BN[:, -1:]
    if not torch.isfinite(total_B1).all():  # (torch.multinomial refuses these too)
        raise ValueError("cannot sample: the model's logits hold NaN or infinite values")
    u_B1 = torch.rand(num_rows, 1, device=scaled_BV.device, dtype=cdf_BN.dtype) * total_B1
    # The first block, then entry, whose cumulative weight exceeds u: one of zero weight never does.
    block_B = torch.searchsorted(cdf_BN, u_B1, right=True).squeeze(-1).clamp_(max=cdf_BN.shape[1] - 1)
    rows_B = torch.arange(num_rows, device=scaled_BV.device)
    cdf_BK = weights_BNK[rows_B, block_B].cumsum(-1)
    before_B = torch.where(block_B > 0, cdf_BN[rows_B, block_B - 1], 0.0)
    # u's place within its block, as a fraction of the block's weight, so that rounding (the block sum
    # against its cumulative sum) can never carry it past the block's last entry of nonzero weight.
    fraction_B = ((u_B1[:, 0] - before_B) / (cdf_BN[rows_B, block_B] - before_B)).clamp_(0.0, 1.0 - 1e-6)
    within_B1 = (fraction_B * cdf_BK[:, -1])[:, None]
    entry_B = torch.searchsorted(cdf_BK, within_B1, right=True).squeeze(-1).clamp_(max=block - 1)
    token_B = block_B * block + entry_B
    logprob_B = weights_BV[rows_B, token_B].log() - total_B1[:, 0].log()  # (a drawn weight is > 0)
    return token_B, logprob_B


class BehaviorLogprobRecorder:
    """Logits processor that records log softmax(scores / T)[sampled token] at every decoding step.

    `generate` calls it with the scores of step t before the token of step t is drawn; that token shows
    up as the last column of `input_ids` at step t + 1, so the previous step's log-softmax is kept until
    then and the last step is resolved by `finish()`. It returns the scores unchanged, or with `draws`
    it draws the token itself (`draw_tokens`) and returns scores whose argmax is that token (a one-hot).
    """

    def __init__(
        self, temperature: float, on_step: Callable[[], None] | None = None, *, draws: bool = False
    ) -> None:
        self.temperature = temperature
        self.draws = draws  # sample the token here (generate then runs greedy over the returned scores)
        self.on_step = on_step  # called once per decoding step, after that step's scores are recorded
        self.logprobs_BC: list[torch.Tensor] = []
        self.input_ids: torch.Tensor | None = None  # prompt + every token drawn so far (a paused call's)
        # The last step's log-probs, resolved once its token is known: [B, V] (all) when generate picks
        # the token, [B] (the drawn token's) when this draws it.
        self._pending: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.input_ids = input_ids
        if self._pending is not None:
            self._resolve(input_ids[:, -1])
        scaled_BV = scores.float()
        if self.temperature != 1.0:  # (a division of B x 49k floats a step saved at the usual T = 1)
            scaled_BV = scaled_BV / self.temperature
        if not self.draws:
            self._pending = torch.log_softmax(scaled_BV, dim=-1)  # [B, V]: the token comes from generate
        if self.on_step is not None:
            self.on_step()
        if not self.draws:
            return scores
        # [B]: the drawn token's log-prob. (scaled_BV is spent: generate keeps no scores.)
        token_B, self._pending = draw_tokens(scaled_BV)
        # generate only takes the argmax of what this returns: a one-hot of bytes is a quarter of
        # the float scores to fill and scan (1.1 -> 0.4 ms a step for 16 x 49k on one thread).
        one_hot_BV = torch.zeros(scores.shape, dtype=torch.uint8, device=scores.device)
        return one_hot_BV.scatter_(-1, token_B[:, None], 1)

    def _resolve(self, token_ids_B: torch.Tensor) -> None:
        """Records the pending step's log-probs of `token_ids_B`, the tokens generate appended (a row that
        had finished gets padding there: its log-prob is masked out later, whatever it is)."""
        assert self._pending is not None
        pending = self._pending
        if pending.dim() == 2:
            pending = pending.gather(-1, token_ids_B[:, None]).squeeze(-1)
        self.logprobs_BC.append(pending)
        self._pending = None

    def finish(self, last_token_ids_B: torch.Tensor) -> torch.Tensor:
        """Resolves the last step; returns the float32 log-probs of every generated position [B, C]."""
        if self._pending is not None:
            self._resolve(last_token_ids_B)
        if not self.logprobs_BC:
            return torch.zeros(last_token_ids_B.shape[0], 0)
        return torch.stack(self.logprobs_BC, dim=1)


def rollout_batch(
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    completion_ids_BC: torch.Tensor,
    behavior_logprobs_BC: torch.Tensor,
    step_versions: list[int],
    samples_per_prompt: int,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    version_at_start: int,
    trim: bool = True,
) -> RolloutBatch:
    """The RolloutBatch of transformers' `generate` output: completions masked after their first EOS
    and (with `trim`) cut to the longest; `step_versions[t]` sampled every row's token t, and
    `version_at_start` stamps the sequences of a call paused before its first token."""
    completion_mask_BC = completion_mask(completion_ids_BC, eos_token_ids)
    # Columns past the longest completion hold only padding (possible when max_new_tokens is hit
    # by none): drop them so C is the longest completion.
    if trim:
        length = int(completion_mask_BC.sum(1).max()) if completion_mask_BC.numel() else 0
    else:
        length = completion_ids_BC.shape[1]
    completion_ids_BC = completion_ids_BC[:, :length]
    completion_mask_BC = completion_mask_BC[:, :length]
    completion_ids_BC = completion_ids_BC.masked_fill(completion_mask_BC == 0, pad_token_id)
    # masked_fill, not a product: a padding position may hold -inf, and -inf * 0 is nan.
    behavior_logprobs_BC = behavior_logprobs_BC[:, :length].float().masked_fill(completion_mask_BC == 0, 0.0)

    num_sequences = prompt_ids_BP.shape[0]
    versions_C = torch.tensor(step_versions[:length], dtype=torch.int64).reshape(1, length)
    token_version_BC = versions_C.expand(num_sequences, length) * completion_mask_BC
    first_version = step_versions[0] if step_versions else version_at_start
    return RolloutBatch(
        prompt_ids_BP=prompt_ids_BP,
        prompt_mask_BP=prompt_mask_BP,
        completion_ids_BC=completion_ids_BC.long(),
        completion_mask_BC=completion_mask_BC,
        behavior_logprobs_BC=behavior_logprobs_BC,
        rewards_B=torch.zeros(num_sequences, dtype=torch.float32),
        policy_version_B=torch.full((num_sequences,), first_version, dtype=torch.int64),
        token_version_BC=token_version_BC,
        group_size=samples_per_prompt,
    )
