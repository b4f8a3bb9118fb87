"""dflash2_kernels on CPU: the self-test passes, catches wrong kernels, and the
exact matmul equals one stock single-row call per row, bit for bit."""

import mlx.core as mx
import pytest

import dflash2_kernels as dk

SHAPE = (16, 512)


def stock_float32_dequantized(x, weight, scales, biases):
    """Right maths, other rounding: dequantize, multiply in float32."""
    w = mx.dequantize(weight, scales, biases, group_size=dk.GROUP_SIZE, bits=dk.BITS)
    return (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(mx.float16)


def split_k_halves(x, weight, scales, biases):
    """MLX's own kernel on each half of K, halves added: another accumulation order."""
    half = x.shape[-1] // 2
    words, groups = half // 16, half // dk.GROUP_SIZE
    first = dk.stock_quantized_matmul(
        x[:, :half], weight[:, :words], scales[:, :groups], biases[:, :groups]
    )
    second = dk.stock_quantized_matmul(
        x[:, half:], weight[:, words:], scales[:, groups:], biases[:, groups:]
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


def test_self_test_passes_on_cpu():
    result = dk.self_test()
    assert result.backend == "cpu"
    assert result.ok, result.reason
    assert result.reason is None
    assert result.mismatches == 0
    assert len(result.cases) == len(dk.DEFAULT_SHAPES) * len(dk.INPUT_KINDS) * dk.MAX_ROWS
    assert {case["rows"] for case in result.cases} == set(range(1, 9))
    assert {case["input"] for case in result.cases} == set(dk.INPUT_KINDS)
    assert all(case["mismatches"] == 0 for case in result.cases)


@pytest.mark.parametrize(
    "kernel",
    [stock_float32_dequantized, split_k_halves, one_bit_off_at_eight_rows],
)
def test_wrong_kernel_fails_naming_the_case(kernel):
    serving = dict(dk._verified)
    result = dk.self_test(kernel=kernel, shapes=[SHAPE])
    assert not result.ok
    assert result.mismatches > 0
    assert "N=16, K=512" in result.reason and "rows=" in result.reason
    assert "input=" in result.reason and "got 0x" in result.reason
    assert dk._verified == serving  # an injected kernel never switches serving


def test_one_differing_bit_is_counted_exactly():
    result = dk.self_test(kernel=one_bit_off_at_eight_rows, shapes=[SHAPE])
    assert result.mismatches == len(dk.INPUT_KINDS)  # y[7, 3] once per input kind
    assert "rows=8" in result.reason and "row 7 column 3" in result.reason
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
    weight, scales, biases = dk.make_weights(n, k, mx.random.key(1))
    x = dk.make_inputs("normal", 8, k, mx.random.key(2))
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
    monkeypatch.setitem(dk._verified, "cpu", False)
    monkeypatch.setattr(dk, "_warned", set())
    weight, scales, biases = dk.make_weights(*SHAPE, mx.random.key(1))
    x = dk.make_inputs("large", 5, SHAPE[1], mx.random.key(2))
    with pytest.warns(UserWarning, match="row by row"):
        y = dk.exact_quantized_matmul(x, weight, scales, biases)
    want = dk.stock_rows(x, weight, scales, biases)
    assert mx.array_equal(y.view(mx.uint16), want.view(mx.uint16)).item()


def test_bad_arguments_are_clear_errors():
    weight, scales, biases = dk.make_weights(*SHAPE, mx.random.key(1))
    x = dk.make_inputs("normal", 9, SHAPE[1], mx.random.key(2))
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
    subnormal = dk.make_inputs("subnormal", 8, 512, key)
    assert (mx.abs(subnormal) < 2.0**-14).all().item()
    zeros = dk.make_inputs("signed_zero", 8, 512, key).view(mx.uint16)
    assert (zeros[0] == 0x8000).all().item()  # row 0: all -0
    assert ((zeros[1] == 0) | (zeros[1] == 0x8000)).all().item()
    cancel = dk.make_inputs("cancellation", 8, 512, key)
    assert mx.array_equal(cancel[:, ::2], -cancel[:, 1::2]).item()
    large = dk.make_inputs("large", 8, 512, key)
    assert mx.isfinite(large).all().item() and mx.abs(large).max().item() > 2048


def test_cuda_launch_table_is_the_one_the_evidence_ran():
    """The H200 evidence's parity and timings ran with the launch table in the code."""
    import json
    from pathlib import Path

    record = json.loads((Path(__file__).parents[1] / "evidence/kernel-parity-cuda.json").read_text())
    ran = {int(rows): tuple(launch) for rows, launch in record["cuda_launch"].items()}
    assert ran == dk.CUDA_LAUNCH
    assert record["self_test"]["ok"] and record["exact_mismatches"] == 0
    assert record["stock_mismatches"] > 0  # the negative control did see MLX's 8-row call differ


def test_cpu_path_stays_exact_where_batched_calls_round_differently(gpu_like_rounding):
    """The CPU path is per-row stock calls, so a backend whose batched call rounds
    otherwise (the negative control counts it) leaves it exact."""
    result = dk.self_test(shapes=[SHAPE])
    assert result.ok, result.reason
    assert result.stock_mismatches > 0


# ---------------------------------------------------------------------------------------
# Launch selection, in process: which kernel serves, and the CUDA launch geometry.


@pytest.mark.parametrize(
    ("backend", "n", "k", "rows", "want"),
    [
        ("cuda", 16, 512, 1, dk.cuda_matmul),  # one row too: faster than MLX's, same bits
        ("cuda", 42, 640, 8, dk.cuda_matmul),  # every shape
        ("metal", 16, 512, 1, None),  # one row is MLX's own call
        ("metal", 16, 512, 5, dk.metal_matmul),
        ("metal", 42, 512, 5, None),  # N % 8: MLX itself leaves qmv_fast
        ("metal", 16, 640, 5, None),  # K % 512
        ("cpu", 16, 512, 1, None),
        ("cpu", 42, 640, 8, dk.stock_rows),
    ],
)
def test_serving_kernel_by_backend_shape_and_rows(monkeypatch, backend, n, k, rows, want):
    monkeypatch.setitem(dk._verified, backend, True)
    assert dk._serving_kernel(backend, n, k, rows) is want


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_kernel_that_failed_its_self_test_never_serves(monkeypatch, backend):
    monkeypatch.setitem(dk._verified, backend, False)
    monkeypatch.setattr(dk, "_warned", set())
    with pytest.warns(UserWarning, match=f"{backend} kernel failed its self-test"):
        assert dk._serving_kernel(backend, 16, 512, 4) is None


class RecordingKernel:
    """Stands in for mx.fast.cuda_kernel's callable: records each launch."""

    def __init__(self):
        self.launches = []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        self.launches.append({"template": dict(template), "grid": grid, "threadgroup": threadgroup})
        return [mx.zeros(output_shapes[0], dtype=output_dtypes[0])]


def rows_stored(n, rows_per_warp, grid, threadgroup):
    """Output rows the launch writes, by qmv_rows' mapping: warp w of block b takes rows
    (b * warps + w) * R + j, stored while below n."""
    blocks, warps = grid[0] // threadgroup[0], threadgroup[1]
    return [
        (block * warps + warp) * rows_per_warp + j
        for block in range(blocks)
        for warp in range(warps)
        for j in range(rows_per_warp)
        if (block * warps + warp) * rows_per_warp + j < n
    ]


@pytest.mark.parametrize("n", [16, 42, 1024, 5120, 17408])
def test_cuda_launch_follows_the_table_and_covers_every_output_once(monkeypatch, n):
    kernel = RecordingKernel()
    monkeypatch.setattr(dk, "_cuda_kernel", lambda: kernel)
    monkeypatch.setattr(dk, "backend_name", lambda: "cuda")
    monkeypatch.setitem(dk._verified, "cuda", True)
    weight, scales, biases = dk.make_weights(n, 512, mx.random.key(1))
    x = dk.make_inputs("normal", dk.MAX_ROWS, 512, mx.random.key(2))
    for rows in range(1, dk.MAX_ROWS + 1):
        assert dk.exact_quantized_matmul(x[:rows], weight, scales, biases).shape == (rows, n)
    for rows, launch in enumerate(kernel.launches, start=1):
        rows_per_warp, chunk, prefetch = dk.CUDA_LAUNCH[rows]
        assert launch["template"] == {"M": rows, "R": rows_per_warp, "C": chunk, "PREFETCH": bool(prefetch)}
        assert launch["threadgroup"] == (32, dk.CUDA_WARPS_PER_BLOCK, 1)
        assert launch["grid"][0] % 32 == 0 and launch["grid"][1:] == (dk.CUDA_WARPS_PER_BLOCK, 1)
        stored = rows_stored(n, rows_per_warp, launch["grid"], launch["threadgroup"])
        assert sorted(stored) == list(range(n))  # each output row once, none missing
        # and no block is launched with nothing to do
        assert (launch["grid"][0] // 32 - 1) * dk.CUDA_WARPS_PER_BLOCK * rows_per_warp < n
    assert len(kernel.launches) == dk.MAX_ROWS
