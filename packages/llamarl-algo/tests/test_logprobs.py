"""token_logprobs and linear_token_logprobs: values against torch's unchunked reference, gradients,
temperature, extreme logits, low-precision inputs."""

import pytest
import torch
from llamarl_algo_testing import assert_close

from llamarl.algo import linear_token_logprobs, token_logprobs


def _reference_logprobs(logits_BTV, token_ids_BT, temperature=1.0):
    logp_BTV = torch.log_softmax(logits_BTV.double() / temperature, dim=-1)
    return logp_BTV.gather(-1, token_ids_BT[..., None]).squeeze(-1)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_reference(chunk_size, temperature):
    gen = torch.Generator().manual_seed(0)
    logits_BTV = torch.randn(2, 5, 11, generator=gen) * 3
    token_ids_BT = torch.randint(0, 11, (2, 5), generator=gen)
    logprobs_BT = token_logprobs(logits_BTV, token_ids_BT, temperature=temperature, chunk_size=chunk_size)
    assert logprobs_BT.dtype == torch.float32 and logprobs_BT.shape == (2, 5)
    assert_close(
        logprobs_BT.double(), _reference_logprobs(logits_BTV, token_ids_BT, temperature), atol=1e-5, rtol=1e-5
    )


def test_token_logprobs_hand_computed():
    logits_BTV = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])
    logprobs_BT = token_logprobs(logits_BTV, torch.tensor([[0, 1]]), temperature=2.0)
    # T=2: [0, 0] -> log 1/2; [1, 0] -> token 1: 0 - log(e + 1)
    expected = torch.tensor([[-torch.log(torch.tensor(2.0)), -torch.log1p(torch.exp(torch.tensor(1.0)))]])
    assert_close(logprobs_BT, expected)


def test_token_logprobs_gradcheck_float64():
    gen = torch.Generator().manual_seed(1)
    logits_BTV = torch.randn(2, 3, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    token_ids_BT = torch.randint(0, 5, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, token_ids_BT, temperature=0.8, chunk_size=4), (logits_BTV,)
    )


def test_token_logprobs_bf16_gradient_matches_reference():
    gen = torch.Generator().manual_seed(2)
    logits_BTV = (torch.randn(3, 4, 7, generator=gen) * 2).bfloat16().requires_grad_()
    token_ids_BT = torch.randint(0, 7, (3, 4), generator=gen)
    weights_BT = torch.randn(3, 4, generator=gen)
    (token_logprobs(logits_BTV, token_ids_BT, chunk_size=5) * weights_BT).sum().backward()
    reference = logits_BTV.detach().double().requires_grad_()
    (_reference_logprobs(reference, token_ids_BT) * weights_BT.double()).sum().backward()
    assert logits_BTV.grad.dtype == torch.bfloat16
    assert_close(logits_BTV.grad.double(), reference.grad, atol=1e-2, rtol=1e-2)


def test_token_logprobs_extreme_logits_stay_finite():
    logits_BTV = torch.tensor(
        [[[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4], [0.0, -torch.inf, 0.0]]], requires_grad=True
    )
    logprobs_BT = token_logprobs(logits_BTV, torch.tensor([[1, 0, 2]]))
    assert_close(
        logprobs_BT, torch.tensor([[-2e4, -torch.log(torch.tensor(3.0)), -torch.log(torch.tensor(2.0))]])
    )
    logprobs_BT.sum().backward()
    assert torch.isfinite(logits_BTV.grad).all()


def _largest_float32_saved_for_backward(fn, logits_BTV):
    sizes = []

    def pack(t):
        if t.dtype == torch.float32:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(logits_BTV)
    return out, max(sizes, default=0)


def test_no_tokens_by_vocab_float32_copy_is_kept_for_backward():
    def fn(x):
        return token_logprobs(x, torch.zeros(4, 64, dtype=torch.long), chunk_size=16)

    # bf16 logits: the only (tokens x vocab) tensor saved is the caller's bf16 logits; float32 saved
    # tensors are per-token vectors.
    logits_BTV = torch.randn(4, 64, 1000).bfloat16().requires_grad_()
    out, largest = _largest_float32_saved_for_backward(fn, logits_BTV)
    assert largest <= 4 * 64
    out.sum().backward()
    assert logits_BTV.grad.dtype == torch.bfloat16 and torch.isfinite(logits_BTV.grad.float()).all()


@pytest.mark.parametrize("chunk_size", [2, 7, 64])
def test_non_contiguous_and_other_ranks_match_reference(chunk_size):
    gen = torch.Generator().manual_seed(4)
    full_BTV = torch.randn(3, 6, 9, dtype=torch.float64, generator=gen, requires_grad=True)
    logits_BTV = full_BTV[:, :-1]  # what a trainer passes: the positions that predict the completion
    assert not logits_BTV.is_contiguous()
    token_ids_BT = torch.randint(0, 9, (3, 5), generator=gen)
    logprobs_BT = token_logprobs(logits_BTV, token_ids_BT, chunk_size=chunk_size)
    assert_close(logprobs_BT, _reference_logprobs(logits_BTV.detach(), token_ids_BT))
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x[:, :-1], token_ids_BT, chunk_size=chunk_size), (full_BTV,)
    )
    # [T, V] and [A, B, T, V]
    assert_close(token_logprobs(logits_BTV[0], token_ids_BT[0], chunk_size=chunk_size), logprobs_BT[0])
    four_d = token_logprobs(
        logits_BTV.reshape(1, 3, 5, 9), token_ids_BT.reshape(1, 3, 5), chunk_size=chunk_size
    )
    assert_close(four_d, logprobs_BT[None])


def test_sliced_logits_are_not_copied():
    full_BTV = torch.randn(2, 9, 50).bfloat16().requires_grad_()
    logits_BTV = full_BTV[:, :-1]
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(logits_BTV, torch.zeros(2, 8, dtype=torch.long), chunk_size=4).sum().backward()
    (saved_logits,) = [t for t in saved if t.dim() == 3]
    assert saved_logits.data_ptr() == full_BTV.data_ptr()  # the caller's view, not a flattened copy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_give_float32_logprobs_and_a_once_rounded_gradient(dtype):
    # Only the inputs are low precision: log-probs are float32 (what the losses need to form ratios),
    # and the gradient is the exact one rounded once to the logits' dtype (not computed in it).
    gen = torch.Generator().manual_seed(7)
    logits_BTV = (torch.randn(3, 5, 11, generator=gen) * 4).to(dtype).requires_grad_()
    token_ids_BT = torch.randint(0, 11, (3, 5), generator=gen)
    weights_BT = torch.randn(3, 5, generator=gen)
    logprobs_BT = token_logprobs(logits_BTV, token_ids_BT, temperature=0.7, chunk_size=4)
    (logprobs_BT * weights_BT).sum().backward()
    reference = logits_BTV.detach().double().requires_grad_()
    expected_BT = _reference_logprobs(reference, token_ids_BT, temperature=0.7)
    (expected_BT * weights_BT.double()).sum().backward()
    assert logprobs_BT.dtype == torch.float32 and logits_BTV.grad.dtype == dtype
    assert_close(logprobs_BT.double(), expected_BT.detach(), rtol=1e-6, atol=1e-6)
    # Within one unit in the last place of the exact gradient (rounding itself costs half of one);
    # computing in bf16 instead is off by several.
    assert_close(logits_BTV.grad.double(), reference.grad, rtol=torch.finfo(dtype).eps, atol=1e-6)


def test_backward_writes_the_gradient_in_the_logits_dtype():
    # Each chunk's float32 gradient goes straight into a buffer of the logits' dtype. A float32 buffer of
    # every token would double the peak memory, and autograd would hide it by casting the result, so
    # this reads the gradient as the backward node itself returns it.
    logits_BTV = torch.randn(2, 16, 500).bfloat16().requires_grad_()
    logprobs_BT = token_logprobs(logits_BTV, torch.zeros(2, 16, dtype=torch.long), chunk_size=8)
    (node,) = [fn for fn, _ in logprobs_BT.grad_fn.next_functions if fn is not None]
    grad_BTV = node.apply(torch.ones(2, 16))[0]
    assert grad_BTV.dtype == torch.bfloat16 and grad_BTV.shape == logits_BTV.shape


def test_token_logprobs_one_and_zero_tokens():
    logits_BTV = torch.tensor([[[0.0, 0.0]], [[2.0, 0.0]]], dtype=torch.float64)
    logprobs_BT = token_logprobs(logits_BTV, torch.tensor([[0], [1]]))
    assert_close(logprobs_BT, _reference_logprobs(logits_BTV, torch.tensor([[0], [1]])))
    empty_BT = token_logprobs(torch.zeros(3, 0, 5), torch.zeros(3, 0, dtype=torch.long))
    assert empty_BT.shape == (3, 0)


def test_token_logprobs_errors_name_the_problem():
    logits_BTV = torch.zeros(2, 3, 5)
    token_ids_BT = torch.zeros(2, 3, dtype=torch.long)
    for temperature in (0.0, -1.0):
        with pytest.raises(ValueError, match=f"temperature must be positive, got {temperature}"):
            token_logprobs(logits_BTV, token_ids_BT, temperature=temperature)
    for chunk_size in (0, -4):
        with pytest.raises(ValueError, match=f"chunk_size must be positive, got {chunk_size}"):
            token_logprobs(logits_BTV, token_ids_BT, chunk_size=chunk_size)
    with pytest.raises(ValueError, match=r"logits \(2, 3, 5\) do not match token ids \(2, 4\)"):
        token_logprobs(logits_BTV, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"at least a token and a vocabulary axis, got \(5,\)"):
        token_logprobs(torch.zeros(5), torch.tensor(0))


# ----------------------------------------------------------------------------------------------------
# linear_token_logprobs: the output head fused with the log-softmax


def _reference_head(hidden_NH, weight_VH, token_ids_N, temperature=1.0):
    """Unchunked float64 log-probs and entropy of softmax(hidden @ weight.T / T)."""
    logp_NV = torch.log_softmax((hidden_NH.double() @ weight_VH.double().T) / temperature, dim=-1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return logp_NV.gather(-1, token_ids_N[..., None]).squeeze(-1), entropy_N


@pytest.mark.parametrize("chunk_size", [1, 3, 6, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_linear_token_logprobs_matches_reference(chunk_size, temperature):
    gen = torch.Generator().manual_seed(5)
    hidden_BTH = torch.randn(2, 3, 8, generator=gen)
    weight_VH = torch.randn(13, 8, generator=gen)
    token_ids_BT = torch.randint(0, 13, (2, 3), generator=gen)
    logprobs_BT, entropy_BT = linear_token_logprobs(
        hidden_BTH, weight_VH, token_ids_BT, temperature=temperature, chunk_size=chunk_size
    )
    expected_logprobs, expected_entropy = _reference_head(hidden_BTH, weight_VH, token_ids_BT, temperature)
    assert logprobs_BT.dtype == torch.float32 and logprobs_BT.shape == (2, 3)
    assert_close(logprobs_BT.double(), expected_logprobs, atol=1e-5, rtol=1e-5)
    assert_close(entropy_BT.double(), expected_entropy, atol=1e-5, rtol=1e-5)


def test_linear_token_logprobs_gradcheck_float64():
    gen = torch.Generator().manual_seed(6)
    hidden_NH = torch.randn(5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight_VH = torch.randn(7, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    token_ids_N = torch.randint(0, 7, (5,), generator=gen)
    assert torch.autograd.gradcheck(
        lambda h, w: linear_token_logprobs(h, w, token_ids_N, temperature=0.8, chunk_size=2)[0],
        (hidden_NH, weight_VH),
    )


def test_linear_token_logprobs_bf16_gradients_match_float64():
    """bf16 hidden states and a float32 weight (mixed precision): gradients within bf16's rounding."""
    gen = torch.Generator().manual_seed(7)
    hidden_NH = torch.randn(9, 16, generator=gen).bfloat16().requires_grad_()
    weight_VH = (torch.randn(40, 16, generator=gen) / 4).requires_grad_()
    token_ids_N = torch.randint(0, 40, (9,), generator=gen)
    weights_N = torch.randn(9, generator=gen)
    (linear_token_logprobs(hidden_NH, weight_VH, token_ids_N, chunk_size=4)[0] * weights_N).sum().backward()
    hidden_ref = hidden_NH.detach().double().requires_grad_()
    weight_ref = weight_VH.detach().double().requires_grad_()
    (_reference_head(hidden_ref, weight_ref, token_ids_N)[0] * weights_N.double()).sum().backward()
    assert hidden_NH.grad.dtype == torch.bfloat16 and weight_VH.grad.dtype == torch.float32
    for grad, reference in ((hidden_NH.grad, hidden_ref.grad), (weight_VH.grad, weight_ref.grad)):
        relative = (grad.double() - reference).norm() / reference.norm()
        assert relative < 2e-2, relative


def test_linear_token_logprobs_never_holds_all_logits():
    """Forward and backward of 64 tokens x 1000 vocabulary in chunks of 16: no tensor of more than one
    chunk's logits is saved for backward or allocated at once."""
    hidden_NH = torch.randn(64, 8, requires_grad=True)
    weight_VH = torch.randn(1000, 8, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs_N, _ = linear_token_logprobs(
            hidden_NH, weight_VH, torch.zeros(64, dtype=torch.long), chunk_size=16
        )
    assert max(saved) == 1000 * 8  # the weight itself; per-token vectors otherwise, no [64, 1000] logits
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logprobs_N.sum().backward()
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)  # one op's allocation
    # The weight's gradient (1000 x 8 float32) is the largest buffer; 16 x 1000 chunks are as large.
    assert largest <= 2 * 1000 * 8 * 4, largest


def test_linear_token_logprobs_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="do not match"):
        linear_token_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[V, H\]"):
        linear_token_logprobs(torch.randn(3, 4), torch.randn(5, 3), torch.zeros(3, dtype=torch.long))
