"""The GPU-like CPU backend (tests/gpu_rounding.py): one-row calls stay MLX's own, bit
for bit; one call over several rows gives the right values with other rounding than
the same rows computed one at a time."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_vlm.models.qwen3_5 import gated_delta

import dflash2_kernel_base
import dflash2_kernel_qmv
import gpu_rounding

ROWS = 8


def random(shape, seed, scale=1.0, dtype=mx.float16):
    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(dtype)


def by_rows(fn, x):
    return mx.concatenate([fn(x[:, i : i + 1]) for i in range(x.shape[1])], axis=1)


def quantized_matmul():
    weight, scales, biases = dflash2_kernel_qmv.make_weights(64, 512, mx.random.key(0))

    def fn(x):
        return mx.quantized_matmul(x, weight, scales, biases, transpose=True, group_size=128, bits=2)

    x = random((1, ROWS, 512), 1)
    return fn(x), by_rows(fn, x)


def linear():
    layer = nn.Linear(512, 48, bias=False)
    layer.weight = random((48, 512), 2, 0.05)
    x = random((1, ROWS, 512), 1)
    return layer(x), by_rows(layer, x)


def matmul():
    weight = random((512, 48), 2, 0.05)
    x = random((1, ROWS, 512), 1)
    return mx.matmul(x, weight), by_rows(lambda row: mx.matmul(row, weight), x)


def addmm():
    weight, bias = random((512, 48), 2, 0.05), random((48,), 3)
    x = random((1, ROWS, 512), 1)
    return mx.addmm(bias, x, weight), by_rows(lambda row: mx.addmm(bias, row, weight), x)


def attention():
    q, k, v = random((1, 4, ROWS, 64), 4), random((1, 2, 24, 64), 5), random((1, 2, 24, 64), 6)
    batched = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    prefix = 24 - ROWS
    rows = [
        mx.fast.scaled_dot_product_attention(
            q[:, :, i : i + 1], k[:, :, : prefix + i + 1], v[:, :, : prefix + i + 1], scale=0.125
        )
        for i in range(ROWS)
    ]
    return batched, mx.concatenate(rows, axis=2)


def recurrence():
    """Per-step states of stock verify's recurrence: one call of 8 steps, or 8 calls."""
    q, k = random((1, ROWS, 1, 64), 7, 0.1), random((1, ROWS, 1, 64), 8, 0.1)
    v, a, b = random((1, ROWS, 2, 64), 9), random((1, ROWS, 2), 10), random((1, ROWS, 2), 11)
    state = random((1, 2, 64, 64), 12, dtype=mx.float32)
    A_log, dt_bias = mx.zeros(2), mx.zeros(2)
    _, _, batched = gated_delta.gated_delta_update_with_states(q, k, v, a, b, A_log, dt_bias, state)
    rows = []
    for i in range(ROWS):
        step = [x[:, i : i + 1] for x in (q, k, v, a, b)]
        _, state, states = gated_delta.gated_delta_update_with_states(*step, A_log, dt_bias, state)
        rows.append(states)
    return batched, mx.concatenate(rows, axis=1)


CASES = [quantized_matmul, linear, matmul, addmm, attention, recurrence]


def bits(a):
    return np.array(a).view({2: np.uint16, 4: np.uint32}[a.dtype.size])


@pytest.mark.parametrize("case", CASES)
def test_one_row_calls_stay_mlx_own(case, monkeypatch):
    _, stock_rows = case()
    gpu_rounding.swap_row_variant_ops(monkeypatch)
    _, rows = case()
    assert np.array_equal(bits(rows), bits(stock_rows))


@pytest.mark.parametrize("case", CASES)
def test_multi_row_calls_round_differently(case, monkeypatch):
    gpu_rounding.swap_row_variant_ops(monkeypatch)
    batched, rows = case()
    assert batched.shape == rows.shape and batched.dtype == rows.dtype
    assert not np.array_equal(bits(batched), bits(rows))
    # Same maths: apart from rounding, within 1% of the largest value.
    batched, rows = (np.array(x.astype(mx.float32)) for x in (batched, rows))
    assert np.abs(batched - rows).max() <= 0.01 * np.abs(rows).max()


def test_one_fp16_row_takes_mlx_s_steps_and_stands_down_where_they_differ(monkeypatch):
    """The fast one-row path gives MLX's CPU kernel's bits on every input kind (signed zeros,
    overflow, subnormals) and serves after its first row, but for rows holding a NaN; a weight
    whose first row differs from MLX's call (here: made otherwise) is served by MLX's call from
    then on."""
    weight, scales, biases = dflash2_kernel_qmv.make_weights(64, 512, mx.random.key(0))
    monkeypatch.setattr(gpu_rounding, "_FP16_WEIGHTS", {})

    def stock(x):
        return gpu_rounding.STOCK_QUANTIZED_MATMUL(x, weight, scales, biases, transpose=True, group_size=128, bits=2)

    for kind in dflash2_kernel_base.INPUT_KINDS:
        x = dflash2_kernel_base.make_inputs(kind, 2, 512, mx.random.key(1))
        for row in (x[:1], x[1:]):
            got = gpu_rounding.one_fp16_row(row, weight, scales, biases, 128, 2)
            assert np.array_equal(bits(got), bits(stock(row))), kind
    assert [kept[1] is not None for kept in gpu_rounding._FP16_WEIGHTS.values()] == [True]
    # A row holding a NaN is MLX's call's: the signs of meeting NaNs follow its operand order.
    nan_row = mx.where(mx.arange(512) == 7, mx.array(float("nan"), dtype=mx.float16), x[:1])
    assert gpu_rounding.one_fp16_row(nan_row, weight, scales, biases, 128, 2) is None

    monkeypatch.setattr(gpu_rounding, "_FP16_WEIGHTS", {})
    monkeypatch.setattr(gpu_rounding, "_fp16_weight", lambda *args: mx.zeros((512, 64)))
    x = random((1, 512), 1)
    assert np.array_equal(bits(gpu_rounding.one_fp16_row(x, weight, scales, biases, 128, 2)), bits(stock(x)))
    assert gpu_rounding.one_fp16_row(x, weight, scales, biases, 128, 2) is None  # MLX's call serves
