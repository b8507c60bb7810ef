"""The C++ RMSNorm, RoPE, KV store and gated SiLU (kernels/native/elementwise.py) give what the torch ops give, on the
layouts the model hands them, and leave what they do not take to torch."""

import pytest
import torch

from batchprefill.kernels.native import elementwise as native_elementwise
from batchprefill.kernels.torch import elementwise as torch_elementwise
from batchprefill.kernels.torch.ops import TorchOps


@pytest.fixture(scope="module")
def kernels() -> native_elementwise.NativeElementwise:
    built = native_elementwise.load()
    assert built is not None, "the elementwise kernels must build here (a C++ compiler is on this machine)"
    return built


@pytest.mark.parametrize("rows", [1, 80, 600])  # 600 rows: split across threads
def test_rms_norm_with_the_residual_add_equals_the_torch_ops(kernels, rows):
    generator = torch.Generator().manual_seed(rows)
    x, residual, weight = (torch.randn(rows, 576, generator=generator), torch.randn(rows, 576, generator=generator),
                           torch.randn(576, generator=generator))
    normed, total = kernels.rms_norm(x, weight, 1e-5, residual)
    want_normed, want_total = torch_elementwise.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(total, want_total)  # one float32 add either way
    assert torch.allclose(normed, want_normed, atol=1e-5)


def test_rms_norm_without_a_residual_returns_the_input_itself_and_reads_strided_rows(kernels):
    base = torch.randn(7, 100)
    x = base[:, 10:74]  # rows 100 floats apart
    normed, same = kernels.rms_norm(x, torch.ones(64), 1e-6)
    assert same is x
    assert torch.allclose(normed, torch_elementwise.rms_norm(x, torch.ones(64), 1e-6)[0], atol=1e-6)
    # mean of squares 1 after the norm, the weight being ones
    assert torch.allclose(normed.pow(2).mean(-1), torch.ones(7), atol=1e-5)


def test_rope_on_views_of_the_fused_projection_equals_the_torch_ops(kernels):
    # q and k as the decoder makes them: views of one [T, q + 2 kv] projection, and a partial rotary slice
    generator = torch.Generator().manual_seed(2)
    qkv = torch.randn(30, 9 * 64 + 2 * 3 * 64, generator=generator)
    q, k = qkv[:, : 9 * 64].view(30, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(30, 3, 64)
    positions = torch.randint(0, 100, (30,), generator=generator)
    table = torch.randn(100, 64, generator=generator)
    for got, want in zip(kernels.rope(q, k, positions, table), torch_elementwise.rope(q, k, positions, table)):
        assert got.is_contiguous() and torch.allclose(got, want, atol=1e-6)
    partial = table[:, :32].contiguous()
    for got, want in zip(kernels.rope(q[..., :32], k[..., :32], positions, partial),
                         torch_elementwise.rope(q[..., :32], k[..., :32], positions, partial)):
        assert torch.allclose(got, want, atol=1e-6)


def test_position_zero_leaves_the_heads_unrotated(kernels):
    # cos 1 and sin 0 at position 0 (as rope_cos_sin makes it): the output is the input
    x = torch.randn(2, 3, 8)
    table = torch.cat([torch.ones(1, 4), torch.zeros(1, 4)], dim=1)
    got, _ = kernels.rope(x, x, torch.zeros(2, dtype=torch.int64), table)
    assert torch.equal(got, x)


def test_the_kv_store_writes_each_token_at_its_slot_and_skips_padding(kernels):
    # value as the decoder hands it: a view of the fused projection, rows 7 x 8 floats apart
    generator = torch.Generator().manual_seed(3)
    key = torch.randn(3, 2, 8, generator=generator)
    value = torch.randn(3, 7 * 8, generator=generator)[:, 8:24].view(3, 2, 8)
    slots = torch.tensor([5, -1, 12])  # the middle token is a padded batch's filler
    pools = [torch.zeros(4, 4, 2, 8) for _ in range(4)]
    kernels.store_kv(key, value, pools[0], pools[1], slots)
    torch_elementwise.store_kv(key, value, pools[2], pools[3], slots)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    flat = pools[0].view(16, 2, 8)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[12], key[2])
    assert int((pools[1].view(16, -1).abs().sum(-1) > 0).sum()) == 2  # nothing written for the filler


@pytest.mark.parametrize("rows", [1, 80, 600])
def test_bfloat16_rms_norm_rounds_once_where_the_torch_ops_widen_and_round_each_tensor(kernels, rows):
    # the same float32 arithmetic on the same rounded sum: bitwise equal but for the order of the sum of squares,
    # which moves a result by at most one bfloat16 step (2^-7 of it)
    generator = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 576, generator=generator).bfloat16() for _ in range(2))
    weight = torch.randn(576, generator=generator).bfloat16()
    normed, total = kernels.rms_norm(x, weight, 1e-5, residual)
    want_normed, want_total = torch_elementwise.rms_norm(x, weight, 1e-5, residual)
    assert normed.dtype == total.dtype == torch.bfloat16
    assert torch.equal(total, want_total)  # x + residual rounded to bfloat16 once either way
    steps = (normed.float() - want_normed.float()).abs() / want_normed.float().abs().clamp_min(1e-30)
    assert float(steps.max()) <= 2**-7 and float((normed != want_normed).float().mean()) < 0.01


def test_bfloat16_rope_and_kv_store_equal_the_torch_ops(kernels):
    generator = torch.Generator().manual_seed(4)
    qkv = torch.randn(30, 9 * 64 + 2 * 3 * 64, generator=generator).bfloat16()
    q, k = qkv[:, : 9 * 64].view(30, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(30, 3, 64)
    v = qkv[:, 12 * 64 :].view(30, 3, 64)
    positions = torch.randint(0, 100, (30,), generator=generator)
    table = torch.randn(100, 64, generator=generator)
    for got, want in zip(kernels.rope(q, k, positions, table), torch_elementwise.rope(q, k, positions, table)):
        # x1 cos - x2 sin in float32, rounded once, in both: at most one rounding step apart (fused multiply-adds)
        assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    pools = [torch.zeros(8, 4, 3, 64, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.randperm(32, generator=generator)[:30]
    kernels.store_kv(k, v, pools[0], pools[1], slots)
    torch_elementwise.store_kv(k, v, pools[2], pools[3], slots)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])


@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (80, 1536), (600, 100)])  # 600: split; 100: a ragged tail
def test_silu_of_the_gate_times_up_equals_the_torch_ops_in_float32(kernels, rows, width):
    generator = torch.Generator().manual_seed(rows)
    gate_up = 4 * torch.randn(rows, 2 * width, generator=generator)
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])  # where the sigmoid is 1/2, 1 and about e^-90
    got = kernels.gated_activation(gate_up, "silu")
    want = torch_elementwise.gated_activation(gate_up, "silu")
    assert got.shape == (rows, width) and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bfloat16_silu_rounds_once_where_the_torch_ops_round_the_activation_and_the_product(kernels):
    # float32 arithmetic on the same bfloat16 gate and up in both; torch rounds silu(gate) to bfloat16 before the
    # product, this rounds the product once: it is the float32 result rounded (half a step, 2^-8 of it, at most)
    gate_up = (4 * torch.randn(80, 2 * 1536, generator=torch.Generator().manual_seed(5))).bfloat16()
    got = kernels.gated_activation(gate_up, "swish")
    exact = torch_elementwise.gated_activation(gate_up.float(), "silu")
    torch_ops = torch_elementwise.gated_activation(gate_up, "silu")
    assert got.dtype == torch.bfloat16
    assert float(((got.float() - exact).abs() / exact.abs().clamp_min(1e-30)).max()) <= 2**-8 * (1 + 1e-5)
    assert float((got != exact.bfloat16()).float().mean()) < 0.01  # the exp's last bits tip a few ties
    assert float((got.float() - exact).abs().sum()) < float((torch_ops.float() - exact).abs().sum())


def test_a_dtype_the_kernels_lack_and_mixed_dtypes_run_the_torch_ops(kernels):
    x, weight = torch.randn(4, 16).half(), torch.ones(16, dtype=torch.half)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5)[0], torch_elementwise.rms_norm(x, weight, 1e-5)[0])
    x = x.bfloat16()
    normed, _ = kernels.rms_norm(x, torch.ones(16), 1e-5)  # a float32 weight on bfloat16 rows
    want, _ = torch_elementwise.rms_norm(x, torch.ones(16), 1e-5)
    assert normed.dtype == torch.bfloat16 and torch.equal(normed, want)


def test_the_torch_backend_takes_them_only_when_native(kernels):
    assert TorchOps(native=False).rms_norm is torch_elementwise.rms_norm
    assert TorchOps().rope.__func__ is native_elementwise.NativeElementwise.rope
    assert TorchOps().store_kv.__func__ is native_elementwise.NativeElementwise.store_kv
    assert TorchOps().gated_activation.__func__ is native_elementwise.NativeElementwise.gated_activation
    assert TorchOps(native=False).gated_activation is torch_elementwise.gated_activation


def test_gelu_and_half_precision_gates_run_the_torch_ops(kernels):
    gate_up = torch.randn(6, 32)
    for activation in ("gelu", "gelu_pytorch_tanh"):
        assert torch.equal(kernels.gated_activation(gate_up, activation),
                           torch_elementwise.gated_activation(gate_up, activation))
    assert torch.equal(kernels.gated_activation(gate_up.half(), "silu"),
                       torch_elementwise.gated_activation(gate_up.half(), "silu"))
