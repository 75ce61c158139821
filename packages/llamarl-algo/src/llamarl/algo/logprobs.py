"""Log-probabilities of sampled tokens and entropy, computed from logits in chunks.

Shape legend:
    B: sequences in the batch, T: tokens per sequence (padded), V: vocabulary size,
    N: B * T flattened tokens.

Why chunks and custom autograd functions: with a 150k-token vocabulary, a float32 copy of the logits
of every token (N x V x 4 bytes) is larger than the bf16 logits themselves. Both the forward and the
backward pass here work on `chunk_size` tokens at a time, upcast only that chunk to float32, and save
nothing of size N x V for the backward pass except the logits the caller already holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK_SIZE = 512
"""Tokens per chunk: 512 x 150k vocabulary x 4 bytes is about 300 MB of float32 at a time."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 for bf16/fp16/fp32 logits; float64 stays float64 (gradcheck, reference computations).
    return torch.promote_types(dtype, torch.float32)


def _chunks(num_tokens: int, chunk_size: int) -> range:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return range(0, num_tokens, chunk_size)


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / temperature)[token] per token, chunked in forward and backward."""

    @staticmethod
    def forward(ctx, logits_NV: Tensor, token_ids_N: Tensor, temperature: float, chunk_size: int) -> Tensor:
        num_tokens = logits_NV.shape[0]
        compute_dtype = _compute_dtype(logits_NV.dtype)
        logprobs_N = torch.empty(num_tokens, dtype=compute_dtype, device=logits_NV.device)
        max_N = torch.empty_like(logprobs_N)
        lse_shifted_N = torch.empty_like(logprobs_N)
        for start in _chunks(num_tokens, chunk_size):
            end = start + chunk_size
            scaled_CV = logits_NV[start:end].to(compute_dtype) / temperature
            # Shift by the row maximum before subtracting, so that logits of -1e4 do not lose the
            # log-prob's digits to the float32 rounding of a large logsumexp.
            max_C = scaled_CV.amax(-1).clamp(min=torch.finfo(compute_dtype).min)
            shifted_CV = scaled_CV - max_C[:, None]
            lse_shifted_C = torch.logsumexp(shifted_CV, dim=-1)
            picked_C = shifted_CV.gather(-1, token_ids_N[start:end, None]).squeeze(-1)
            logprobs_N[start:end] = picked_C - lse_shifted_C
            max_N[start:end] = max_C
            lse_shifted_N[start:end] = lse_shifted_C
        ctx.save_for_backward(logits_NV, token_ids_N, max_N, lse_shifted_N)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logprobs_N

    @staticmethod
    def backward(ctx, grad_N: Tensor):
        logits_NV, token_ids_N, max_N, lse_shifted_N = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        compute_dtype = _compute_dtype(logits_NV.dtype)
        grad_logits_NV = torch.empty_like(logits_NV)
        for start in _chunks(logits_NV.shape[0], chunk_size):
            end = start + chunk_size
            # d logprob / d logits = (onehot(token) - softmax(logits / T)) / T
            shifted_CV = logits_NV[start:end].to(compute_dtype) / temperature - max_N[start:end, None]
            probs_CV = torch.exp(shifted_CV - lse_shifted_N[start:end, None])
            grad_CV = -probs_CV
            grad_CV.scatter_add_(-1, token_ids_N[start:end, None], torch.ones_like(grad_CV[:, :1]))
            grad_CV *= grad_N[start:end, None].to(compute_dtype) / temperature
            grad_logits_NV[start:end] = grad_CV.to(grad_logits_NV.dtype)
        return grad_logits_NV, None, None, None


def token_logprobs(
    logits_BTV: Tensor,
    token_ids_BT: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Log-probabilities of the sampled tokens under softmax(logits / temperature).

    Args:
        logits_BTV: logits at the positions that predict `token_ids_BT` (already shifted by the
            caller), any float dtype.
        token_ids_BT: sampled token ids, int64.
        temperature: the sampling temperature, so that the trainer's log-probs match the distribution
            the generator sampled from.
        chunk_size: tokens upcast to float32 at a time.

    Returns:
        logprobs_BT, float32 (float64 for float64 logits), differentiable with respect to `logits_BTV`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    *batch_shape, vocab = logits_BTV.shape
    if tuple(batch_shape) != tuple(token_ids_BT.shape):
        raise ValueError(
            f"logits {tuple(logits_BTV.shape)} do not match token ids {tuple(token_ids_BT.shape)}"
        )
    logits_NV = logits_BTV.reshape(-1, vocab)
    token_ids_N = token_ids_BT.reshape(-1).long()
    logprobs_N = _TokenLogprobs.apply(logits_NV, token_ids_N, float(temperature), int(chunk_size))
    return logprobs_N.view(batch_shape)


class _Entropy(torch.autograd.Function):
    """Entropy of softmax(logits / temperature) per token, chunked in forward and backward."""

    @staticmethod
    def forward(ctx, logits_NV: Tensor, temperature: float, chunk_size: int) -> Tensor:
        num_tokens = logits_NV.shape[0]
        compute_dtype = _compute_dtype(logits_NV.dtype)
        entropy_N = torch.empty(num_tokens, dtype=compute_dtype, device=logits_NV.device)
        for start in _chunks(num_tokens, chunk_size):
            end = start + chunk_size
            logp_CV = torch.log_softmax(logits_NV[start:end].to(compute_dtype) / temperature, dim=-1)
            # p * log p is 0 where p is 0 (e.g. logits of -inf), not nan.
            plogp_CV = torch.where(logp_CV > -torch.inf, logp_CV.exp() * logp_CV, 0.0)
            entropy_N[start:end] = -plogp_CV.sum(-1)
        ctx.save_for_backward(logits_NV, entropy_N)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return entropy_N

    @staticmethod
    def backward(ctx, grad_N: Tensor):
        logits_NV, entropy_N = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        compute_dtype = _compute_dtype(logits_NV.dtype)
        grad_logits_NV = torch.empty_like(logits_NV)
        for start in _chunks(logits_NV.shape[0], chunk_size):
            end = start + chunk_size
            # dH/dz_j = -p_j (log p_j + H) with z = logits / T.
            logp_CV = torch.log_softmax(logits_NV[start:end].to(compute_dtype) / temperature, dim=-1)
            probs_CV = logp_CV.exp()
            centered_CV = torch.where(probs_CV > 0, logp_CV + entropy_N[start:end, None], 0.0)
            grad_CV = -probs_CV * centered_CV * (grad_N[start:end, None].to(compute_dtype) / temperature)
            grad_logits_NV[start:end] = grad_CV.to(grad_logits_NV.dtype)
        return grad_logits_NV, None, None


def entropy_from_logits(
    logits_BTV: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(logits / temperature) at every position.

    Args:
        logits_BTV: logits, any float dtype.
        temperature: the sampling temperature.
        chunk_size: tokens upcast to float32 at a time.

    Returns:
        entropy_BT, float32 (float64 for float64 logits), differentiable with respect to `logits_BTV`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    *batch_shape, vocab = logits_BTV.shape
    entropy_N = _Entropy.apply(logits_BTV.reshape(-1, vocab), float(temperature), int(chunk_size))
    return entropy_N.view(batch_shape)
