"""The rotary embedding of decode's queries and keys, at any number of positions in one launch:
stock reference, CUDA, dispatch, self-test.

- `rope_rows(q, k, cos, sin)`: queries and keys rotated as mlx-vlm's compiled rotary
  rotates them (fp16 products, one contracted into the sum as ptxas compiles MLX's
  fused kernel), in one launch where decode runs twelve. fp32 rows (the real file's) the
  same in fp32, once their own self-test found which product MLX's build contracts. cuda
  only.
"""

from functools import cache, partial

import mlx.core as mx
from mlx_vlm.models import rope_utils

from dflash2_kernel_base import (
    CUDA_ELEMENT_TYPE, MAX_ROWS, BakedCudaKernel, SelfTestResult, _self_test_cases, cuda_header,
    cuda_serving_variant, input_kinds_for, make_inputs_for,
)

# ===========================================================================
# Rotary embedding

# `rope_rows(q, k, cos, sin)`: queries (B, Hq, L, D) and keys (B, Hk, L, D) rotated as
# mlx-vlm 0.7.2 rotates them at every position (qwen3_5/language.py:44 ->
# rope_utils.py:1338-1357, `_apply_interleaved_rotary_pos_emb_axis1`, an mx.compile'd
# function): the first R = cos.shape[-1] features of each head become
# x * cos + rotate_half(x) * sin (rotate_half: the halves swapped, the second negated),
# the rest pass through, and each comes back concatenated. On CUDA that is six launches
# for q and six for k (the negation, rotate_half's and the result's concatenations, two
# copies each, and one fused kernel for the products and the sum); here one for both.
# The fused kernel MLX generates (backend/cuda/compiled.cpp) computes on __half with its
# Multiply and Add functors, `Add{}(Multiply{}(x, cos), Multiply{}(r, sin))`, and ptxas
# contracts one product into the add: compiled offline for sm_90a the same source is
# HMUL2 for r * sin, then HFMA2 x * cos + that. Variant "fma" does exactly that with
# explicit rounding (__hfma of x, cos and __hmul_rn(r, sin)); "mul_add" never contracts
# (for a compiler that does not). The self-test decides which serves; the negation and
# the copies are exact. fp32 rows: the same kernel on float (MLX's fused kernel then
# computes in fp32 and either product could be the contracted one: "fma_sin" contracts
# r * sin into x * cos + it), its own self-test and verdict. Their cos and sin tables come
# in the embeddings' dtype, fp16 in the real file's layout (its embedding's scales are
# fp16): the fused kernel widens each to fp32 first, exactly, and so does this one; the
# self-test takes both table dtypes.

ROPE_SHAPES_SMALL = ((1, 4, 2, 64, 16), (2, 3, 1, 32, 32), (1, 6, 6, 256, 64))  # (B, Hq, Hk, D, R)
ROPE_VARIANTS = ("fma", "mul_add")
ROPE32_VARIANTS = ("fma", "fma_sin", "mul_add")
_CONTRACTED = {"mul_add": 0, "fma": 1, "fma_sin": 2}  # the kernel's FMA: which product fuses into the sum
ROPE32_TABLES = {"fp16": mx.float16, "fp32": mx.float32}  # fp32 rows' cos and sin dtypes
ROPE_LONG_ROWS = 300  # a prefill's length, beside 1..8: the kernel is element-wise at any L
stock_rope_rows = rope_utils._apply_interleaved_rotary_pos_emb_axis1

_ROPE_CUDA_HEADER = CUDA_ELEMENT_TYPE + r"""
namespace dflash2_rope {

// Each operation rounded as written, on __half or float.
__device__ __forceinline__ __half neg(__half v) { return __hneg(v); }
__device__ __forceinline__ float neg(float v) { return -v; }
__device__ __forceinline__ __half mul_rn(__half a, __half b) { return __hmul_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ __half add_rn(__half a, __half b) { return __hadd_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ __half fma_rn(__half a, __half b, __half c) { return __hfma(a, b, c); }
__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }

// Feature d of one head's row x (its last-axis stride `step`), rotated by c and s. FMA: 0
// no product contracted, 1 x * c into the sum, 2 r * s into it.
template <int R, int FMA, typename T>
__device__ __forceinline__ T rotated(const T* x, int64_t step, int d, T c, T s) {
  if (d >= R) {
    return x[d * step];
  }
  constexpr int kHalf = R / 2;
  const T r = d < kHalf ? neg(x[(d + kHalf) * step]) : x[(d - kHalf) * step];
  if (FMA == 1) {
    return fma_rn(x[d * step], c, mul_rn(r, s));
  }
  if (FMA == 2) {
    return fma_rn(r, s, mul_rn(x[d * step], c));
  }
  return add_rn(mul_rn(x[d * step], c), mul_rn(r, s));
}

}  // namespace dflash2_rope
"""
# One thread per output element (b, h, l, d) over the Hq + Hk heads of q and k, read in
# place through their strides (the model hands over transposed views).
_ROPE_SOURCE = """
  const int D = q_shape[3], L = q_shape[2], Hq = q_shape[1], H = Hq + k_shape[1];
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(q_shape[0]) * H * L * D) {
    return;
  }
  const int d = i % D;
  const int l = (i / D) % L;
  const int h = (i / (int64_t(D) * L)) % H;
  const int64_t b = i / (int64_t(D) * L * H);
  using T = dflash2_types::Element<decltype(q_out)>::type;
  T c{}, s{};
  if (d < R) {  // tables in q's dtype, or fp16 widened to fp32 rows' (exact)
    c = static_cast<T>(cos[b * cos_strides[0] + l * cos_strides[1] + d * cos_strides[2]]);
    s = static_cast<T>(sin[b * sin_strides[0] + l * sin_strides[1] + d * sin_strides[2]]);
  }
  if (h < Hq) {
    const T* x = q + b * q_strides[0] + h * q_strides[1] + l * q_strides[2];
    q_out[((b * Hq + h) * L + l) * D + d] = dflash2_rope::rotated<R, FMA>(x, q_strides[3], d, c, s);
  } else {
    const int hk = h - Hq;
    const T* x = k + b * k_strides[0] + hk * k_strides[1] + l * k_strides[2];
    k_out[((b * (H - Hq) + hk) * L + l) * D + d] = dflash2_rope::rotated<R, FMA>(x, k_strides[3], d, c, s);
  }
"""
ROPE_THREADS = 256


@cache
def _rope_kernel():
    return BakedCudaKernel(
        name="dflash2_rope_rows",
        input_names=["q", "k", "cos", "sin"],
        output_names=["q_out", "k_out"],
        source=_ROPE_SOURCE,
        header=cuda_header(_ROPE_CUDA_HEADER),
        ensure_row_contiguous=False,  # q and k are transposed views
    )


def cuda_rope_rows(q, k, cos, sin, variant: str):
    """(q, k) rotated through the CUDA kernel in one of ROPE32_VARIANTS (fp16 rows: of
    ROPE_VARIANTS), in q's dtype; no self-test gate."""
    batch, q_heads, rows, width = q.shape
    total = batch * (q_heads + k.shape[1]) * rows * width
    return tuple(_rope_kernel()(
        inputs=[q, k, cos, sin],
        template=[("R", cos.shape[-1]), ("FMA", _CONTRACTED[variant])],
        grid=(-(-total // ROPE_THREADS) * ROPE_THREADS, 1, 1),
        threadgroup=(ROPE_THREADS, 1, 1),
        output_shapes=[q.shape, k.shape],
        output_dtypes=[q.dtype, q.dtype],
    ))


# backend -> the variant its self-test verified, or None (fp16 rows, fp32 rows).
_rope_serving: dict = {}
_rope32_serving: dict = {}


def rope_kernel_supports(q, k, cos, sin) -> bool:
    if not q.ndim == k.ndim == 4:
        return False
    batch, _, rows, width = q.shape
    return (cos.shape == sin.shape == (batch, rows, cos.shape[-1])
            and k.shape[0] == batch and k.shape[2:] == q.shape[2:]
            and 0 < cos.shape[-1] <= width and cos.shape[-1] % 2 == 0
            and q.dtype == k.dtype and cos.dtype == sin.dtype and q.dtype in (mx.float16, mx.float32)
            and cos.dtype in {q.dtype, mx.float16})


def rope_rows(q, k, cos, sin, variant=None):
    """(q, k) each rotated as mlx-vlm's `_apply_interleaved_rotary_pos_emb_axis1` rotates it
    (cos, sin: (B, L, R)), bit for bit, as two row-contiguous arrays of q's and k's shapes.
    variant: one of ROPE32_VARIANTS forces the kernel (no gate); default: the self-test's
    for fp16 rows, or fp32 rows' own."""
    if variant is None:  # the inputs first: a call the kernel never takes tests nothing
        variant = rope_kernel_supports(q, k, cos, sin) and (
            cuda_serving_variant(_rope32_serving, self_test_rope32) if q.dtype == mx.float32
            else cuda_serving_variant(_rope_serving, self_test_rope))
        if not variant:
            return stock_rope_rows(q, k, cos, sin)
    return cuda_rope_rows(q, k, cos, sin, variant)


def make_rope_case(kind: str, batch, q_heads, k_heads, width, rotary, rows, key, dtype=mx.float16,
                   table_dtype=None):
    """(q, k, cos, sin) as the model hands them over: q and k (B, H, L, D) transposed
    views of (B, L, H, D) fp16 (or fp32) activations of `kind`, cos and sin (B, L, R) of
    table_dtype (default: that dtype), of real angles (position p times MRoPE-like
    frequencies)."""
    make = make_inputs_for(dtype)
    k_q, k_k = mx.random.split(key)
    q = make(kind, batch * rows, q_heads * width, k_q).reshape(batch, rows, q_heads, width)
    k = make(kind, batch * rows, k_heads * width, k_k).reshape(batch, rows, k_heads, width)
    frequencies = 10000.0 ** (-mx.arange(0, rotary, 2, dtype=mx.float32) / rotary)
    angles = (mx.arange(rows, dtype=mx.float32) + 1000.0)[:, None] * frequencies
    angles = mx.broadcast_to(mx.concatenate([angles, angles], axis=-1), (batch, rows, rotary))
    return (q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
            mx.cos(angles).astype(table_dtype or dtype), mx.sin(angles).astype(table_dtype or dtype))


def self_test_rope(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """Check the rotary kernel bit for bit against mlx-vlm's compiled rotary call, at
    1..8 positions and a prefill's length, every input kind. kernel: (q, k, cos, sin) ->
    (q, k), tested as variant "kernel"; default: each of ROPE_VARIANTS, serving then
    switched to the first that passed (None: the stock call). shapes: (B, Hq, Hk, D, R).
    The variants that did not pass are the controls of the one that did."""
    return _self_test_rows(mx.float16, ROPE_VARIANTS, _rope_serving, shapes, seed, kernel)


def self_test_rope32(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """self_test_rope on fp32 rows (the real file's), every fp32 input kind, with fp16
    tables (the real file's) and fp32 ones: each of ROPE32_VARIANTS, fp32 rows' serving then
    switched to the first that passed."""
    return _self_test_rows(mx.float32, ROPE32_VARIANTS, _rope32_serving, shapes, seed, kernel)


def _self_test_rows(dtype, variant_names, serving: dict, shapes, seed, kernel) -> SelfTestResult:
    fp32 = dtype == mx.float32
    tables = [(name,) for name in ROPE32_TABLES] if fp32 else [()]  # fp32 rows: each table dtype

    def make_case(kind, rows, shape, key):
        if not fp32:
            return make_rope_case(kind, *shape, rows, key), f"(B, Hq, Hk, D, R)={shape} rows={rows}"
        *shape, table = shape
        return (make_rope_case(kind, *shape, rows, key, dtype=dtype, table_dtype=ROPE32_TABLES[table]),
                f"(B, Hq, Hk, D, R)={tuple(shape)} rows={rows} fp32, {table} tables")

    def parts(function):
        return lambda *arguments: dict(zip(("q", "k"), function(*arguments)))

    variants = {name: parts(partial(cuda_rope_rows, variant=name)) for name in variant_names}
    return _self_test_cases(kernel and parts(kernel), variants, serving,
                            [(*s, *table) for s in (shapes or ROPE_SHAPES_SMALL) for table in tables], seed, make_case,
                            parts(stock_rope_rows), failed_are_controls=True,
                            rows=(*range(1, MAX_ROWS + 1), ROPE_LONG_ROWS),
                            kinds=input_kinds_for(dtype))
