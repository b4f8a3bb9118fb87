"""dflash2_kernel_qmv32 (the exact 2-bit matmul for fp32 rows): the self-test passes what
equals MLX's single-row calls and fails what rounds otherwise, naming the case; the input
kinds reach fp32's edges; an fp32 pack's start-up tests it at the pack's shapes and verify
hands it fp32 rows. On CUDA: the kernel at the 27B shapes, bitwise."""

import shutil

import mlx.core as mx
import numpy as np
import pytest

import dflash2_kernel_base
import dflash2_kernel_qmv
import dflash2_kernel_qmv32
import dflash2_kernels as dk
import dflash2_verify
from dflash2_kernel_base import NO_KERNEL, _differing
from kernel_cases import one_bit_off_at_eight_rows, split_k_halves

SHAPE = (16, 512)


def fp16_kernel(x, weight, scales, biases):
    """The fp16 kernel's rows: right shape and dtype, fp16's rounding."""
    return dk.stock_rows(x.astype(mx.float16), weight, scales, biases).astype(mx.float32)


def test_the_serving_path_passes_where_batched_calls_round_otherwise(gpu_like_rounding):
    """What exact_rows_fp32 serves here equals the single-row calls at rows 1..8 of every
    kind and shape, where MLX's batched call rounds otherwise (the control counts it);
    off CUDA there is no kernel of its own to test."""
    assert dflash2_kernel_qmv32.self_test_qmv32().reason == NO_KERNEL or dk.backend_name() == "cuda"
    serving = dict(dflash2_kernel_qmv32._qmv32_serving)
    result = dflash2_kernel_qmv32.self_test_qmv32(kernel=dk.exact_rows_fp32)
    assert result.ok and result.variant == "kernel" and result.mismatches == 0, result.reason
    assert result.stock_mismatches > 0
    assert {case["rows"] for case in result.cases} == set(range(1, 9))
    assert {case["input"] for case in result.cases} == set(dflash2_kernel_base.FP32_INPUT_KINDS)
    assert {tuple(case["shape"]) for case in result.cases} == set(dflash2_kernel_qmv32.FP32_SHAPES_SMALL)
    assert dflash2_kernel_qmv32._qmv32_serving == serving  # an injected kernel never switches serving


@pytest.mark.parametrize("kernel", [fp16_kernel, split_k_halves, one_bit_off_at_eight_rows])
def test_a_wrong_kernel_fails_naming_the_case(kernel):
    result = dflash2_kernel_qmv32.self_test_qmv32(kernel=kernel, shapes=[SHAPE])
    assert not result.ok and result.variant is None and result.mismatches > 0
    assert "(N, K)=(16, 512)" in result.reason and "rows=" in result.reason
    assert "input=" in result.reason and "got 0x" in result.reason


def test_one_differing_bit_is_counted_exactly():
    result = dflash2_kernel_qmv32.self_test_qmv32(kernel=one_bit_off_at_eight_rows, shapes=[SHAPE])
    assert result.mismatches == len(dflash2_kernel_base.FP32_INPUT_KINDS)  # y[7, 3] once per kind
    assert "rows=8" in result.reason and "first at [7, 3]" in result.reason


def test_the_input_kinds_reach_fp32_s_edges():
    """`large` overflows some rows' sums and not others; `tiny` holds fp32 subnormals;
    `signed_zero`'s first row is all -0."""
    weight, scales, biases = dflash2_kernel_qmv.make_weights(*SHAPE, mx.random.key(1))
    large = dflash2_kernel_base.make_inputs_fp32("large", 8, SHAPE[1], mx.random.key(2))
    finite = np.isfinite(np.array(dk.stock_rows(large, weight, scales, biases))).all(axis=1)
    assert finite.any() and not finite.all()
    tiny = np.abs(np.array(dflash2_kernel_base.make_inputs_fp32("tiny", 8, SHAPE[1], mx.random.key(3))))
    assert ((tiny > 0) & (tiny < np.finfo(np.float32).tiny)).any()
    zero = dflash2_kernel_base.make_inputs_fp32("signed_zero", 8, SHAPE[1], mx.random.key(4))
    assert (np.array(zero[0].view(mx.uint32)) == 0x80000000).all()


@pytest.mark.parametrize("leading", [(1,), (3,), (8,), (2, 4)])
def test_exact_rows_fp32_equals_single_row_calls(leading):
    n, k = 24, 640
    weight, scales, biases = dflash2_kernel_qmv.make_weights(n, k, mx.random.key(1))
    rows = int(np.prod(leading))
    x = dflash2_kernel_base.make_inputs_fp32("normal", rows, k, mx.random.key(2))
    y = dk.exact_rows_fp32(x.reshape(*leading, k), weight, scales, biases)
    assert y.shape == (*leading, n) and y.dtype == mx.float32
    want = mx.concatenate([dflash2_kernel_qmv.stock_quantized_matmul(x[m : m + 1], weight, scales, biases)
                           for m in range(rows)])
    assert _differing(y.reshape(rows, n), want) == 0


def test_an_fp32_pack_s_start_up_tests_the_kernel_at_its_packed_shapes(target, float32_target):
    """kernel_shapes hands the fp32 kernel the pack's packed shapes where its norms (so its
    activations) are fp32, and none to an fp16 pack's start-up."""
    from dflash2_pack import kernel_shapes

    fp32 = kernel_shapes(float32_target[0])
    assert fp32["packed_fp32"] and not fp32["packed"]  # an fp32 pack tests no fp16 kernel
    assert kernel_shapes(target[0])["packed_fp32"] == []
    assert dk.SELF_TESTS["qmv32"][0] == "packed_fp32" and "qmv32" in dk.VERDICT_TABLES


def test_verify_hands_fp32_rows_to_the_fp32_kernel(float32_target, monkeypatch):
    """A packed linear of the fp32 pack, given a verify block's rows, makes one exact_rows_fp32
    call for them as they come, (B, L, K) with no reshape around it, whose result it returns."""
    from mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35 import HadamardQuantizedLinear

    linear = next(module for _, module in float32_target[0].language_model.named_modules()
                  if isinstance(module, HadamardQuantizedLinear))
    calls = []

    def spy(x, weight, scales, biases):
        calls.append(x.shape)
        return dflash2_kernel_qmv32.exact_rows_fp32(x, weight, scales, biases)

    monkeypatch.setattr(dk, "exact_rows_fp32", spy)
    k = dk.packed_width(linear.weight)
    x = dflash2_kernel_base.make_inputs_fp32("normal", 5, k, mx.random.key(0)).reshape(1, 5, k)
    y = dflash2_verify._packed_linear(linear, x)
    assert calls == [(1, 5, k)] and y.shape == (1, 5, linear.weight.shape[0]) and y.dtype == mx.float32


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA toolkit's nvcc")
def test_the_fp32_launches_compile_with_their_accumulators_in_registers():
    """The launches with the most accumulators (R * M * 8 = 64: rows 2, 4 and 8) compile offline
    for the H200 (sm_90a) inside the wrapper MLX writes, with no register spill (nvcc 13.0:
    135, 140 and 155 registers); the other launches hold fewer."""
    from qmv_sass import compile_reports, fp32_launches_unit

    per_warp = dflash2_kernel_qmv32.CUDA_ROWS_PER_WARP
    most = max(rows * per_warp[rows] for rows in per_warp)
    widest = {f"rows{rows}": rows for rows in per_warp if rows * per_warp[rows] == most}
    assert list(widest.values()) == [2, 4, 8]
    reports = compile_reports(fp32_launches_unit(widest), widest)
    assert [report["spill_bytes"] for report in reports.values()] == [0, 0, 0], reports


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("nvdisasm") is None,
                    reason="needs the CUDA toolkit's nvcc and nvdisasm")
def test_the_fp32_weight_steps_make_their_addresses_once():
    """Each lane's pointers are made before the weight steps and advanced a step at a time, so
    a step's loads need no index arithmetic: offline (nvcc 13.0, sm_90a) the 8-row launch's
    weight-step loop (4 steps unrolled) issues 493 instructions, 288 of them the FFMAs (at
    3b80a8a, computing each load's index from the step's: 630)."""
    from qmv_sass import compile_report, fp32_translation_unit

    loop = max(compile_report(fp32_translation_unit(8))["loops"], key=lambda found: found["instructions"])
    assert loop["instructions"] <= 4 * 130, loop


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
def test_the_cuda_kernel_equals_single_row_calls_at_the_27b_shapes():
    """Both variants tried at every 27B packed shape; one passes (fma, as nvcc contracts MLX's
    dequantization), and MLX's own 8-row call (qmm_naive) differs (the control)."""
    result = dflash2_kernel_qmv32.self_test_qmv32(shapes=list(dflash2_kernel_qmv.PACKED_SHAPES_27B))
    assert result.ok and result.variant == "fma", result.reason
    assert result.controls["quantized_matmul(x[:8])"] > 0


def test_on_cuda_one_fp32_row_takes_the_kernel_too(monkeypatch):
    """As on CUDA (the backend faked, the kernel a stand-in): the self-test checks rows 1..8,
    and one row then takes the kernel, not MLX's fp32 call (which converts the fp16 scales
    and biases to fp32 first: two launches more, every call)."""
    calls = []

    def cuda(x, weight, scales, biases, variant):
        calls.append((x.shape, variant))
        return dk.stock_rows(x, weight, scales, biases)

    monkeypatch.setattr(dflash2_kernel_qmv32, "backend_name", lambda: "cuda")
    monkeypatch.setattr(dflash2_kernel_qmv32, "cuda_matmul_fp32", cuda)
    monkeypatch.setattr(dflash2_kernel_qmv32, "_qmv32_serving", {})
    tested = dflash2_kernel_qmv32.self_test_qmv32(shapes=[SHAPE])
    assert tested.ok and tested.variant == "fma", tested.reason
    assert {case["rows"] for case in tested.cases} == set(range(1, 9))
    packed = dflash2_kernel_qmv.make_weights(*SHAPE, mx.random.key(1))
    x = dflash2_kernel_base.make_inputs_fp32("normal", 1, SHAPE[1], mx.random.key(2))
    calls.clear()
    got = dk.exact_rows_fp32(x, *packed)
    assert calls == [((1, SHAPE[1]), "fma")] and _differing(got, dk.stock_rows(x, *packed)) == 0


def test_on_metal_fp32_rows_take_the_qmv_fast_kernel_where_it_serves(monkeypatch):
    """As on a Mac (the backend faked, the kernel a stand-in: no Metal here): the self-test runs
    the qmv_fast variant at the shapes qmv_fast takes (N % 8 == 0, K % 512 == 0), and rows
    2..8 of such a shape then take it; other shapes and one row stay MLX's calls."""
    calls = []

    def metal(x, weight, scales, biases):
        calls.append((x.shape, weight.shape[0]))
        return dk.stock_rows(x, weight, scales, biases)

    monkeypatch.setattr(dflash2_kernel_qmv32, "backend_name", lambda: "metal")
    monkeypatch.setattr(dflash2_kernel_qmv32, "metal_matmul", metal)
    monkeypatch.setattr(dflash2_kernel_qmv32, "_qmv32_serving", {})
    tested = dflash2_kernel_qmv32.self_test_qmv32()
    assert tested.ok and tested.variant == "qmv_fast", tested.reason
    assert {tuple(case["shape"]) for case in tested.cases} == {(16, 512), (24, 1536)}
    assert dflash2_kernel_qmv32._qmv32_serving == {"metal": "qmv_fast"}
    for (n, k), rows, served in (((16, 512), 5, True), ((42, 640), 5, False), ((16, 512), 1, False)):
        packed = dflash2_kernel_qmv.make_weights(n, k, mx.random.key(1))
        x = dflash2_kernel_base.make_inputs_fp32("normal", rows, k, mx.random.key(2))
        calls.clear()
        got = dk.exact_rows_fp32(x, *packed)
        assert bool(calls) == served and _differing(got, dk.stock_rows(x, *packed)) == 0
