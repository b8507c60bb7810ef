"""Linear layers: the prepacked oneDNN path gives what F.linear gives, and falls back where it cannot pack."""

import pytest
import torch
import torch.nn.functional as F

from batchprefill.kernels.linear import Linear


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_matches_f_linear_in_float32(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 64, generator=generator)
    layer = Linear(weight, bias)
    assert layer.packed == torch.backends.mkldnn.is_available()
    assert torch.allclose(layer(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_a_non_contiguous_input_is_taken_as_is():
    generator = torch.Generator().manual_seed(1)
    weight, wide = torch.randn(32, 48, generator=generator), torch.randn(5, 96, generator=generator)
    x = wide[:, ::2]  # every other column: strided rows
    assert torch.allclose(Linear(weight)(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_dtypes_onednn_does_not_take_keep_f_linear():
    weight = torch.randn(16, 8, dtype=torch.float64)
    layer = Linear(weight)
    assert not layer.packed
    x = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(layer(x), F.linear(x, weight))
