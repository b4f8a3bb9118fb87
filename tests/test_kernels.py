"""dflash2_kernels on CPU: the self-tests pass, catch wrong kernels naming the
case, every public function equals its stock reference bit for bit, and the
launch helpers follow MLX's source rules."""

import itertools
import math
import os
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import dflash2_kernel_attention
import dflash2_kernel_base
import dflash2_kernel_fused
import dflash2_kernel_gdn
import dflash2_kernel_qmv
import dflash2_kernel_rotate
import dflash2_kernels as dk
from kernel_parity import MAX_ACCUMULATORS, TUNE_FALLBACK, TUNE_LAUNCHES, launch_for_rows
from kernel_cases import patch_kernels

SHAPE = (16, 512)


def stock_float32_dequantized(x, weight, scales, biases):
    """Right maths, other rounding: dequantize, multiply in float32."""
    w = mx.dequantize(weight, scales, biases, group_size=dflash2_kernel_qmv.GROUP_SIZE, bits=dflash2_kernel_qmv.BITS)
    return (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(mx.float16)


def split_k_halves(x, weight, scales, biases):
    """MLX's own kernel on each half of K, halves added: another accumulation order. The
    halves are copied contiguous: MLX CUDA's qmv takes only row-contiguous weights (and
    has no other kernel for a column slice of them)."""
    half = x.shape[-1] // 2
    words, groups = half // 16, half // dflash2_kernel_qmv.GROUP_SIZE
    first, second = (
        dflash2_kernel_qmv.stock_quantized_matmul(*(mx.contiguous(a) for a in arrays))
        for arrays in (
            (x[:, :half], weight[:, :words], scales[:, :groups], biases[:, :groups]),
            (x[:, half:], weight[:, words:], scales[:, groups:], biases[:, groups:]),
        )
    )
    return first + second


def one_bit_off_at_eight_rows(x, weight, scales, biases):
    """Exact except the last bit of y[7, 3] when given 8 rows."""
    y = dk.stock_rows(x, weight, scales, biases)
    if x.shape[0] < 8:
        return y
    bits = y.view(mx.uint16)
    target = (mx.arange(8)[:, None] == 7) & (mx.arange(y.shape[1])[None] == 3)
    return mx.where(target, bits ^ 1, bits).view(mx.float16)


def raises(x, weight, scales, biases):
    raise RuntimeError("kernel failed to build")


def returns_float32(x, weight, scales, biases):
    return dk.stock_rows(x, weight, scales, biases).astype(mx.float32)


def test_serving_path_passes_the_self_test_here(gpu_like_rounding):
    """What exact_quantized_matmul serves here (this backend's kernel, or per-row stock
    calls where it has none) equals the single-row calls where batched calls round
    otherwise (the negative control counts it)."""
    own = dk.self_test()  # NO_KERNEL at once where there is no kernel
    assert own.ok and own.backend == dk.backend_name(), own.reason
    result = dk.self_test(kernel=dk.exact_quantized_matmul)
    assert result.ok, result.reason
    assert result.reason is None
    assert result.stock_mismatches > 0
    assert result.mismatches == 0
    assert len(result.cases) == len(dflash2_kernel_qmv.DEFAULT_SHAPES) * len(dflash2_kernel_base.INPUT_KINDS) * dk.MAX_ROWS
    assert {case["rows"] for case in result.cases} == set(range(1, 9))
    assert {case["input"] for case in result.cases} == set(dflash2_kernel_base.INPUT_KINDS)
    assert all(case["mismatches"] == 0 for case in result.cases)


@pytest.mark.parametrize(
    "kernel",
    [stock_float32_dequantized, split_k_halves, one_bit_off_at_eight_rows],
)
def test_wrong_kernel_fails_naming_the_case(kernel):
    serving = dict(dflash2_kernel_qmv._verified)
    result = dk.self_test(kernel=kernel, shapes=[SHAPE])
    assert not result.ok
    assert result.mismatches > 0
    assert "N=16, K=512" in result.reason and "rows=" in result.reason
    assert "input=" in result.reason and "got 0x" in result.reason
    assert dflash2_kernel_qmv._verified == serving  # an injected kernel never switches serving


def test_one_differing_bit_is_counted_exactly():
    result = dk.self_test(kernel=one_bit_off_at_eight_rows, shapes=[SHAPE])
    assert result.mismatches == len(dflash2_kernel_base.INPUT_KINDS)  # y[7, 3] once per input kind
    assert "rows=8" in result.reason and "first at [7, 3]" in result.reason
    failing = [case for case in result.cases if case["mismatches"]]
    assert all(case["rows"] == 8 for case in failing)


@pytest.mark.parametrize(("kernel", "words"), [(raises, "RuntimeError"), (returns_float32, "float32")])
def test_broken_kernel_fails_with_reason(kernel, words):
    result = dk.self_test(kernel=kernel, shapes=[SHAPE])
    assert not result.ok
    assert words in result.reason


@pytest.mark.parametrize("shape", [(16, 512), (24, 640)])
@pytest.mark.parametrize("leading", [(1,), (3,), (8,), (2, 4)])
def test_exact_matmul_equals_single_row_calls(shape, leading):
    n, k = shape
    weight, scales, biases = dflash2_kernel_qmv.make_weights(n, k, mx.random.key(1))
    x = dflash2_kernel_base.make_inputs("normal", 8, k, mx.random.key(2))
    rows = 1
    for size in leading:
        rows *= size
    y = dk.exact_quantized_matmul(x[:rows].reshape(*leading, k), weight, scales, biases)
    assert y.shape == (*leading, n) and y.dtype == mx.float16
    want = mx.concatenate(
        [
            mx.quantized_matmul(
                x[m : m + 1], weight, scales, biases, transpose=True, group_size=128, bits=2
            )
            for m in range(rows)
        ]
    )
    assert mx.array_equal(y.reshape(rows, n).view(mx.uint16), want.view(mx.uint16)).item()


def test_failed_self_test_serves_row_by_row(monkeypatch):
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")  # a backend with a kernel
    monkeypatch.setitem(dflash2_kernel_qmv._verified, "cuda", False)
    monkeypatch.setattr(dflash2_kernel_qmv, "_warned", set())
    weight, scales, biases = dflash2_kernel_qmv.make_weights(*SHAPE, mx.random.key(1))
    x = dflash2_kernel_base.make_inputs("large", 5, SHAPE[1], mx.random.key(2))
    with pytest.warns(UserWarning, match="row by row"):
        y = dk.exact_quantized_matmul(x, weight, scales, biases)
    want = dk.stock_rows(x, weight, scales, biases)
    assert mx.array_equal(y.view(mx.uint16), want.view(mx.uint16)).item()


def test_bad_arguments_are_clear_errors():
    weight, scales, biases = dflash2_kernel_qmv.make_weights(*SHAPE, mx.random.key(1))
    x = dflash2_kernel_base.make_inputs("normal", 9, SHAPE[1], mx.random.key(2))
    with pytest.raises(ValueError, match="1..8 rows, got 9"):
        dk.exact_quantized_matmul(x, weight, scales, biases)
    with pytest.raises(ValueError, match="1..8 rows, got 12"):
        dk.exact_quantized_matmul(mx.concatenate([x, x[:3]]).reshape(2, 6, -1), weight, scales, biases)
    with pytest.raises(TypeError, match="x must be float16"):
        dk.exact_quantized_matmul(x[:2].astype(mx.float32), weight, scales, biases)
    with pytest.raises(TypeError, match="weight must be"):
        dk.exact_quantized_matmul(x[:2], weight.astype(mx.int32), scales, biases)
    with pytest.raises(TypeError, match="scales must be"):
        dk.exact_quantized_matmul(x[:2], weight, scales.astype(mx.bfloat16), biases)
    with pytest.raises(ValueError, match="must end in K=512"):
        dk.exact_quantized_matmul(x[:2, :256], weight, scales, biases)


def test_input_kinds_are_what_they_say():
    key = mx.random.key(3)
    subnormal = dflash2_kernel_base.make_inputs("subnormal", 8, 512, key)
    assert (mx.abs(subnormal) < 2.0**-14).all().item()
    zeros = dflash2_kernel_base.make_inputs("signed_zero", 8, 512, key).view(mx.uint16)
    assert (zeros[0] == 0x8000).all().item()  # row 0: all -0
    assert ((zeros[1] == 0) | (zeros[1] == 0x8000)).all().item()
    cancel = dflash2_kernel_base.make_inputs("cancellation", 8, 512, key)
    assert mx.array_equal(cancel[:, ::2], -cancel[:, 1::2]).item()
    for kind in dflash2_kernel_base.INPUT_KINDS:  # odd widths too (the norms' self-test runs one, 1003)
        assert dflash2_kernel_base.make_inputs(kind, 3, 1003, key).shape == (3, 1003), kind
    large = dflash2_kernel_base.make_inputs("large", 8, 512, key)
    assert mx.isfinite(large).all().item() and mx.abs(large).max().item() > 2048


def test_every_cuda_launch_in_the_table_ran_bitwise_on_the_h200():
    """Each row count's launch in the code ran on the H200 at every 27B shape with every
    element its single-row bits: in kernel_parity's record (its table, self-test and negative
    control) or as an arm of compare_qmv_launch's (each arm checked per shape)."""
    import json
    from pathlib import Path

    evidence = Path(__file__).parents[1] / "evidence"
    record = json.loads((evidence / "kernel-parity-cuda.json").read_text())
    assert record["self_test"]["ok"] and record["exact_mismatches"] == 0
    assert record["stock_mismatches"] > 0  # the negative control did see MLX's 8-row call differ
    ran = {(int(rows), tuple(launch)) for rows, launch in record["cuda_launch"].items()}
    compared = json.loads((evidence / "qmv-launch-cuda.json").read_text())
    shapes = {tuple(map(int, shape.split("x"))) for shape in compared["shapes"]}
    assert shapes == set(dflash2_kernel_qmv.PACKED_SHAPES_27B)
    # The previous arm counts only where it ran this kernel (--previous-kernels can give it another).
    same_kernel = compared.get("previous_kernel_source") in (None, dflash2_kernel_qmv.cuda_qmv_source_digest())
    arms = ("previous", "current") if same_kernel else ("current",)
    for arm in arms:
        for rows, launch in compared[arm].items():
            if all(entry["mismatches_vs_single_rows"][f"{arm} {rows}"] == 0 for entry in compared["shapes"].values()):
                ran.add((int(rows), tuple(launch)))
    assert {(rows, tuple(launch)) for rows, launch in dflash2_kernel_qmv.CUDA_LAUNCH.items()} <= ran
    # Records written since the kernel's source digest was recorded must have run this source
    # (session 24's predate it: their kernel is this one, its launch check added after them).
    for written in (record, compared):
        assert written.get("cuda_kernel_source", dflash2_kernel_qmv.cuda_qmv_source_digest()) == dflash2_kernel_qmv.cuda_qmv_source_digest()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA toolkit's nvcc")
def test_every_cuda_launch_keeps_its_accumulators_in_registers():
    """Each row count's launch in the table compiles for the H200 (sm_90a, offline) without
    register spills: a spill put the 8-row kernel's loads behind local memory (session 34's
    baked-K variant, 24 bytes, made its K = 5120 shapes slower). The check sees a spill where
    one is: 4 output rows of 8 activation rows in one warp want 256 accumulator registers."""
    from qmv_sass import compile_report, translation_unit

    assert compile_report(translation_unit(8, (4, 2, 1, 1)))["spill_bytes"] > 0
    for rows, launch in dflash2_kernel_qmv.CUDA_LAUNCH.items():
        assert compile_report(translation_unit(rows, launch))["spill_bytes"] == 0, (rows, launch)


# ---------------------------------------------------------------------------
# rotate, gdn_recurrence, dense_rows, decode_attention_rows


def same_bits(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(dk.raw_bits(a), dk.raw_bits(b)).item()


def flip_first_bit(a):
    """a with the last bit of its first element flipped."""
    bits = dk.raw_bits(a).reshape(-1)
    return mx.concatenate([bits[:1] ^ 1, bits[1:]]).reshape(a.shape).view(a.dtype)


def one_bit_off(function, at_rows):
    """function, but the last bit of its first output element flipped when its
    first argument has `at_rows` rows (axis `axis`)."""

    def wrong(*args, axis=0):
        out = function(*args)
        first = out[0] if isinstance(out, tuple) else out
        if args[0].shape[axis] != at_rows:
            return out
        flipped = flip_first_bit(first)
        return (flipped, *out[1:]) if isinstance(out, tuple) else flipped

    return wrong


def test_rotate_equals_the_stock_chain():
    k, block = 1024, 512
    signs = dflash2_kernel_rotate.make_signs("general", k, mx.random.key(1))
    x = dflash2_kernel_rotate.make_rotate_inputs("nonfinite", 5, k, mx.random.key(2)).reshape(5, 1, k)
    assert same_bits(dk.rotate(x, block, signs), dflash2_kernel_rotate.stock_rotate(x, block, signs))


def test_gdn_recurrence_equals_decode_steps():
    inputs = dflash2_kernel_gdn.make_gdn_inputs("normal", 1, 3, 1, 2, 64, 64, mx.random.key(1))
    y, states = dk.gdn_recurrence(*inputs)
    want_y, want_states = dflash2_kernel_gdn.stock_recurrence(*inputs, eval_each_step=True)
    assert y.shape == (1, 3, 2, 64) and states.shape == (1, 3, 2, 64, 64)
    assert same_bits(y, want_y) and same_bits(states, want_states)


def test_dense_rows_equals_one_row_linears():
    weight = dflash2_kernel_gdn.make_dense_weight(7, 320, mx.random.key(1))
    x = dflash2_kernel_base.make_inputs("large", 6, 320, mx.random.key(2)).reshape(2, 3, 320)
    want = mx.concatenate([x.reshape(6, 320)[m : m + 1] @ weight.T for m in range(6)])
    assert same_bits(dk.dense_rows(x, weight), want.reshape(2, 3, 7))
    with pytest.raises(ValueError, match="1..8 rows"):
        dk.dense_rows(mx.zeros((9, 320), dtype=mx.float16), weight)


def test_conv_rows_equals_decode_per_window():
    """Each position: decode's convolution of the window that ends there, silu after it,
    and the concatenated window the cache keeps."""
    assert dflash2_kernel_fused.stock_decode_conv.__name__ == "_qwen3_5_decode_depthwise_conv"  # mlx-vlm's own
    state, x, weight = dflash2_kernel_fused.make_conv_case("normal", 2, 40, 4, mx.random.key(1))
    window = mx.concatenate([state, x[:, :5]], axis=1)
    want = mx.concatenate([dflash2_kernel_fused.stock_decode_conv(window[:, t : t + 4], weight) for t in range(5)], axis=1)
    kernel = "taps" if dk.backend_name() == "cuda" else None  # on CUDA the kernel itself, ungated
    got_window, got = dk.conv_rows(state, x[:, :5], weight, variant=kernel)
    assert same_bits(got_window, window) and same_bits(got, nn.silu(want))


def test_rope_rows_equals_mlx_vlm_rotary():
    """Queries and keys (transposed views, as the model hands them over) rotated in their
    first R features, the rest passed through, as arrays of their shapes; on
    CUDA through the variant the kernel's self-test chose."""
    from mlx_vlm.models.rope_utils import rotate_half

    q, k, cos, sin = dflash2_kernel_fused.make_rope_case("normal", 2, 3, 1, 32, 16, 5, mx.random.key(1))
    variant = None
    if dk.backend_name() == "cuda":
        dflash2_kernel_fused.self_test_rope()
        variant = dflash2_kernel_fused._rope_serving["cuda"]
        assert variant in dflash2_kernel_fused.ROPE_VARIANTS
    got = dk.rope_rows(q, k, cos, sin, variant=variant)
    for x, rotated in zip((q, k), got):
        head, tail = x[..., :16], x[..., 16:]
        want = mx.concatenate([head * cos[:, None] + rotate_half(head) * sin[:, None], tail], axis=-1)
        assert rotated.shape == x.shape
        if variant is None:  # MLX's ops one at a time; a GPU contracts one product (rope_rows)
            assert same_bits(rotated, want)
        assert same_bits(rotated, dflash2_kernel_fused.stock_rope_rows(q, k, cos, sin)[x is k])


def test_decode_attention_rows_equals_single_query_calls():
    queries, keys, values, _, _ = dflash2_kernel_attention._make_case((1, 4, 2, 64), 5, 3, "normal", mx.random.key(1))
    got = dk.decode_attention_rows(queries, keys, values, 0.125, 5)
    want = mx.concatenate(
        [
            mx.fast.scaled_dot_product_attention(
                queries[:, :, j : j + 1], keys[:, :, : 5 + j], values[:, :, : 5 + j], scale=0.125
            )
            for j in range(3)
        ],
        axis=2,
    )
    assert same_bits(got, want)
    with pytest.raises(ValueError, match="need 8 keys"):
        dk.decode_attention_rows(queries, keys[:, :, :6], values, 0.125, 6)


def test_attention_kernels_serve_only_the_softmax_block_dims_their_self_test_covered(monkeypatch):
    """Each softmax block dim is its own compiled kernel: a context whose queries need a
    block dim the self-test never ran takes the stock per-query calls."""
    shape = (1, 2, 2, 256)
    served = []
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setattr(dflash2_kernel_attention, "cuda_attention_rows", lambda *args: served.append(args[-1]) or "kernel")
    monkeypatch.setitem(dflash2_kernel_attention._attention_verified, ("cuda", shape), {32, 64})
    for first_length, rows, kernel in ((250, 8, True), (509, 4, True), (510, 4, False), (600, 1, False)):
        queries, keys, values, _, _ = dflash2_kernel_attention._make_case(shape, first_length, rows, "normal", mx.random.key(1))
        got = dk.decode_attention_rows(queries, keys, values, 0.0625, first_length)
        assert (isinstance(got, str)) == kernel, (first_length, rows)
    assert served == [250, 509]


def test_metal_attention_spans_keep_decode_s_routing():
    """At most 32 // GQA queries a call (8 at most), never across a key length where MLX's
    Metal routing changes (query j sees first_length + j keys)."""
    pack, gqa_8, gqa_16 = dflash2_kernel_attention.ATTENTION_PACK_SHAPE, (1, 16, 2, 128), (1, 32, 2, 256)
    assert dflash2_kernel_attention.metal_attention_spans(pack, 8, 100) == [(0, 5), (5, 8)]
    assert dflash2_kernel_attention.metal_attention_spans(pack, 8, 1020) == [(0, 4), (4, 5), (5, 8)]  # 1024 and 1025 start regimes
    assert dflash2_kernel_attention.metal_attention_spans(gqa_16, 3, 4094) == [(0, 2), (2, 3)]
    assert dflash2_kernel_attention.metal_attention_spans(pack, 1, 7) == [(0, 1)]
    # GQA 8 at head dim 128: from 8192 keys decode's one query takes a kernel of its own.
    assert dflash2_kernel_attention.metal_attention_spans(gqa_8, 6, 8188) == [(0, 4), (4, 5), (5, 6)]
    assert dflash2_kernel_attention.metal_sdpa_regime(gqa_8, 8192) is None and dflash2_kernel_attention.metal_sdpa_regime(pack, 8192) == 4
    assert not dflash2_kernel_attention.metal_attention_supports(1, 8, 2, 256, mx.float16)  # GQA 4: its n_simds branches move
    assert not dflash2_kernel_attention.metal_attention_supports(1, 24, 4, 192, mx.float16)  # decode runs the unfused path
    assert dflash2_kernel_attention.metal_attention_supports(*dflash2_kernel_attention.ATTENTION_PACK_SHAPE, mx.float16)


def test_metal_attention_serves_multi_query_calls_only_where_its_self_test_passed(monkeypatch, on_cpu):
    """On Metal verify takes MLX's multi-query attention once the shape's self-test found it
    decode's per query; where multi-query calls round otherwise (the GPU-like backend) the
    test fails and each query is the stock call."""
    from gpu_rounding import swap_row_variant_ops

    shape = (1, 12, 2, 64)  # GQA 6: five queries a call
    patch_kernels(monkeypatch, "backend_name", lambda: "metal")
    monkeypatch.setattr(dflash2_kernel_attention, "_attention_verified", {})
    queries, keys, values, _, _ = dflash2_kernel_attention._make_case(shape, 250, 8, "normal", mx.random.key(2))
    calls = []
    spans = dflash2_kernel_attention.metal_attention_spans
    monkeypatch.setattr(dflash2_kernel_attention, "metal_attention_spans", lambda *args: calls.append(args) or spans(*args))
    want = dflash2_kernel_attention.stock_attention_rows(queries, keys, values, 0.125, 250)
    assert same_bits(dk.decode_attention_rows(queries, keys, values, 0.125, 250), want)
    assert dflash2_kernel_attention._attention_verified == {("metal", shape): {0}} and calls[-1] == (shape, 8, 250)

    swap_row_variant_ops(monkeypatch)
    monkeypatch.setattr(dflash2_kernel_attention, "_attention_verified", {})
    calls.clear()
    want = dflash2_kernel_attention.stock_attention_rows(queries, keys, values, 0.125, 250)
    with pytest.warns(UserWarning, match="metal attention failed its self-test"):
        got = dk.decode_attention_rows(queries, keys, values, 0.125, 250)
    assert same_bits(got, want) and dflash2_kernel_attention._attention_verified == {("metal", shape): set()}
    calls.clear()
    assert same_bits(dk.decode_attention_rows(queries, keys, values, 0.125, 250), want) and calls == []


def test_attention_self_test_lengths_cover_every_softmax_block_dim_at_the_pack_shape():
    lengths = {first + j for first in dflash2_kernel_attention.PACK_FIRST_LENGTHS for j in range(dflash2_kernel_attention.MAX_QUERIES)}
    assert {dflash2_kernel_attention.softmax_block_dim(t) for t in lengths} == {32, 64, 128, 256, 512, 1024}


def test_own_self_tests_have_nothing_to_test_without_kernels(monkeypatch):
    patch_kernels(monkeypatch, "backend_name", lambda: "cpu")
    serving = dict(dflash2_kernel_qmv._verified)
    for name, (_, test) in dk.SELF_TESTS.items():
        result = test(shapes=None)
        assert result.ok and result.reason == dflash2_kernel_base.NO_KERNEL and not result.cases, name
    assert dflash2_kernel_qmv._verified == serving


def test_verify_kernel_self_tests_runs_each_kernel_at_the_pack_shapes(monkeypatch):
    given = {}

    def recorded(name, test):
        def run(shapes):
            given[name] = shapes
            return test(shapes=shapes)
        return run

    monkeypatch.setattr(dk, "SELF_TESTS", {name: (key, recorded(name, test))
                                           for name, (key, test) in dk.SELF_TESTS.items()})
    results = dk.verify_kernel_self_tests(
        {"packed": [[16, 512]], "rotations": [(512, 512)], "gdn": [(1, 1, 2, 64, 64)],
         "dense": [], "attention": [(1, 24, 4, 256)]}
    )
    assert set(results) == {"qmv", "rotate", "gdn", "attention"}  # empty: left to first use
    assert all(result.ok for result in results.values())
    assert given == {"qmv": [(16, 512)], "rotate": [(512, 512)], "gdn": [(1, 1, 2, 64, 64)],
                     "attention": [(1, 24, 4, 256)]}


def test_wrong_rotation_fails_naming_the_case():
    result = dflash2_kernel_rotate.self_test_rotate([(512, 512)], kernel=one_bit_off(dflash2_kernel_rotate.stock_rotate, 4))
    assert not result.ok and result.mismatches == len(dflash2_kernel_rotate.SIGN_KINDS) * len(dflash2_kernel_rotate.ROTATE_INPUT_KINDS)
    assert "K=512, block=512, rows=4, input=normal, signs=pm1" in result.reason
    assert "first at [0, 0]" in result.reason
    fp16 = dflash2_kernel_rotate.self_test_rotate([(512, 512)], kernel=lambda x, block, signs: dflash2_kernel_rotate._fp16_chain(x, block, signs))
    assert not fp16.ok and fp16.stock_mismatches > 0  # the control sees fp16 rounding


def test_wrong_recurrence_fails_naming_the_case():
    def wrong(q, k, v, g, beta, state):
        return one_bit_off(dflash2_kernel_gdn.stock_recurrence, 3)(q, k, v, g, beta, state, axis=1)

    result = dflash2_kernel_gdn.self_test_gdn([(1, 1, 2, 64, 64)], max_steps=3, kernel=wrong)
    assert not result.ok and result.variant is None
    assert result.variants == {"kernel": len(dflash2_kernel_gdn.GDN_INPUT_KINDS)}
    assert "(B, Hk, Hv, Dk, Dv)=(1, 1, 2, 64, 64) L=3 input=normal" in result.reason
    assert "1 of y, 0 of states" in result.reason
    assert dflash2_kernel_gdn.self_test_gdn([(1, 1, 2, 64, 64)], max_steps=3, kernel=dflash2_kernel_gdn.stock_recurrence).ok


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


def test_wrong_dense_rows_fails_naming_the_case():
    result = dflash2_kernel_gdn.self_test_dense([(7, 320)], kernel=one_bit_off(dflash2_kernel_gdn.stock_dense_rows, 8))
    assert not result.ok and result.mismatches == len(dflash2_kernel_base.INPUT_KINDS)
    assert "(N, K)=(7, 320) rows=8 input=normal" in result.reason
    assert dflash2_kernel_gdn.self_test_dense([(7, 320)], kernel=dflash2_kernel_gdn.stock_dense_rows).ok


def test_wrong_convolution_fails_naming_the_case():
    def wrong(state, x, weight):  # the first output's last bit off at 8 rows
        made, out = dflash2_kernel_fused.stock_conv_rows(state, x, weight)
        return made, flip_first_bit(out) if x.shape[1] == 8 else out

    result = dflash2_kernel_fused.self_test_conv([(1, 24, 3)], kernel=wrong)
    assert not result.ok and result.mismatches == len(dflash2_kernel_base.INPUT_KINDS)
    assert "(B, C, K)=(1, 24, 3) rows=8 input=normal, out" in result.reason
    assert dflash2_kernel_fused.self_test_conv([(1, 24, 3)], kernel=dflash2_kernel_fused.stock_conv_rows).ok


def test_wrong_attention_fails_naming_the_case():
    def wrong(queries, keys, values, scale, first_length):
        return one_bit_off(dflash2_kernel_attention.stock_attention_rows, 2)(queries, keys, values, scale, first_length, axis=2)

    serving = dict(dflash2_kernel_attention._attention_verified)
    result = dflash2_kernel_attention.self_test_attention([(1, 2, 1, 64)], first_lengths=(7,), max_queries=2, kernel=wrong)
    assert not result.ok
    assert "(B, Hq, Hkv, D)=(1, 2, 1, 64), first_length=7, L=2, input=normal" in result.reason
    assert "first at [0, 0, 0, 0]" in result.reason
    assert dflash2_kernel_attention._attention_verified == serving  # an injected kernel never switches serving


# ---------------------------------------------------------------------------
# Launch helpers, against MLX 0.32.2's source rules


@pytest.mark.parametrize(
    ("k", "npt"), [(5120, 4), (256, 4), (128, 4), (320, 2), (192, 2), (64, 2), (136, 1), (102, 1), (96, 1)]
)
def test_gemv_elements_per_lane(k, npt):
    # gemv.cu:242-249: 4 when K % 128 == 0, 2 when K % 64 == 0, else 1 (aligned pointers).
    assert dflash2_kernel_base.gemv_elements_per_lane(k) == npt


@pytest.mark.parametrize(
    ("axis_size", "block_dim"),
    [(1, 32), (256, 32), (257, 64), (512, 64), (513, 128), (1024, 128), (1025, 256),
     (2048, 256), (2049, 512), (4096, 512), (4097, 1024), (100000, 1024)],
)
def test_softmax_block_dim(axis_size, block_dim):
    # softmax.cu:145-147 with N_READS 8, kernel_utils.cuh:48-62: the smallest of
    # 32..512 holding ceil(axis_size / 8) threads, else 1024.
    assert dflash2_kernel_attention.softmax_block_dim(axis_size) == block_dim


def test_block_dim_runs_split_where_the_block_dim_changes():
    assert dflash2_kernel_attention._block_dim_runs(250, 8) == [[0, 7, 32], [7, 8, 64]]
    assert dflash2_kernel_attention._block_dim_runs(1, 3) == [[0, 3, 32]]


@pytest.mark.parametrize(
    ("block", "bits"), [(512, 0x3D3504F3), (1024, 0x3D000000), (2048, 0x3CB504F3), (4096, 0x3C800000)]
)
def test_scale_bits(block, bits):
    # 1/sqrt(block) rounded to fp32: 2^-5 and 2^-6 exactly, else 2^-k times fp32(1/sqrt 2) = 0x3F3504F3.
    assert dflash2_kernel_rotate.scale_bits(block) == bits

# ---------------------------------------------------------------------------------------
# Launch selection, in process: which kernel serves, and the CUDA launch geometry.


@pytest.mark.parametrize(
    ("backend", "n", "k", "rows", "want"),
    [
        ("cuda", 16, 512, 1, dflash2_kernel_qmv.cuda_matmul),  # one row too: faster than MLX's, same bits
        ("cuda", 42, 640, 8, dflash2_kernel_qmv.cuda_matmul),  # every shape
        ("metal", 16, 512, 1, None),  # one row is MLX's own call
        ("metal", 16, 512, 5, dflash2_kernel_qmv.metal_matmul),
        ("metal", 42, 512, 5, None),  # N % 8: MLX itself leaves qmv_fast
        ("metal", 16, 640, 5, None),  # K % 512
        ("cpu", 16, 512, 1, None),
        ("cpu", 42, 640, 8, None),  # no kernel: the per-row stock calls
    ],
)
def test_serving_kernel_by_backend_shape_and_rows(monkeypatch, backend, n, k, rows, want):
    monkeypatch.setitem(dflash2_kernel_qmv._verified, backend, True)
    assert dflash2_kernel_qmv._serving_kernel(backend, n, k, rows) is want


def test_a_backend_without_kernel_serves_without_a_self_test(monkeypatch):
    monkeypatch.setattr(dflash2_kernel_qmv, "_verified", {})
    monkeypatch.setattr(dflash2_kernel_qmv, "self_test", lambda **_: pytest.fail("self-tested"))
    assert dflash2_kernel_qmv._serving_kernel("cpu", 16, 512, 8) is None
    assert dflash2_kernel_qmv._verified == {}


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_kernel_that_failed_its_self_test_never_serves(monkeypatch, backend):
    monkeypatch.setitem(dflash2_kernel_qmv._verified, backend, False)
    monkeypatch.setattr(dflash2_kernel_qmv, "_warned", set())
    with pytest.warns(UserWarning, match=f"{backend} kernel failed its self-test"):
        assert dflash2_kernel_qmv._serving_kernel(backend, 16, 512, 4) is None


def test_a_baked_kernel_is_made_once_per_template_under_mlx_s_name_and_source(monkeypatch):
    """BakedCudaKernel: per template one mx.fast.cuda_kernel, named with MLX's template suffix
    (the 8-row qmv's name in the H200 profiles) and with the lines MLX writes for a template
    ahead of the source; calls pass the launch on without the template."""
    made, calls = [], []

    def cuda_kernel(**kwargs):
        made.append(kwargs)
        return lambda **launch: calls.append((kwargs["name"], launch)) or ["y"]

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    kernel = dflash2_kernel_base.BakedCudaKernel(name="dflash2_qmv_2bit_g128", input_names=["x"], output_names=["y"],
                                source="body();", header="#include <h>\n")
    template = [("M", 8), ("S", 1), ("R", 2), ("C", 2), ("PREFETCH", 1), ("TILES", True)]
    assert kernel(template=template, grid=(1, 1, 1)) == ["y"]
    assert kernel(template=list(template), grid=(2, 1, 1)) == ["y"]
    assert kernel(grid=(3, 1, 1)) == ["y"]  # no template: MLX's name and source as given
    assert [m["name"] for m in made] == ["dflash2_qmv_2bit_g128_8_1_2_2_1_t", "dflash2_qmv_2bit_g128"]
    assert made[0]["source"] == ("  constexpr int M = 8;\n  constexpr int S = 1;\n  constexpr int R = 2;\n"
                                 "  constexpr int C = 2;\n  constexpr int PREFETCH = 1;\n  constexpr bool TILES = true;\n"
                                 "\nbody();")
    assert made[1]["source"] == "body();" and made[0]["header"] == "#include <h>\n"
    assert [launch for _, launch in calls] == [{"grid": (1, 1, 1)}, {"grid": (2, 1, 1)}, {"grid": (3, 1, 1)}]
    assert dflash2_kernel_base._template_suffix([("FMA", False), ("D", np.int64(256))]) == "_f_256"
    with pytest.raises(TypeError, match="T must be an int or a bool"):
        kernel(template=[("T", mx.float16)])


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
def test_a_baked_kernel_compiles_the_source_mlx_writes_for_its_template(capfd):
    """On CUDA, MLX's own print of the source it generates (verbose=True): the served qmv's
    (baked) equals the same kernel's called with the template, name included."""
    weight, scales, biases = dflash2_kernel_qmv.make_weights(16, 512, mx.random.key(0))
    x = dflash2_kernel_base.make_inputs("normal", dk.MAX_ROWS, 512, mx.random.key(1))
    templated = mx.fast.cuda_kernel(name="dflash2_qmv_2bit_g128", input_names=["x", "w", "scales", "biases"],
                                    output_names=["y"], source=dflash2_kernel_qmv._CUDA_SOURCE, header=dflash2_kernel_base.cuda_header(dflash2_kernel_qmv._CUDA_HEADER))
    for rows in (1, dk.MAX_ROWS):
        call = dflash2_kernel_qmv._cuda_launch((rows,), 16)
        capfd.readouterr()
        mx.eval(templated(inputs=[x[:rows], weight, scales, biases], verbose=True, **call))
        want = capfd.readouterr().out
        mx.eval(dflash2_kernel_qmv._cuda_kernel()(inputs=[x[:rows], weight, scales, biases], verbose=True, **call))
        got = capfd.readouterr().out
        assert "Generated source code for `custom_kernel_dflash2_qmv_2bit_g128_" in want and got == want


class RecordingKernel:
    """Stands in for mx.fast.cuda_kernel's callable: records each launch."""

    def __init__(self):
        self.launches = []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        self.launches.append({"template": dict(template), "grid": grid, "threadgroup": threadgroup,
                              "x": inputs[0]})
        return [mx.zeros(output_shapes[0], dtype=output_dtypes[0])]


def rows_stored(n, rows_per_warp, split, grid, threadgroup, tiles):
    """(output row, activation-row part) pairs the launch writes, by qmv_split_rows' mapping:
    warp w of block b (global warp g = b * warps + w) takes part g % S of the activation rows
    and output rows (g // S) * R + j, stored while below n; with TILES, also the output rows
    a grid's worth of warps further on (tile stride: all warps / S * R), while below n."""
    blocks, warps = grid[0] // threadgroup[0], threadgroup[1]
    stride = blocks * warps // split * rows_per_warp if tiles else 0
    stored = []
    for g in range(blocks * warps):
        first = g // split * rows_per_warp
        while first < n:
            stored += [(first + j, g % split) for j in range(rows_per_warp) if first + j < n]
            if not stride:
                break
            first += stride
    return stored


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("n", [16, 42, 1024, 5120, 17408])
def test_cuda_launch_follows_the_table_and_covers_every_output_once(monkeypatch, request, n, split):
    """Every output row once per part of the activation rows, whatever the table (the
    committed one, and activation rows split over 2 or 4 warps where that divides them)."""
    kernel = RecordingKernel()
    monkeypatch.setattr(dflash2_kernel_qmv, "_cuda_kernel", lambda: kernel)
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setitem(dflash2_kernel_qmv._verified, "cuda", True)
    if split > 1:
        monkeypatch.setattr(dflash2_kernel_qmv, "CUDA_LAUNCH", {
            rows: (*launch[:3], split, *launch[4:]) if rows % split == 0 else launch
            for rows, launch in dflash2_kernel_qmv.CUDA_LAUNCH.items()})
    dflash2_kernel_qmv._cuda_launch.cache_clear()  # it keeps each (rows, n)'s arguments
    request.addfinalizer(dflash2_kernel_qmv._cuda_launch.cache_clear)
    weight, scales, biases = dflash2_kernel_qmv.make_weights(n, 512, mx.random.key(1))
    x = dflash2_kernel_base.make_inputs("normal", dk.MAX_ROWS, 512, mx.random.key(2))
    for rows in range(1, dk.MAX_ROWS + 1):
        assert dk.exact_quantized_matmul(x[:rows], weight, scales, biases).shape == (rows, n)
    for rows, launch in enumerate(kernel.launches, start=1):
        rows_per_warp, chunk, prefetch, parts, max_blocks = dflash2_kernel_qmv.cuda_launch_fields(dflash2_kernel_qmv.CUDA_LAUNCH[rows])
        assert rows % parts == 0
        assert launch["template"] == {"M": rows, "S": parts, "R": rows_per_warp, "C": chunk,
                                      "PREFETCH": prefetch, "TILES": max_blocks is not None, "SWIZZLED": False}
        assert launch["threadgroup"] == (32, dflash2_kernel_qmv.CUDA_WARPS_PER_BLOCK, 1)
        assert launch["grid"][0] % 32 == 0 and launch["grid"][1:] == (dflash2_kernel_qmv.CUDA_WARPS_PER_BLOCK, 1)
        blocks = launch["grid"][0] // 32
        assert max_blocks is None or blocks <= max_blocks
        stored = rows_stored(n, rows_per_warp, parts, launch["grid"], launch["threadgroup"], max_blocks is not None)
        assert sorted(stored) == [(row, part) for row in range(n) for part in range(parts)]
        # and no block is launched with nothing to do
        assert (blocks - 1) * dflash2_kernel_qmv.CUDA_WARPS_PER_BLOCK < -(-n // rows_per_warp) * parts
    assert len(kernel.launches) == dk.MAX_ROWS


def test_cuda_kernel_takes_a_blocks_rows_as_they_are(monkeypatch, request):
    """A verify block's (1, L, K) activations reach the kernel as they are, not reshaped to
    (L, K) and back (two view primitives per packed linear, about 800 a verify round): one
    launch for the L rows in all, its output (1, L, N)."""
    kernel = RecordingKernel()
    monkeypatch.setattr(dflash2_kernel_qmv, "_cuda_kernel", lambda: kernel)
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setitem(dflash2_kernel_qmv._verified, "cuda", True)
    dflash2_kernel_qmv._cuda_launch.cache_clear()
    request.addfinalizer(dflash2_kernel_qmv._cuda_launch.cache_clear)
    weight, scales, biases = dflash2_kernel_qmv.make_weights(42, 512, mx.random.key(1))
    for leading in ((1, 3), (2, 2, 2), (5,)):
        x = dflash2_kernel_base.make_inputs("normal", math.prod(leading), 512, mx.random.key(2)).reshape(*leading, 512)
        assert dk.exact_rows(x, weight, scales, biases).shape == (*leading, 42)
        launch = kernel.launches[-1]
        assert launch["x"] is x and launch["template"]["M"] == math.prod(leading)


def test_swizzled_rows_put_each_lane_s_halves_where_the_cuda_kernels_read_them():
    """The qmv's swizzled layout: in each 512-wide step, lane l's first 8 elements
    (16 l .. 16 l + 7) at 8 l, its last 8 at 256 + 8 l; rows and steps stay in place."""
    x = mx.arange(2 * 1024).reshape(2, 1024)
    got = np.array(dflash2_kernel_qmv.swizzle_steps(x))
    for row, step, lane, half in itertools.product((0, 1), (0, 1), (0, 5, 31), (0, 1)):
        source = row * 1024 + step * 512 + 16 * lane + 8 * half
        at = step * 512 + 256 * half + 8 * lane
        assert got[row, at : at + 8].tolist() == list(range(source, source + 8))
    assert same_bits(dflash2_kernel_qmv.swizzle_steps(x.reshape(2, 1, 1024)).reshape(2, 1024), dflash2_kernel_qmv.swizzle_steps(x))


@pytest.mark.parametrize("rotation_passed", [True, False])
def test_rotated_rows_reach_the_qmv_swizzled_only_where_both_kernels_passed(monkeypatch, rotation_passed):
    """exact_linear_rows on CUDA: the rotation writes swizzled rows for the qmv where it
    passed its self-test at (K, block) (every rotated K is whole 512-wide steps: blocks are
    512 or more); otherwise the stock chain rotates and the qmv reads plain rows."""
    k = 1024
    qmv, rotation = RecordingKernel(), RecordingKernel()
    monkeypatch.setattr(dflash2_kernel_qmv, "_cuda_kernel", lambda: qmv)
    monkeypatch.setattr(dflash2_kernel_rotate, "_cuda_rotate_kernel", lambda outputs=1: rotation)
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setitem(dflash2_kernel_qmv._verified, "cuda", True)
    monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_plans", {})
    monkeypatch.setattr(dflash2_kernel_rotate, "_swizzled_rotations", {})
    monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_verified", {("cuda", k, 512): rotation_passed})
    dflash2_kernel_qmv._cuda_launch.cache_clear()
    dflash2_kernel_rotate.cuda_rotate_plan.cache_clear()
    weight, scales, biases = dflash2_kernel_qmv.make_weights(16, k, mx.random.key(1))
    x = dflash2_kernel_base.make_inputs("normal", 3, k, mx.random.key(2)).reshape(1, 3, k)
    signs = dflash2_kernel_rotate.make_signs("pm1", k, mx.random.key(3))
    try:
        assert dk.exact_linear_rows(x, 512, signs, weight, scales, biases).shape == (1, 3, 16)
    finally:
        dflash2_kernel_qmv._cuda_launch.cache_clear()
        dflash2_kernel_rotate.cuda_rotate_plan.cache_clear()
    assert qmv.launches[-1]["template"]["SWIZZLED"] is rotation_passed
    if rotation_passed:
        assert [launch["template"]["SWIZZLED"] for launch in rotation.launches] == [True]
    else:
        assert not rotation.launches  # the stock chain rotates


def test_group_rotation_self_test_fails_naming_the_output():
    """The group rotation's check, with stand-in kernels (CUDA has the real one; here the
    default says there is none): the chain per sign vector, in plain rows or swizzled as asked,
    passes; outputs in another order, or one layout whatever is asked, fail naming the case."""
    assert dflash2_kernel_rotate.self_test_rotate_group().reason == (dflash2_kernel_base.NO_KERNEL if dk.backend_name() != "cuda" else None)
    shape = [(1024, 512, 3)]

    def chain(x, block, signs, swizzled):
        rotated = [dflash2_kernel_rotate.stock_rotate(x, block, sign) for sign in signs]
        return [dflash2_kernel_qmv.swizzle_steps(out) for out in rotated] if swizzled else rotated

    assert dflash2_kernel_rotate.self_test_rotate_group(shape, kernel=chain).ok
    swapped = dflash2_kernel_rotate.self_test_rotate_group(shape, kernel=lambda x, block, signs, swizzled:
                                        chain(x, block, signs[::-1], swizzled))
    assert not swapped.ok and "outputs=3, output 0, rows=1" in swapped.reason and "got 0x" in swapped.reason
    for layout, always in (("swizzled", False), ("rows", True)):
        one_layout = dflash2_kernel_rotate.self_test_rotate_group(shape, kernel=lambda x, block, signs, swizzled:
                                               chain(x, block, signs, always))
        assert not one_layout.ok and f"layout={layout}" in one_layout.reason and one_layout.stock_mismatches > 0


@pytest.mark.parametrize("group_passed", [True, False])
def test_rotated_linears_sharing_their_input_take_one_rotation_launch_where_it_passed(monkeypatch, group_passed):
    """exact_linear_group on CUDA: where the group rotation passed its self-test at (K, block,
    count), one launch rotates x by every sign vector (grid.y: which) and each qmv reads its
    swizzled rows; otherwise a rotation each, as exact_linear_rows runs them. rotate_group
    (decode's, for MLX's matmuls) likewise, in plain rows."""
    qmv, rotation, group = RecordingKernel(), RecordingKernel(), RecordingGroupRotation()
    monkeypatch.setattr(dflash2_kernel_qmv, "_cuda_kernel", lambda: qmv)
    monkeypatch.setattr(dflash2_kernel_rotate, "_cuda_rotate_kernel", lambda outputs=1: rotation if outputs == 1 else group)
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setitem(dflash2_kernel_qmv._verified, "cuda", True)
    monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_plans", {})
    monkeypatch.setattr(dflash2_kernel_rotate, "_swizzled_rotations", {})
    monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_verified", {("cuda", 1024, 512): True})
    monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_group_verified", {(1024, 512, 3): group_passed})
    for cached in (dflash2_kernel_qmv._cuda_launch, dflash2_kernel_rotate.cuda_rotate_plan):
        cached.cache_clear()
    matrices = [dflash2_kernel_qmv.make_weights(n, 1024, mx.random.key(n)) for n in (48, 16, 16)]
    signs = [dflash2_kernel_rotate.make_signs("pm1", 1024, mx.random.key(10 + index)) for index in range(3)]
    x = dflash2_kernel_base.make_inputs("normal", 4, 1024, mx.random.key(2)).reshape(1, 4, 1024)
    try:
        outputs = dk.exact_linear_group(x, 512, signs, matrices)
        decode_qmv, decode_group, decode_rotation = RecordingKernel(), RecordingGroupRotation(), RecordingKernel()
        monkeypatch.setattr(dflash2_kernel_qmv, "_cuda_kernel", lambda: decode_qmv)
        monkeypatch.setattr(dflash2_kernel_rotate, "_cuda_rotate_kernel",
                            lambda outputs=1: decode_rotation if outputs == 1 else decode_group)
        monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_plans", {})  # each plan holds the kernel it was made with
        dflash2_kernel_rotate.cuda_rotate_plan.cache_clear()
        rotated = dk.rotate_group(x, 512, signs)
    finally:
        for cached in (dflash2_kernel_qmv._cuda_launch, dflash2_kernel_rotate.cuda_rotate_plan):
            cached.cache_clear()
    assert len(rotated) == 3 and not decode_qmv.launches
    if group_passed:
        assert not decode_rotation.launches and [launch["grid"][1] for launch in decode_group.launches] == [3]
        assert decode_group.launches[0]["template"]["SWIZZLED"] is False and list(rotated) == decode_group.outputs
    else:
        assert not decode_group.launches
        assert [launch["template"]["SWIZZLED"] for launch in decode_rotation.launches] == [False] * 3
    assert [out.shape for out in outputs] == [(1, 4, 48), (1, 4, 16), (1, 4, 16)]
    assert [launch["template"]["SWIZZLED"] for launch in qmv.launches] == [True] * 3
    if group_passed:
        assert not rotation.launches and len(group.launches) == 1
        assert group.launches[0]["grid"][1] == 3 and group.launches[0]["template"]["SWIZZLED"] is True
        assert [launch["x"] for launch in qmv.launches] == group.outputs  # each qmv reads its own rotation
    else:
        assert not group.launches and len(rotation.launches) == 3


class RecordingGroupRotation(RecordingKernel):
    """The group rotation's stand-in: one output per sign vector, kept to follow them."""

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        super().__call__(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                         output_shapes=output_shapes, output_dtypes=output_dtypes)
        self.outputs = [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return self.outputs


def test_the_pack_s_shared_input_linears_are_its_rotation_groups():
    """kernel_shapes names the 27B pack's groups of rotated linears that share their input, for
    the start-up self-test of the group rotation: q/k/v (3), in_proj_qkv and in_proj_z, gate and up (2)."""
    from make_synthetic_pack import target_config

    from dflash2_pack import build_skeleton, kernel_shapes

    shapes = kernel_shapes(build_skeleton(target_config("27b"), "config.json"))
    assert shapes["rotation_groups"] == [(5120, 1024, 2), (5120, 1024, 3)]


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernels")
def test_group_rotation_and_qmvs_equal_the_stock_chain_and_single_row_calls_on_cuda():
    """One rotation launch for three linears sharing x, each qmv on its swizzled rows: every
    row of every output is the stock chain's and MLX's single-row call's; decode's group
    rotation (plain rows, for MLX's matmuls) the stock chain's."""
    k, block = 1024, 512
    matrices = [dflash2_kernel_qmv.make_weights(n, k, mx.random.key(n)) for n in (48, 16, 24)]
    signs = [dflash2_kernel_rotate.make_signs(kind, k, mx.random.key(index)) for index, kind in enumerate(("pm1", "general", "pm1"))]
    for rows in range(1, dk.MAX_ROWS + 1):
        x = dflash2_kernel_base.make_inputs("normal", rows, k, mx.random.key(3 + rows))
        got = dk.exact_linear_group(x, block, signs, matrices)
        for out, sign, matrix in zip(got, signs, matrices):
            assert dflash2_kernel_base._differing(out, dk.stock_rows(dflash2_kernel_rotate.stock_rotate(x, block, sign), *matrix)) == 0
        for out, sign in zip(dk.rotate_group(x, block, signs), signs):  # decode's, in plain rows
            assert dflash2_kernel_base._differing(out, dflash2_kernel_rotate.stock_rotate(x, block, sign)) == 0
    assert dflash2_kernel_rotate._rotate_group_verified[(k, block, 3)]  # the group kernel served, with the qmv:
    assert all(dflash2_kernel_qmv._serving_kernel("cuda", n, k, dk.MAX_ROWS) for n in (48, 16, 24))


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernels")
def test_swizzled_rotation_and_qmv_equal_the_stock_chain_and_single_row_calls_on_cuda():
    """The served rotated linear (rotation writing swizzled rows, qmv reading them) gives
    every row the stock chain's and MLX's single-row bits; each kernel reading or writing
    the other layout is caught by its self-test (the layout check can fail)."""
    k, block = 1024, 512
    weight, scales, biases = dflash2_kernel_qmv.make_weights(24, k, mx.random.key(1))
    signs = dflash2_kernel_rotate.make_signs("pm1", k, mx.random.key(2))
    for rows in range(1, dk.MAX_ROWS + 1):
        x = dflash2_kernel_base.make_inputs("normal", rows, k, mx.random.key(3 + rows))
        want = dk.stock_rows(dflash2_kernel_rotate.stock_rotate(x, block, signs), weight, scales, biases)
        assert dflash2_kernel_base._differing(dk.exact_linear_rows(x, block, signs, weight, scales, biases), want) == 0
    assert dflash2_kernel_rotate._swizzled_rotation(k, block) is not None and dflash2_kernel_qmv._serving_kernel("cuda", 24, k, dk.MAX_ROWS)
    plain_read_as_swizzled = dk.self_test(
        kernel=lambda x, w, s, b: dflash2_kernel_qmv.cuda_matmul(x, w, s, b, swizzled=True), shapes=[(16, k)])
    assert not plain_read_as_swizzled.ok and "layout=rows" in plain_read_as_swizzled.reason
    swizzled_as_plain = dflash2_kernel_rotate.self_test_rotate(
        [(k, block)], kernel=lambda x, block, signs: dflash2_kernel_rotate.cuda_rotate_plan(k, block, swizzled=True)(x, signs))
    assert not swizzled_as_plain.ok and "layout=rows" in swizzled_as_plain.reason


def test_tuned_launch_splits_only_rows_it_divides_and_keeps_accumulators_in_registers():
    """kernel_parity's tuning gives untimed row counts the nearest timed choice, its split of
    the activation rows cut to one that divides theirs (qmv_split_rows asserts it does) and
    its output rows per warp to MAX_ACCUMULATORS (at 5 or 7 rows, 4 output rows spill)."""
    assert launch_for_rows((2, 4, 1, 4), 6) == (2, 4, 1, 3)
    assert launch_for_rows((2, 4, 1, 2), 7) == (2, 4, 1)
    assert launch_for_rows((2, 2, 1), 5) == (2, 2, 1)
    assert launch_for_rows((4, 2, 1, 2), 7) == (2, 2, 1)
    assert launch_for_rows((4, 2, 1, 2), 5) == (3, 2, 1)
    assert launch_for_rows((4, 2, 1, 2), 6) == (4, 2, 1, 2)
    # A capped grid keeps its cap, and a split that divides a block's 4 warps (a warp keeps its
    # part of the rows across its tiles only then): 6 rows over 4 warps become 2, not 3.
    assert launch_for_rows((2, 4, 1, 4, 264), 6) == (2, 4, 1, 2, 264)
    with pytest.raises(ValueError, match="a capped grid needs S"):
        dflash2_kernel_qmv._cuda_launch.__wrapped__((6,), 1024, (2, 4, 1, 3, 264))

    def accumulators(launch, rows):
        return launch[0] * rows // (launch[3] if len(launch) > 3 else 1)

    for rows, launches in TUNE_LAUNCHES.items():
        assert all(rows % (launch[3] if len(launch) > 3 else 1) == 0 for launch in launches)
        assert all(accumulators(launch, rows) <= MAX_ACCUMULATORS for launch in launches)
    for rows, like in TUNE_FALLBACK.items():
        for launch in TUNE_LAUNCHES[like]:
            split = launch_for_rows(launch, rows)
            assert rows % (split[3] if len(split) > 3 else 1) == 0
            assert accumulators(split, rows) <= MAX_ACCUMULATORS
    assert all(accumulators(launch, rows) <= MAX_ACCUMULATORS for rows, launch in dflash2_kernel_qmv.CUDA_LAUNCH.items())


def tuned_launches_beyond_one_warps_loads():
    """(rows, launch) the tuning may pick, timed or as a fallback row count's, that split the
    activation rows over warps or ask L2 for the weights first."""
    pairs = {(rows, launch) for rows, launches in TUNE_LAUNCHES.items() for launch in launches}
    pairs |= {(rows, launch_for_rows(launch, rows)) for rows, like in TUNE_FALLBACK.items()
              for launch in TUNE_LAUNCHES[like]}
    return sorted(pair for pair in pairs if len(pair[1]) > 3 or pair[1][2] > 1)


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
@pytest.mark.parametrize("rows, launch", tuned_launches_beyond_one_warps_loads())
def test_split_and_prefetching_launches_equal_single_row_calls_on_cuda(rows, launch):
    """Each launch the tuning may pick with its activation rows split over warps or its
    weights asked of L2 first gives every row MLX's single-row bits, at the row counts it may
    serve, for every input kind and shape (K under one step, one step with a tail, several
    steps with a tail; warps past the last output row): a wrong part offset or prefetch
    address would give some row another row's outputs, another step's or none."""
    assert_single_row_bits(rows, launch, (*dflash2_kernel_qmv.DEFAULT_SHAPES, (24, 1152)), mx.random.key(7))


def assert_single_row_bits(rows, launch, shapes, key):
    """The CUDA kernel under `launch` gives every row MLX's single-row bits at each shape,
    for every input kind."""
    for n, k in shapes:
        key, weight_key, input_key = mx.random.split(key, 3)
        weight, scales, biases = dflash2_kernel_qmv.make_weights(n, k, weight_key)
        for kind in dflash2_kernel_base.INPUT_KINDS:
            x = dflash2_kernel_base.make_inputs(kind, rows, k, input_key)
            got = dflash2_kernel_qmv.cuda_matmul(x, weight, scales, biases, launch=launch)
            assert dflash2_kernel_base._differing(got, dk.stock_rows(x, weight, scales, biases)) == 0, (launch, n, k, kind)


def capped_to_a_block_or_two():
    """(rows, launch) of every capped launch in the table and the tuning, its cap cut to one
    or two blocks: on the small test shapes each warp then takes several tiles."""
    pairs = {(rows, launch) for rows, launches in TUNE_LAUNCHES.items() for launch in launches}
    pairs |= set(dflash2_kernel_qmv.CUDA_LAUNCH.items())
    return sorted({(rows, (*launch[:4], blocks)) for rows, launch in pairs if len(launch) > 4 for blocks in (1, 2)})


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
@pytest.mark.parametrize("rows, launch", capped_to_a_block_or_two())
def test_warps_taking_several_tiles_equal_single_row_calls_on_cuda(rows, launch):
    """A grid capped below its tiles (a warp then loads its next tile's first chunk during its
    last one) gives every row MLX's single-row bits, with a tail step (K % 512), K under one
    step, chunks that do not divide the steps and a ragged last tile (n odd)."""
    assert_single_row_bits(rows, launch, (*dflash2_kernel_qmv.DEFAULT_SHAPES, (43, 1152), (37, 2560)), mx.random.key(11))


def test_cuda_header_includes_a_file_named_by_its_content(tmp_path, monkeypatch):
    monkeypatch.setattr(dflash2_kernel_base.tempfile, "gettempdir", lambda: str(tmp_path))
    line = dflash2_kernel_base.cuda_header("namespace a { int x; }\n")
    path = line.split('"')[1]
    assert line == f'#include "{path}"\n' and open(path).read() == "namespace a { int x; }\n"
    assert dflash2_kernel_base.cuda_header("namespace a { int x; }\n") == line  # same text, same file
    assert dflash2_kernel_base.cuda_header("namespace b {}\n") != line  # other text, other name: no stale PTX
    with open(path, "w") as tampered:
        tampered.write("changed")
    dflash2_kernel_base.cuda_header("namespace a { int x; }\n")
    assert open(path).read() == "namespace a { int x; }\n"
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"


def test_add_rms_norm_equals_decode_s_add_and_norm():
    """The residual add and the RMSNorm after it, both outputs, at 1 and 5 rows of a ragged
    width; on CUDA through the variant the kernel's self-test chose."""
    x, residual = (dflash2_kernel_base.make_inputs("normal", 5, 1000, mx.random.key(seed)).reshape(1, 5, 1000) for seed in (1, 2))
    weight = dflash2_kernel_base.make_inputs("normal", 1, 1000, mx.random.key(3))[0]
    variant = None
    if dk.backend_name() == "cuda":
        dflash2_kernel_fused.self_test_add_norm()
        variant = dflash2_kernel_fused._add_norm_serving["cuda"]
        assert variant == "fused"
    for rows in (1, 5):
        h, normed = dk.add_rms_norm(x[:, :rows], residual[:, :rows], weight, 1e-6, variant=variant)
        want = x[:, :rows] + residual[:, :rows]
        assert same_bits(h, want) and same_bits(normed, mx.fast.rms_norm(want, weight, 1e-6))


def test_gated_rms_norm_equals_mlx_vlm_s_gated_norm(target):
    """The GatedDeltaNet's output norm with its gate (Qwen3_5RMSNormGated, the pack's own
    module) at 1 and 5 positions of 3 heads; on CUDA through the kernel its self-test passed."""
    norm = next(layer.linear_attn.norm for layer in target[0].language_model.model.layers if layer.is_linear)
    width = norm.weight.shape[0]
    x, gate = (dflash2_kernel_base.make_inputs("normal", 15, width, mx.random.key(seed)).reshape(1, 5, 3, width) for seed in (1, 2))
    variant = None
    if dk.backend_name() == "cuda":
        dflash2_kernel_fused.self_test_gated_norm()
        variant = dflash2_kernel_fused._gated_norm_serving["cuda"]
        assert variant == "fused"
    for rows in (1, 5):
        got = dk.gated_rms_norm(x[:, :rows], norm.weight, norm.eps, gate[:, :rows], variant=variant)
        assert same_bits(got, norm(x[:, :rows], gate[:, :rows]))


def test_gdn_gates_equal_mlx_vlm_s_compute_g_beta():
    """g and beta of slices of one projection (as the model hands them over), at 1 and 5
    positions; on CUDA through the variant the kernel's self-test chose."""
    A_log, a, b, dt_bias = dflash2_kernel_fused.make_gates_case("normal", 5, 6, mx.random.key(1))
    variant = None
    if dk.backend_name() == "cuda":
        dflash2_kernel_fused.self_test_gates()
        variant = dflash2_kernel_fused._gates_serving["cuda"]
        assert variant in dflash2_kernel_fused.GATE_VARIANTS
    for rows in (1, 5):
        got = dk.gdn_gates(A_log, a[:, :rows], b[:, :rows], dt_bias, variant=variant)
        want = mx.exp(-mx.exp(A_log) * nn.softplus(a[:, :rows] + dt_bias)), mx.sigmoid(b[:, :rows])
        assert all(same_bits(x, y) for x, y in zip(got, want))


def test_rms_norm_launch_is_mlx_s_for_each_width():
    """MLX's (block, chunks) for an fp16 row (rms_norm.cu dispatch_num_chunks): 64 threads
    up to 512 features, 128 where the 8-wide vectors split evenly over 128, else 64, else
    128 with the chunks rounded up."""
    assert [dflash2_kernel_fused.rms_norm_launch(width) for width in (100, 512, 1000, 1024, 2560, 4096, 5120, 5128, 8192)] == [
        (64, 1), (64, 1), (128, 1), (128, 1), (64, 5), (128, 4), (128, 5), (128, 6), (128, 8)]


def test_wrong_add_norm_fails_naming_the_case():
    def wrong(x, residual, weight, eps):  # the norm's first element one bit off at 8 rows
        h, normed = dflash2_kernel_fused.stock_add_rms_norm(x, residual, weight, eps)
        return h, flip_first_bit(normed) if x.shape[1] == 8 else normed

    result = dflash2_kernel_fused.self_test_add_norm([(512,)], kernel=wrong)
    assert not result.ok and result.mismatches == len(dflash2_kernel_base.INPUT_KINDS)
    assert "D=512 (B, L)=(1, 8) input=normal, norm" in result.reason
    assert dflash2_kernel_fused.self_test_add_norm([(512,)], kernel=dflash2_kernel_fused.stock_add_rms_norm).ok


def test_wrong_gated_norm_fails_naming_the_case():
    def wrong(x, weight, eps, gate):  # the first element one bit off at 3 positions
        out = dflash2_kernel_fused.stock_gated_rms_norm(x, weight, eps, gate)
        return flip_first_bit(out) if x.shape[1] == 3 else out

    result = dflash2_kernel_fused.self_test_gated_norm([(2, 64)], kernel=wrong)
    assert not result.ok and result.mismatches == len(dflash2_kernel_base.INPUT_KINDS)
    assert "(heads, D)=(2, 64) L=3 input=normal, out" in result.reason
    assert dflash2_kernel_fused.self_test_gated_norm([(2, 64)], kernel=dflash2_kernel_fused.stock_gated_rms_norm).ok


def test_wrong_gates_fail_naming_the_case():
    def wrong(A_log, a, b, dt_bias):  # beta's first element one bit off at 4 positions
        g, beta = dflash2_kernel_fused._compute_g_beta(A_log, a, b, dt_bias)
        return g, flip_first_bit(beta) if a.shape[1] == 4 else beta

    result = dflash2_kernel_fused.self_test_gates([(4,)], kernel=wrong)
    assert not result.ok and result.mismatches == len(dflash2_kernel_base.INPUT_KINDS)
    assert "Hv=4 L=4 input=normal, beta" in result.reason
    assert dflash2_kernel_fused.self_test_gates([(4,)], kernel=dflash2_kernel_fused._compute_g_beta).ok


def test_gates_serve_the_variant_that_passed_with_the_other_as_control(monkeypatch):
    """The self-test's default path (CUDA's, here with a stand-in kernel whose "half"
    variant is one bit off in every case): "float" serves, "half" is counted as its control,
    and gdn_gates then calls the kernel with "float"."""
    calls = []

    def stand_in(A_log, a, b, dt_bias, variant):
        calls.append(variant)
        g, beta = dflash2_kernel_fused._compute_g_beta(A_log, a, b, dt_bias)
        return g, flip_first_bit(beta) if variant == "half" else beta

    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setattr(dflash2_kernel_fused, "cuda_gdn_gates", stand_in)
    monkeypatch.setattr(dflash2_kernel_fused, "_gates_serving", {})
    result = dflash2_kernel_fused.self_test_gates([(4,)])
    cases = len(dflash2_kernel_base.INPUT_KINDS) * dk.MAX_ROWS
    assert result.ok and result.variant == "float" and dflash2_kernel_fused._gates_serving == {"cuda": "float"}
    assert result.controls == {"half": cases} and "half differs at Hv=4 L=1 input=normal, beta" in result.reason
    calls.clear()
    A_log, a, b, dt_bias = dflash2_kernel_fused.make_gates_case("normal", 3, 4, mx.random.key(2))
    assert all(same_bits(x, y) for x, y in zip(dk.gdn_gates(A_log, a, b, dt_bias), dflash2_kernel_fused._compute_g_beta(A_log, a, b, dt_bias)))
    assert calls == ["float"]


def test_cuda_header_leaves_a_folder_others_can_write(tmp_path, monkeypatch):
    monkeypatch.setattr(dflash2_kernel_base.tempfile, "gettempdir", lambda: str(tmp_path))
    shared = tmp_path / f"dflash2-cuda-{os.getuid()}"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    path = dflash2_kernel_base.cuda_header("namespace c {}\n").split('"')[1]
    assert os.path.dirname(path) != str(shared) and open(path).read() == "namespace c {}\n"
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    # A link in the folder's place (to a folder of ours, or to a file) is left alone too.
    for target in (tmp_path / "ours", tmp_path / "a-file"):
        shutil.rmtree(shared, ignore_errors=True)
        shared.unlink(missing_ok=True)
        if target.name == "ours":
            target.mkdir(mode=0o700)
        else:
            target.write_text("")
        shared.symlink_to(target)
        path = dflash2_kernel_base.cuda_header("namespace d {}\n").split('"')[1]
        assert os.path.dirname(path) not in (str(shared), str(target)) and open(path).read() == "namespace d {}\n"


def test_wrong_rope_fails_naming_the_case():
    def wrong(q, k, cos, sin):  # the keys' first element one bit off at 8 positions
        q_out, k_out = dflash2_kernel_fused.stock_rope_rows(q, k, cos, sin)
        return q_out, flip_first_bit(k_out) if q.shape[2] == 8 else k_out

    result = dflash2_kernel_fused.self_test_rope([(1, 2, 1, 32, 16)], kernel=wrong)
    assert not result.ok and result.mismatches == len(dflash2_kernel_base.INPUT_KINDS)
    assert "(B, Hq, Hk, D, R)=(1, 2, 1, 32, 16) rows=8 input=normal, k" in result.reason
    assert dflash2_kernel_fused.self_test_rope([(1, 2, 1, 32, 16)], kernel=dflash2_kernel_fused.stock_rope_rows).ok


def test_packed_weights_must_hold_whole_groups():
    """K = 64: scales of K // 128 = 0 columns match their shape check, so K itself is checked
    (the verify forward's matmuls rely on install's check_packed_weights alone)."""
    weight = mx.zeros((4, 4), dtype=mx.uint32)
    empty = mx.zeros((4, 0), dtype=mx.float16)
    with pytest.raises(ValueError, match="K=64 is not a multiple of the group size 128"):
        dk.check_packed_weights(weight, empty, empty)


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
def test_convolution_kernel_equals_decode_at_the_27b_shape_on_cuda():
    """The 27B's GatedDeltaNet convolution (10240 channels, 4 taps) and the small shapes,
    rows 1..8, silu after it, the window too: the kernel serves."""
    result = dflash2_kernel_fused.self_test_conv([(1, 10240, 4), *dflash2_kernel_fused.CONV_SHAPES_SMALL])
    assert result.ok and result.variant == "taps", result.reason


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
def test_rope_kernel_equals_mlx_vlm_at_the_27b_shape_on_cuda():
    """The 27B's attention rotary (24 query and 4 key heads of 256, the first 64 rotated)
    and the small shapes, 1..8 positions and a prefill's: a variant serves."""
    result = dflash2_kernel_fused.self_test_rope([(1, 24, 4, 256, 64), *dflash2_kernel_fused.ROPE_SHAPES_SMALL])
    assert result.ok and result.variant in dflash2_kernel_fused.ROPE_VARIANTS, result.reason
    print("rope variants, differing elements:", result.variants)


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
def test_add_norm_kernel_equals_mlx_at_the_27b_shape_on_cuda():
    """The 27B's residual add and post-attention norm (5120 features) and the small widths,
    rows 1..8: the kernel serves."""
    result = dflash2_kernel_fused.self_test_add_norm([(5120,), *dflash2_kernel_fused.NORM_WIDTHS_SMALL])
    assert result.ok and result.variant == "fused", result.reason


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
def test_gates_kernel_equals_mlx_vlm_at_the_27b_shape_on_cuda():
    """The 27B's GatedDeltaNet gates (48 value heads) and the small shapes, 1..8 positions:
    a variant serves."""
    result = dflash2_kernel_fused.self_test_gates([(48,), *dflash2_kernel_fused.GATE_SHAPES_SMALL])
    assert result.ok and result.variant in dflash2_kernel_fused.GATE_VARIANTS, result.reason
    print("gates variants, differing elements:", result.variants)


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
def test_gated_norm_kernel_equals_mlx_vlm_at_the_27b_shape_on_cuda():
    """The 27B's GatedDeltaNet output norm (48 heads of 128) and the small shapes, 1..8
    positions: the kernel serves."""
    result = dflash2_kernel_fused.self_test_gated_norm([(48, 128), *dflash2_kernel_fused.GATED_NORM_SHAPES_SMALL])
    assert result.ok and result.variant == "fused", result.reason
