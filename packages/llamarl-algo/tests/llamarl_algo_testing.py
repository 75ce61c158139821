"""assert_close for the algo tests, without torch.testing.

torch.testing.assert_close imports torch.distributed.tensor on first use, which costs about 10 s of
this suite's budget on a loaded 2-core machine; these tests only compare small dense tensors.
"""

import torch

# torch.testing's defaults (rtol, atol) per dtype.
_TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def assert_close(actual, expected, *, rtol=None, atol=None, msg=None):
    """Same shape, same dtype, and |actual - expected| <= atol + rtol |expected| everywhere."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, (
        f"shape {tuple(actual.shape)} != {tuple(expected.shape)} {msg or ''}"
    )
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype} {msg or ''}"
    default_rtol, default_atol = _TOLERANCES.get(actual.dtype, (0.0, 0.0))
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    a, e = actual.detach().double(), expected.detach().double()
    close = torch.isclose(a, e, rtol=rtol, atol=atol) | ((a == e) & torch.isinf(e))
    if not bool(close.all()):
        diff = (a - e).abs()[~close]
        raise AssertionError(
            f"{int((~close).sum())} of {close.numel()} elements differ (max |diff| {float(diff.max()):.3g}) "
            f"{msg or ''}\nactual:\n{actual}\nexpected:\n{expected}"
        )
