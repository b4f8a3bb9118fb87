"""Decode attention at L queries: stock reference, CUDA stages, dispatch, self-test (Metal's
multi-query calls: dflash2_kernel_attention_metal).

- `decode_attention_rows(queries, keys, values, scale, first_length)`: L verify
  queries, query j seeing first_length + j keys, each decode's single-query
  `mx.fast.scaled_dot_product_attention`. cuda, where decode runs MLX's unfused
  fallback (fp16 or fp32, head dim > 128): gemv scores, MLX's softmax, decode's own p @ v
  call, fp32 rows under their own self-test. metal, where decode runs sdpa_vector (GQA 6
  to 16): MLX's multi-query sdpa_vector, split where decode's routing would change. Gated
  per (B, Hq, Hkv, D) and dtype, and per softmax block dim (cuda) or routing regime (metal).
"""

import warnings
from functools import cache, partial

import mlx.core as mx
import numpy as np
from mlx_vlm.models.cache import KVCache

from dflash2_kernel_attention_metal import metal_attention_rows, metal_attention_supports, metal_sdpa_regime
from dflash2_kernel_base import (
    CUDA_ELEMENT_TYPE, BakedCudaKernel, SelfTestResult, _differing, _first_difference, _no_kernel_result,
    backend_name, cuda_header, gemv_elements_per_lane,
)

# ===========================================================================
# Decode attention

# `decode_attention_rows(queries, keys, values, scale, first_length)`: query j of
# queries (B, Hq, L, D) sees keys[..., :first_length + j]. Decode (mlx-vlm 0.7.2,
# models/base.py:418) calls `mx.fast.scaled_dot_product_attention` with one query,
# the KV cache's views up to its position and mask=None. At head dim 256 MLX 0.32.2's
# CUDA backend has no fused kernel for that (cuDNN takes D <= 128,
# cuda/scaled_dot_product_attention.cpp:343-346; sdpa_vector D in {64, 96, 128},
# scaled_dot_product_attention.cu:676-682), so decode runs the unfused fallback
# (mlx/fast.cpp:718-790, called at :869), which with GQA (n_rep = Hq / Hkv) is:
#   q = multiply(array(scale, fp16), q)            :725  fp16 multiply, element-wise
#   q: (B, Hkv, n_rep, 1, D); k, v: (B, Hkv, 1, T, D)  :730-732
#   scores = matmul(q, swapaxes(k))                :734  M = 1, k transposed: gemv
#   scores = softmax(scores, -1, precise=True)     :777  fp16 in/out, fp32 inside
#   out = matmul(scores, v)                        :785  M = 1, v not transposed: cuBLASLt
#   out = flatten(out, 1, 2)                       :787  (B, Hq, 1, D)
# Here each step takes all L queries at once, each query's arithmetic as decode's:
# 1. the scale multiply, fused into step 2: fp16 x fp16 rounded to nearest, as
#    MLX's Multiply on __half (device/binary_ops.cuh:194-199) rounds it;
# 2. scores: one warp per (batch, kv head, key t), for every query head of the group
#    and every query j that sees key t, with gemv_impl's arithmetic
#    (gemms/gemv.cu:55-84, batched over (B*Hkv, n_rep) by matmul.cpp:98-111 and
#    gemv.cu:92-116; the keys are read in place, no copy): lane l sums
#    float(k) * float(q) over columns NPT*l + 32*NPT*r (+0..NPT-1) in that order
#    from +0, then cg::reduce, then a round-to-nearest fp16 store. NPT is the n_per_thread gemv picks at
#    gemv.cu:242-249 (the cache and q buffers start at offset 0, so aligned): 4 when
#    D % 128 == 0, 2 when D % 64 == 0, else 1. Products of two fp16 are exact in
#    fp32, so FMA contraction cannot change a bit; only the order counts;
# 3. softmax: cu::softmax<__half, float, BLOCK_DIM, 8> (softmax.cu:30-104) copied
#    with each row's own axis size T_j and MLX's block dim for it
#    (softmax.cu:145-147, kernel_utils.cuh:48-62: 32..1024 by ceil(T_j / 8)); one
#    launch per block-dim bucket (one unless the queries straddle T = 256 * 2^k),
#    each query's probabilities written to its own fresh contiguous array of
#    decode's shape (B, Hkv, n_rep, 1, T_j);
# 4. p @ v: decode's own call per query, `mx.matmul(p_j, expand_dims(v[:T_j], 2))`,
#    on the same shapes and strides, so MLX builds the identical cuBLASLt call
#    (matmul.cpp:115-138; cublas_gemm.cpp:146-158 sends it to the pointer-array
#    batched run of cublas_gemm_batched_12_9.cu:150-229 over (B*Hkv, n_rep), whose
#    descriptors hold n_rep's strides (T_j and 0) but not the cache's capacity,
#    which only moves the pointers). Without GQA (n_rep = 1) the call is a strided
#    batch whose descriptor holds the value buffer's head stride, capacity * D; a
#    verify buffer may have another capacity than decode's (cache.py:509-531), so
#    there the self-test (whose cases include such capacities) decides;
# 5. the L outputs gathered by one copy kernel into (B, L, Hq, D) (instead of a
#    concatenate's L copies), returned as the (B, Hq, L, D) transpose, so the
#    model's `transpose(0, 2, 1, 3).reshape(B, L, -1)` (qwen3_5/language.py:928)
#    of it is a view.
# fp32 rows (the real file's) take the same fallback (fast.cpp's is dtype-blind; cuDNN
# takes fp16 and bf16 only, sdpa_vector D <= 128) and so the same stages on float: the
# scale multiply rounded in fp32, softmax<float, float, BLOCK_DIM, 4> (N_READS 16 / 4, so
# other block dims by key length), and gemv's `sum += k * q`, no longer of exact products,
# so whether MLX's build contracted it matters: variants "fma" and "mul_add" (the fp16
# kernel's exact products make it "fma" there, the same bits), under their own self-test
# and verdicts (attention32).
# Where decode does not run that fallback (D <= 128, other dtypes, or B*Hkv == 1
# with n_rep > 1, where matmul.cpp:86-96 folds the heads into M and leaves gemv),
# or Metal's multi-query call cannot keep decode's routing (metal_attention_supports),
# for more than MAX_QUERIES queries, and on CPU, each query is the stock single-query call.

SOFTMAX_READS = 8  # N_READS = 16 / sizeof(__half) (softmax.cu:144); fp32 rows: 4
ATTENTION32_VARIANTS = ("fma", "mul_add")
ATTENTION_PACK_SHAPE = (1, 24, 4, 256)  # (B, Hq, Hkv, D) of the 27B's full-attention layers
# Tiny shapes: D 192 (NPT 2, B 2), 136 (NPT 1, lanes past D idle), one head per
# group (no GQA reshape), and the tiny pack's 2/1/64, which decode runs fused
# (sdpa_vector) and this module per query.
ATTENTION_TINY_SHAPES = ((2, 4, 2, 192), (1, 6, 3, 136), (1, 2, 2, 256), (1, 2, 1, 64))
# Key lengths of query 0: past the cache's 256 growth steps (mlx_vlm cache.py:501-531)
# and across every softmax block dim's edge (T = 256, 512, 1024, 2048, 4096): each block
# dim is its own compiled kernel, served only at block dims its self-test covered.
PACK_FIRST_LENGTHS = (1, 7) + tuple(range(250, 263)) + (508, 1020, 1030, 2044, 4092)
TINY_FIRST_LENGTHS = (1, 7, 250, 255, 256, 257, 262)
MAX_QUERIES = 8  # queries one kernel call takes (its softmax has this many output slots)
QUERY_SLOTS = MAX_QUERIES
ATTENTION_INPUT_KINDS = ("normal", "wide")  # wide: keys x16, scores spread over ~+-50 (exp underflows)


# ---------------------------------------------------------------------------
# attention: stock reference


def stock_attention_rows(queries, keys, values, scale, first_length):
    """One stock single-query call per query: exactly what decode does."""
    outputs = [
        mx.fast.scaled_dot_product_attention(
            queries[:, :, j : j + 1],
            keys[:, :, : first_length + j],
            values[:, :, : first_length + j],
            scale=scale,
            mask=None,
        )
        for j in range(queries.shape[2])
    ]
    return mx.concatenate(outputs, axis=2)


def attention_kernel_supports(batch, q_heads, kv_heads, head_dim, dtype) -> bool:
    """Whether decode runs the gemv + softmax + cuBLASLt fallback the kernels copy."""
    return (
        dtype in (mx.float16, mx.float32)
        and head_dim > 128  # neither cuDNN nor sdpa_vector takes it
        and q_heads % kv_heads == 0
        and not (batch * kv_heads == 1 and q_heads > kv_heads)  # q.k leaves gemv there
    )


def softmax_reads(dtype) -> int:
    """MLX softmax's N_READS for rows of this dtype: 16 bytes a thread a pass (softmax.cu:144)."""
    return 16 // dtype.size


def softmax_block_dim(axis_size: int, reads: int = SOFTMAX_READS) -> int:
    """dispatch_block_dim(ceil(axis_size / N_READS)) (kernel_utils.cuh:48-62)."""
    threads = -(-axis_size // reads)
    for block_dim in (32, 64, 128, 256, 512):
        if threads <= block_dim:
            return block_dim
    return 1024


# ---------------------------------------------------------------------------
# attention: CUDA (Metal: MLX's own multi-query call, below)

# MIT License, Copyright (c) 2025 Apple Inc. (arithmetic of gemv_impl,
# mlx/backend/cuda/gemms/gemv.cu, and cu::softmax, mlx/backend/cuda/softmax.cu,
# MLX 0.32.2). See NOTICE.txt.
_ATTENTION_CUDA_HEADER = CUDA_ELEMENT_TYPE + r"""
#include <cooperative_groups/reduce.h>

namespace mlx::core::cu {
namespace dflash2_attention {

namespace cg = cooperative_groups;

// fast.cpp's multiply(array(scale, q.dtype), q): one rounding in the rows' dtype.
__device__ __forceinline__ __half scaled(__half s, __half x) { return __hmul(s, x); }
__device__ __forceinline__ float scaled(float s, float x) { return __fmul_rn(s, x); }

// gemv_impl's `sum += a * b`: FMA 1 one rounding (nvcc's contraction), 0 the product
// rounded first. Products of fp16 values are exact in fp32, so there both are one.
template <int FMA>
__device__ __forceinline__ float add_product(float sum, float a, float b) {
  return FMA ? __fmaf_rn(a, b, sum) : __fadd_rn(sum, __fmul_rn(a, b));
}

// Scores of one (batch b, kv head g, key t) for every query head h of the group
// and every query j that sees key t (t < first + j): gemv_impl's sum for each.
// q (B, Hq, L, D) and k (B, Hkv, T, D) strided; scores (B, Hq, L, T) contiguous,
// entries t >= T_j left unwritten. Launch: one warp per (b, g, t).
template <int D, int NPT, int FMA, typename T>
__device__ void query_key_scores(
    const T* q,
    const Shape& q_shape,
    const Strides& q_strides,
    const T* k,
    const Shape& k_shape,
    const Strides& k_strides,
    const T* scale,
    T* scores) {
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<WARP_SIZE>(block);
  const int batch = q_shape[0];
  const int q_heads = q_shape[1];
  const int rows = q_shape[2];
  const int kv_heads = k_shape[1];
  const int keys = k_shape[2];
  const int first = keys - rows + 1;
  const int repeats = q_heads / kv_heads;

  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / WARP_SIZE;
  if (w >= int64_t(batch) * kv_heads * keys) {
    return;
  }
  const int t = w % keys;
  const int g = (w / keys) % kv_heads;
  const int b = w / (int64_t(keys) * kv_heads);
  const int lane = warp.thread_rank();

  // gemv's columns of this lane: NPT * lane + 32 * NPT * c + e, c in order.
  constexpr int kStep = WARP_SIZE * NPT;
  constexpr int kChunks = (D + kStep - 1) / kStep;
  const T* key = k + b * k_strides[0] + g * k_strides[1] + t * k_strides[2];
  T key_lane[kChunks][NPT];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
#pragma unroll
    for (int e = 0; e < NPT; ++e) {
      const int col = c * kStep + NPT * lane + e;
      key_lane[c][e] = col < D ? key[col * k_strides[3]] : static_cast<T>(0.0f);
    }
  }
  const T s = scale[0];

  for (int r = 0; r < repeats; ++r) {
    const int h = g * repeats + r;
    for (int j = t < first ? 0 : t - first + 1; j < rows; ++j) {
      const T* query = q + b * q_strides[0] + h * q_strides[1] + j * q_strides[2];
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if (c * kStep + NPT * lane < D) {
#pragma unroll
          for (int e = 0; e < NPT; ++e) {
            // fast.cpp's multiply(scale, q), then gemv's fp32 product and sum.
            const T qs = scaled(s, query[(c * kStep + NPT * lane + e) * q_strides[3]]);
            sum = add_product<FMA>(sum, static_cast<float>(key_lane[c][e]), static_cast<float>(qs));
          }
        }
      }
      sum = cg::reduce(warp, sum, cg::plus<float>{});
      if (warp.thread_rank() == 0) {
        scores[((int64_t(b) * q_heads + h) * rows + j) * keys + t] = static_cast<T>(sum);
      }
    }
  }
}

// dispatch_block_dim(ceil_div(axis_size, N_READS)) (softmax.cu:145-147, kernel_utils.cuh:48-62).
template <int READS>
__device__ __forceinline__ int softmax_block_dim(int axis_size) {
  const int threads = (axis_size + READS - 1) / READS;
  return threads <= 32 ? 32 : threads <= 64 ? 64 : threads <= 128 ? 128
      : threads <= 256 ? 256 : threads <= 512 ? 512 : 1024;
}

// softmax.cu:23-28, unchanged.
template <typename T>
inline __device__ T softmax_exp(T x) {
  return __expf(x);
}

// cu::softmax (softmax.cu:30-104) with T = __half or float, AccT = float, for the one row
// at `in` / `out` of `axis_size` elements; the body is MLX's, unchanged but for
// the row pointers (MLX: in += grid.block_rank() * axis_size) and spelling
// cuda::ceil_div and cast_to out. Launch: one block of BLOCK_DIM threads per row.
template <typename T, typename AccT, int BLOCK_DIM, int N_READS>
__device__ void softmax_row(const T* in, T* out, int axis_size) {
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<WARP_SIZE>(block);

  cg::greater<AccT> max_op;
  cg::plus<AccT> plus_op;

  // Thread reduce.
  AccT prevmax;
  AccT maxval = Limits<AccT>::finite_min();
  AccT normalizer = AccT(0);
  for (int r = 0; r < (axis_size + BLOCK_DIM * N_READS - 1) / (BLOCK_DIM * N_READS); r++) {
    auto index = r * BLOCK_DIM + block.thread_rank();
    auto vals = load_vector<N_READS>(in, index, axis_size, Limits<T>::min());
    prevmax = maxval;
#pragma unroll
    for (int i = 0; i < N_READS; ++i) {
      maxval = max_op(maxval, static_cast<AccT>(vals[i]));
    }

    // Online normalizer calculation for softmax:
    // https://github.com/NVIDIA/online-softmax
    normalizer = normalizer * softmax_exp(prevmax - maxval);
#pragma unroll
    for (int i = 0; i < N_READS; i++) {
      normalizer =
          normalizer + softmax_exp(static_cast<AccT>(vals[i]) - maxval);
    }
  }

  // First warp reduce.
  prevmax = maxval;
  maxval = cg::reduce(warp, maxval, max_op);
  normalizer = normalizer * softmax_exp(prevmax - maxval);
  normalizer = cg::reduce(warp, normalizer, plus_op);

  __shared__ AccT local_max[WARP_SIZE];
  __shared__ AccT local_normalizer[WARP_SIZE];

  // Write to shared memory and do second warp reduce.
  prevmax = maxval;
  if (warp.thread_rank() == 0) {
    local_max[warp.meta_group_rank()] = maxval;
  }
  block.sync();
  maxval = warp.thread_rank() < warp.meta_group_size()
      ? local_max[warp.thread_rank()]
      : Limits<AccT>::min();
  maxval = cg::reduce(warp, maxval, max_op);
  normalizer = normalizer * softmax_exp(prevmax - maxval);
  if (warp.thread_rank() == 0) {
    local_normalizer[warp.meta_group_rank()] = normalizer;
  }
  block.sync();
  normalizer = warp.thread_rank() < warp.meta_group_size()
      ? local_normalizer[warp.thread_rank()]
      : AccT{};
  normalizer = cg::reduce(warp, normalizer, plus_op);
  normalizer = 1 / normalizer;

  // Write output.
  for (int r = 0; r < (axis_size + BLOCK_DIM * N_READS - 1) / (BLOCK_DIM * N_READS); r++) {
    auto index = r * BLOCK_DIM + block.thread_rank();
    auto vals = load_vector<N_READS>(in, index, axis_size, T(0));
    for (int i = 0; i < N_READS; i++) {
      vals[i] = softmax_exp(static_cast<AccT>(vals[i]) - maxval) * normalizer;
    }
    store_vector<N_READS>(out, index, vals, axis_size);
  }
}

}  // namespace dflash2_attention
}  // namespace mlx::core::cu
"""

_SCORES_SOURCE = (
    "dflash2_attention::query_key_scores<D, NPT, FMA>("
    "q, q_shape, q_strides, k, k_shape, k_strides, scale, scores);"
)


_SOFTMAX_SOURCE = f"""
  // This launch: the queries j whose softmax block dim is BD, from the first such
  // j (start) on, since T_j grows with j; block (j - start) * B * Hq + b * Hq + h
  // writes row b * Hq + h of output p{{j - start}}. Slots past the run stay unused.
  const int heads = scores_shape[0] * scores_shape[1];
  const int rows = scores_shape[2];
  const int keys = scores_shape[3];
  const int first = keys - rows + 1;
  int start = 0;
  while (dflash2_attention::softmax_block_dim<READS>(first + start) != BD) {{
    ++start;
  }}
  const int local = blockIdx.x / heads;
  const int head = blockIdx.x % heads;
  const int j = start + local;
  const int axis_size = first + j;
  using T = dflash2_types::Element<decltype(p0)>::type;
  T* outputs[{QUERY_SLOTS}] = {{{", ".join(f"p{i}" for i in range(QUERY_SLOTS))}}};
  dflash2_attention::softmax_row<T, float, BD, READS>(
      scores + (int64_t(head) * rows + j) * keys,
      outputs[local] + int64_t(head) * axis_size,
      axis_size);
"""

# y (B, L, Hq, D) from the L per-query outputs (B, Hq, 1, D) (scores only gives the sizes).
_GATHER_SOURCE = f"""
  using T = dflash2_types::Element<decltype(y)>::type;
  const T* rows_in[{QUERY_SLOTS}] = {{{", ".join(f"o{i}" for i in range(QUERY_SLOTS))}}};
  const int64_t queries = scores_shape[2];
  const int64_t row = int64_t(scores_shape[1]) * D;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < scores_shape[0] * queries * row) {{
    const int64_t b = i / (queries * row);
    const int j = (i / row) % queries;
    y[i] = rows_in[j][b * row + i % row];
  }}
"""


@cache
def _scores_kernel():
    return BakedCudaKernel(
        name="dflash2_attention_scores",
        input_names=["q", "k", "scale"],
        output_names=["scores"],
        source=_SCORES_SOURCE,
        header=cuda_header(_ATTENTION_CUDA_HEADER),
        ensure_row_contiguous=False,  # keys are views into the cache's buffer
    )


@cache
def _softmax_kernel():
    return BakedCudaKernel(
        name="dflash2_attention_softmax",
        input_names=["scores"],
        output_names=[f"p{i}" for i in range(QUERY_SLOTS)],
        source=_SOFTMAX_SOURCE,
        header=cuda_header(_ATTENTION_CUDA_HEADER),
        ensure_row_contiguous=False,
    )


@cache
def _gather_kernel():
    return BakedCudaKernel(
        name="dflash2_attention_gather",
        input_names=["scores"] + [f"o{i}" for i in range(QUERY_SLOTS)],
        output_names=["y"],
        source=_GATHER_SOURCE,
        header=cuda_header(CUDA_ELEMENT_TYPE),
    )


@cache
def _scale_array(scale: float, dtype) -> mx.array:
    """fast.cpp's array(scale, q.dtype): nanobind's float (a C++ float), then the rows' dtype."""
    value = np.array([scale], dtype=np.float32)
    return mx.array(value.astype(np.float16) if dtype == mx.float16 else value)


def _block_dim_runs(first_length: int, rows: int, reads: int):
    """(first query, end, block dim) for runs of queries sharing a softmax block dim."""
    runs = []
    for j in range(rows):
        block_dim = softmax_block_dim(first_length + j, reads)
        if runs and runs[-1][2] == block_dim:
            runs[-1][1] = j + 1
        else:
            runs.append([j, j + 1, block_dim])
    return runs


def cuda_attention_stages(queries, keys, values, scale, first_length, variant="fma"):
    """(scores, [p_j], [out_j], out) through the CUDA kernels, in the rows' dtype (fp16, or
    fp32 in one of ATTENTION32_VARIANTS); no self-test gate.

    keys, values: (B, Hkv, first_length + L - 1, D) views; scores (B, Hq, L, T) with
    row j valid up to T_j; p_j decode's (B, Hkv, n_rep, 1, T_j) probabilities
    ((B, Hq, 1, T_j) without GQA); out (B, Hq, L, D) as a transposed view."""
    batch, q_heads, rows, head_dim = queries.shape
    kv_heads, keys_total = keys.shape[1], keys.shape[2]
    repeats = q_heads // kv_heads
    dtype, reads = queries.dtype, softmax_reads(queries.dtype)
    scores = _scores_kernel()(
        inputs=[queries, keys, _scale_array(scale, dtype)],
        template=[("D", head_dim), ("NPT", gemv_elements_per_lane(head_dim)), ("FMA", int(variant == "fma"))],
        grid=(32 * batch * kv_heads * keys_total, 1, 1),
        threadgroup=(256, 1, 1),  # 8 warps a block, like gemv
        output_shapes=[(batch, q_heads, rows, keys_total)],
        output_dtypes=[dtype],
    )[0]

    def probability_shape(j):
        length = first_length + j
        if repeats > 1:
            return (batch, kv_heads, repeats, 1, length)
        return (batch, q_heads, 1, length)

    probabilities = []
    for start, end, block_dim in _block_dim_runs(first_length, rows, reads):
        count = end - start
        unused = [(1,)] * (QUERY_SLOTS - count)  # one-element outputs for the slots left over
        probabilities += _softmax_kernel()(
            inputs=[scores],
            template=[("BD", block_dim), ("READS", reads)],
            grid=(count * batch * q_heads * block_dim, 1, 1),
            threadgroup=(block_dim, 1, 1),
            output_shapes=[probability_shape(j) for j in range(start, end)] + unused,
            output_dtypes=[dtype] * QUERY_SLOTS,
        )[:count]

    outputs = []
    for j, p in enumerate(probabilities):
        v = values[:, :, : first_length + j]
        outputs.append(mx.matmul(p, mx.expand_dims(v, 2) if repeats > 1 else v))

    gathered = _gather_kernel()(
        inputs=[scores] + outputs + outputs[:1] * (QUERY_SLOTS - rows),
        template=[("D", head_dim)],
        grid=(batch * rows * q_heads * head_dim, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(batch, rows, q_heads, head_dim)],
        output_dtypes=[dtype],
    )[0]
    return scores, probabilities, outputs, gathered.transpose(0, 2, 1, 3)


def cuda_attention_rows(queries, keys, values, scale, first_length, variant="fma"):
    """The kernels' output (fp32 rows: in the variant their shape's self-test chose)."""
    return cuda_attention_stages(queries, keys, values, scale, first_length, variant)[-1]


# ---------------------------------------------------------------------------
# attention: dispatch

# verified_key(backend, (B, Hq, Hkv, D), dtype) -> the variants the shape's self-test passed
# at (empty where it failed): CUDA's softmax block dims, Metal's routing regimes. A longer
# context needs a variant never tested (on CUDA never compiled either: ~1.5 s of JIT in the
# middle of a request): its queries run the stock calls.
_attention_verified: dict = {}
# verified_key(backend, shape, float32) -> the variant (ATTENTION32_VARIANTS) fp32 rows of that
# shape take, or None: one shape's test (a new batch size's, say) never changes another's.
_attention32_serving: dict = {}


def verified_key(backend: str, shape: tuple, dtype) -> tuple:
    """_attention_verified's key: (backend, shape) for fp16 rows, fp32 rows' their own."""
    return (backend, shape, "float32") if dtype == mx.float32 else (backend, shape)


def attention_path(backend: str):
    """(supports(B, Hq, Hkv, D, dtype), the multi-query rows, variant(shape, key length,
    dtype): what must have passed the self-test) of this backend's attention path; None
    where each query is the stock call."""
    if backend == "cuda":
        return (attention_kernel_supports, cuda_attention_rows,
                lambda shape, keys, dtype: softmax_block_dim(keys, softmax_reads(dtype)))
    if backend == "metal":
        return metal_attention_supports, metal_attention_rows, lambda shape, keys, dtype: metal_sdpa_regime(shape, keys)
    return None


def _check_attention_arguments(queries, keys, values, first_length):
    if queries.ndim != 4 or keys.ndim != 4 or values.ndim != 4:
        raise ValueError(
            f"queries, keys, values must be 4-D, got {queries.shape}, {keys.shape}, {values.shape}"
        )
    batch, q_heads, rows, head_dim = queries.shape
    needed = first_length + rows - 1
    if first_length < 1 or keys.shape[2] < needed or values.shape[2] < needed:
        raise ValueError(
            f"{rows} queries from first_length {first_length} need {needed} keys and values, "
            f"got {keys.shape[2]} and {values.shape[2]}"
        )
    if keys.shape[:2] != values.shape[:2] or keys.shape[0] != batch or keys.shape[3] != head_dim:
        raise ValueError(f"mismatched shapes {queries.shape}, {keys.shape}, {values.shape}")


def decode_attention_rows(queries, keys, values, scale: float, first_length: int):
    """Attention of L queries (B, Hq, L, D); query j sees keys[..., :first_length + j].

    keys, values: (B, Hkv, >= first_length + L - 1, D), the KV cache's fetched views.
    Query j of the result is bitwise decode's single-query
    `mx.fast.scaled_dot_product_attention(queries[:, :, j:j+1], keys[..., :T_j, :],
    values[..., :T_j, :], scale=scale, mask=None)`, T_j = first_length + j. On CUDA,
    where decode runs MLX's unfused fallback, through the kernels, and on Metal
    through MLX's multi-query sdpa_vector, once their self-test passed; elsewhere one
    stock call per query. Returns (B, Hq, L, D) (on CUDA a transposed view of a
    contiguous (B, L, Hq, D) array).
    """
    _check_attention_arguments(queries, keys, values, first_length)
    batch, q_heads, rows, head_dim = queries.shape
    needed = first_length + rows - 1
    if keys.shape[2] > needed:
        keys, values = keys[:, :, :needed], values[:, :, :needed]
    backend = backend_name()
    shape = (batch, q_heads, keys.shape[1], head_dim)
    path = attention_path(backend)
    if (path and rows <= MAX_QUERIES and path[0](*shape, queries.dtype)
            and keys.dtype == values.dtype == queries.dtype):
        _, attend, variant = path
        key = verified_key(backend, shape, queries.dtype)
        if key not in _attention_verified:
            test = self_test_attention32 if queries.dtype == mx.float32 else self_test_attention
            result = test([shape])
            if not result.ok:
                warnings.warn(f"dflash2 {backend} attention failed its self-test: {result.reason}")
        variants = {variant(shape, first_length + j, queries.dtype) for j in range(rows)}
        if variants <= _attention_verified.get(key, set()):
            if queries.dtype != mx.float32:
                return attend(queries, keys, values, scale, first_length)
            fp32_variant = _attention32_serving.get(key)  # CUDA's (Metal's path is fp16's), its shape's
            if fp32_variant:
                return attend(queries, keys, values, scale, first_length, variant=fp32_variant)
    return stock_attention_rows(queries, keys, values, scale, first_length)


# ---------------------------------------------------------------------------
# attention: self-test


def _fallback_stages(query, keys, values, scale):
    """fast.cpp:718-790 for one query (B, Hq, 1, D) with MLX ops: (scores, p, out)."""
    batch, q_heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    repeats = q_heads // kv_heads
    q = mx.multiply(_scale_array(scale, query.dtype)[0], query)
    if repeats > 1:
        q = q.reshape(batch, kv_heads, repeats, 1, head_dim)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = mx.matmul(q, mx.swapaxes(keys, -1, -2))
    p = mx.softmax(scores, axis=-1, precise=True)
    out = mx.matmul(p, values).reshape(batch, q_heads, 1, head_dim)
    return scores, p, out


def _make_case(shape, first_length, rows, kind, key, dtype=mx.float16):
    """Random fp16 (or fp32) inputs and the caches' views: the verify's (all rows appended
    at once) and decode's per query (one row appended at a time), both mlx-vlm KVCache;
    then the two buffers' capacities at the end."""
    batch, q_heads, kv_heads, head_dim = shape
    total = first_length + rows - 1
    kq, kk, kv = mx.random.split(key, 3)
    queries = mx.random.normal((batch, q_heads, rows, head_dim), key=kq).astype(dtype)
    keys = mx.random.normal((batch, kv_heads, total, head_dim), key=kk)
    keys = (keys * (16.0 if kind == "wide" else 1.0)).astype(dtype)
    values = mx.random.normal((batch, kv_heads, total, head_dim), key=kv).astype(dtype)
    prefix = first_length - 1
    verify_cache, decode_cache = KVCache(), KVCache()
    if prefix:
        for cache_ in (verify_cache, decode_cache):
            cache_.update_and_fetch(keys[:, :, :prefix], values[:, :, :prefix])
    verify_keys, verify_values = verify_cache.update_and_fetch(
        keys[:, :, prefix:], values[:, :, prefix:]
    )
    decode_views = []
    for j in range(prefix, total):
        decode_views.append(decode_cache.update_and_fetch(keys[:, :, j : j + 1], values[:, :, j : j + 1]))
    capacities = [verify_cache.keys.shape[2], decode_cache.keys.shape[2]]
    return queries, verify_keys, verify_values, decode_views, capacities


def _describe_attention_difference(got, want, case, scale, first_length, served, variant="fma"):
    """Where the first differing element is, and, for the kernels (in that variant), which
    step differs. case: _make_case's inputs and views."""
    queries, verify_keys, verify_values, decode_views, _ = case
    text, (_, _, j, _) = _first_difference(got, want)  # (batch, head, query, column)
    text += f", query {j} sees {first_length + j} keys"
    if not served:
        return text
    query = mx.contiguous(queries[:, :, j : j + 1])
    step_keys, step_values = decode_views[j]
    scores, p, out = _fallback_stages(query, step_keys, step_values, scale)
    try:
        ours_scores, ours_p, ours_out, _ = cuda_attention_stages(
            queries, verify_keys, verify_values, scale, first_length, variant
        )
    except Exception as error:  # the difference is named; its step is a diagnostic
        return text + f"; by step: the stages raised {type(error).__name__}: {error}"
    length = first_length + j
    ours_scores = ours_scores[:, :, j : j + 1, :length].reshape(scores.shape)

    return text + (
        f"; query {j} by step, kernels vs MLX ops: scores {_differing(ours_scores, scores)}, "
        f"softmax {_differing(ours_p[j], p)}, "
        f"p@v {_differing(ours_out[j], out.reshape(ours_out[j].shape))} "
        f"differing; MLX ops vs the SDPA call: {_differing(out, want[:, :, j : j + 1])}"
    )


def _test_shape(backend, shape, key, first_lengths, max_queries, kernel, dtype=mx.float16, variant=None):
    """Cases of one (B, Hq, Hkv, D): (case records, reason of the first difference).
    kernel: the attention under test; None: this backend's path for the shape (variant:
    the CUDA kernels in that variant, ending at the first difference)."""
    batch, q_heads, kv_heads, head_dim = shape
    path = attention_path(backend)
    served = kernel is None and path is not None and path[0](*shape, dtype)
    attend = kernel or (partial(cuda_attention_rows, variant=variant) if variant and served
                        else path[1] if served else stock_attention_rows)
    scale = head_dim**-0.5
    lengths = first_lengths or (
        PACK_FIRST_LENGTHS if shape == ATTENTION_PACK_SHAPE else TINY_FIRST_LENGTHS
    )
    cases, reason = [], None
    try:
        for kind in ATTENTION_INPUT_KINDS:
            for first_length in lengths:
                for rows in range(1, max_queries + 1):
                    key, case_key = mx.random.split(key)
                    case = _make_case(shape, first_length, rows, kind, case_key, dtype)
                    queries, verify_keys, verify_values, decode_views, capacities = case
                    want = mx.concatenate(
                        [
                            mx.fast.scaled_dot_product_attention(
                                mx.contiguous(queries[:, :, j : j + 1]), k, v, scale=scale, mask=None
                            )
                            for j, (k, v) in enumerate(decode_views)
                        ],
                        axis=2,
                    )
                    got = attend(queries, verify_keys, verify_values, scale, first_length)
                    stock = mx.fast.scaled_dot_product_attention(
                        queries, verify_keys, verify_values, scale=scale, mask="causal"
                    )
                    mx.eval(want, got, stock)
                    differ = _differing(got, want)
                    cases.append(
                        {
                            "shape": list(shape),
                            "first_length": first_length,
                            "queries": rows,
                            "input": kind,
                            "kernel": served,
                            "capacity": capacities,  # verify's, decode's
                            "mismatches": differ,
                            "stock_mismatches": _differing(stock, want),
                        }
                    )
                    if differ and reason is None:
                        reason = (
                            f"{backend} {'kernels' if served else 'attention'} differ from decode at "
                            f"(B, Hq, Hkv, D)={shape}, first_length={first_length}, L={rows}, input={kind}: "
                        ) + _describe_attention_difference(
                            got, want, case, scale, first_length, served and backend == "cuda", variant or "fma")
                        if variant:
                            return cases, reason
    except Exception as error:  # a kernel that fails to build or run fails the test
        reason = f"{backend} attention at {shape} raised {type(error).__name__}: {error}"
    return cases, reason


def self_test_attention(
    shapes=None, seed: int = 0, first_lengths=None, max_queries: int = MAX_QUERIES, kernel=None
) -> SelfTestResult:
    """Check decode_attention_rows' path on this backend bit for bit against decode.

    kernel: (queries, keys, values, scale, first_length) -> (B, Hq, L, D) to test
    instead; default: this backend's path, switched on or off per shape (off CUDA
    and Metal there is nothing to test).
    shapes: (B, Hq, Hkv, D) tuples; default the pack's and the tiny ones. first_lengths: key
    lengths of query 0; default PACK_FIRST_LENGTHS for the pack's shape and
    TINY_FIRST_LENGTHS otherwise. For each shape, input kind, first length and
    L = 1..max_queries: fp16 inputs, KV views from mlx-vlm's KVCache (the verify's
    buffer after appending L rows, which may have grown to a capacity decode's
    never had), and the reference: per query, the stock call on decode's own cache
    views. `stock_mismatches` counts the stock multi-query call with
    mask="causal" (negative control on CUDA; on Metal, within 32 / GQA queries, the very
    call the path makes). Switches the kernels on or off per shape.
    """
    backend = backend_name()
    if kernel is None and attention_path(backend) is None:
        return _no_kernel_result(backend)
    cases, reason = [], None
    key = mx.random.key(seed)
    for shape in [tuple(s) for s in (shapes or (ATTENTION_PACK_SHAPE,) + ATTENTION_TINY_SHAPES)]:
        key, shape_key = mx.random.split(key)
        shape_cases, shape_reason = _test_shape(
            backend, shape, shape_key, first_lengths, max_queries, kernel
        )
        cases += shape_cases
        reason = reason or shape_reason
        if kernel is None:
            _attention_verified[(backend, shape)] = set() if shape_reason else _variants_covered(
                backend, shape_cases, mx.float16)
    mismatches = sum(c["mismatches"] for c in cases)
    stock_mismatches = sum(c["stock_mismatches"] for c in cases)
    return SelfTestResult(reason is None, backend, reason, mismatches, stock_mismatches, cases)


def self_test_attention32(
    shapes=None, seed: int = 0, first_lengths=None, max_queries: int = MAX_QUERIES, kernel=None
) -> SelfTestResult:
    """self_test_attention on fp32 rows (the real file's), CUDA only. At each shape, each of
    ATTENTION32_VARIANTS in turn, a variant ending at its first difference (the next is
    then tried); the first to pass every case serves that shape's fp32 rows at the softmax
    block dims its cases covered (none passing: the stock call per query), those before it
    its controls. A shape decode does not send to the fallback is stock against stock.
    kernel: tested alone instead, nothing switched."""
    backend = backend_name()
    if kernel is None and backend != "cuda":
        return _no_kernel_result(backend)
    differing, failures, cases, chosen = {}, {}, [], []
    key = mx.random.key(seed)
    for shape in [tuple(s) for s in (shapes or (ATTENTION_PACK_SHAPE,) + ATTENTION_TINY_SHAPES)]:
        key, shape_key = mx.random.split(key)
        if kernel is None and not attention_kernel_supports(*shape, mx.float32):
            # Decode sends this shape elsewhere: the stock call per query, against itself.
            shape_cases, reason = _test_shape(backend, shape, shape_key, first_lengths, max_queries, None, mx.float32)
            cases += shape_cases
            if reason:
                failures.setdefault("stock", f"stock: {reason}")
                chosen.append(None)
            _attention32_serving[verified_key(backend, shape, mx.float32)] = None
            _attention_verified[verified_key(backend, shape, mx.float32)] = set()
            continue
        served = None
        for name in ["kernel"] if kernel else ATTENTION32_VARIANTS:
            shape_cases, reason = _test_shape(backend, shape, shape_key, first_lengths, max_queries, kernel,
                                              mx.float32, None if kernel else name)
            # Elements that differ (at least 1 where the variant raised).
            differing[name] = differing.get(name, 0) + max(sum(c["mismatches"] for c in shape_cases), bool(reason))
            if reason:
                failures.setdefault(name, f"{name}: {reason}")
                continue
            served = name
            break
        cases += shape_cases  # the served variant's, else the last one's up to its difference
        chosen.append(served)
        if kernel is None:
            verified = verified_key(backend, shape, mx.float32)
            _attention32_serving[verified] = served
            _attention_verified[verified] = _variants_covered(backend, shape_cases, mx.float32) if served else set()
    ok = None not in chosen
    variants = set(chosen) - {None}
    return SelfTestResult(ok, backend, "; ".join(failures.values()) or None,
                          sum(c["mismatches"] for c in cases), sum(c["stock_mismatches"] for c in cases), cases,
                          variants.pop() if ok and len(variants) == 1 else None, differing,
                          {name: differing[name] for name in failures if name in differing})


def _variants_covered(backend, cases, dtype) -> set:
    """The path's variants (attention_path) at every query of the cases: what they verified."""
    variant = attention_path(backend)[2]
    return {variant(tuple(case["shape"]), case["first_length"] + query, dtype)
            for case in cases for query in range(case["queries"])}
