"""dflash2_kernel_gdn on CPU: the recurrence equals decode's steps and the dense rows decode's
one-row linears, bit for bit, and their self-tests catch wrong kernels."""

import mlx.core as mx
import pytest

import dflash2_kernel_base
import dflash2_kernel_gdn
import dflash2_kernels as dk
from kernel_cases import flip_first_bit, one_bit_off, same_bits


def test_gdn_recurrence_equals_decode_steps():
    inputs = dflash2_kernel_gdn.make_gdn_inputs("normal", 1, 3, 1, 2, 64, 64, mx.random.key(1))
    y, states = dk.gdn_recurrence(*inputs)
    want_y, want_states = dflash2_kernel_gdn.stock_recurrence(*inputs, eval_each_step=True)
    assert y.shape == (1, 3, 2, 64) and states.shape == (1, 3, 2, 64, 64)
    assert same_bits(y, want_y) and same_bits(states, want_states)


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_dense_rows_equals_one_row_linears(dtype):
    """fp16, and fp32 as the real file's gate weights and activations."""
    weight = dflash2_kernel_gdn.make_dense_weight(7, 320, mx.random.key(1), dtype)
    make = dflash2_kernel_base.make_inputs if dtype == mx.float16 else dflash2_kernel_base.make_inputs_fp32
    x = make("large", 6, 320, mx.random.key(2)).reshape(2, 3, 320)
    want = mx.concatenate([x.reshape(6, 320)[m : m + 1] @ weight.T for m in range(6)])
    got = dk.dense_rows(x, weight)
    assert got.dtype == dtype and same_bits(got, want.reshape(2, 3, 7))
    with pytest.raises(ValueError, match="1..8 rows"):
        dk.dense_rows(mx.zeros((9, 320), dtype=dtype), weight)


@pytest.mark.parametrize("fp32", [False, True])
def test_wrong_recurrence_fails_naming_the_case(fp32):
    """fp16 q, k, v's self-test and fp32's (the real file's, their own inputs) each fail a y
    one bit off at 3 steps."""
    dtypes = []

    def wrong(q, k, v, g, beta, state):
        dtypes.append((q.dtype, beta.dtype))
        return one_bit_off(dflash2_kernel_gdn.stock_recurrence, 3)(q, k, v, g, beta, state, axis=1)

    self_test = dflash2_kernel_gdn.self_test_gdn32 if fp32 else dflash2_kernel_gdn.self_test_gdn
    result = self_test([(1, 1, 2, 64, 64)], max_steps=3, kernel=wrong)
    assert not result.ok and result.variant is None
    assert result.variants == {"kernel": len(dflash2_kernel_gdn.GDN_INPUT_KINDS)}
    assert f"(B, Hk, Hv, Dk, Dv)=(1, 1, 2, 64, 64) L=3{' fp32' * fp32} input=normal" in result.reason
    assert "1 of y, 0 of states" in result.reason
    dtype = mx.float32 if fp32 else mx.float16
    assert set(dtypes) == {(dtype, dtype)}
    assert self_test([(1, 1, 2, 64, 64)], max_steps=3, kernel=dflash2_kernel_gdn.stock_recurrence).ok


def test_fp32_recurrence_serves_by_its_own_self_test(monkeypatch, float32_target):
    """fp32 q, k, v and beta (the real file's), as on CUDA with a stand-in kernel: they take
    the variant fp32's own self-test chose, on fp32 inputs (fp16's verdict, from fp16 inputs,
    never decided them); fp16 inputs fp16's verdict; a mix of dtypes the self-tests never saw
    stays decode's steps. An fp32 pack's start-up tests it at its shapes."""
    from dflash2_pack import kernel_shapes

    calls = []

    def stand_in(q, k, v, g, beta, state, variant):
        calls.append((q.dtype, variant))
        return dflash2_kernel_gdn.stock_recurrence(q, k, v, g, beta, state)

    monkeypatch.setattr(dflash2_kernel_gdn, "recurrence_backend", lambda: "cuda")
    monkeypatch.setattr(dflash2_kernel_gdn, "cuda_recurrence", stand_in)
    monkeypatch.setattr(dflash2_kernel_gdn, "_gdn_serving", {"cuda": None})
    monkeypatch.setattr(dflash2_kernel_gdn, "_gdn32_serving", {})
    result = dflash2_kernel_gdn.self_test_gdn32([(1, 1, 2, 64, 64)], max_steps=2)
    assert result.ok and result.variant == "fma" and dflash2_kernel_gdn._gdn32_serving == {"cuda": "fma"}
    assert {dtype for dtype, _ in calls} == {mx.float32}
    calls.clear()
    for dtype in (mx.float32, mx.float16):
        inputs = dflash2_kernel_gdn.make_gdn_inputs("normal", 1, 2, 1, 2, 64, 64, mx.random.key(1), dtype)
        dk.gdn_recurrence(*inputs)
    assert calls == [(mx.float32, "fma")]  # fp16's verdict is None here: decode's steps
    q, k, v, g, beta, state = dflash2_kernel_gdn.make_gdn_inputs("normal", 1, 2, 1, 2, 64, 64, mx.random.key(1), mx.float32)
    dk.gdn_recurrence(q, k, v, g, beta.astype(mx.float16), state)
    assert calls == [(mx.float32, "fma")]
    shapes = kernel_shapes(float32_target[0])
    assert shapes["gdn_fp32"] and not shapes["gdn"]  # an fp32 pack tests no fp16 kernel
    assert dk.SELF_TESTS["gdn32"][0] == "gdn_fp32" and "gdn32" in dk.VERDICT_TABLES


def test_metal_verify_recurrence_is_decode_s_fused_kernel(monkeypatch, on_cpu):
    """Where decode runs mlx-vlm's fused Metal kernel (a Metal-like CPU backend: its stand-in
    rounds unlike the ops step), the reference is that kernel a step at a time; the
    with-states kernel serves all steps in one call only while its self-test finds it equal,
    and one a bit off leaves verify on the fused kernel a step at a time."""
    from gpu_rounding import metal_like_recurrence, metal_like_with_states_kernel
    from mlx_vlm.models.qwen3_5 import gated_delta

    metal_like_recurrence(monkeypatch)
    monkeypatch.setattr(dflash2_kernel_gdn, "_gdn_serving", {})
    inputs = dflash2_kernel_gdn.make_gdn_inputs("normal", 1, 4, 1, 2, 64, 64, mx.random.key(1))
    want_y, want_states = dflash2_kernel_gdn.stock_recurrence(*inputs, eval_each_step=True)
    kernel_y, kernel_state = gated_delta.gated_delta_kernel(*inputs)  # T=4 in one call
    assert same_bits(want_y, kernel_y) and same_bits(want_states[:, -1], kernel_state)
    assert not same_bits(want_states[:, -1], dflash2_kernel_gdn.gated_delta_ops(*inputs)[1])  # the stand-in has teeth
    shape = [(1, 1, 2, 64, 64)]
    served = dflash2_kernel_gdn.self_test_gdn(shape, max_steps=3)
    assert served.ok and served.backend == "metal" and served.variant == "with_states"
    y, states = dk.gdn_recurrence(*inputs)
    assert same_bits(y, want_y) and same_bits(states, want_states)

    def off_by_one_bit(**launch):  # the last bit of the first state's first element
        y, state, states = metal_like_with_states_kernel(**launch)
        return y, state, flip_first_bit(states)

    monkeypatch.setattr(gated_delta, "_gated_delta_with_states_kernel", off_by_one_bit)
    refused = dflash2_kernel_gdn.self_test_gdn(shape, max_steps=3)
    assert not refused.ok and refused.variant is None and "0 of y, 1 of states" in refused.reason
    y, states = dk.gdn_recurrence(*inputs)
    assert same_bits(y, want_y) and same_bits(states, want_states)


def test_dense_rows_take_only_the_dtypes_their_self_test_covers():
    """fp16 and fp32, weight and rows alike: a bf16 call (never tested) is decode's own."""
    for dtype, taken in ((mx.float16, True), (mx.float32, True), (mx.bfloat16, False)):
        x, weight = mx.zeros((2, 64), dtype), mx.zeros((3, 64), dtype)
        assert dflash2_kernel_gdn.dense_kernel_supports(x, weight) == taken, dtype
    assert not dflash2_kernel_gdn.dense_kernel_supports(mx.zeros((2, 64), mx.float32), mx.zeros((3, 64), mx.float16))


def test_wrong_dense_rows_fails_naming_the_case():
    result = dflash2_kernel_gdn.self_test_dense([(7, 320)], kernel=one_bit_off(dflash2_kernel_gdn.stock_dense_rows, 8))
    assert not result.ok
    assert result.mismatches == len(dflash2_kernel_base.INPUT_KINDS) + len(dflash2_kernel_base.FP32_INPUT_KINDS)
    assert "(N, K)=(7, 320) float16 rows=8 input=normal" in result.reason
    passed = dflash2_kernel_gdn.self_test_dense([(7, 320)], kernel=dflash2_kernel_gdn.stock_dense_rows)
    assert passed.ok and {case["dtype"] for case in passed.cases} == {"float16", "float32"}


def test_a_dense_kernel_wrong_only_in_fp32_fails_naming_it():
    """The fp32 cases are what tell the gemv replica's variants apart (fp16 products are
    exact in fp32): a kernel that rounds fp32 rows through fp16 passes every fp16 case."""
    def through_fp16(x, weight):
        return dflash2_kernel_gdn.stock_dense_rows(x.astype(mx.float16), weight.astype(mx.float16)).astype(x.dtype)

    result = dflash2_kernel_gdn.self_test_dense([(7, 320)], kernel=through_fp16)
    assert not result.ok and "float32" in result.reason
    assert all(case["mismatches"] == 0 for case in result.cases if case["dtype"] == "float16")
