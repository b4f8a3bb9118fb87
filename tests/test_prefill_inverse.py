"""The prefill inverse (dflash2_kernel_prefill.invert_unit_lower), in process: bitwise mlx-vlm's
forward substitution, whole chunks and prompts shorter than one, swapped into
gated_delta_chunked by the engine only when the start-up check finds it so; test_server.py
checks both servers' logs say it serves."""

import functools

import mlx.core as mx
import numpy as np
import mlx_vlm.models.qwen3_5.gated_delta as gated_delta
import pytest

import dflash2_audit
import dflash2_engine
import dflash2_kernel_prefill
import dflash2_kernels
import dflash2_runtime
from kernel_cases import patch_kernels
from parity import differing

STOCK = gated_delta._invert_unit_lower  # never swapped: gated_delta_chunked is
STOCK_CHUNKED = dflash2_audit.stock(dflash2_runtime.PREFILL_CHUNKED_TARGET)  # mlx-vlm's, even once swapped


def unit_lower(shape, scale, seed):
    """I + a strictly lower matrix, as gated_delta_chunked builds it (off-diagonals of
    correlated keys are about 1: scale 1)."""
    *batch, C, _ = shape
    lower = mx.tril(mx.random.normal(shape, key=mx.random.key(seed)) * scale, -1)
    return mx.eye(C, dtype=mx.float32) + lower


@pytest.mark.parametrize("shape, scale", [((1, 3, 1, 64, 64), 0.3), ((2, 2, 3, 64, 64), 1.0),
                                          ((1, 4, 2, 16, 16), 2.0)])
def test_row_appending_inverse_is_stock_bit_for_bit(shape, scale):
    Tmat = unit_lower(shape, scale, seed=sum(shape))
    C = shape[-1]
    want = STOCK(Tmat, C)
    assert differing(dflash2_kernel_prefill.invert_unit_lower(Tmat, C), want) == 0
    # The test sees arithmetic: the same substitution summing each row's products in
    # reverse order is the same matrix in other bits.
    assert differing(reversed_substitution(Tmat, C), want) > 0


def rows_ignored(inverse):
    """An inverse without the rows shortcut (every row substituted), as the self-test calls it."""
    return lambda Tmat, C, rows=None: inverse(Tmat, C)


def reversed_substitution(Tmat, C):
    rows = mx.broadcast_to(mx.eye(C, dtype=mx.float32), Tmat.shape)[..., :1, :]
    for i in range(1, C):
        product = Tmat[..., i : i + 1, :i][..., ::-1] @ rows[..., ::-1, :]
        rows = mx.concatenate([rows, mx.eye(C, dtype=mx.float32)[i : i + 1] - product], axis=-2)
    return rows


def test_swapped_in_only_when_the_start_up_check_passes(monkeypatch):
    patch_kernels(monkeypatch, "backend_name", lambda: "cpu")  # row-appending the only candidate
    monkeypatch.setattr(gated_delta, "gated_delta_chunked", STOCK_CHUNKED)  # undone after the test
    assert dflash2_kernels.self_test_inverse(heads=2, kernel=rows_ignored(reversed_substitution)) > 0
    monkeypatch.setattr(dflash2_kernels, "self_test_inverse", lambda heads=48, chunks=2, kernel=None: 7)
    line = dflash2_engine.use_exact_prefill_inverse()
    assert "the row-appending one differed from it here in 7 elements" in line
    assert gated_delta.gated_delta_chunked is STOCK_CHUNKED
    monkeypatch.undo()
    patch_kernels(monkeypatch, "backend_name", lambda: "cpu")
    monkeypatch.setattr(gated_delta, "gated_delta_chunked", STOCK_CHUNKED)
    line = dflash2_engine.use_exact_prefill_inverse()
    assert "row-appending" in line and gated_delta.gated_delta_chunked is not STOCK_CHUNKED
    assert gated_delta.gated_delta_chunked.__dflash2_stock__ is STOCK_CHUNKED


def test_on_cuda_the_one_launch_append_is_tried_first_and_skipped_when_it_fails(monkeypatch):
    """Off CUDA only the row-appending inverse is a candidate. On CUDA the one-launch append
    comes first; here (MLX on CPU) its kernel cannot build, so the engine says so and
    installs the row-appending one."""
    if dflash2_kernels.backend_name() == "cuda":
        pytest.skip("here the one-launch kernel builds: test_one_launch_inverse_on_cuda")
    assert [name for name, _ in dflash2_kernels.inverse_candidates()] == ["row-appending"]
    monkeypatch.setattr(gated_delta, "gated_delta_chunked", STOCK_CHUNKED)
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    assert [name for name, _ in dflash2_kernels.inverse_candidates()] == ["one-launch append", "row-appending"]
    line = dflash2_engine.use_exact_prefill_inverse()
    assert line.startswith("prefill inverse: row-appending, bitwise") and "the one-launch append one failed" in line
    assert "the fused one failed" in line  # its calibration launches the CUDA kernel first
    assert gated_delta.gated_delta_chunked is not STOCK_CHUNKED


def identity_row_minus(negate_zero: bool):
    """The one-launch kernel's row in MLX ops: the identity's row i written from the column
    index, minus the product (negate_zero: -product where the identity is 0, which turns
    +0 into -0)."""
    def append(done, x_row, product):
        i = done.shape[-2]
        at_i = mx.arange(product.shape[-1]) == i
        row = mx.where(at_i, 1.0 - product, -product if negate_zero else 0.0 - product)
        return mx.concatenate([done, row], axis=-2)

    return append


def test_the_one_launch_kernels_row_formula_is_stocks_bits():
    """What the CUDA kernel computes for the new row, (j == i ? 1 : 0) - product, gives
    stock's bits; the shortcut -product where the identity is 0 does not (signed zeros)."""
    Tmat = unit_lower((1, 3, 2, 64, 64), 0.5, seed=5)
    want = STOCK(Tmat, 64)
    assert differing(dflash2_kernel_prefill.invert_unit_lower(Tmat, 64, append=identity_row_minus(False)), want) == 0
    assert differing(dflash2_kernel_prefill.invert_unit_lower(Tmat, 64, append=identity_row_minus(True)), want) > 0


@pytest.mark.skipif(dflash2_kernels.backend_name() != "cuda", reason="the kernel is CUDA's")
@pytest.mark.parametrize("shape, scale", [((1, 3, 1, 64, 64), 0.3), ((2, 2, 3, 64, 64), 1.0),
                                          ((1, 4, 2, 16, 16), 2.0), ((5, 16, 16), 1.0)])
def test_one_launch_inverse_on_cuda(shape, scale):
    """The CUDA kernel itself (CPU tests hold only its formula): stock's bits."""
    Tmat = unit_lower(shape, scale, seed=sum(shape))
    assert differing(dflash2_kernel_prefill.invert_unit_lower_one_launch(Tmat, shape[-1]), STOCK(Tmat, shape[-1])) == 0


@pytest.mark.skipif(dflash2_kernels.backend_name() != "cuda", reason="the kernel is CUDA's")
def test_one_launch_inverse_passes_the_start_up_check_on_cuda():
    """The engine's check at the 27B's heads, whole chunks and short prompts' rows."""
    assert dflash2_kernels.self_test_inverse(kernel=dflash2_kernel_prefill.invert_unit_lower_one_launch) == 0


@pytest.mark.skipif(dflash2_kernels.backend_name() != "cuda", reason="the kernel is CUDA's")
def test_fused_inverse_on_cuda(monkeypatch):
    """The calibrated one-launch inverse at the 27B's 48 heads and a 2048-token step's chunk
    counts: every count it serves gives stock's bits on inputs the calibration never saw
    (signed zeros of the inverse's structure included), and another count's plan does not
    (on the H200, cuBLASLt sums these rows in one chain at 32 chunks, in halves at 2)."""
    monkeypatch.setattr(dflash2_kernel_prefill, "_fused_inverse_plans", {})
    summary = dflash2_kernels.calibrate_fused_inverse(48, 32)
    plans = dflash2_kernel_prefill._fused_inverse_plans
    served = sorted(batch // 48 for batch in plans)
    assert served, summary
    for chunks in served:
        for scale in (0.3, 1.0):
            Tmat = unit_lower((1, 48, chunks, 64, 64), scale, seed=7 * chunks + int(10 * scale))
            assert differing(dflash2_kernel_prefill.invert_unit_lower_fused(Tmat, 64), STOCK(Tmat, 64)) == 0, (chunks, summary)
    by_plan = {str(plans[48 * chunks].tolist()): chunks for chunks in served}
    assert len(by_plan) >= 2, summary
    chunks, other = list(by_plan.values())[:2]
    Tmat = unit_lower((1, 48, chunks, 64, 64), 0.3, seed=3)
    assert differing(dflash2_kernel_prefill.fused_inverse_rows(Tmat, plans[48 * other]), STOCK(Tmat, 64)) > 0
    assert dflash2_kernels.self_test_inverse(kernel=dflash2_kernel_prefill.invert_unit_lower_fused) == 0


@pytest.mark.skipif(dflash2_kernels.backend_name() != "cuda", reason="the kernel is CUDA's")
@pytest.mark.parametrize("T", [8, 64, 70])
def test_fused_inverse_in_the_swapped_prefill_on_cuda(T, monkeypatch):
    """gated_delta_chunked swapped with the one-launch inverse, calibrated for chunk_inputs'
    4 value heads: stock's output and state bits for one prompt and for two in a batch
    (left-padded, with a mask), prompts shorter than a chunk included."""
    monkeypatch.setattr(dflash2_kernel_prefill, "_fused_inverse_plans", {})
    summary = dflash2_kernels.calibrate_fused_inverse(4, 4)
    assert {4, 8} <= set(dflash2_kernel_prefill._fused_inverse_plans), summary  # 1 and 2 chunks
    for batch in (1, 2):
        inputs = chunk_inputs(T, seed=200 + T, batch=batch)
        mask = None if batch == 1 else mx.array([[True] * T, [False] * (T // 2) + [True] * (T - T // 2)])
        want_y, want_state = STOCK_CHUNKED(*inputs, mask)
        got_y, got_state = dflash2_runtime.prefill_chunked(dflash2_kernel_prefill.invert_unit_lower_fused)(*inputs, mask)
        assert differing(got_y, want_y) == 0 and differing(got_state, want_state) == 0, (batch, summary)


def emulated_fused_rows(Tmat, plan, stock=None):
    """The fused kernel's arithmetic in numpy (an FMA as one float64 multiply-add rounded to
    float32: the same emulation on both sides of the calibration test below)."""
    T = np.array(Tmat, np.float32).reshape(-1, 64, 64)
    X = np.broadcast_to(np.eye(64, dtype=np.float32), T.shape).copy() if stock is None else \
        np.array(stock, np.float32).reshape(T.shape).copy()
    out = X.copy()
    for i, (parts, interleaved, combine, width) in enumerate(np.array(plan).reshape(64, 4)[1:].tolist(), 1):
        span = width or -(-i // parts)
        part = np.zeros((parts, *T.shape[:1], 64), np.float32)
        for k in range(i):
            s = k % parts if interleaved else k // span
            part[s] = (T[:, i, k, None].astype(np.float64) * X[:, k] + part[s]).astype(np.float32)
        if combine == 0:
            total = part[0]
            for s in range(1, parts):
                total = total + part[s]
        else:  # adjacent pairs or butterfly
            pairs = [(s, s + w) for w in (1 << e for e in range(6)) if w < parts for s in range(0, parts - w, 2 * w)] \
                if combine == 1 else [(s, s + h) for h in (parts >> e for e in range(1, 6)) if h for s in range(h)]
            for a, b in pairs:
                part[a] = part[a] + part[b]
            total = part[0]
        out[:, i] = np.eye(64, dtype=np.float32)[i] - total
        if stock is None:
            X[:, i] = out[:, i]
    return mx.array(out.reshape(Tmat.shape))


def reversed_rows_on(Tmat, X):
    """stock_rows_on's rows, each row's products summed in reverse order."""
    rows = [X[..., :1, :]]
    for i in range(1, 64):
        rows.append(mx.eye(64)[i : i + 1] - Tmat[..., i : i + 1, :i][..., ::-1] @ X[..., :i, :][..., ::-1, :])
    return mx.concatenate(rows, axis=-2)


# Per batch count (heads x chunks): the row sums an emulated stock uses, by K (rows 1..63).
EMULATED_ORDERS = {
    2: ["2 spans s"] * 63,
    4: ["2 spans s"] * 63,
    6: ["width 4 b"] * 63,
    8: ["2 spans s"] * 13 + ["4 spans s"] * 50,  # cuBLASLt's mix at 9-13 chunks on the H200
}  # 10: summed in reverse, which no order gives


def emulated_stock(orders):
    """(_invert_unit_lower, stock_rows_on) for a stock whose row sums follow the batch count."""
    def inverse(Tmat, C):
        labels = orders.get(Tmat.size // (C * C))
        return emulated_fused_rows(Tmat, dflash2_kernel_prefill.row_sum_plan(labels)) if labels else reversed_substitution(Tmat, C)

    def rows_on(Tmat, X):
        labels = orders.get(Tmat.size // 4096)
        return emulated_fused_rows(Tmat, dflash2_kernel_prefill.row_sum_plan(labels), stock=X) if labels else reversed_rows_on(Tmat, X)

    return inverse, rows_on


def test_the_calibration_finds_each_batch_counts_row_sums(monkeypatch):
    """calibrate_fused_inverse against a stock whose row sums follow the batch count: each
    count gets the orders that give its rows (the previous count's reused, in one launch,
    where they still do; per row where no one order does), and a count no order matches is
    left to the one-launch append."""
    inverse, rows_on = emulated_stock(EMULATED_ORDERS)
    monkeypatch.setattr(dflash2_kernel_prefill, "_invert_unit_lower", inverse)
    monkeypatch.setattr(dflash2_kernel_prefill, "stock_rows_on", rows_on)
    monkeypatch.setattr(dflash2_kernel_prefill, "_fused_inverse_plans", {})
    isolated_runs = []

    def run(Tmat, plan, stock=None):
        if stock is not None:
            isolated_runs.append(Tmat.size // 4096)
        return emulated_fused_rows(Tmat, plan, stock)

    summary = dflash2_kernels.calibrate_fused_inverse(2, 5, run=run)
    assert summary == ("one launch at 4 of 5 chunk counts (2 heads); 1-2: 2 spans s; 3: width 4 b; "
                       "4: 4 spans s + 2 spans s; the one-launch append at 5")
    assert isolated_runs.count(4) == 1  # count 1's orders, checked once
    assert sorted(dflash2_kernel_prefill._fused_inverse_plans) == [2, 4, 6, 8]
    # Rows 1 and 2 sum the same in both orders: they take the order of the most rows.
    chosen = {**EMULATED_ORDERS, 8: ["4 spans s"] * 2 + EMULATED_ORDERS[8][2:]}
    for batch, labels in chosen.items():
        assert dflash2_kernel_prefill._fused_inverse_plans[batch].tolist() == dflash2_kernel_prefill.row_sum_plan(labels).tolist()


def test_a_calibration_cut_short_serves_no_plan(monkeypatch):
    """Plans take effect only once every count is calibrated: a failure part way (here the
    third count's kernel) leaves none behind for the fused inverse to serve."""
    inverse, rows_on = emulated_stock(EMULATED_ORDERS)
    monkeypatch.setattr(dflash2_kernel_prefill, "_invert_unit_lower", inverse)
    monkeypatch.setattr(dflash2_kernel_prefill, "stock_rows_on", rows_on)
    monkeypatch.setattr(dflash2_kernel_prefill, "_fused_inverse_plans", {})

    def run(Tmat, plan, stock=None):
        if Tmat.size // 4096 == 6:
            raise RuntimeError("out of memory")
        return emulated_fused_rows(Tmat, plan, stock)

    with pytest.raises(RuntimeError):
        dflash2_kernels.calibrate_fused_inverse(2, 4, run=run)
    assert dflash2_kernel_prefill._fused_inverse_plans == {}
    assert "fused" not in dict(dflash2_kernels.inverse_candidates())


def chunk_inputs(T, seed, heads=(2, 4), Dk=16, Dv=16, batch=1):
    """gated_delta_chunked's inputs for a T-token prompt: normalized keys, gates in (0, 1).
    float32 throughout, not dflash2_kernel_gdn.make_gdn_inputs' fp16 q, k, v: with those, a
    wrapper that miscounts a short prompt's rows still gave stock's bits under GPU-like
    rounding (checked), so only these let the output comparison catch it."""
    Hk, Hv = heads
    keys = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((batch, T, Hk, Dk), key=keys[0])
    k = mx.random.normal((batch, T, Hk, Dk), key=keys[1])
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((batch, T, Hv, Dv), key=keys[2])
    g = mx.sigmoid(mx.random.normal((batch, T, Hv), key=keys[3]) + 3)
    beta = mx.sigmoid(mx.random.normal((batch, T, Hv), key=keys[4]))
    state = mx.random.normal((batch, Hv, Dv, Dk), key=keys[5]) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [1, 2, 8, 33, 63, 64, 70])
def test_swapped_chunked_prefill_is_stock_bit_for_bit(T, gpu_like_rounding):
    """The swapped gated_delta_chunked (stock's code, the inverse told a short prompt's
    rows) gives stock's output and state bits, prompts shorter than a chunk included."""
    inputs = chunk_inputs(T, seed=T)
    want_y, want_state = STOCK_CHUNKED(*inputs)
    appended = []
    inverse = functools.partial(dflash2_kernel_prefill.invert_unit_lower, append=counting_append(appended))
    got_y, got_state = dflash2_runtime.prefill_chunked(inverse)(*inputs)
    assert differing(got_y, want_y) == 0 and differing(got_state, want_state) == 0
    assert len(appended) == min(T, 64) - 1  # rows past a short prompt's are not substituted
    for _, candidate in dflash2_kernels.inverse_candidates():  # on CUDA the one-launch one too
        got_y, got_state = dflash2_runtime.prefill_chunked(candidate)(*inputs)
        assert differing(got_y, want_y) == 0 and differing(got_state, want_state) == 0


@pytest.mark.parametrize("T", [2, 8, 33])
def test_swapped_chunked_prefill_with_a_padding_mask_is_stock_bit_for_bit(T, gpu_like_rounding):
    """Two prompts in one batch, the second left-padded (its mask marks the padding inside
    the first T rows, which are substituted as any other row)."""
    inputs = chunk_inputs(T, seed=100 + T, batch=2)
    mask = mx.array([[True] * T, [False] * (T // 2) + [True] * (T - T // 2)])
    want_y, want_state = STOCK_CHUNKED(*inputs, mask)
    got_y, got_state = dflash2_runtime.prefill_chunked(dflash2_kernel_prefill.invert_unit_lower)(*inputs, mask)
    assert differing(got_y, want_y) == 0 and differing(got_state, want_state) == 0


def counting_append(counter):
    def append(done, x_row, product):
        counter.append(done.shape[-2])
        return dflash2_kernel_prefill.append_by_concatenate(done, x_row, product)

    return append


@pytest.mark.parametrize("rows", dflash2_kernel_prefill.INVERSE_TEST_ROWS)
def test_short_prompts_substitute_only_their_rows(rows, gpu_like_rounding):
    """A prompt of `rows` tokens substitutes rows - 1 rows one by one (the padding rows in
    one matmul, whose products are sums of zeros in any order) and is stock's bits; told one
    row too few, its last row comes from that multi-row matmul, which rounds differently
    (as on GPUs), and the inverse is not stock's."""
    C = 64
    lower = mx.tril(mx.random.normal((1, 3, 1, C, C), key=mx.random.key(3)) * 0.5, -1)
    held = lower if rows is None else lower * (mx.arange(C) < rows)[:, None]
    Tmat = mx.eye(C, dtype=mx.float32) + held
    appended = []
    got = dflash2_kernel_prefill.invert_unit_lower(Tmat, C, append=counting_append(appended), rows=rows)
    assert len(appended) == (C if rows is None else rows) - 1
    assert differing(got, STOCK(Tmat, C)) == 0
    if rows is not None and rows > 1:
        assert differing(dflash2_kernel_prefill.invert_unit_lower(Tmat, C, rows=rows - 1), STOCK(Tmat, C)) > 0
