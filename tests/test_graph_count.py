"""tools/graph_count.py: the counting rule, and issue 13's launch budget for exact verify."""

import mlx.core as mx
import pytest

import dflash2_decode_arms
import dflash2_kernel_conv32
import dflash2_kernel_fused
import dflash2_kernel_qmv
import dflash2_kernel_rotate
import dflash2_kernels as dk
import dflash2_runtime
from graph_count import count_steps, gpu_primitives, graph_kinds, load_target, one_launch_calls, views_outside_calls


def count(build):
    with one_launch_calls() as calls:
        outputs = build()
    return gpu_primitives(graph_kinds(outputs)[0], calls)


def count_views(build):
    with one_launch_calls() as calls:
        outputs = build()
    return views_outside_calls(graph_kinds(outputs)[1], calls)


def test_views_are_free_and_one_launch_calls_count_once():
    x, weight = mx.ones((8, 512), mx.float16), mx.ones((512,), mx.float16)
    packed = dflash2_kernel_qmv.make_weights(16, 512, mx.random.key(0))
    mx.eval(x, weight, packed)
    assert count(lambda: [x.reshape(8, 4, 128).transpose(1, 0, 2)[:, 2:]]) == 0
    assert count(lambda: [mx.fast.rms_norm(x, weight, 1e-6), mx.fast.rms_norm(x, None, 1e-6)]) == 2
    assert count(lambda: [dk.exact_quantized_matmul(x, *packed)]) == 1
    x32 = x.astype(mx.float32)  # the real file's rows: on CPU a stock call a row, each converting scales
    mx.eval(x32)
    assert count(lambda: [dk.exact_rows_fp32(x32, *packed)]) == 1
    signs = [dflash2_kernel_rotate.make_signs("pm1", 512, mx.random.key(index)) for index in range(3)]
    mx.eval(signs)
    assert count(lambda: list(dk.exact_linear_group(x, 512, signs, [packed] * 3))) == 4  # one rotation for three
    assert count(lambda: list(dk.rotate_group(x, 512, signs))) == 1
    assert count(lambda: [dk.stock_rows(x, *packed)]) == 9  # eight calls and a concatenate
    assert count(lambda: [mx.exp(x) + 1]) == 2
    # add_rms_norm's stock form calls rms_norm, itself one launch: counted once in all.
    assert count(lambda: list(dk.add_rms_norm(x, x, weight, 1e-6))) == 1


def test_calls_a_cuda_kernel_does_not_take_count_as_the_stock_calls_cuda_runs():
    """The convolution kernel is fp16's only: on fp32 rows CUDA runs decode's own calls, so the
    count is what they build (nested one-launch calls, as the norms' rms_norm, still one each);
    the norm kernels take fp32 rows, but not an fp32 row with an fp16 weight."""
    state, x, weight = (a.astype(mx.float32) for a in dflash2_kernel_fused.make_conv_case(
        "normal", 1, 40, 4, mx.random.key(1)))
    mx.eval(state, x, weight)
    state16, x16 = state.astype(mx.float16), x.astype(mx.float16)
    mx.eval(state16, x16)
    assert count(lambda: list(dk.conv_rows(state, x[:, :2], weight))) > 2
    assert count(lambda: list(dk.conv_rows(state16, x16[:, :2], weight))) == 1
    rows, weight32, weight16 = mx.ones((2, 512), mx.float32), mx.ones((512,), mx.float32), mx.ones((512,), mx.float16)
    mx.eval(rows, weight32, weight16)
    assert count(lambda: list(dk.add_rms_norm(rows, rows, weight32, 1e-6))) == 1
    assert count(lambda: list(dk.add_rms_norm(rows, rows, weight16, 1e-6))) == 2  # Add, rms_norm


def test_fp32_convolution_counts_one_call_over_the_window_as_cuda_proves_it():
    """fp32 convolution weights (the real file's): CUDA's self-test proves one nn.Conv1d over a
    verify block's window equal to decode's call a position (dflash2_kernel_conv32), so the
    count takes that one call, not CPU's eight and their concatenation; CPU's verdicts stay."""
    conv1d, window = dflash2_kernel_conv32.make_conv32_case("normal", 1, 40, 4, mx.random.key(0))
    mx.eval(conv1d.parameters(), window)
    verdicts = dict(dflash2_kernel_conv32._conv32_serving)
    assert count(lambda: [dk.conv1d_rows(conv1d, window, 8)]) == 1
    assert count(lambda: [dflash2_kernel_conv32.stock_conv1d_rows(conv1d, window, 8)]) == 9
    assert dflash2_kernel_conv32._conv32_serving == verdicts


def test_views_are_counted_apart_those_inside_one_launch_calls_left_out():
    x, rows = mx.ones((8, 512), mx.float16), mx.ones((1, 8, 512), mx.float16)
    packed = dflash2_kernel_qmv.make_weights(16, 512, mx.random.key(0))
    mx.eval(x, rows, packed)
    assert count_views(lambda: [x.reshape(8, 4, 128).transpose(1, 0, 2)[:, 2:]]) == 3
    # CPU's per-row calls slice and reshape inside the call: none of that is the step's.
    assert count_views(lambda: [dk.exact_quantized_matmul(rows, *packed)]) == 0
    assert count_views(lambda: [dk.exact_quantized_matmul(rows.reshape(8, 512), *packed)]) == 1


@pytest.fixture(scope="module")
def counts():
    """Decode and verify(8) of the tiny-width target with the real 64-layer pattern; decode
    with every replacement a CUDA machine may choose (the fewest launches). The runtime's
    replacements only: install(model)'s self-tests and decode timing on 64 layers would
    change no count."""
    model, taps = load_target(None)
    dflash2_runtime.apply_patches()
    dflash2_decode_arms.use_decode_arm("rotation+recurrence+convolution+rope+residual")
    try:
        return count_steps(model.language_model, taps, lengths=(8,))
    finally:
        dflash2_decode_arms.use_decode_arm("mlx")


def test_counts_see_the_whole_step(counts):
    # 64 layers, about 25 launches each: a count that missed layers would be far lower.
    assert counts["decode"] > 64 * 20 and counts["verify"][8] > 64 * 20


def test_exact_verify_of_eight_launches_at_most_1_3_decode_steps(counts):
    assert counts["verify"][8] <= 1.3 * counts["decode"]


def test_exact_verify_of_eight_builds_at_most_1_3_decode_steps_of_views(counts):
    """Views launch nothing but cost the host a node each on a host-bound step: a verify
    forward that reshaped around each packed linear (about 800 more) would fail."""
    assert counts["decode_views"] > 64 * 5
    assert counts["verify_views"][8] <= 1.3 * counts["decode_views"]
