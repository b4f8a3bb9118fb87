"""dflash2_kernel_rope on CPU: the rotary of queries and keys equals mlx-vlm's compiled call bit
for bit, and its self-test catches wrong kernels; on CUDA the kernel at the 27B shape."""

import mlx.core as mx
import pytest

import dflash2_kernel_base
import dflash2_kernel_rope
import dflash2_kernels as dk
from kernel_cases import RecordingKernel, flip_first_bit, patch_kernels, same_bits


def test_rope_rows_equals_mlx_vlm_rotary():
    """Queries and keys (transposed views, as the model hands them over) rotated in their
    first R features, the rest passed through, as arrays of their shapes; on
    CUDA through the variant the kernel's self-test chose."""
    from mlx_vlm.models.rope_utils import rotate_half

    q, k, cos, sin = dflash2_kernel_rope.make_rope_case("normal", 2, 3, 1, 32, 16, 5, mx.random.key(1))
    variant = None
    if dk.backend_name() == "cuda":
        dflash2_kernel_rope.self_test_rope()
        variant = dflash2_kernel_rope._rope_serving["cuda"]
        assert variant in dflash2_kernel_rope.ROPE_VARIANTS
    got = dk.rope_rows(q, k, cos, sin, variant=variant)
    for x, rotated in zip((q, k), got):
        head, tail = x[..., :16], x[..., 16:]
        want = mx.concatenate([head * cos[:, None] + rotate_half(head) * sin[:, None], tail], axis=-1)
        assert rotated.shape == x.shape
        if variant is None:  # MLX's ops one at a time; a GPU contracts one product (rope_rows)
            assert same_bits(rotated, want)
        assert same_bits(rotated, dflash2_kernel_rope.stock_rope_rows(q, k, cos, sin)[x is k])


def test_wrong_rope_fails_naming_the_case():
    def wrong(q, k, cos, sin):  # the keys' first element one bit off at 8 positions
        q_out, k_out = dflash2_kernel_rope.stock_rope_rows(q, k, cos, sin)
        return q_out, flip_first_bit(k_out) if q.shape[2] == 8 else k_out

    result = dflash2_kernel_rope.self_test_rope([(1, 2, 1, 32, 16)], kernel=wrong)
    assert not result.ok and result.mismatches == len(dflash2_kernel_base.INPUT_KINDS)
    assert "(B, Hq, Hk, D, R)=(1, 2, 1, 32, 16) rows=8 input=normal, k" in result.reason
    assert dflash2_kernel_rope.self_test_rope([(1, 2, 1, 32, 16)], kernel=dflash2_kernel_rope.stock_rope_rows).ok


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
def test_rope_kernel_equals_mlx_vlm_at_the_27b_shape_on_cuda():
    """The 27B's attention rotary (24 query and 4 key heads of 256, the first 64 rotated)
    and the small shapes, 1..8 positions and a prefill's: a variant serves."""
    result = dflash2_kernel_rope.self_test_rope([(1, 24, 4, 256, 64), *dflash2_kernel_rope.ROPE_SHAPES_SMALL])
    assert result.ok and result.variant in dflash2_kernel_rope.ROPE_VARIANTS, result.reason
    print("rope variants, differing elements:", result.variants)


def test_the_fp32_rotary_self_test_passes_the_stock_call_and_fails_a_bit_off():
    """fp32 rows (the real file's): the self-test takes every fp32 input kind at 1..8 positions
    and a prefill's, with fp16 tables (the real file's: its embedding's dtype) and fp32 ones,
    passes mlx-vlm's own call as a kernel, and fails one bit off in the keys at 8 positions
    naming the case; off CUDA the default has no kernel to test."""
    assert dflash2_kernel_rope.self_test_rope32().reason == (
        dflash2_kernel_base.NO_KERNEL if dk.backend_name() != "cuda" else None)
    shape = [(1, 2, 1, 32, 16)]
    passed = dflash2_kernel_rope.self_test_rope32(shape, kernel=dflash2_kernel_rope.stock_rope_rows)
    assert passed.ok and {case["input"] for case in passed.cases} == set(dflash2_kernel_base.FP32_INPUT_KINDS)
    assert {case["rows"] for case in passed.cases} == {*range(1, 9), dflash2_kernel_rope.ROPE_LONG_ROWS}
    assert {case["shape"][-1] for case in passed.cases} == {"fp16", "fp32"}
    tables = []

    def wrong(q, k, cos, sin):
        assert q.dtype == k.dtype == mx.float32 and cos.dtype == sin.dtype
        tables.append(cos.dtype)
        q_out, k_out = dflash2_kernel_rope.stock_rope_rows(q, k, cos, sin)
        return q_out, flip_first_bit(k_out) if q.shape[2] == 8 else k_out

    result = dflash2_kernel_rope.self_test_rope32(shape, kernel=wrong)
    assert not result.ok and result.mismatches == 2 * len(dflash2_kernel_base.FP32_INPUT_KINDS)
    assert "(B, Hq, Hk, D, R)=(1, 2, 1, 32, 16) rows=8 fp32, fp16 tables input=normal, k" in result.reason
    assert set(tables) == {mx.float16, mx.float32}


def test_fp32_rows_with_fp16_tables_take_the_fp32_kernel():
    """The real file's attention hands fp32 queries and keys with the rotary's fp16 cos and sin
    (its embedding's dtype): the kernel takes them, widening each table entry exactly as
    MLX's fused kernel does; other mixes stay mlx-vlm's call."""
    supports = dflash2_kernel_rope.rope_kernel_supports
    q, k, cos, sin = dflash2_kernel_rope.make_rope_case("normal", 1, 2, 1, 32, 16, 3, mx.random.key(1),
                                                        dtype=mx.float32, table_dtype=mx.float16)
    assert cos.dtype == sin.dtype == mx.float16 and supports(q, k, cos, sin)
    assert not supports(q.astype(mx.float16), k.astype(mx.float16), cos.astype(mx.float32), sin.astype(mx.float32))
    assert not supports(q, k, cos.astype(mx.bfloat16), sin.astype(mx.bfloat16))
    assert not supports(q, k, cos, sin.astype(mx.float32))


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_rope_rows_serve_each_dtype_by_its_own_verdict(monkeypatch, dtype):
    """As on CUDA (backend faked, the kernel a stand-in): fp32 rows take the variant fp32's
    self-test chose (here fma_sin: the kernel's FMA 2), fp16 rows fp16's (fma: 1), each one
    launch in its rows' dtype; a dtype whose verdict is None stays mlx-vlm's call."""
    kernel = RecordingKernel()
    monkeypatch.setattr(dflash2_kernel_rope, "_rope_kernel", lambda: kernel)
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setattr(dflash2_kernel_rope, "_rope_serving", {"cuda": "fma"})
    monkeypatch.setattr(dflash2_kernel_rope, "_rope32_serving", {"cuda": "fma_sin"})
    q, k, cos, sin = dflash2_kernel_rope.make_rope_case("normal", 1, 2, 1, 32, 16, 3, mx.random.key(1), dtype=dtype)
    dk.rope_rows(q, k, cos, sin)
    assert [launch["template"]["FMA"] for launch in kernel.launches] == [2 if dtype == mx.float32 else 1]
    assert kernel.launches[0]["dtypes"] == [dtype, dtype]
    monkeypatch.setattr(dflash2_kernel_rope, "_rope32_serving" if dtype == mx.float32 else "_rope_serving",
                        {"cuda": None})
    got = dk.rope_rows(q, k, cos, sin)
    assert len(kernel.launches) == 1 and same_bits(got[1], dflash2_kernel_rope.stock_rope_rows(q, k, cos, sin)[1])


def test_an_fp32_pack_s_start_up_tests_the_fp32_rotary(target, float32_target):
    from dflash2_pack import kernel_shapes

    fp32 = kernel_shapes(float32_target[0])
    assert fp32["rope_fp32"] and not fp32["rope"]  # an fp32 pack tests no fp16 kernel
    assert kernel_shapes(target[0])["rope_fp32"] == []
    assert dk.SELF_TESTS["rope32"][0] == "rope_fp32" and "rope32" in dk.VERDICT_TABLES
