"""Log-probabilities of sampled tokens, computed in chunks: from logits (`token_logprobs`), or from the
last hidden states and the output head's weight without ever holding all the logits
(`linear_token_logprobs`).

Shape legend:
    B: sequences in the batch, T: tokens per sequence (padded), V: vocabulary size,
    b, t: the sequences and tokens of one chunk (b * t <= chunk_size, or one row's slice of T),
    N: tokens (any leading shape flattened), H: hidden size, n: the tokens of one chunk of N.

Why chunks and a custom autograd function: with a 150k-token vocabulary, a float32 copy of the logits
of every token (B x T x V x 4 bytes) is larger than the bf16 logits themselves. Its forward and
backward passes work on about `chunk_size` tokens at a time, upcast only that chunk to float32, and
save nothing of size B x T x V for the backward pass except the logits the caller already holds.

Chunks are taken as views of the [B, T, V] logits, never through a flattening reshape: logits sliced
to the completion (`logits[:, :-1]`) are not contiguous, and flattening them would copy all of them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

DEFAULT_CHUNK_SIZE = 512
"""Tokens per chunk: 512 x 150k vocabulary x 4 bytes is about 300 MB of float32 at a time."""

DEFAULT_HEAD_CHUNK_SIZE = 256
"""Tokens per chunk of `linear_token_logprobs`: 256 x 49k vocabulary (SmolLM2) x 4 bytes is 50 MB of
float32 logits at a time. Measured (SmolLM2-135M, bf16, one thread, a 1511-token step): the trainer's
peak 3.85 GB at 1024 tokens, 3.70 at 512, 3.53 at 256, 3.49 at 128, the step time the same down to 256
(the head's matrix products stay efficient at 256 rows) and a little slower at 128."""

_Chunk = tuple[slice, slice]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 for bf16/fp16/fp32 logits; float64 stays float64 (gradcheck, reference computations).
    return torch.promote_types(dtype, torch.float32)


def _chunks(num_sequences: int, num_tokens: int, chunk_size: int) -> Iterator[_Chunk]:
    """(rows, columns) slices covering [B, T], each of at most max(chunk_size, 1 row's worth) tokens:
    whole rows grouped when a row fits in a chunk, else pieces of one row."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if num_tokens == 0:
        return
    if num_tokens <= chunk_size:
        rows_per_chunk = chunk_size // num_tokens
        for first in range(0, num_sequences, rows_per_chunk):
            yield slice(first, first + rows_per_chunk), slice(None)
    else:
        for row in range(num_sequences):
            for first in range(0, num_tokens, chunk_size):
                yield slice(row, row + 1), slice(first, first + chunk_size)


def _as_3d(logits: Tensor) -> Tensor:
    """[..., T, V] -> [B, T, V] without copying when possible ([T, V] gets B = 1)."""
    if logits.dim() < 2:
        raise ValueError(f"logits need at least a token and a vocabulary axis, got {tuple(logits.shape)}")
    return logits.unsqueeze(0) if logits.dim() == 2 else logits.flatten(0, -3)


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / temperature)[token] per token, chunked in forward and backward."""

    @staticmethod
    def forward(ctx, logits_BTV: Tensor, token_ids_BT: Tensor, temperature: float, chunk_size: int) -> Tensor:
        num_sequences, num_tokens, _ = logits_BTV.shape
        compute_dtype = _compute_dtype(logits_BTV.dtype)
        logprobs_BT = logits_BTV.new_empty((num_sequences, num_tokens), dtype=compute_dtype)
        max_BT = torch.empty_like(logprobs_BT)
        lse_shifted_BT = torch.empty_like(logprobs_BT)
        for chunk in _chunks(num_sequences, num_tokens, chunk_size):
            scaled_btV = logits_BTV[chunk].to(compute_dtype) / temperature
            # Shift by the row maximum before subtracting, so that logits of -1e4 do not lose the
            # log-prob's digits to the float32 rounding of a large logsumexp.
            max_bt = scaled_btV.amax(-1).clamp(min=torch.finfo(compute_dtype).min)
            shifted_btV = scaled_btV - max_bt[..., None]
            lse_shifted_bt = torch.logsumexp(shifted_btV, dim=-1)
            picked_bt = shifted_btV.gather(-1, token_ids_BT[chunk][..., None]).squeeze(-1)
            logprobs_BT[chunk] = picked_bt - lse_shifted_bt
            max_BT[chunk] = max_bt
            lse_shifted_BT[chunk] = lse_shifted_bt
        ctx.save_for_backward(logits_BTV, token_ids_BT, max_BT, lse_shifted_BT)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logprobs_BT

    @staticmethod
    def backward(ctx, grad_BT: Tensor):
        logits_BTV, token_ids_BT, max_BT, lse_shifted_BT = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        compute_dtype = _compute_dtype(logits_BTV.dtype)
        grad_logits_BTV = torch.empty(logits_BTV.shape, dtype=logits_BTV.dtype, device=logits_BTV.device)
        for chunk in _chunks(logits_BTV.shape[0], logits_BTV.shape[1], chunk_size):
            # d logprob / d logits = (onehot(token) - softmax(logits / T)) / T
            shifted_btV = logits_BTV[chunk].to(compute_dtype) / temperature - max_BT[chunk][..., None]
            grad_btV = -torch.exp(shifted_btV - lse_shifted_BT[chunk][..., None])
            ones_bt1 = torch.ones_like(grad_btV[..., :1])
            grad_btV.scatter_add_(-1, token_ids_BT[chunk][..., None], ones_bt1)
            grad_btV *= grad_BT[chunk][..., None].to(compute_dtype) / temperature
            grad_logits_BTV[chunk] = grad_btV.to(grad_logits_BTV.dtype)
        return grad_logits_BTV, None, None, None


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
            caller), any float dtype, contiguous or not; [T, V] and [..., T, V] work too.
        token_ids_BT: sampled token ids (valid vocabulary indexes also on padding, e.g. the pad id).
        temperature: the sampling temperature, so that the trainer's log-probs match the distribution
            the generator sampled from.
        chunk_size: tokens upcast to float32 at a time.

    Returns:
        logprobs_BT, float32 (float64 for float64 logits), differentiable with respect to `logits_BTV`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if tuple(logits_BTV.shape[:-1]) != tuple(token_ids_BT.shape):
        raise ValueError(
            f"logits {tuple(logits_BTV.shape)} do not match token ids {tuple(token_ids_BT.shape)}"
        )
    logprobs_BT = _TokenLogprobs.apply(
        _as_3d(logits_BTV),
        _as_3d(token_ids_BT[..., None])[..., 0].long(),
        float(temperature),
        int(chunk_size),
    )
    return logprobs_BT.view(token_ids_BT.shape)


class _HeadChunks:
    """The [n, V] work buffers of `_LinearTokenLogprobs`, allocated once per pass and reused by every
    chunk: a fresh 200 MB tensor per step of a chunk costs more (the kernel maps and zero-fills its
    pages: measured 70-80 ms per [1024, 49k] float32 tensor here) than the arithmetic on it (about 10 ms
    for an in-place multiply), so every step below writes into these."""

    def __init__(self, hidden_NH: Tensor, weight_VH: Tensor, chunk_size: int) -> None:
        rows = min(chunk_size, hidden_NH.shape[0])
        shape = (rows, weight_VH.shape[0])
        self.compute_dtype = _compute_dtype(hidden_NH.dtype)
        # The matrix product's output in the inputs' dtype (bf16 under mixed precision: the fast path),
        # where that is not the float32 the softmax runs in.
        self.product = hidden_NH.new_empty(shape) if hidden_NH.dtype != self.compute_dtype else None
        self.scaled = hidden_NH.new_empty(shape, dtype=self.compute_dtype)

    def logits(self, hidden_nH: Tensor, weight_VH: Tensor, temperature: float) -> Tensor:
        """float32 logits / temperature of one chunk, [n, V], in `self.scaled`."""
        n = hidden_nH.shape[0]
        scaled_nV = self.scaled[:n]
        if self.product is None:
            torch.mm(hidden_nH, weight_VH.T, out=scaled_nV)
        else:
            scaled_nV.copy_(torch.mm(hidden_nH, weight_VH.T, out=self.product[:n]))
        if temperature != 1.0:
            scaled_nV.div_(temperature)
        return scaled_nV


def _row_dots(a_nV: Tensor, b_nV: Tensor, *, out: Tensor) -> Tensor:
    """out[i] = a_nV[i] . b_nV[i] for each row, into `out` [n] (returned)."""
    if a_nV.device.type == "cpu":
        # One BLAS dot a row: a batched [n, 1, V] x [n, V, 1] product takes 6x as long on the CPU (33 ms
        # against 5.7 for 256 rows of SmolLM2's 49k vocabulary, one thread), as does (a * b).sum(-1).
        for i in range(len(out)):
            torch.dot(a_nV[i], b_nV[i], out=out[i])
        return out
    return torch.linalg.vecdot(a_nV, b_nV, out=out)


class _LinearTokenLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[token] per token, and the distribution's entropy,
    one chunk of tokens at a time: the [N, V] logits exist one [n, V] chunk at a time, in forward and
    again (recomputed) in backward. Saved for backward: the inputs and one float32 number per token."""

    @staticmethod
    def forward(
        ctx,
        hidden_NH: Tensor,
        weight_VH: Tensor,
        token_ids_N: Tensor,
        temperature: float,
        chunk_size: int,
        shape: tuple[int, ...],
    ) -> tuple[Tensor, Tensor]:
        num_tokens = hidden_NH.shape[0]
        chunks = _HeadChunks(hidden_NH, weight_VH, chunk_size)
        # Outputs are allocated in the caller's shape (not views of flat ones: a module returning a view
        # of a custom function's output trips FSDP2's checks), written through flat views.
        logprobs = hidden_NH.new_empty(shape, dtype=chunks.compute_dtype)
        entropy = torch.empty_like(logprobs)
        logprobs_N, entropy_N = logprobs.view(-1), entropy.view(-1)
        lse_N = hidden_NH.new_empty(num_tokens, dtype=chunks.compute_dtype)
        spare = torch.empty_like(chunks.scaled)  # exp(z - max), a third buffer backward does not need
        for first in range(0, num_tokens, chunk_size):
            rows = slice(first, first + chunk_size)
            scaled_nV = chunks.logits(hidden_NH[rows], weight_VH, temperature)
            # log-sum-exp, shifted by the row maximum.
            max_n = scaled_nV.amax(-1)
            exp_nV = torch.sub(scaled_nV, max_n[:, None], out=spare[: len(max_n)]).exp_()
            sum_n = exp_nV.sum(-1)
            lse_n = sum_n.log() + max_n
            logp_nV = scaled_nV.sub_(lse_n[:, None])  # the log-softmax, in place of the logits
            logprobs_N[rows] = logp_nV.gather(-1, token_ids_N[rows, None]).squeeze(-1)
            # H = -sum_v p_v log p_v, p = exp(z - max) / sum, as one dot product per token.
            probs_nV = exp_nV.div_(sum_n[:, None])
            _row_dots(probs_nV, logp_nV, out=entropy_N[rows]).neg_()
            lse_N[rows] = lse_n
        ctx.save_for_backward(hidden_NH, weight_VH, token_ids_N, lse_N)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(entropy)  # a metric: no gradient flows through it
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_entropy: Tensor | None):
        hidden_NH, weight_VH, token_ids_N, lse_N = ctx.saved_tensors
        grad_N = grad.reshape(-1)
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        chunks = _HeadChunks(hidden_NH, weight_VH, chunk_size)
        grad_hidden_NH = torch.empty_like(hidden_NH) if want_hidden else None
        # Accumulated by the matrix products themselves, in their dtype (addmm_: one pass over the
        # [V, H] sum per chunk). Summing bf16 products into a float32 buffer instead took an extra
        # conversion and addition per chunk: 60 -> 30 ms a chunk for SmolLM2's head (one thread), 0.25 s
        # of a 6 s step; the sum is rounded to bf16 once per chunk rather than once (relative error
        # 0.33% against 0.24% for 7 chunks), and bf16 is what the gradient is returned in either way.
        grad_weight_VH: Tensor | None = None
        for first in range(0, hidden_NH.shape[0], chunk_size):
            rows = slice(first, first + chunk_size)
            hidden_nH = hidden_NH[rows]
            # d logprob / d logits = (onehot(token) - softmax(logits / T)) / T, built in place.
            grad_nV = chunks.logits(hidden_nH, weight_VH, temperature)
            grad_nV.sub_(lse_N[rows, None]).exp_()
            coefficient_n1 = grad_N[rows, None].to(chunks.compute_dtype) / temperature
            grad_nV.mul_(-coefficient_n1).scatter_add_(-1, token_ids_N[rows, None], coefficient_n1)
            if chunks.product is not None:  # back to the matrix products' dtype
                grad_nV = chunks.product[: len(grad_nV)].copy_(grad_nV)
            if want_hidden:
                torch.mm(grad_nV, weight_VH, out=grad_hidden_NH[rows])
            if want_weight and grad_weight_VH is None:
                grad_weight_VH = grad_nV.T @ hidden_nH
            elif want_weight:
                grad_weight_VH.addmm_(grad_nV.T, hidden_nH)
        return grad_hidden_NH, grad_weight_VH, None, None, None, None


def linear_token_logprobs(
    hidden_NH: Tensor,
    weight_VH: Tensor,
    token_ids_N: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_HEAD_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """Log-probabilities of the sampled tokens under softmax(hidden @ weight.T / temperature), and the
    entropy of that distribution, without materialising the logits of every token at once.

    The output head (a bias-free linear layer) and the log-softmax are fused, as the fused linear
    cross-entropy of Liger and TRL are: the forward pass computes the logits of `chunk_size` tokens at a
    time, keeps one float32 log-sum-exp per token, and the backward pass recomputes each chunk's logits
    to form its gradient. Peak memory is that of one chunk's [n, V] logits instead of [N, V], for one more
    matrix product per chunk in backward.

    Args:
        hidden_NH: the last hidden states at the positions that predict `token_ids_N` (after the final
            norm), any leading shape ([B, T, H] too), any float dtype; the matrix products run in it.
        weight_VH: the output head's weight [V, H] (cast to the hidden states' dtype where they differ).
        token_ids_N: the sampled tokens, the hidden states' leading shape (valid ids also on padding).
        temperature: the sampling temperature, so that the log-probs match the distribution sampled.
        chunk_size: tokens whose logits exist at a time.

    Returns:
        (logprobs_N, entropy_N) in the hidden states' leading shape, float32 (float64 for float64
        inputs). Log-probs are differentiable with respect to `hidden_NH` and `weight_VH` (its gradient
        is accumulated over the chunks in the matrix products' dtype); the entropy carries no gradient
        (a metric).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if tuple(hidden_NH.shape[:-1]) != tuple(token_ids_N.shape):
        raise ValueError(
            f"hidden states {tuple(hidden_NH.shape)} do not match token ids {tuple(token_ids_N.shape)}"
        )
    if weight_VH.dim() != 2 or weight_VH.shape[1] != hidden_NH.shape[-1]:
        raise ValueError(
            f"weight {tuple(weight_VH.shape)} is not [V, H] for hidden size {hidden_NH.shape[-1]}"
        )
    if weight_VH.dtype != hidden_NH.dtype:
        weight_VH = weight_VH.to(hidden_NH.dtype)  # (differentiable: the gradient is cast back)
    return _LinearTokenLogprobs.apply(
        hidden_NH.reshape(-1, hidden_NH.shape[-1]),
        weight_VH,
        token_ids_N.reshape(-1).long(),
        float(temperature),
        int(chunk_size),
        tuple(token_ids_N.shape),
    )
