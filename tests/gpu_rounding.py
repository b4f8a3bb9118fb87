"""A CPU backend whose multi-row work rounds differently from single-row work, as GPUs do.

On MLX's CPU backend a batched op gives each row exactly what the op gives that row
alone, so stock verify equals decode there and a CPU test cannot tell exact code from
inexact code. `swap_row_variant_ops(monkeypatch)` replaces the ops whose GPU kernels
change with the number of rows or queries (../shared/notes/exact-fast-verify.md, sections
1-2) by versions that sum in another order whenever they see more than one row. A call
with one row, one query or one step is MLX's own call, untouched.

- `mx.quantized_matmul`, more than one row: the weights dequantized, then one float32
  matmul rounded once to the output dtype, as GPU kernels for many rows tile it (and
  about 30 times faster than MLX's CPU kernel, which takes ~8 ms a row at 512 x 512:
  prefills under the swaps cost little). One fp16 row keeps MLX's own bits but not its
  speed: MLX's CPU kernel (quantized.cpp `_qmm_t`) rounds every step to fp16 in scalar
  code (11 to 29 ms a row at the tiny packs' widths), so `one_fp16_row` takes the same
  steps as array ops, each weight's dequantized values made once (about 4 times faster;
  checked against MLX's call on each weight's first row, MLX's call serving if it differs).
- dense matmul (`mx.matmul`, `mx.addmm`, the `@` operator that `nn.Linear` uses), more
  than one row: the sum of two K halves, each rounded to the output dtype (a split-K GEMM).
- `mx.fast.scaled_dot_product_attention`, more than one query: MLX's unfused formula with
  split-K matmuls for q.k and p.v.
- the GatedDeltaNet recurrence that records every step's state (stock verify's
  `_gated_delta_with_states_ops`), more than one step: key dimension reversed. The
  recurrence that loops decode's compiled step (`gated_delta_ops`) is decode's
  arithmetic at any T, as is the Metal kernel, so it stays stock.

Row-wise ops (norms, softmax, logsumexp, argmax, element-wise, Hadamard) take their GPU
launch shape from the row length, never the row count, so they stay stock too. The swaps
are looked up where callers look: attributes of `mlx.core`, `mlx.core.fast`,
`mlx.core.array` and the mlx-vlm module, so every caller sees them while active.

`metal_like_recurrence(monkeypatch)` is the GatedDeltaNet side of a Mac: mlx-vlm's
gated_delta_update sees a GPU with Metal, so decode (and prefill, and stock verify's
with-states call) run its fused kernels instead of the ops step. Their stand-ins run each
step in float64 (state kept float32 between steps): the same at T=1 a step at a time as at
T=L in one call, as the Metal kernel is, and different from the ops step, as it is.
"""

import types

import mlx.core as mx
from mlx_vlm.models.qwen3_5 import gated_delta

STOCK_QUANTIZED_MATMUL = mx.quantized_matmul
STOCK_MATMUL = mx.matmul
STOCK_ARRAY_MATMUL = mx.array.__matmul__
STOCK_ADDMM = mx.addmm
STOCK_SDPA = mx.fast.scaled_dot_product_attention
STOCK_WITH_STATES = gated_delta._gated_delta_with_states_ops


def matmul_rows(a, b) -> int:
    """Rows one GEMM sees: a shared 2-D weight folds every leading dim of `a` into M."""
    if a.ndim < 2:
        return 1
    return a.size // a.shape[-1] if b.ndim == 2 else a.shape[-2]


def split_k(a, b):
    """a @ b as two K halves, each rounded to the output dtype, then added."""
    half = a.shape[-1] // 2
    if half == 0:
        return STOCK_MATMUL(a, b)
    return STOCK_MATMUL(a[..., :half], b[..., :half, :]) + STOCK_MATMUL(
        a[..., half:], b[..., half:, :]
    )


def matmul(a, b, **kwargs):
    if kwargs or matmul_rows(a, b) == 1 or b.ndim < 2:
        return STOCK_MATMUL(a, b, **kwargs)
    return split_k(a, b)


def array_matmul(a, b):
    if not isinstance(b, mx.array) or matmul_rows(a, b) == 1 or b.ndim < 2:
        return STOCK_ARRAY_MATMUL(a, b)
    return split_k(a, b)


def addmm(c, a, b, alpha=1.0, beta=1.0, **kwargs):
    if kwargs or matmul_rows(a, b) == 1:
        return STOCK_ADDMM(c, a, b, alpha=alpha, beta=beta, **kwargs)
    return beta * c + alpha * split_k(a, b)


# (weight, scales, biases, group size, bits) by their ids -> (those arrays, kept alive so no
# id is reused while cached; the (K, N) float32 of their fp16 dequantized values, or None
# where one_fp16_row's first row differed from MLX's call).
_FP16_WEIGHTS: dict = {}


def _fp16_weight(w, scales, biases, group_size, bits):
    """MLX's CPU kernel's fp16 weights, scale * code + bias, each op rounded to fp16, as (K, N) float32."""
    codes = mx.dequantize(w, mx.ones_like(scales), mx.zeros_like(biases), group_size=group_size, bits=bits)
    spread = lambda a: mx.repeat(a, group_size, axis=1)  # noqa: E731
    return (spread(scales) * codes.astype(mx.float16) + spread(biases)).astype(mx.float32).T


def tracing(x) -> bool:
    """Whether x is a placeholder of mx.compile's trace (evaluating it raises there)."""
    try:
        mx.eval(x)
    except ValueError:
        return True
    return False


def one_fp16_row(x, w, scales, biases, group_size, bits):
    """MLX's CPU single-row quantized matmul for fp16 (_qmm_t: sum from +0, sum += x * w in
    fp16, element after element), bit for bit: the products are exact in float32 and rounded
    once, cumsum adds in fp16 one after another, and + 0 turns an all-zero row's -0 into
    _qmm_t's +0. None where the pack's weights are not what this was checked on, and for a row
    holding a NaN: where NaNs of both signs meet x86 keeps the first operand's, and _qmm_t and
    cumsum add in other operand orders (a review found signs that differ there)."""
    if tracing(x):
        return None  # inside mx.compile's trace no value can be read: MLX's own call serves
    key = (id(w), id(scales), id(biases), group_size, bits)
    kept = _FP16_WEIGHTS.get(key)
    if kept is None:
        if len(_FP16_WEIGHTS) > 4096:
            _FP16_WEIGHTS.clear()
        weight = _fp16_weight(w, scales, biases, group_size, bits)
        mx.eval(weight)
        kept = _FP16_WEIGHTS[key] = ((w, scales, biases), weight)
        got = one_fp16_row(x, w, scales, biases, group_size, bits)
        want = STOCK_QUANTIZED_MATMUL(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
        if not mx.array_equal(got.view(mx.uint16), want.view(mx.uint16)).item():
            _FP16_WEIGHTS[key] = (kept[0], None)
        return want
    if kept[1] is None or mx.isnan(x).any().item():
        return None
    products = (x.reshape(-1, 1).astype(mx.float32) * kept[1]).astype(mx.float16)
    out = mx.cumsum(products, axis=0)[-1] + mx.array(0, dtype=mx.float16)
    return out.reshape(*x.shape[:-1], kept[1].shape[1])


def quantized_matmul(
    x, w, scales=None, biases=None, transpose=True, group_size=None, bits=None,
    mode="affine", **kwargs
):
    rows = x.size // x.shape[-1]
    if rows == 1 and transpose and mode == "affine" and biases is not None and not kwargs \
            and x.dtype == scales.dtype == biases.dtype == mx.float16:
        y = one_fp16_row(x, w, scales, biases, group_size or 64, bits or 4)
        if y is not None:
            return y
    if rows == 1 or not transpose or mode != "affine" or biases is None or kwargs:
        return STOCK_QUANTIZED_MATMUL(x, w, scales, biases, transpose=transpose, group_size=group_size,
                                      bits=bits, mode=mode, **kwargs)
    weight = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    y = STOCK_MATMUL(x.astype(mx.float32), weight.astype(mx.float32).T)
    return y.astype(mx.result_type(x, scales))  # the stock call's output dtype


def attention_mask(mask, queries: int, keys: int):
    if isinstance(mask, str):  # "causal": query i sees keys up to keys - queries + i
        return mx.arange(keys)[None] <= (keys - queries + mx.arange(queries))[:, None]
    return mask


def scaled_dot_product_attention(q, k, v, *, scale, mask=None, sinks=None, **kwargs):
    if q.shape[-2] == 1 or sinks is not None or kwargs:
        return STOCK_SDPA(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)
    batch, heads, queries, width = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    repeats = heads // kv_heads
    q = (q * mx.array(scale, dtype=q.dtype)).reshape(batch, kv_heads, repeats, queries, width)
    scores = split_k(q, k[:, :, None].swapaxes(-1, -2))
    mask = attention_mask(mask, queries, keys)
    if mask is not None:
        if mask.ndim >= 3 and mask.shape[-3] == heads:
            mask = mask.reshape(*mask.shape[:-3], kv_heads, repeats, queries, keys)
        elif mask.ndim >= 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-float("inf"), dtype=scores.dtype))
        else:
            scores = scores + mask
    probabilities = mx.softmax(scores, axis=-1, precise=True)
    return split_k(probabilities, v[:, :, None]).reshape(batch, heads, queries, -1)


def with_states_ops(q, k, v, g, beta, state, mask=None, state_steps=None):
    if q.shape[1] == 1:
        return STOCK_WITH_STATES(q, k, v, g, beta, state, mask, state_steps)
    y, state, states = STOCK_WITH_STATES(
        q[..., ::-1], k[..., ::-1], v, g, beta, state[..., ::-1], mask, state_steps
    )
    return y, state[..., ::-1], states[..., ::-1]


def swap_row_variant_ops(monkeypatch):
    """Install the swaps for the rest of the test (monkeypatch undoes them)."""
    monkeypatch.setattr(mx, "quantized_matmul", quantized_matmul)
    monkeypatch.setattr(mx, "matmul", matmul)
    monkeypatch.setattr(mx.array, "__matmul__", array_matmul)
    monkeypatch.setattr(mx, "addmm", addmm)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", scaled_dot_product_attention)
    monkeypatch.setattr(gated_delta, "_gated_delta_with_states_ops", with_states_ops)


class MetalLikeMx(types.ModuleType):
    """mlx.core as gated_delta_update sees it on a Mac: the default device a GPU with Metal."""

    metal = types.SimpleNamespace(is_available=lambda: True)

    def __getattr__(self, name):
        return getattr(mx, name)

    @staticmethod
    def default_device():
        return mx.gpu


def float64_steps(q, k, v, g, beta, state, state_steps=None):
    """y, final state and the first state_steps states of T recurrence steps, each step's
    arithmetic in float64, its state rounded to float32 and y to q's dtype: a step at a time
    or T at once give the same bits (the state is float32 between steps either way)."""
    if (repeat := v.shape[2] // q.shape[2]) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    wide = [a.astype(mx.float64) for a in (q, k, v, g, beta)]
    ys, states = [], []
    for t in range(q.shape[1]):
        q_t, k_t, v_t, g_t, beta_t = (a[:, t] for a in wide)
        s = state.astype(mx.float64) * g_t[..., None, None]
        delta = (v_t - (s * k_t[..., None, :]).sum(-1)) * beta_t[..., None]
        s = s + k_t[..., None, :] * delta[..., None]
        ys.append((s * q_t[..., None, :]).sum(-1).astype(q.dtype))
        state = s.astype(mx.float32)
        states.append(state)
    kept = states[: q.shape[1] if state_steps is None else state_steps]
    return mx.stack(ys, axis=1), state, mx.stack(kept, axis=1) if kept else mx.zeros((q.shape[0], 0, *state.shape[1:]))


def metal_like_kernel(q, k, v, g, beta, state, mask=None):
    """gated_delta_kernel's stand-in: (y, final state) of T steps."""
    assert mask is None, "the stand-in covers unmasked calls only"
    return float64_steps(q, k, v, g, beta, state)[:2]


def metal_like_with_states_kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    """_gated_delta_with_states_kernel's stand-in: (y, final state, StateT states), launched
    only as gated_delta_update_with_states launches the kernel (checked)."""
    q, k, v, g, beta, state, steps = inputs
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    kept = dict(template).get("StateT")
    assert steps == T and q.shape == k.shape and kept is not None and 0 <= kept <= T
    assert template == [("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv),
                        ("StateT", kept)], template
    assert grid == (32, Dv, B * Hv) and threadgroup == (32, 4, 1), (grid, threadgroup)
    assert output_shapes == [(B, T, Hv, Dv), state.shape, (B, kept, Hv, Dv, Dk)], output_shapes
    assert output_dtypes == [q.dtype, state.dtype, state.dtype], output_dtypes
    return float64_steps(q, k, v, g, beta, state, kept)


def metal_like_recurrence(monkeypatch, with_states_kernel=metal_like_with_states_kernel):
    """Install the Metal-like recurrence for the rest of the test (monkeypatch undoes it)."""
    monkeypatch.setattr(gated_delta, "mx", MetalLikeMx("mlx.core"))
    monkeypatch.setattr(gated_delta, "gated_delta_kernel", metal_like_kernel)
    monkeypatch.setattr(gated_delta, "_gated_delta_with_states_kernel", with_states_kernel)
