"""dflash2_kernel_qmv on CPU: the self-test passes, catches wrong kernels naming the case, the
exact matmul equals MLX's single-row calls bit for bit, and the CUDA launch helpers follow
MLX's source rules."""

import itertools
import math
import shutil

import mlx.core as mx
import numpy as np
import pytest

import dflash2_kernel_base
import dflash2_kernel_qmv
import dflash2_kernel_qmv_metal
import dflash2_kernels as dk
from kernel_cases import RecordingKernel, one_bit_off_at_eight_rows, patch_kernels, same_bits, split_k_halves
from kernel_parity import MAX_ACCUMULATORS, TUNE_FALLBACK, TUNE_LAUNCHES, launch_for_rows


SHAPE = (16, 512)


def stock_float32_dequantized(x, weight, scales, biases):
    """Right maths, other rounding: dequantize, multiply in float32."""
    w = mx.dequantize(weight, scales, biases, group_size=dflash2_kernel_qmv.GROUP_SIZE, bits=dflash2_kernel_qmv.BITS)
    return (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(mx.float16)


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
    one is: 4 output rows of 8 activation rows in one warp want 256 accumulator registers.
    All in one nvcc run."""
    from qmv_sass import compile_reports, launches_unit

    launches = {"spilling": (8, (4, 2, 1, 1)), **{f"rows{rows}": (rows, launch)
                                                   for rows, launch in dflash2_kernel_qmv.CUDA_LAUNCH.items()}}
    reports = compile_reports(launches_unit(launches), launches)
    assert reports.pop("spilling")["spill_bytes"] > 0
    assert {name: report["spill_bytes"] for name, report in reports.items()} == dict.fromkeys(reports, 0), reports


@pytest.mark.parametrize(
    ("backend", "n", "k", "rows", "want"),
    [
        ("cuda", 16, 512, 1, dflash2_kernel_qmv.cuda_matmul),  # one row too: faster than MLX's, same bits
        ("cuda", 42, 640, 8, dflash2_kernel_qmv.cuda_matmul),  # every shape
        ("metal", 16, 512, 1, None),  # one row is MLX's own call
        ("metal", 16, 512, 5, dflash2_kernel_qmv_metal.metal_matmul),
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


def test_packed_weights_must_hold_whole_groups():
    """K = 64: scales of K // 128 = 0 columns match their shape check, so K itself is checked
    (the verify forward's matmuls rely on install's check_packed_weights alone)."""
    weight = mx.zeros((4, 4), dtype=mx.uint32)
    empty = mx.zeros((4, 0), dtype=mx.float16)
    with pytest.raises(ValueError, match="K=64 is not a multiple of the group size 128"):
        dk.check_packed_weights(weight, empty, empty)
