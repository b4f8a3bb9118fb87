"""The prefill inverse (dflash2_kernels.invert_unit_lower), in process: bitwise mlx-vlm's
forward substitution, swapped in by the engine only when the start-up check finds it so;
test_server.py checks both servers' logs say it serves."""

import mlx.core as mx
import mlx_vlm.models.qwen3_5.gated_delta as gated_delta
import pytest

import dflash2_audit
import dflash2_engine
import dflash2_kernels
from parity import differing

STOCK = dflash2_audit.stock(dflash2_engine.INVERSE_TARGET)  # mlx-vlm's, even once swapped


def unit_lower(shape, scale, seed):
    """I + a strictly lower matrix, as gated_delta_chunked builds it (off-diagonals of
    correlated keys are about 1: scale 1)."""
    *batch, C, _ = shape
    lower = mx.tril(mx.random.normal(shape, key=mx.random.key(seed)) * scale, -1)
    return mx.eye(C, dtype=mx.float32) + lower


@pytest.mark.parametrize("shape, scale", [((1, 3, 1, 64, 64), 0.3), ((2, 2, 3, 64, 64), 1.0),
                                          ((1, 4, 2, 16, 16), 2.0)])
def test_row_appending_inverse_is_stock_bit_for_bit(shape, scale):
    Tmat = unit_lower(shape, scale, seed=sum(shape))
    C = shape[-1]
    want = STOCK(Tmat, C)
    assert differing(dflash2_kernels.invert_unit_lower(Tmat, C), want) == 0
    # The test sees arithmetic: the same substitution summing each row's products in
    # reverse order is the same matrix in other bits.
    assert differing(reversed_substitution(Tmat, C), want) > 0


def reversed_substitution(Tmat, C):
    rows = mx.broadcast_to(mx.eye(C, dtype=mx.float32), Tmat.shape)[..., :1, :]
    for i in range(1, C):
        product = Tmat[..., i : i + 1, :i][..., ::-1] @ rows[..., ::-1, :]
        rows = mx.concatenate([rows, mx.eye(C, dtype=mx.float32)[i : i + 1] - product], axis=-2)
    return rows


def test_swapped_in_only_when_the_start_up_check_passes(monkeypatch):
    monkeypatch.setattr(dflash2_kernels, "backend_name", lambda: "cpu")  # row-appending the only candidate
    monkeypatch.setattr(gated_delta, "_invert_unit_lower", STOCK)  # undone after the test
    assert dflash2_kernels.self_test_inverse(heads=2, kernel=reversed_substitution) > 0
    monkeypatch.setattr(dflash2_kernels, "self_test_inverse", lambda kernel=None: 7)
    line = dflash2_engine.use_exact_prefill_inverse()
    assert "the row-appending one differed from it here in 7 elements" in line
    assert gated_delta._invert_unit_lower is STOCK
    monkeypatch.undo()
    monkeypatch.setattr(dflash2_kernels, "backend_name", lambda: "cpu")
    monkeypatch.setattr(gated_delta, "_invert_unit_lower", STOCK)
    line = dflash2_engine.use_exact_prefill_inverse()
    assert "row-appending" in line and gated_delta._invert_unit_lower is dflash2_kernels.invert_unit_lower
    assert gated_delta._invert_unit_lower.__dflash2_stock__ is STOCK


def test_on_cuda_the_one_launch_append_is_tried_first_and_skipped_when_it_fails(monkeypatch):
    """Off CUDA only the row-appending inverse is a candidate. On CUDA the one-launch append
    comes first; here (MLX on CPU) its kernel cannot build, so the engine says so and
    installs the row-appending one."""
    if dflash2_kernels.backend_name() == "cuda":
        pytest.skip("here the one-launch kernel builds: test_one_launch_inverse_on_cuda")
    assert [name for name, _ in dflash2_kernels.inverse_candidates()] == ["row-appending"]
    monkeypatch.setattr(gated_delta, "_invert_unit_lower", STOCK)
    monkeypatch.setattr(dflash2_kernels, "backend_name", lambda: "cuda")
    assert [name for name, _ in dflash2_kernels.inverse_candidates()] == ["one-launch append", "row-appending"]
    line = dflash2_engine.use_exact_prefill_inverse()
    assert line.startswith("prefill inverse: row-appending, bitwise") and "the one-launch append one failed" in line
    assert gated_delta._invert_unit_lower is dflash2_kernels.invert_unit_lower


def identity_row_minus(negate_zero: bool):
    """The one-launch kernel's row in MLX ops: the identity's row i written from the column
    index, minus the product (negate_zero: -product where the identity is 0, which turns
    +0 into -0)."""
    def append(done, x_row, product):
        i = done.shape[-2]
        at_i = mx.arange(product.shape[-1]) == i
        row = mx.where(at_i, 1.0 - product, -product if negate_zero else 0.0 - product)
        return mx.concatenate([done, row], axis=-2)

    return append


def test_the_one_launch_kernels_row_formula_is_stocks_bits():
    """What the CUDA kernel computes for the new row, (j == i ? 1 : 0) - product, gives
    stock's bits; the shortcut -product where the identity is 0 does not (signed zeros)."""
    Tmat = unit_lower((1, 3, 2, 64, 64), 0.5, seed=5)
    want = STOCK(Tmat, 64)
    assert differing(dflash2_kernels.invert_unit_lower(Tmat, 64, append=identity_row_minus(False)), want) == 0
    assert differing(dflash2_kernels.invert_unit_lower(Tmat, 64, append=identity_row_minus(True)), want) > 0


@pytest.mark.skipif(dflash2_kernels.backend_name() != "cuda", reason="the kernel is CUDA's")
@pytest.mark.parametrize("shape, scale", [((1, 3, 1, 64, 64), 0.3), ((2, 2, 3, 64, 64), 1.0),
                                          ((1, 4, 2, 16, 16), 2.0), ((5, 16, 16), 1.0)])
def test_one_launch_inverse_on_cuda(shape, scale):
    """The CUDA kernel itself (CPU tests hold only its formula): stock's bits."""
    Tmat = unit_lower(shape, scale, seed=sum(shape))
    assert differing(dflash2_kernels.invert_unit_lower_one_launch(Tmat, shape[-1]), STOCK(Tmat, shape[-1])) == 0
