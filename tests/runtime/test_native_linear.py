"""The native form's skinny product (layers/native_linear_source.py) against F.linear: every shape a
decode step or a prompt gives it, with and without a bias, and rows read at a stride."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from goodput_runtime.layers import native_attention

pytestmark = pytest.mark.skipif(
    not native_attention.skinny_linear_available(), reason="this CPU's build has no skinny product (AVX2 and FMA)"
)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 65])
@pytest.mark.parametrize("out_features, in_features", [(8, 8), (13, 5), (960, 576), (577, 1539)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_skinny_product_equals_f_linear(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    out = native_attention.skinny_linear(x, weight, b)
    assert out is not None and out.shape == (rows, out_features)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-4 * in_features**0.5)


def test_rows_read_at_a_stride_and_each_row_alone_give_the_same_sums():
    # a row's result does not depend on the rows beside it: the same sums in the same order
    x = torch.randn(6, 2 * 64)[:, :64]  # each row 128 floats apart
    weight = torch.randn(40, 64)
    together = native_attention.skinny_linear(x, weight, None)
    assert together is not None
    for i in range(6):
        alone = native_attention.skinny_linear(x[i : i + 1].contiguous(), weight, None)
        assert alone is not None and torch.equal(alone[0], together[i])


def test_what_it_does_not_take_is_left_to_f_linear():
    weight = torch.randn(16, 8)
    assert native_attention.skinny_linear(torch.randn(2, 8, dtype=torch.bfloat16), weight.bfloat16(), None) is None
    assert native_attention.skinny_linear(torch.randn(1, 2, 8), weight, None) is None  # not [T, in]
    assert native_attention.skinny_linear(torch.randn(2, 8), weight.t().contiguous().t(), None) is None
