"""Decode's small fused steps, each in one launch: convolution, the RMSNorms and the
GatedDeltaNet gates (CUDA only; dflash2_kernel_rope has the rotary embedding's).

- `conv_rows(state, x, weight)`: the GatedDeltaNet's depthwise convolution at each
  of L positions, decode's per-window arithmetic (fp32 products, summed over the taps
  in order, rounded to fp16), silu after it with MLX's own functors, and the window
  the cache keeps, in one launch where decode runs six. cuda only.
- `add_rms_norm(x, residual, weight, eps)`: the decoder layer's residual add and the
  RMSNorm after it (MLX's Add and rms_norm_small or rms_norm copied), both outputs, in one
  launch where decode runs two; `gated_rms_norm(x, weight, eps, gate)`: the GatedDeltaNet's
  output norm and its fp32 swiglu gate, one launch where decode runs two. fp16 and fp32
  rows, each under its own self-test. cuda only.
- `gdn_gates(A_log, a, b, dt_bias)`: the GatedDeltaNet's g and beta (`_compute_g_beta`),
  one launch where decode runs two. cuda only.
"""

from functools import cache, partial

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.qwen3_5 import language as qwen3_5_language
from mlx_vlm.models.qwen3_5.gated_delta import _compute_g_beta

from dflash2_kernel_base import (
    CUDA_ELEMENT_TYPE, INPUT_KINDS, MAX_ROWS, BakedCudaKernel, SelfTestResult, _differing, _no_kernel_result,
    _self_test_cases, _variants_result, backend_name, cuda_header, cuda_serving_variant, input_kinds_for, make_inputs,
    make_inputs_for, run_case,
)

# ===========================================================================
# Convolution

# `conv_rows(state, x, weight)`: the GatedDeltaNet's depthwise causal convolution for L
# positions, each decode's (mlx-vlm 0.7.2 qwen3_5/language.py:71-73,
# `_qwen3_5_decode_depthwise_conv` on the (B, K, C) window that ends at it), with
# nn.silu after it, and the (B, K - 1 + L, C) concatenation of state and x
# the cache keeps as its window. On CUDA decode runs that as five kernels a layer (the
# concatenation's two copies, a compiled astype-multiply, a column reduce, an astype
# copy) and one more for silu; the kernel below is one launch with their arithmetic:
# each product float(x) * w rounded to fp32 (a kernel of its own in MLX, so never fused
# into an FMA), summed over the K taps in tap order from +0 as col_reduce_small's Sum
# does (reduce/col_reduce.cu:206-244), rounded to fp16 (static_cast, device/cast_op.cuh),
# then silu as MLX's compiled kernel computes it on __half: Multiply{}(x, Sigmoid{}(x))
# with MLX's own functors (device/unary_ops.cuh, binary_ops.cuh, included here).

CONV_SHAPES_SMALL = ((1, 96, 4), (2, 40, 4), (1, 24, 3))  # (B, C, K)
stock_decode_conv = qwen3_5_language._qwen3_5_decode_depthwise_conv  # mlx-vlm's own (dflash2_audit.AUDITED)


def stock_conv_rows(state, x, weight):
    """(window, silu(out)): decode's convolution, one stock call per position."""
    made = mx.concatenate([state, x], axis=1)
    taps = weight.shape[0]
    out = mx.concatenate([stock_decode_conv(made[:, t : t + taps], weight) for t in range(x.shape[1])], axis=1)
    return made, nn.silu(out)


_CONV_CUDA_HEADER = r"""
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"

namespace dflash2_conv {

// One thread per element (b, p, c) of the (B, K - 1 + L, C) window: it writes that element
// and, for p < L, output position p from window positions p..p+K-1, silu after it. w: (C, K),
// the layout of decode's (K, C) weight (the transpose of conv1d.weight[:, :, 0], cast).
template <int K>
__device__ void conv_rows(const __half* state, const __half* x, const float* w,
                          __half* window, __half* out, int rows, int channels, int64_t total) {
  const int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= total) {
    return;
  }
  constexpr int kWidth = K - 1;
  const int c = index % channels;
  const int p = (index / channels) % (kWidth + rows);
  const int64_t b = index / channels / (kWidth + rows);
  auto input = [&](int position) {
    return position < kWidth ? state[(b * kWidth + position) * channels + c]
                             : x[(b * rows + position - kWidth) * channels + c];
  };
  window[index] = input(p);
  if (p < rows) {
    float sum = 0.0f;
#pragma unroll
    for (int t = 0; t < K; ++t) {
      sum = __fadd_rn(sum, __fmul_rn(static_cast<float>(input(p + t)), w[c * K + t]));
    }
    const __half y = static_cast<__half>(sum);
    out[(b * rows + p) * channels + c] = mlx::core::cu::Multiply{}(y, mlx::core::cu::Sigmoid{}(y));
  }
}

}  // namespace dflash2_conv
"""
_CONV_SOURCE = (
    "dflash2_conv::conv_rows<K>(state, x, w, window, out, x_shape[1], x_shape[2], "
    "int64_t(x_shape[0]) * (K - 1 + x_shape[1]) * x_shape[2]);"
)
CONV_THREADS = 256


@cache
def _conv_kernel():
    return BakedCudaKernel(
        name="dflash2_conv_rows",
        input_names=["state", "x", "w"],
        output_names=["window", "out"],
        source=_CONV_SOURCE,
        header=cuda_header(_CONV_CUDA_HEADER),
    )


def cuda_conv_rows(state, x, weight):
    """(window, silu(out)) through the CUDA kernel; no self-test gate."""
    batch, rows, channels = x.shape
    taps = weight.shape[0]
    total = batch * (taps - 1 + rows) * channels
    made = _conv_kernel()(
        inputs=[state, x, weight.T],  # (C, K): decode's weight is that transposed, so a view
        template=[("K", taps)],
        grid=(-(-total // CONV_THREADS) * CONV_THREADS, 1, 1),
        threadgroup=(CONV_THREADS, 1, 1),
        output_shapes=[(batch, taps - 1 + rows, channels), x.shape],
        output_dtypes=[mx.float16, mx.float16],
    )
    return made[0], made[1]


_conv_serving: dict = {}  # backend -> the variant its self-test verified, or None


def conv_kernel_supports(state, x, weight) -> bool:
    # Decode's column sum is col_reduce_small (taps in order) only for up to 32 taps and
    # C % 4 == 0 (reduce/col_reduce.cu:484-486); elsewhere MLX sums in another order.
    return (weight.shape[0] <= 32 and weight.shape[1] % 4 == 0
            and state.dtype == x.dtype == mx.float16 and weight.dtype == mx.float32
            and state.shape[1] == weight.shape[0] - 1 and x.shape[2] == weight.shape[1] == state.shape[2]
            and state.shape[0] == x.shape[0])


def conv_rows(state, x, weight, variant=None):
    """Decode's depthwise convolution at each of L positions, silu after it.

    state: (B, K - 1, C) the window before the block; x: (B, L, C) the block's inputs;
    weight: (K, C) float32, decode's cached `conv1d.weight[:, :, 0].T` in fp32 (column-major
    there, so the kernel reads it in place). Returns
    (the (B, K - 1 + L, C) concatenation, silu(out) (B, L, C)), out bitwise decode's per
    position. variant: "taps" forces the kernel (no gate)."""
    if variant is None:  # the inputs first: a call the kernel never takes tests nothing
        variant = conv_kernel_supports(state, x, weight) and cuda_serving_variant(_conv_serving, self_test_conv)
        if not variant:
            return stock_conv_rows(state, x, weight)
    return cuda_conv_rows(state, x, weight)


def make_conv_case(kind: str, batch: int, channels: int, taps: int, key):
    """(state (B, K-1, C), x (B, 8, C), weight (K, C) fp32 from fp16 values, laid out as
    decode's: the transpose of a (C, K) array, cast)."""
    k_window, k_weight = mx.random.split(key)
    rows = taps - 1 + MAX_ROWS
    window = make_inputs(kind, batch * rows, channels, k_window).reshape(batch, rows, channels)
    weight = (mx.random.normal((channels, taps), key=k_weight) * 0.5).astype(mx.float16).T.astype(mx.float32)
    return window[:, : taps - 1], window[:, taps - 1 :], weight


def self_test_conv(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """Check the convolution bit for bit against decode's per-position calls, rows 1..8,
    silu after it, and the window. kernel: (state, x, weight) -> (window, silu(out)),
    tested as variant "kernel"; default: the CUDA kernel, serving then switched on or off. shapes: (B, C, K) triples, default the small ones. MLX's convolution of the
    whole block (stock verify's nn.Conv1d call) is counted alongside (the control)."""
    backend = backend_name()
    if kernel is None and backend != "cuda":
        return _no_kernel_result(backend)
    variants = {"kernel": kernel} if kernel else {"taps": cuda_conv_rows}
    shapes = [tuple(s) for s in (shapes or CONV_SHAPES_SMALL)]
    differing = {name: 0 for name in variants}
    failures, cases = {}, []
    negative = {"block convolution": 0}
    key = mx.random.key(seed)
    for batch, channels, taps in shapes:
        for kind in INPUT_KINDS:
            key, case_key = mx.random.split(key)
            state, x, weight = make_conv_case(kind, batch, channels, taps, case_key)
            want_window, want = stock_conv_rows(state, x, weight)
            block = mx.conv1d(want_window, weight.T[:, :, None].astype(mx.float16), groups=channels)
            negative["block convolution"] += _differing(nn.silu(block), want)
            for name, conv in variants.items():
                for rows in range(1, MAX_ROWS + 1):
                    def compare(conv=conv, rows=rows):
                        got_window, got = conv(state, x[:, :rows], weight)
                        return {"out": (got, want[:, :rows]), "window": (got_window, want_window[:, : taps - 1 + rows])}

                    run_case(name, compare, {"shape": [batch, channels, taps], "rows": rows, "input": kind},
                              f"(B, C, K)={(batch, channels, taps)} rows={rows} input={kind}", differing, failures, cases)
    result = _variants_result(backend, differing, failures, negative, cases)
    if kernel is None:
        _conv_serving[backend] = result.variant
    return result


# ===========================================================================
# RMSNorm with a residual add before it or a gate after it

# `add_rms_norm(x, residual, weight, eps)`: the decoder layer's `h = x + r` and its
# post-attention norm `mx.fast.rms_norm(h, weight, eps)` (mlx-vlm 0.7.2
# qwen3_5/language.py, Qwen3_5DecoderLayer.__call__; nn.RMSNorm) in one launch instead of
# two, both outputs bit for bit. The add is MLX's Add functor on __half (one rounding, as
# the binary kernel does it).
# `gated_rms_norm(x, weight, eps, gate)`: the GatedDeltaNet's output norm,
# Qwen3_5RMSNormGated.__call__ with a gate: `mx.fast.rms_norm(x, weight, eps)`, then the
# compiled `_precise_swiglu`, gate and norm in fp32, `fp16(silu(gate) * norm)` with
# silu(g) = g * sigmoid(g) through MLX's Sigmoid and Multiply functors (one fused kernel on
# CUDA, no product there followed by an add), in one launch instead of two.
# The norm copies MLX's rms_norm_small (backend/cuda/rms_norm.cu:53-125, its launch from
# :525-536 and :584-616): one block of BLOCK threads per row, thread i loading the
# 8-element vectors BLOCK * c + i, c < CHUNKS, with MLX's own load_vector (zeros past the
# row: the same values aligned or not), its square sum in fp32 over them in that order,
# BlockBroadcastReduce's sum (each warp's cg::reduce, the warps' sums through shared
# memory, one more cg::reduce), rsqrt of sum / D + eps, then each output
# `w * half(float(x) * that)`. The square of an fp16 value is exact in fp32, so whether a
# compiler fuses it into the running sum (MLX's build does: FFMA) cannot change a bit.
# MLX picks rms_norm_small for rows of up to 8192 fp16 (N_READS * 128 * 8); longer rows
# take its rms_norm (:128-170), 1024 threads each loading vectors r * 1024 + i in turn with
# the same sums: this kernel at BLOCK 1024 and CHUNKS ceil(D / (1024 * N_READS)).
# fp32 rows (the real file's residual stream and norm weights): the same kernels on float,
# N_READS 4, so the 27B's 5120 features take MLX's rms_norm (rows above 4096 floats). An
# fp32 square is rounded, so whether MLX's build fused it into the sum matters there: two
# variants, "fma" (fused, as the fp16 kernel's exact squares are) and "mul_add" (rounded
# apart), under their own self-tests and verdicts (add_norm32, gated_norm32).

# (D,): blocks 64 and 128, 1 to 5 chunks, rows that end inside a vector (1003; odd rows then
# start unaligned, where load_vector reads element by element), MLX's long-row kernel (9000)
NORM_WIDTHS_SMALL = ((512,), (1003,), (2560,), (4096,), (9000,))
# fp32: 4-wide vectors, long rows from 4097 (the 27B's 5120, and one ending inside a vector)
NORM32_WIDTHS_SMALL = ((512,), (1003,), (4096,), (5120,), (6001,))
GATED_NORM_SHAPES_SMALL = ((4, 128), (3, 64), (2, 100))  # (heads, D): rows of heads at each position
NORM_VARIANTS = ("fused",)
NORM32_VARIANTS = ("fma", "mul_add")
_SQUARE_FUSED = {"fused": 1, "fma": 1, "mul_add": 0}  # the kernel's FMA template argument
NORM_LONG_THREADS = 1024  # rms_norm's BLOCK_DIM (rms_norm.cu:617)
# Vectors a thread holds at 1024 threads (rows up to 1024 * N_READS * 2: fp16 16384, fp32
# 8192): a block of 1024 has 64 registers a thread, which the fp16 gated norm passes at 3
# (nvcc 13.0, sm_90a: 72) and the launch would fail. rms_norm_small's blocks take 8.
NORM_LONG_MAX_CHUNKS = 2


def stock_add_rms_norm(x, residual, weight, eps: float):
    """(x + residual, rms_norm of it) as decode's two calls compute them."""
    h = x + residual
    return h, mx.fast.rms_norm(h, weight, eps)


def stock_gated_rms_norm(x, weight, eps: float, gate):
    """Qwen3_5RMSNormGated's output with a gate, as decode's two calls compute it."""
    return qwen3_5_language._precise_swiglu(x, gate, mx.fast.rms_norm(x, weight, eps))


def norm_reads(dtype) -> int:
    """MLX's N_READS for rows of this dtype: 16 bytes a vector (rms_norm.cu:583)."""
    return 16 // dtype.size


def rms_norm_launch(width: int, reads: int = 8) -> tuple:
    """(BLOCK, CHUNKS) of MLX's norm for a row of `width` in vectors of `reads` (fp16 8,
    fp32 4): rms_norm_small's (dispatch_num_chunks and dispatch_chunks, rms_norm.cu:502-536)
    up to reads * 128 * 8, then rms_norm's 1024 threads and its passes over the row."""
    if width > reads * 128 * 8:
        return NORM_LONG_THREADS, -(-width // (NORM_LONG_THREADS * reads))
    vectors = -(-width // reads)
    if width <= reads * 64:
        return 64, 1
    if vectors % 128 == 0 and vectors // 128 <= 8:
        return 128, vectors // 128
    if vectors % 64 == 0 and vectors // 64 <= 8:
        return 64, vectors // 64
    return 128, min(-(-vectors // 128), 8)


_NORM_CUDA_HEADER = r"""
#include <cooperative_groups/reduce.h>
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"

namespace dflash2_norm {

namespace cg = cooperative_groups;
using mlx::core::cu::AlignedVector;
using mlx::core::cu::load_vector;
using mlx::core::cu::store_vector;
template <typename T>
constexpr int kReads = 16 / sizeof(T);  // N_READS: 8 for __half, 4 for float

// One square into the running sum: FMA 1 fused (one rounding), 0 rounded apart.
template <int FMA>
__device__ __forceinline__ float add_square(float sum, float t) {
  return FMA ? __fmaf_rn(t, t, sum) : __fadd_rn(sum, __fmul_rn(t, t));
}

// rms_norm_small's (or rms_norm's) factor for the row whose thread-owned vectors are xn.
template <int BLOCK, int CHUNKS, int FMA, typename T>
__device__ float inverse_rms(const AlignedVector<T, kReads<T>> (&xn)[CHUNKS], const float* eps, uint32_t axis) {
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  __shared__ float temp[BLOCK / 32 > 1 ? BLOCK / 32 : 1];
  float normalizer = 0.0f;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
#pragma unroll
    for (int j = 0; j < kReads<T>; ++j) {
      normalizer = add_square<FMA>(normalizer, static_cast<float>(xn[c][j]));
    }
  }
  normalizer = cg::reduce(warp, normalizer, cg::plus<float>{});
  if constexpr (BLOCK > 32) {
    if (warp.thread_rank() == 0) {
      temp[warp.meta_group_rank()] = normalizer;
    }
    block.sync();
    normalizer = warp.thread_rank() < warp.meta_group_size() ? temp[warp.thread_rank()] : 0.0f;
    normalizer = cg::reduce(warp, normalizer, cg::plus<float>{});
  }
  return rsqrt(normalizer / axis + eps[0]);
}

// One norm output as rms_norm_small writes it.
template <typename T>
__device__ __forceinline__ T normed(T x, float normalizer, T w) {
  const float y = static_cast<float>(x) * normalizer;
  return w * static_cast<T>(y);
}

template <int BLOCK, int CHUNKS, int FMA, typename T>
__device__ void add_rms_norm(const T* x, const T* r, const T* w, const float* eps, T* h, T* out, uint32_t axis) {
  constexpr int N = kReads<T>;
  const int64_t row = blockIdx.x;
  x += row * axis;
  r += row * axis;
  h += row * axis;
  out += row * axis;
  AlignedVector<T, N> hn[CHUNKS];
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int offset = BLOCK * c + threadIdx.x;
    const auto xn = load_vector<N>(x, offset, axis, static_cast<T>(0.0f));
    const auto rn = load_vector<N>(r, offset, axis, static_cast<T>(0.0f));
#pragma unroll
    for (int j = 0; j < N; ++j) {
      hn[c][j] = mlx::core::cu::Add{}(xn[j], rn[j]);
    }
    store_vector<N>(h, offset, hn[c], axis);
  }
  const float normalizer = inverse_rms<BLOCK, CHUNKS, FMA>(hn, eps, axis);
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int offset = BLOCK * c + threadIdx.x;
    const auto wn = load_vector<N>(w, offset, axis, static_cast<T>(0.0f));
#pragma unroll
    for (int j = 0; j < N; ++j) {
      hn[c][j] = normed(hn[c][j], normalizer, wn[j]);
    }
    store_vector<N>(out, offset, hn[c], axis);
  }
}

template <int BLOCK, int CHUNKS, int FMA, typename T>
__device__ void gated_rms_norm(const T* x, const T* w, const float* eps, const T* gate, T* out, uint32_t axis) {
  constexpr int N = kReads<T>;
  const int64_t row = blockIdx.x;
  x += row * axis;
  gate += row * axis;
  out += row * axis;
  AlignedVector<T, N> xn[CHUNKS];
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    xn[c] = load_vector<N>(x, BLOCK * c + threadIdx.x, axis, static_cast<T>(0.0f));
  }
  const float normalizer = inverse_rms<BLOCK, CHUNKS, FMA>(xn, eps, axis);
  mlx::core::cu::Multiply multiply;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int offset = BLOCK * c + threadIdx.x;
    const auto wn = load_vector<N>(w, offset, axis, static_cast<T>(0.0f));
    const auto gn = load_vector<N>(gate, offset, axis, static_cast<T>(0.0f));
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float g = static_cast<float>(gn[j]);
      const float silu = multiply(g, mlx::core::cu::Sigmoid{}(g));
      xn[c][j] = static_cast<T>(multiply(silu, static_cast<float>(normed(xn[c][j], normalizer, wn[j]))));
    }
    store_vector<N>(out, offset, xn[c], axis);
  }
}

}  // namespace dflash2_norm
"""
_ADD_NORM_SOURCE = "dflash2_norm::add_rms_norm<BLOCK, CHUNKS, FMA>(x, r, w, eps, h, out, x_shape[x_ndim - 1]);"
_GATED_NORM_SOURCE = "dflash2_norm::gated_rms_norm<BLOCK, CHUNKS, FMA>(x, w, eps, gate, out, x_shape[x_ndim - 1]);"


@cache
def _add_norm_kernel():
    return BakedCudaKernel(
        name="dflash2_add_rms_norm",
        input_names=["x", "r", "w", "eps"],
        output_names=["h", "out"],
        source=_ADD_NORM_SOURCE,
        header=cuda_header(_NORM_CUDA_HEADER),
    )


@cache
def _gated_norm_kernel():
    return BakedCudaKernel(
        name="dflash2_gated_rms_norm",
        input_names=["x", "w", "eps", "gate"],
        output_names=["out"],
        source=_GATED_NORM_SOURCE,
        header=cuda_header(_NORM_CUDA_HEADER),
    )


@cache
def _eps_array(eps: float) -> mx.array:
    value = mx.array([eps], mx.float32)  # a Python float rounded to fp32, as rms_norm's eps_
    mx.eval(value)
    return value


def _norm_launch(x, variant: str) -> dict:
    block, chunks = rms_norm_launch(x.shape[-1], norm_reads(x.dtype))
    return dict(template=[("BLOCK", block), ("CHUNKS", chunks), ("FMA", _SQUARE_FUSED[variant])],
                grid=(x.size // x.shape[-1] * block, 1, 1), threadgroup=(block, 1, 1))


def cuda_add_rms_norm(x, residual, weight, eps: float, variant: str = "fused"):
    """(h, norm) through the CUDA kernel in one of NORM32_VARIANTS (fp16 rows: "fused"), in
    x's dtype; no self-test gate."""
    return tuple(_add_norm_kernel()(
        inputs=[x, residual, weight, _eps_array(eps)], **_norm_launch(x, variant),
        output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype],
    ))


def cuda_gated_rms_norm(x, weight, eps: float, gate, variant: str = "fused"):
    """The gated norm through the CUDA kernel, variants as cuda_add_rms_norm's; no self-test gate."""
    return _gated_norm_kernel()(
        inputs=[x, weight, _eps_array(eps), gate], **_norm_launch(x, variant),
        output_shapes=[x.shape], output_dtypes=[x.dtype],
    )[0]


# backend -> the variant its self-test verified, or None (fp16 rows, fp32 rows).
_add_norm_serving: dict = {}
_add_norm32_serving: dict = {}
_gated_norm_serving: dict = {}
_gated_norm32_serving: dict = {}


def norm_kernel_supports(x, weight, *same) -> bool:
    """Whether the norm kernels take x (the residual or the gate beside it: `same`): all
    fp16 or all fp32, rows of up to 1024 threads' NORM_LONG_MAX_CHUNKS vectors."""
    return (x.ndim >= 1 and x.size > 0 and x.dtype in (mx.float16, mx.float32)
            and 0 < x.shape[-1] <= NORM_LONG_THREADS * norm_reads(x.dtype) * NORM_LONG_MAX_CHUNKS
            and weight.shape == (x.shape[-1],) and all(other.shape == x.shape for other in same)
            and all(a.dtype == x.dtype for a in (weight, *same)))


def add_rms_norm(x, residual, weight, eps: float, variant=None):
    """(x + residual, mx.fast.rms_norm(x + residual, weight, eps)), each bit for bit as
    decode's own Add and rms_norm compute it, in one launch where the kernel serves.
    variant: one of NORM32_VARIANTS (fp16: "fused") forces the kernel (no gate); default:
    as the self-test of the rows' dtype decided."""
    if variant is None:  # the inputs first: a call the kernel never takes (an fp16 embedding
        # row beside an fp32 residual, in layer 0 of an fp32 pack) tests nothing
        variant = norm_kernel_supports(x, weight, residual) and (
            cuda_serving_variant(_add_norm32_serving, self_test_add_norm32) if x.dtype == mx.float32
            else cuda_serving_variant(_add_norm_serving, self_test_add_norm))
        if not variant:
            return stock_add_rms_norm(x, residual, weight, eps)
    return cuda_add_rms_norm(x, residual, weight, eps, variant=variant)


def gated_rms_norm(x, weight, eps: float, gate, variant=None):
    """Qwen3_5RMSNormGated's output for x and its gate, bit for bit as decode's rms_norm and
    compiled swiglu compute it, in one launch where the kernel serves. variant: as
    add_rms_norm's."""
    if variant is None:  # the inputs first: a call the kernel never takes tests nothing
        variant = norm_kernel_supports(x, weight, gate) and (
            cuda_serving_variant(_gated_norm32_serving, self_test_gated_norm32) if x.dtype == mx.float32
            else cuda_serving_variant(_gated_norm_serving, self_test_gated_norm))
        if not variant:
            return stock_gated_rms_norm(x, weight, eps, gate)
    return cuda_gated_rms_norm(x, weight, eps, gate, variant=variant)


def _norm_weight(width: int, key, dtype) -> mx.array:
    return (1 + 0.25 * mx.random.normal((width,), key=key)).astype(dtype)


def self_test_add_norm(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """Check the residual add and norm bit for bit against decode's Add and
    mx.fast.rms_norm, at 1..8 positions (the first two of them also as 2 batch rows).
    kernel: (x, residual, weight, eps) -> (h, norm), tested as variant "kernel"; default:
    the CUDA kernel ("fused"), serving then switched on or off. shapes: (D,) widths."""
    # No control: MLX's norm of many rows is its norm of each (one block a row), which is
    # what lets verify batch it.
    return _self_test_add_norm_rows(mx.float16, NORM_VARIANTS, _add_norm_serving, shapes, seed, kernel)


def self_test_add_norm32(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """self_test_add_norm on fp32 rows and weights (the real file's), every fp32 input kind:
    each of NORM32_VARIANTS, fp32 rows' serving then switched to the first that passed; the
    other is its control."""
    return _self_test_add_norm_rows(mx.float32, NORM32_VARIANTS, _add_norm32_serving, shapes, seed, kernel)


def _self_test_add_norm_rows(dtype, variant_names, serving: dict, shapes, seed, kernel) -> SelfTestResult:
    fp32, make = dtype == mx.float32, make_inputs_for(dtype)

    def make_case(kind, rows, shape, key):
        k_x, k_r, k_w = mx.random.split(key, 3)
        (width,) = shape
        batch = 2 if rows == 2 else 1  # (2, 1, D): rows of a batch, as the servers' batches make
        x, residual = (make(kind, rows, width, k).reshape(batch, rows // batch, width) for k in (k_x, k_r))
        return (x, residual, _norm_weight(width, k_w, dtype), 1e-6), f"D={width} (B, L)={x.shape[:2]}" + " fp32" * fp32

    def parts(function):
        return lambda *arguments: dict(zip(("h", "norm"), function(*arguments)))

    variants = {name: parts(partial(cuda_add_rms_norm, variant=name)) for name in variant_names}
    return _self_test_cases(kernel and parts(kernel), variants, serving,
                            [tuple(s) for s in (shapes or (NORM32_WIDTHS_SMALL if fp32 else NORM_WIDTHS_SMALL))],
                            seed, make_case, parts(stock_add_rms_norm), failed_are_controls=fp32,
                            kinds=input_kinds_for(dtype))


def self_test_gated_norm(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """Check the gated norm bit for bit against decode's rms_norm and compiled swiglu, at
    1..8 positions of every head. kernel: (x, weight, eps, gate) -> out, tested as variant
    "kernel"; default: the CUDA kernel ("fused"), serving then switched on or off.
    shapes: (heads, D)."""
    return _self_test_gated_norm_rows(mx.float16, NORM_VARIANTS, _gated_norm_serving, shapes, seed, kernel)


def self_test_gated_norm32(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """self_test_gated_norm on fp32 rows, gates and weights (the real file's), as
    self_test_add_norm32 does the residual norm's."""
    return _self_test_gated_norm_rows(mx.float32, NORM32_VARIANTS, _gated_norm32_serving, shapes, seed, kernel)


def _self_test_gated_norm_rows(dtype, variant_names, serving: dict, shapes, seed, kernel) -> SelfTestResult:
    fp32, make = dtype == mx.float32, make_inputs_for(dtype)

    def make_case(kind, rows, shape, key):
        k_x, k_g, k_w = mx.random.split(key, 3)
        heads, width = shape
        x, gate = (make(kind, rows * heads, width, k).reshape(1, rows, heads, width) for k in (k_x, k_g))
        return (x, _norm_weight(width, k_w, dtype), 1e-6, gate), f"(heads, D)={shape} L={rows}" + " fp32" * fp32

    def parts(function):
        return lambda *arguments: {"out": function(*arguments)}

    variants = {name: parts(partial(cuda_gated_rms_norm, variant=name)) for name in variant_names}
    return _self_test_cases(kernel and parts(kernel), variants, serving,
                            [tuple(s) for s in (shapes or GATED_NORM_SHAPES_SMALL)], seed, make_case,
                            parts(stock_gated_rms_norm), failed_are_controls=fp32,
                            kinds=input_kinds_for(dtype))


# ===========================================================================
# GatedDeltaNet gates

# `gdn_gates(A_log, a, b, dt_bias)`: mlx-vlm's `_compute_g_beta` (qwen3_5/gated_delta.py),
# g = exp(-exp(A_log) * softplus(a + dt_bias)) in fp32 and beta = sigmoid(b) in fp16, in one
# launch where decode runs two. g is mx.compile's fused kernel, whose generated code
# (backend/cuda/compiled.cpp:145-182) is MLX's functors in the graph's dtypes:
# Exp, Negative on fp32; Add, LogAddExp (with a constant fp16 0) on __half; the cast to fp32;
# Multiply, Exp on fp32. This kernel calls the same functors in the same order. beta is
# MLX's unary Sigmoid kernel on __half, built with MLX itself rather than by NVRTC, so two
# variants: "half" runs the functor on __half as that kernel does, "float" in fp32 with one
# rounding. The self-test decides which serves. fp32 rows (the real file's: a, b and dt_bias
# fp32): the same functors on float, where both variants are one ("float"), under their own
# self-test and verdict.

GATE_SHAPES_SMALL = ((4,), (48,), (7,))  # (Hv,): value heads
GATE_VARIANTS = ("half", "float")
GATE32_VARIANTS = ("float",)

_GATES_CUDA_HEADER = r"""
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"
""" + CUDA_ELEMENT_TYPE
# One thread per (b, l, h); a and b are read in place through their strides (the gate
# projections hand over slices of one output).
_GATES_SOURCE = """
  const int H = a_shape[2], L = a_shape[1];
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(a_shape[0]) * L * H) {
    return;
  }
  const int h = i % H;
  const int l = (i / H) % L;
  const int64_t n = i / (int64_t(H) * L);
  using T = dflash2_types::Element<decltype(beta)>::type;  // the rows' dtype: __half or float
  const T a_value = a[n * a_strides[0] + l * a_strides[1] + h * a_strides[2]];
  const T b_value = b[n * b_strides[0] + l * b_strides[1] + h * b_strides[2]];
  const float decay = Negative{}(Exp{}(A_log[h * A_log_strides[0]]));
  const T softplus = LogAddExp{}(Add{}(a_value, dt_bias[h * dt_bias_strides[0]]), static_cast<T>(0));
  g[i] = Exp{}(Multiply{}(decay, static_cast<float>(softplus)));
  beta[i] = HALF ? Sigmoid{}(b_value) : static_cast<T>(Sigmoid{}(static_cast<float>(b_value)));
"""
GATES_THREADS = 256


@cache
def _gates_kernel():
    return BakedCudaKernel(
        name="dflash2_gdn_gates",
        input_names=["A_log", "a", "b", "dt_bias"],
        output_names=["g", "beta"],
        source=_GATES_SOURCE,
        header=cuda_header(_GATES_CUDA_HEADER),
        ensure_row_contiguous=False,
    )


def cuda_gdn_gates(A_log, a, b, dt_bias, variant: str):
    """(g, beta) through the CUDA kernel in one of GATE_VARIANTS (beta in a's dtype); no
    self-test gate."""
    total = a.size
    return tuple(_gates_kernel()(
        inputs=[A_log, a, b, dt_bias],
        template=[("HALF", variant == "half")],
        grid=(-(-total // GATES_THREADS) * GATES_THREADS, 1, 1),
        threadgroup=(GATES_THREADS, 1, 1),
        output_shapes=[a.shape, a.shape],
        output_dtypes=[mx.float32, a.dtype],
    ))


# backend -> the variant its self-test verified, or None (fp16 rows, fp32 rows).
_gates_serving: dict = {}
_gates32_serving: dict = {}


def gates_kernel_supports(A_log, a, b, dt_bias) -> bool:
    return (a.ndim == 3 and a.shape == b.shape and a.size > 0
            and A_log.shape == dt_bias.shape == (a.shape[2],)
            and A_log.dtype == mx.float32 and a.dtype == b.dtype == dt_bias.dtype
            and a.dtype in (mx.float16, mx.float32))


def gdn_gates(A_log, a, b, dt_bias, variant=None):
    """`_compute_g_beta(A_log, a, b, dt_bias)` bit for bit, in one launch where the kernel
    serves. variant: one of GATE_VARIANTS forces the kernel (no gate); default: the
    self-test's for fp16 rows, or fp32 rows' own."""
    if variant is None:  # the inputs first: a call the kernel never takes tests nothing
        variant = gates_kernel_supports(A_log, a, b, dt_bias) and (
            cuda_serving_variant(_gates32_serving, self_test_gates32) if a.dtype == mx.float32
            else cuda_serving_variant(_gates_serving, self_test_gates))
        if not variant:
            return _compute_g_beta(A_log, a, b, dt_bias)
    return cuda_gdn_gates(A_log, a, b, dt_bias, variant)


def make_gates_case(kind: str, rows: int, heads: int, key, dtype=mx.float16):
    """(A_log, a, b, dt_bias) as the model hands them over: a and b slices of one
    (1, rows, 2 * heads) fp16 (or fp32) output of `kind`, A_log fp32 and dt_bias of that
    dtype per head."""
    k_x, k_A, k_dt = mx.random.split(key, 3)
    gates = make_inputs_for(dtype)(kind, rows, 2 * heads, k_x).reshape(1, rows, 2 * heads)
    A_log = mx.log(mx.random.uniform(0.5, 16.0, (heads,), key=k_A))
    dt_bias = (1.0 + 0.1 * mx.random.normal((heads,), key=k_dt)).astype(dtype)
    return A_log, gates[..., heads:], gates[..., :heads], dt_bias


def self_test_gates(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """Check the gates bit for bit against `_compute_g_beta`, at 1..8 positions, every input
    kind. kernel: (A_log, a, b, dt_bias) -> (g, beta), tested as variant "kernel"; default:
    each of GATE_VARIANTS, serving then switched to the first that passed (None: the stock
    calls). shapes: (Hv,). The variants that did not pass are the controls of the one that did."""
    return _self_test_gate_rows(mx.float16, GATE_VARIANTS, _gates_serving, shapes, seed, kernel)


def self_test_gates32(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """self_test_gates on fp32 rows (the real file's), every fp32 input kind, GATE32_VARIANTS,
    fp32 rows' serving then switched on or off."""
    return _self_test_gate_rows(mx.float32, GATE32_VARIANTS, _gates32_serving, shapes, seed, kernel)


def _self_test_gate_rows(dtype, variant_names, serving: dict, shapes, seed, kernel) -> SelfTestResult:
    fp32 = dtype == mx.float32

    def make_case(kind, rows, shape, key):
        return make_gates_case(kind, rows, shape[0], key, dtype), f"Hv={shape[0]} L={rows}" + " fp32" * fp32

    def parts(function):
        return lambda *arguments: dict(zip(("g", "beta"), function(*arguments)))

    variants = {name: parts(partial(cuda_gdn_gates, variant=name)) for name in variant_names}
    return _self_test_cases(kernel and parts(kernel), variants, serving,
                            [tuple(s) for s in (shapes or GATE_SHAPES_SMALL)], seed, make_case,
                            parts(_compute_g_beta), failed_are_controls=True,
                            kinds=input_kinds_for(dtype))
