"""The fp32 convolution's positions in one MLX call (conv32): stock reference, dispatch, self-test.

The real file's GatedDeltaNet convolution weights are fp32, and for those mlx-vlm's decode
runs the layer's own `nn.Conv1d` on the (B, K, C) window that ends at its position (not the
depthwise sum that fp16 weights take: dflash2_kernel_fused.conv_rows), which on CUDA goes to
cuDNN. No kernel here reproduces cuDNN's choice of algorithm, but one `nn.Conv1d` call over
the whole (B, K - 1 + L, C) window gives L outputs, and where cuDNN's algorithm computes each
output as the one-window call does, those are decode's bits. `conv1d_rows` takes that one
call only for the block lengths whose self-test found every position's bits equal on this
machine (variant "block"); else, and off CUDA, one call per position, as decode makes them.
"""

import mlx.core as mx
import mlx.nn as nn

from dflash2_kernel_base import (
    FP32_INPUT_KINDS, MAX_ROWS, SelfTestResult, _no_kernel_result, _variants_result, backend_name, make_inputs_fp32,
    run_case,
)

# (B, C, K): a partial vector of channels, a batch of two, three taps.
CONV32_SHAPES_SMALL = ((1, 96, 4), (2, 40, 4), (1, 22, 3))


def stock_conv1d_rows(conv1d, window, rows):
    """Decode's convolution at each of the last `rows` positions of window (B, K - 1 + rows, C):
    the layer's own call on each position's (B, K, C) window."""
    taps = conv1d.weight.shape[1]
    return mx.concatenate([conv1d(window[:, t : t + taps]) for t in range(rows)], axis=1)


def block_conv1d_rows(conv1d, window, rows):
    """The same positions in one call over the whole window (stock verify's call)."""
    return conv1d(window)


# (backend, rows) -> whether the block call equalled the per-position calls there.
_conv32_serving: dict = {}


def conv1d_rows(conv1d, window, rows):
    """A GatedDeltaNet's depthwise `nn.Conv1d` at the last `rows` positions of window, each
    position bitwise decode's one-window call: one call where this machine's self-test proved
    that at this many positions, else one per position."""
    backend = backend_name()
    if "bias" in conv1d:  # tested without one: a call the block call never takes tests nothing
        return stock_conv1d_rows(conv1d, window, rows)
    if backend == "cuda" and (backend, rows) not in _conv32_serving:
        self_test_conv32(shapes=[(window.shape[0], *conv1d.weight.shape[:2])])
    if _conv32_serving.get((backend, rows)):
        return block_conv1d_rows(conv1d, window, rows)
    return stock_conv1d_rows(conv1d, window, rows)


def make_conv32_case(kind: str, batch: int, channels: int, taps: int, key):
    """(a depthwise nn.Conv1d with fp32 weights and no bias, as the GatedDeltaNet's; its window
    (B, K - 1 + 8, C))."""
    k_window, k_weight = mx.random.split(key)
    rows = taps - 1 + MAX_ROWS
    window = make_inputs_fp32(kind, batch * rows, channels, k_window).reshape(batch, rows, channels)
    conv1d = nn.Conv1d(channels, channels, taps, groups=channels, bias=False)
    conv1d.weight = mx.random.normal((channels, taps, 1), key=k_weight) * 0.5
    return conv1d, window


def self_test_conv32(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """Check the block call bit for bit against decode's per-position calls at 1..8 positions.

    kernel: (conv1d, window, rows) -> (B, rows, C), tested as variant "kernel"; default: the
    block call on CUDA, which then serves at each block length where it passed (off CUDA the
    per-position calls serve: nothing to test). shapes: (B, C, K), default the small ones.
    """
    backend = backend_name()
    if kernel is None and backend != "cuda":
        return _no_kernel_result(backend)
    name = "kernel" if kernel else "block"
    kernel = kernel or block_conv1d_rows
    differing, failures, cases = {name: 0}, {}, []
    passed = {rows: True for rows in range(1, MAX_ROWS + 1)}
    key = mx.random.key(seed)
    for batch, channels, taps in [tuple(s) for s in (shapes or CONV32_SHAPES_SMALL)]:
        for kind in FP32_INPUT_KINDS:
            key, case_key = mx.random.split(key)
            conv1d, window = make_conv32_case(kind, batch, channels, taps, case_key)
            for rows in range(1, MAX_ROWS + 1):
                part = window[:, : taps - 1 + rows]
                want = stock_conv1d_rows(conv1d, part, rows)

                def compare(conv1d=conv1d, part=part, rows=rows, want=want):
                    return {"out": (kernel(conv1d, part, rows), want)}

                diff = run_case(name, compare, {"shape": [batch, channels, taps], "rows": rows, "input": kind},
                                f"(B, C, K)={(batch, channels, taps)} rows={rows} input={kind}", differing, failures,
                                cases)
                passed[rows] = passed[rows] and diff == 0
    result = _variants_result(backend, differing, failures, {}, cases)
    if name == "block":
        _conv32_serving.update({(backend, rows): ok for rows, ok in passed.items()})
    return result
