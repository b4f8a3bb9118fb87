"""Prefill: the GatedDeltaNet chunked scan's unit lower-triangular inverse, stock's bits
with fewer launches (row appending, one launch, or one launch calibrated per batch count)."""

import math
from functools import cache

import mlx.core as mx
from mlx_vlm.models.qwen3_5.gated_delta import _invert_unit_lower

from dflash2_kernel_base import BakedCudaKernel, _differing, backend_name, raw_bits

# ===========================================================================
# Prefill: the GatedDeltaNet chunked scan's unit lower-triangular inverse


def append_by_concatenate(done, x_row, product):
    """Stock's row (the identity's row less the product), then concatenated to the rows done."""
    return mx.concatenate([done, x_row - product], axis=-2)


def invert_unit_lower(Tmat, C: int, append=append_by_concatenate, rows: int = None):
    """mlx-vlm's _invert_unit_lower (forward substitution over a chunk's C rows) with the
    same matmuls on the same operands. Stock concatenates all earlier rows again for every
    row: on GPUs one copy kernel per row, about 2,000 a 27B layer and most of a prefill
    chunk's fixed cost on the H200 (evidence/prefix-cache-cuda-27b*.md). Appending each row to
    the previous concatenation gives every matmul the same contiguous operand with two
    copies, so the same bits by construction (on CUDA, the same cuBLASLt call).
    append(done, x_row, product): the next `done` (invert_unit_lower_one_launch does the
    subtraction and concatenate in one launch).

    rows: where a prompt is shorter than one chunk, how many of its rows hold tokens. The
    rows past them must be exactly the identity's rows of Tmat, as gated_delta_chunked's
    padding (beta 0) makes them. Stock's row i there is e_i - (+0 row) @ X: the identity's
    row bit for bit while the rows before it are finite (and NaN where they are not, as
    here). So the padding rows are one matmul and subtraction, not C - rows appends (on
    GPUs the appends are most of a short prompt's prefill)."""
    X = mx.broadcast_to(mx.eye(C, dtype=mx.float32), Tmat.shape) + mx.zeros_like(Tmat)
    done = X[..., 0:1, :]  # stock's concatenate of one row is that row itself
    substituted = C if rows is None else min(rows, C)
    for i in range(1, substituted):
        done = append(done, X[..., i : i + 1, :], Tmat[..., i : i + 1, :i] @ done)
    if substituted == C:
        return done
    padding = X[..., substituted:, :] - Tmat[..., substituted:, :substituted] @ done
    return mx.concatenate([done, padding], axis=-2)


# out = [done; e_i - product] over the last two axes (i: done's rows): stock's row
# `X[..., i:i+1, :] - T[..., i:i+1, :i] @ X_j`, X being the identity, with its append.
# One IEEE fp32 subtraction per element, as MLX's Subtract (no fast math).
_APPEND_ROW_SOURCE = """
  const int rows = done_shape[done_ndim - 2];
  const int width = done_shape[done_ndim - 1];
  size_t batch = 1;
  for (int d = 0; d < done_ndim - 2; ++d) batch *= done_shape[d];
  const size_t per_batch = size_t(rows + 1) * width;
  const size_t index = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= batch * per_batch) return;
  const size_t b = index / per_batch;
  const int r = int(index % per_batch) / width;
  const int j = int(index % width);
  out[index] = r < rows ? done[(b * rows + r) * width + j]
                        : __fsub_rn(j == rows ? 1.0f : 0.0f, product[b * width + j]);
"""


@cache
def _append_row_kernel():
    return BakedCudaKernel(
        name="dflash2_append_identity_row",
        input_names=["done", "product"],
        output_names=["out"],
        source=_APPEND_ROW_SOURCE,
    )


def cuda_append_row(done, x_row, product):
    """invert_unit_lower's append in one CUDA launch (x_row: the identity's row, which the
    kernel writes from its index)."""
    *batch, rows, width = done.shape
    total = math.prod(batch) * (rows + 1) * width
    if total == 0:  # nothing to launch (a launch of no threads fails)
        return mx.zeros((*batch, rows + 1, width), mx.float32)
    return _append_row_kernel()(
        inputs=[done, product],
        grid=(total, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(*batch, rows + 1, width)],
        output_dtypes=[mx.float32],
    )[0]


def invert_unit_lower_one_launch(Tmat, C: int, rows: int = None):
    """invert_unit_lower with each row's subtraction and append in one CUDA launch: two
    launches a row (the matmul and this) where the row-appending one makes four."""
    return invert_unit_lower(Tmat, C, append=cuda_append_row, rows=rows)


# The whole substitution in one launch (CUDA). Stock's row i is e_i - T[i, :i] @ X[:i], a
# batched (1 x K) @ (K x 64) fp32 matmul (K = i) that MLX sends to cuBLASLt, whose kernel
# follows the batch count (heads x chunks) and K. Measured on the H200 (CUDA 12, 48 heads):
# it sums a row's products as fp32 FMA chains, each ascending from +0, over `parts` spans
# of K, then adds the partial sums: one chain at 30-32 chunks, two contiguous halves at 2-8,
# two interleaved (even, odd k) at 14-29, four at 9-13 from K 14, spans of 4 added as a
# butterfly at 1. ROW_SUMS lists such orders; calibrate_fused_inverse finds, at start-up and
# per batch count, which one gives each row stock's bits, and serves only counts whose whole
# inverse then matches stock's on fresh inputs.
_ROW_SUM_COMBINES = {"s": 0, "t": 1, "b": 2}  # sequential, adjacent pairs, butterfly (xor halves)


def _row_sum_orders() -> dict:
    """label -> K -> (parts, interleaved, combine, fixed span width or 0 for ceil(K / parts)).
    Combines that add the same pairs in the same order as another are left out (with two
    or three parts every combine is sequential; a butterfly needs a power of two)."""
    orders = {"one chain": lambda K: (1, 0, 0, 0)}
    for parts in (2, 3, 4, 5, 6, 7, 8, 16, 32):
        combines = "s" if parts <= 3 else "stb" if parts & (parts - 1) == 0 else "st"
        for interleaved in (0, 1):
            for combine in combines:
                plan = (parts, interleaved, _ROW_SUM_COMBINES[combine], 0)
                orders[f"{parts} {'interleaved' if interleaved else 'spans'} {combine}"] = lambda K, plan=plan: plan
    for width in (2, 4, 8, 16):
        for combine in "stb":
            # Spans of `width` k's (the last shorter), as many parts as a power of two holds.
            orders[f"width {width} {combine}"] = lambda K, width=width, combine=_ROW_SUM_COMBINES[combine]: (
                1 << max(0, (-(-K // width) - 1).bit_length()), 0, combine, width)
    return orders


ROW_SUMS = _row_sum_orders()

# One thread per column of one matrix; row i from rows 0..i-1 (X's, read from Xstock, when
# ISOLATED: the calibration judges each row alone). IEEE fp32 throughout (no fast
# math): the FMAs, adds and the subtraction from the identity's row are spelled out.
_FUSED_INVERSE_SOURCE = """
  constexpr int C = 64;
  __shared__ float X[C][C];
  __shared__ float trow[C];
  const size_t b = blockIdx.x;
  const int j = threadIdx.x;
  const float* T = Tmat + b * C * C;
  for (int r = 0; r < C; ++r) X[r][j] = ISOLATED ? Xstock[b * C * C + r * C + j] : (r == j ? 1.0f : 0.0f);
  out[b * C * C + j] = X[0][j];
  __syncthreads();
  float part[32];
  for (int i = 1; i < C; ++i) {
    trow[j] = T[i * C + j];
    __syncthreads();
    const int parts = plan[4 * i], interleaved = plan[4 * i + 1], combine = plan[4 * i + 2];
    const int span = plan[4 * i + 3] ? plan[4 * i + 3] : (i + parts - 1) / parts;
    for (int s = 0; s < parts; ++s) part[s] = 0.0f;
    for (int k = 0; k < i; ++k) {
      const int s = interleaved ? k % parts : k / span;
      part[s] = __fmaf_rn(trow[k], X[k][j], part[s]);
    }
    if (combine == 0) {
      for (int s = 1; s < parts; ++s) part[0] = __fadd_rn(part[0], part[s]);
    } else if (combine == 1) {
      for (int w = 1; w < parts; w *= 2)
        for (int s = 0; s + w < parts; s += 2 * w) part[s] = __fadd_rn(part[s], part[s + w]);
    } else {
      for (int half = parts / 2; half >= 1; half /= 2)
        for (int s = 0; s < half; ++s) part[s] = __fadd_rn(part[s], part[s + half]);
    }
    const float row = __fsub_rn(j == i ? 1.0f : 0.0f, part[0]);
    out[b * C * C + i * C + j] = row;
    if (!ISOLATED) X[i][j] = row;  // each thread reads only its own column of X
    __syncthreads();  // every thread done with trow before the next row's
  }
"""


@cache
def _fused_inverse_kernel():
    return BakedCudaKernel(
        name="dflash2_unit_lower_inverse",
        input_names=["Tmat", "Xstock", "plan"],
        output_names=["out"],
        source=_FUSED_INVERSE_SOURCE,
    )


def row_sum_plan(labels: list) -> mx.array:
    """The kernel's plan: row K's (parts, interleaved, combine, width) from labels[K - 1]."""
    return mx.array([(1, 0, 0, 0)] + [ROW_SUMS[label](K) for K, label in enumerate(labels, 1)], mx.int32)


def fused_inverse_rows(Tmat, plan: mx.array, stock=None):
    """Every row of 64 x 64 unit lower inverses in one launch, each row's products summed as
    `plan` says; with `stock`, each row i from stock's rows 0..i-1 instead of its own."""
    return _fused_inverse_kernel()(
        inputs=[Tmat, Tmat if stock is None else stock, plan.reshape(-1)],
        template=[("ISOLATED", stock is not None)],
        grid=(64 * (Tmat.size // 4096), 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[Tmat.shape],
        output_dtypes=[mx.float32],
    )[0]


# Batch count (heads x chunks x prompts) -> the row-sum plan that gives stock's bits there.
_fused_inverse_plans: dict = {}


def stock_rows_on(Tmat, X):
    """Each row i of mlx-vlm's substitution computed from X's rows 0..i-1 (row 0: X's), by
    _invert_unit_lower's own ops (the concatenate of the rows before, a strided row of
    Tmat), so the same cuBLASLt problems and kernels, on operands without the inverse's
    zeros: every order of summation shows in every column."""
    rows = [X[..., k : k + 1, :] for k in range(64)]
    identity = mx.eye(64, dtype=mx.float32)
    return mx.concatenate([rows[0]] + [
        identity[i : i + 1] - Tmat[..., i : i + 1, :i] @ mx.concatenate(rows[:i], axis=-2) for i in range(1, 64)
    ], axis=-2)


def calibrate_fused_inverse(heads: int, max_chunks: int, run=fused_inverse_rows) -> str:
    """For 1..max_chunks chunks of `heads` heads, the row sums giving each row of mlx-vlm's
    inverse its bits (on dense operands, the previous count's orders tried first), then the
    whole inverse checked against mlx-vlm's on three fresh inputs (one with subnormal and
    zero entries, as strong decay gives); counts that pass are served in one launch
    (invert_unit_lower_fused), the others by the one-launch append. The plans take effect
    only once every count is done. Returns a summary for the log."""
    _fused_inverse_plans.clear()
    plans, labels, served, missed = {}, None, {}, []
    for chunks in range(1, max_chunks + 1):
        Tmat = _random_unit_lower(heads, chunks, 0.3, seed=chunks)
        X = mx.random.normal(Tmat.shape, key=mx.random.key(chunks))
        want = stock_rows_on(Tmat, X)

        def matching(orders):  # K = 1..63: row K's bits are stock's
            got = run(Tmat, row_sum_plan(orders), stock=X)
            return (raw_bits(got) == raw_bits(want)).reshape(-1, 64, 64).all(axis=(0, 2)).tolist()[1:]

        if labels is None or not all(matching(labels)):
            matches = {label: matching([label] * 63) for label in ROW_SUMS}
            # Each row from the order that gives the most rows (short rows match many).
            ranked = sorted(matches, key=lambda label: -sum(matches[label]))
            found = [next((label for label in ranked if matches[label][K]), None) for K in range(63)]
            labels = None if None in found else found
        plan = labels and row_sum_plan(labels)
        fresh = [_random_unit_lower(heads, chunks, scale, seed=1000 * scale + chunks) for scale in (0.3, 1.0)]
        decay = mx.exp(-mx.random.uniform(0, 110, Tmat.shape, key=mx.random.key(chunks)))
        fresh.append(mx.eye(64, dtype=mx.float32) + _random_lower(heads, chunks, 1.0, seed=1000 + chunks) * decay)
        if plan is None or any(_differing(run(T, plan), _invert_unit_lower(T, 64)) for T in fresh):
            missed.append(chunks)
            continue
        plans[heads * chunks] = plan
        served[chunks] = " + ".join(dict.fromkeys(labels))
    _fused_inverse_plans.update(plans)
    ranges = {}
    for chunks, orders in served.items():
        ranges.setdefault(orders, []).append(chunks)
    return (f"one launch at {len(served)} of {max_chunks} chunk counts ({heads} heads)"
            + "".join(f"; {_spans(counts)}: {orders}" for orders, counts in ranges.items())
            + (f"; the one-launch append at {_spans(missed)}" if missed else ""))


def _spans(numbers: list) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    groups = []
    for n in numbers:
        if groups and n == groups[-1][-1] + 1:
            groups[-1].append(n)
        else:
            groups.append([n])
    return ", ".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else f"{g[0]}" for g in groups)


def _random_lower(heads: int, chunks: int, scale: float, seed: int):
    """A chunked prefill's strictly lower part of Tmat, random (one prompt, 64-row chunks)."""
    return mx.tril(mx.random.normal((1, heads, chunks, 64, 64), key=mx.random.key(int(seed))) * scale, -1)


def _random_unit_lower(heads: int, chunks: int, scale: float, seed: int):
    return mx.eye(64, dtype=mx.float32) + _random_lower(heads, chunks, scale, seed)


def invert_unit_lower_fused(Tmat, C: int, rows: int = None):
    """The inverse in one launch where calibrate_fused_inverse found stock's row sums for this
    batch count: every row is stock's, so a short prompt's padding rows need no shortcut.
    Elsewhere the one-launch append (rows used as invert_unit_lower does)."""
    plan = _fused_inverse_plans.get(Tmat.size // (C * C)) if C == 64 and Tmat.dtype == mx.float32 else None
    if plan is None:
        return invert_unit_lower_one_launch(Tmat, C, rows=rows)
    return fused_inverse_rows(Tmat, plan)


def inverse_candidates() -> list:
    """(name, inverse) for the engine to check against mlx-vlm's, fastest first (the fused one
    once calibrate_fused_inverse found a plan)."""
    candidates = [("row-appending", invert_unit_lower)]
    if backend_name() == "cuda":
        candidates.insert(0, ("one-launch append", invert_unit_lower_one_launch))
        if _fused_inverse_plans:
            candidates.insert(0, ("fused", invert_unit_lower_fused))
    return candidates


# Prompts shorter than one chunk: the rows that hold tokens (the rest are padding).
INVERSE_TEST_ROWS = (None, 1, 8, 33, 63)


def self_test_inverse(heads: int = 48, chunks: int = 2, kernel=None) -> int:
    """Elements of invert_unit_lower (or `kernel`) whose bits differ from mlx-vlm's on a
    chunked-prefill-like input (48: the 27B's GatedDeltaNet value heads; 64:
    gated_delta_chunked's chunk), whole chunks and prompts shorter than one (rows past the
    prompt's are the identity's, as gated_delta_chunked's padding makes them)."""
    C = 64
    lower = _random_lower(heads, chunks, 0.3, seed=0)
    differing = 0
    for rows in INVERSE_TEST_ROWS:
        held = lower if rows is None else lower * (mx.arange(C) < rows)[:, None]
        Tmat = mx.eye(C, dtype=mx.float32) + held
        differing += _differing((kernel or invert_unit_lower)(Tmat, C, rows=rows), _invert_unit_lower(Tmat, C))
    return differing
