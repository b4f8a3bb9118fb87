"""dflash2_kernel_fused on CPU: the convolution, norms and gates equal decode's calls bit for
bit, and their self-tests catch wrong kernels."""

import mlx.core as mx
import mlx.nn as nn
import pytest

import dflash2_kernel_base
import dflash2_kernel_fused
import dflash2_kernels as dk
from kernel_cases import flip_first_bit, patch_kernels, same_bits


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


def test_wrong_convolution_fails_naming_the_case():
    def wrong(state, x, weight):  # the first output's last bit off at 8 rows
        made, out = dflash2_kernel_fused.stock_conv_rows(state, x, weight)
        return made, flip_first_bit(out) if x.shape[1] == 8 else out

    result = dflash2_kernel_fused.self_test_conv([(1, 24, 3)], kernel=wrong)
    assert not result.ok and result.mismatches == len(dflash2_kernel_base.INPUT_KINDS)
    assert "(B, C, K)=(1, 24, 3) rows=8 input=normal, out" in result.reason
    assert dflash2_kernel_fused.self_test_conv([(1, 24, 3)], kernel=dflash2_kernel_fused.stock_conv_rows).ok


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
    128 with the chunks rounded up; past 8192 its long-row kernel, 1024 threads a pass. fp32
    rows read 4-wide vectors, so the long-row kernel takes them past 4096: the 27B's 5120."""
    launch = dflash2_kernel_fused.rms_norm_launch
    assert [launch(width) for width in (100, 512, 1000, 1024, 2560, 4096, 5120, 5128, 8192, 8193, 9000, 16385)] == [
        (64, 1), (64, 1), (128, 1), (128, 1), (64, 5), (128, 4), (128, 5), (128, 6), (128, 8), (1024, 2), (1024, 2),
        (1024, 3)]
    reads = dflash2_kernel_fused.norm_reads(mx.float32)
    assert [launch(width, reads) for width in (128, 256, 1003, 2560, 4096, 4097, 5120, 8192, 8193)] == [
        (64, 1), (64, 1), (128, 2), (128, 5), (128, 8), (1024, 2), (1024, 2), (1024, 2), (1024, 3)]
    assert dflash2_kernel_fused.norm_reads(mx.float16) == 8 and reads == 4


def one_bit_off_at(stock, part: int, rows: int, rows_of: int):
    """stock, with output `part`'s first element one bit off where its argument `rows_of` has
    `rows` positions."""
    def wrong(*args):
        out = stock(*args)
        if args[rows_of].shape[1] != rows:
            return out
        if not isinstance(out, tuple):
            return flip_first_bit(out)
        return tuple(flip_first_bit(o) if i == part else o for i, o in enumerate(out))

    return wrong


@pytest.mark.parametrize("fp32", [False, True])
@pytest.mark.parametrize(("family", "shape", "stock", "part", "rows", "where"), [
    ("add_norm", (512,), dflash2_kernel_fused.stock_add_rms_norm, 1, (8, 0), "D=512 (B, L)=(1, 8){} input=normal, norm"),
    ("gated_norm", (2, 64), dflash2_kernel_fused.stock_gated_rms_norm, 0, (3, 0),
     "(heads, D)=(2, 64) L=3{} input=normal, out"),
    ("gates", (4,), dflash2_kernel_fused._compute_g_beta, 1, (4, 1), "Hv=4 L=4{} input=normal, beta"),
])
def test_wrong_kernels_fail_naming_the_case(fp32, family, shape, stock, part, rows, where):
    """fp16 rows' self-test and fp32 rows' (their own input kinds) each fail a kernel one bit
    off in one output at one row count, naming the case; the stock call passes."""
    self_test = getattr(dflash2_kernel_fused, f"self_test_{family}{'32' * fp32}")
    kinds = dflash2_kernel_base.FP32_INPUT_KINDS if fp32 else dflash2_kernel_base.INPUT_KINDS
    result = self_test([shape], kernel=one_bit_off_at(stock, part, *rows))  # rows: (count, of argument)
    assert not result.ok and result.mismatches == len(kinds)
    assert where.format(" fp32" * fp32) in result.reason
    assert self_test([shape], kernel=stock).ok


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


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
def test_convolution_kernel_equals_decode_at_the_27b_shape_on_cuda():
    """The 27B's GatedDeltaNet convolution (10240 channels, 4 taps) and the small shapes,
    rows 1..8, silu after it, the window too: the kernel serves."""
    result = dflash2_kernel_fused.self_test_conv([(1, 10240, 4), *dflash2_kernel_fused.CONV_SHAPES_SMALL])
    assert result.ok and result.variant == "taps", result.reason


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


def test_fp32_gates_serve_by_their_own_self_test(monkeypatch, float32_target):
    """fp32 rows (the real file's a, b and dt_bias), as on CUDA with a stand-in kernel: their
    self-test takes every fp32 input kind and the one fp32 variant, fills fp32's verdict only,
    and gdn_gates then sends fp32 rows to it and fp16 rows by fp16's verdict; beta comes in
    the rows' dtype. An fp32 pack's start-up tests the gates at its heads."""
    from dflash2_pack import kernel_shapes

    calls = []

    def stand_in(A_log, a, b, dt_bias, variant):
        calls.append((a.dtype, variant))
        return dflash2_kernel_fused._compute_g_beta(A_log, a, b, dt_bias)

    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setattr(dflash2_kernel_fused, "cuda_gdn_gates", stand_in)
    monkeypatch.setattr(dflash2_kernel_fused, "_gates_serving", {"cuda": None})
    monkeypatch.setattr(dflash2_kernel_fused, "_gates32_serving", {})
    result = dflash2_kernel_fused.self_test_gates32([(4,)])
    assert result.ok and result.variant == "float" and dflash2_kernel_fused._gates32_serving == {"cuda": "float"}
    assert {case["input"] for case in result.cases} == set(dflash2_kernel_base.FP32_INPUT_KINDS)
    assert set(calls) == {(mx.float32, "float")}
    calls.clear()
    for dtype in (mx.float32, mx.float16):
        A_log, a, b, dt_bias = dflash2_kernel_fused.make_gates_case("normal", 3, 4, mx.random.key(2), dtype)
        g, beta = dk.gdn_gates(A_log, a, b, dt_bias)
        assert g.dtype == mx.float32 and beta.dtype == dtype
    assert calls == [(mx.float32, "float")]  # fp16's verdict is None here: its stock calls
    shapes = kernel_shapes(float32_target[0])
    assert shapes["gates_fp32"] and not shapes["gates"]  # an fp32 pack tests no fp16 kernel
    assert dk.SELF_TESTS["gates32"][0] == "gates_fp32" and "gates32" in dk.VERDICT_TABLES


@pytest.mark.parametrize("norm", ["add_norm", "gated_norm"])
def test_fp32_norms_serve_by_their_own_self_tests(monkeypatch, float32_target, norm):
    """fp32 rows and weights (the real file's residual stream and norms), as on CUDA with a
    stand-in kernel whose "mul_add" variant is one bit off: the fp32 self-test tries both
    variants on every fp32 input kind, serves "fma" with "mul_add" as its control, fills
    fp32's verdict only; the norm then sends fp32 rows to it and fp16 rows by fp16's verdict
    (stock here), outputs in the rows' dtype. An fp32 pack's start-up tests both norms at its
    widths."""
    from dflash2_pack import kernel_shapes

    fused = dflash2_kernel_fused
    stock = {"add_norm": fused.stock_add_rms_norm, "gated_norm": fused.stock_gated_rms_norm}[norm]
    calls = []

    def stand_in(*arguments, variant):
        calls.append((arguments[0].dtype, variant))
        out = stock(*arguments)
        return out if variant == "fma" else one_bit_off(out)

    def one_bit_off(out):  # the first output's first element
        return (flip_first_bit(out[0]), out[1]) if isinstance(out, tuple) else flip_first_bit(out)

    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setattr(fused, f"cuda_{norm.replace('norm', 'rms_norm')}", stand_in)
    monkeypatch.setattr(fused, f"_{norm}_serving", {"cuda": None})
    monkeypatch.setattr(fused, f"_{norm}32_serving", {})
    shape = (512,) if norm == "add_norm" else (2, 64)
    result = getattr(fused, f"self_test_{norm}32")([shape])
    assert result.ok and result.variant == "fma" and getattr(fused, f"_{norm}32_serving") == {"cuda": "fma"}
    assert result.controls["mul_add"] > 0
    assert {case["input"] for case in result.cases} == set(dflash2_kernel_base.FP32_INPUT_KINDS)
    assert {dtype for dtype, _ in calls} == {mx.float32}
    calls.clear()
    for dtype in (mx.float32, mx.float16):
        x, other = (dflash2_kernel_base.make_inputs("normal", 3, shape[-1], mx.random.key(s)).astype(dtype)
                    for s in (1, 2))
        weight = mx.ones((shape[-1],), dtype)
        out = (dk.add_rms_norm(x, other, weight, 1e-6) if norm == "add_norm"
               else dk.gated_rms_norm(x, weight, 1e-6, other))
        assert all(o.dtype == dtype for o in (out if isinstance(out, tuple) else (out,)))
    assert calls == [(mx.float32, "fma")]  # fp16's verdict is None here: its stock calls
    shapes = kernel_shapes(float32_target[0])
    key = {"add_norm": "norms", "gated_norm": "gated_norms"}[norm]
    assert shapes[f"{key}_fp32"] and not shapes[key]  # an fp32 pack tests no fp16 kernel
    assert dk.SELF_TESTS[f"{norm}32"][0] == f"{key}_fp32" and f"{norm}32" in dk.VERDICT_TABLES


def test_norms_take_fp16_or_fp32_rows_of_one_dtype_up_to_their_longest():
    """The kernels' reach: all of one dtype (fp16 or fp32), weight the row's width, rows up to
    1024 threads' 2 vectors (fp16 16384 features, fp32 8192: at 3 the gated norm needs more
    than a 1024-thread block's 64 registers a thread)."""
    supports = dflash2_kernel_fused.norm_kernel_supports
    for dtype, longest in ((mx.float16, 16384), (mx.float32, 8192)):
        for width, taken in ((5120, True), (longest, True), (longest + 1, False)):
            x = mx.zeros((1, width), dtype)
            assert supports(x, mx.zeros((width,), dtype), x) == taken
    x = mx.zeros((1, 64), mx.float32)
    assert not supports(x, mx.zeros((64,), mx.float16), x)  # an fp16 weight on fp32 rows: promoted, stock's
    assert not supports(x.astype(mx.bfloat16), mx.zeros((64,), mx.bfloat16))


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
@pytest.mark.parametrize("norm", ["add_norm32", "gated_norm32"])
def test_fp32_norm_kernels_equal_mlx_at_the_27b_shapes_on_cuda(norm):
    """fp32 rows at the 27B's shapes (5120 features: MLX's long-row kernel; 48 heads of 128)
    and the small ones, 1..8 positions: a variant serves, the other differs (its control)."""
    shapes = {"add_norm32": [(5120,), *dflash2_kernel_fused.NORM32_WIDTHS_SMALL],
              "gated_norm32": [(48, 128), *dflash2_kernel_fused.GATED_NORM_SHAPES_SMALL]}[norm]
    result = getattr(dflash2_kernel_fused, f"self_test_{norm}")(shapes)
    assert result.ok and result.variant in dflash2_kernel_fused.NORM32_VARIANTS, result.reason
    print(norm, "variants, differing elements:", result.variants)


def test_a_call_no_kernel_takes_runs_no_self_test(monkeypatch):
    """As on CUDA before any self-test ran: calls whose inputs no kernel takes (layer 0 of an
    fp32 pack adds its fp16 embedding row to an fp32 residual; fp32 rows meet the fp16
    convolution; fp16 rows with fp32 rotary tables) run decode's calls without testing a
    kernel first (each fp16 test would cost the start seconds, at every start: the verdict
    cache keeps the tables as the start-up's tests left them)."""
    import dflash2_kernel_rope

    tested = []
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    for module, name in ((dflash2_kernel_fused, "self_test_add_norm"), (dflash2_kernel_fused, "self_test_conv"),
                         (dflash2_kernel_rope, "self_test_rope")):
        monkeypatch.setattr(module, name, lambda *args, name=name, **kwargs: tested.append(name))
    monkeypatch.setattr(dflash2_kernel_fused, "_add_norm_serving", {})
    monkeypatch.setattr(dflash2_kernel_fused, "_conv_serving", {})
    monkeypatch.setattr(dflash2_kernel_rope, "_rope_serving", {})
    x16 = dflash2_kernel_base.make_inputs("normal", 2, 64, mx.random.key(1))
    h, _ = dk.add_rms_norm(x16, x16.astype(mx.float32), mx.ones((64,), mx.float32), 1e-6)
    assert h.dtype == mx.float32
    state, x, weight = dflash2_kernel_fused.make_conv_case("normal", 1, 40, 4, mx.random.key(1))
    dk.conv_rows(state.astype(mx.float32), x[:, :2].astype(mx.float32), weight)
    q, k, cos, sin = dflash2_kernel_rope.make_rope_case("normal", 1, 2, 1, 32, 16, 2, mx.random.key(1),
                                                        table_dtype=mx.float32)
    dk.rope_rows(q, k, cos, sin)
    assert tested == []
    dk.add_rms_norm(x16, x16, mx.ones((64,), mx.float16), 1e-6)  # a call the kernel takes: tested first
    assert tested == ["self_test_add_norm"]
