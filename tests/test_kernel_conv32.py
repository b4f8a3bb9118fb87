"""dflash2_kernel_conv32 (fp32 convolution weights, the real file's): the self-test passes a
block call whose every position equals decode's one-window call and fails one that differs,
naming the case; dispatch takes the block call only at the block lengths it proved, never
with a bias; an fp32 pack's start-up tests it at the pack's shape and verify hands it the
convolution."""

import mlx.core as mx
import pytest

import dflash2_kernel_conv32
import dflash2_kernels as dk
import dflash2_verify
from dflash2_kernel_base import NO_KERNEL, _differing
from kernel_cases import flip_first_bit

SHAPE = (1, 40, 4)


def test_the_block_call_passes_where_it_equals_the_per_position_calls():
    """On CPU MLX's block convolution happens to equal its one-window calls: injected, it
    passes at every block length and kind, and an injected kernel never switches serving;
    off CUDA nothing of its own is tested."""
    assert dflash2_kernel_conv32.self_test_conv32().reason == NO_KERNEL or dk.backend_name() == "cuda"
    serving = dict(dflash2_kernel_conv32._conv32_serving)
    result = dflash2_kernel_conv32.self_test_conv32(kernel=dflash2_kernel_conv32.block_conv1d_rows)
    assert result.ok and result.mismatches == 0, result.reason
    assert {case["rows"] for case in result.cases} == set(range(1, 9))
    assert dflash2_kernel_conv32._conv32_serving == serving


def test_a_call_that_differs_fails_naming_the_case():
    def wrong(conv1d, window, rows):  # one bit off at 8 positions
        out = dflash2_kernel_conv32.block_conv1d_rows(conv1d, window, rows)
        return flip_first_bit(out) if rows == 8 else out

    result = dflash2_kernel_conv32.self_test_conv32(shapes=[SHAPE], kernel=wrong)
    assert not result.ok and result.mismatches == 5  # once per input kind
    assert "(B, C, K)=(1, 40, 4) rows=8 input=normal" in result.reason and "got 0x" in result.reason


@pytest.mark.parametrize("proven, bias, block", [(True, False, True), (False, False, False), (True, True, False)])
def test_the_block_call_serves_only_where_proven_and_without_a_bias(monkeypatch, proven, bias, block):
    conv1d, window = dflash2_kernel_conv32.make_conv32_case("normal", *SHAPE, mx.random.key(0))
    if bias:
        conv1d.bias = mx.ones((SHAPE[1],))
    rows = 5
    part = window[:, : SHAPE[2] - 1 + rows]
    monkeypatch.setattr(dflash2_kernel_conv32, "backend_name", lambda: "cuda")
    monkeypatch.setitem(dflash2_kernel_conv32._conv32_serving, ("cuda", rows), proven)
    calls = []
    monkeypatch.setattr(dflash2_kernel_conv32, "block_conv1d_rows", lambda *args: calls.append(args) or conv1d(part))
    got = dk.conv1d_rows(conv1d, part, rows)
    assert bool(calls) == block
    assert _differing(got, dflash2_kernel_conv32.stock_conv1d_rows(conv1d, part, rows)) == 0


def test_an_fp32_pack_s_convolution_is_tested_at_start_up_and_verify_hands_it_over(target, float32_target,
                                                                                  monkeypatch):
    """kernel_shapes names the fp32 pack's convolution (and no fp16 pack's); the verify forward
    gives its layers' nn.Conv1d and the block's window to conv1d_rows."""
    from dflash2_pack import kernel_shapes

    assert kernel_shapes(float32_target[0])["conv_fp32"] == kernel_shapes(target[0])["conv"] != []
    assert kernel_shapes(target[0])["conv_fp32"] == []
    assert dk.SELF_TESTS["conv32"][0] == "conv_fp32" and "conv32" in dk.VERDICT_TABLES

    layer = next(layer.linear_attn for layer in float32_target[0].language_model.model.layers if layer.is_linear)
    calls = []

    def spy(conv1d, window, rows):
        calls.append((conv1d, window.shape, rows))
        return dflash2_kernel_conv32.conv1d_rows(conv1d, window, rows)

    monkeypatch.setattr(dk, "conv1d_rows", spy)
    taps, channels = layer.conv_kernel_size, layer.conv_dim
    state = mx.zeros((1, taps - 1, channels))
    mixed = dflash2_kernel_conv32.make_conv32_case("normal", 1, channels, taps, mx.random.key(1))[1][:, :3]
    window, out = dflash2_verify._convolve_positions(layer, state, mixed)
    assert calls == [(layer.conv1d, (1, taps - 1 + 3, channels), 3)]
    assert window.shape == (1, taps - 1 + 3, channels) and out.shape == (1, 3, channels)


def test_on_cuda_the_first_call_tests_the_pack_s_shape_and_serves_the_lengths_that_passed(monkeypatch):
    """As on CUDA (the block call faked there: off only at 8 positions): the first call runs
    the self-test at the window's (B, C, K), then the block call serves at 1..7 positions and
    8 take a call each."""
    conv1d, window = dflash2_kernel_conv32.make_conv32_case("normal", *SHAPE, mx.random.key(0))
    block = dflash2_kernel_conv32.block_conv1d_rows
    tested, used = [], []

    def off_at_eight(conv, part, rows):
        used.append(rows)
        out = block(conv, part, rows)
        return flip_first_bit(out) if rows == 8 else out

    def recording_self_test(shapes=None, **kwargs):
        tested.append(shapes)
        return self_test(shapes=shapes, **kwargs)

    self_test = dflash2_kernel_conv32.self_test_conv32
    monkeypatch.setattr(dflash2_kernel_conv32, "backend_name", lambda: "cuda")
    monkeypatch.setattr(dflash2_kernel_conv32, "_conv32_serving", {})
    monkeypatch.setattr(dflash2_kernel_conv32, "block_conv1d_rows", off_at_eight)
    monkeypatch.setattr(dflash2_kernel_conv32, "self_test_conv32", recording_self_test)
    dk.conv1d_rows(conv1d, window[:, : SHAPE[2] - 1 + 3], 3)
    assert tested == [[SHAPE]]
    assert dflash2_kernel_conv32._conv32_serving == {("cuda", rows): rows < 8 for rows in range(1, 9)}
    for rows in (5, 8):
        used.clear()
        part = window[:, : SHAPE[2] - 1 + rows]
        got = dk.conv1d_rows(conv1d, part, rows)
        assert used == ([rows] if rows < 8 else [])
        assert _differing(got, dflash2_kernel_conv32.stock_conv1d_rows(conv1d, part, rows)) == 0
    assert tested == [[SHAPE]]  # once
