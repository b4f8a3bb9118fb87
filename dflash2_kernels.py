"""An exact 2-bit matmul for 1..8 rows, proven by a start-up self-test.

`exact_quantized_matmul(x, weight, scales, biases)` computes y = x @ W.T for a
2-bit affine, group-128 packed W (the pack's format) and up to 8 fp16 rows.
Row m of the result is bit for bit what MLX 0.32.2's own single-row call
`mx.quantized_matmul(x[m:m+1], ...)` gives on this backend, while the weights are
read once for all rows. MLX's multi-row call is not exact: on CUDA 8 rows switch
to a tensor-core kernel, on Metal 2+ rows (M3 and later) or 6+ rows (M1/M2) switch
to kernels that round differently.

Per backend:
- cuda: `mx.fast.cuda_kernel` with MLX's qmv_kernel arithmetic (qmv.cu): lane l
  owns elements 16l + 512r, one fp16 fma chain per element slot over r, the slots
  summed in float from +0 in order, a xor butterfly 16..1, a round-to-nearest
  fp16 store. Each warp keeps several output rows so each activation load serves
  all of them.
- metal: `mx.fast.metal_kernel` with affine_qmv_fast's arithmetic, MLX's
  load_vector/qdot copied verbatim. Written from MLX's source and never run here
  (no Mac); like every kernel it serves only after its self-test passed.
- cpu: one stock single-row call per row. MLX's batched CPU call happens to equal
  it today, but nothing promises that (the tests' GPU-like CPU backend,
  tests/gpu_rounding.py, makes it differ), so the CPU path never relies on it.

The kernel serves only after `self_test` passed on this machine (it runs by
itself on first use; the runtime calls it at start-up with the pack's shapes).
After a failed self-test, or for a shape the kernel does not take (Metal: N % 8
or K % 512 nonzero, where MLX itself takes another kernel),
`exact_quantized_matmul` falls back to one stock single-row call per row: still
exact, only slower. One row on Metal or CPU is always MLX's own call; on CUDA it
goes through the kernel, which is about twice as fast as MLX's (H200).
"""

import warnings
from dataclasses import dataclass, field
from functools import cache
from typing import Callable, Optional

import mlx.core as mx

BITS = 2
GROUP_SIZE = 128
MAX_ROWS = 8
INPUT_KINDS = ("normal", "large", "tiny", "subnormal", "signed_zero", "cancellation")
# Small shapes, cheap on a 2-core CPU: K = 512 and 1536 take the plain K loop,
# 640 and 384 MLX's tail for K % 512 (384: tail only), N = 42 a partial last warp.
DEFAULT_SHAPES = ((16, 512), (24, 1536), (42, 640), (24, 384))

Kernel = Callable[[mx.array, mx.array, mx.array, mx.array], mx.array]


def backend_name() -> str:
    """Where MLX runs ops by default here: "cuda", "metal" or "cpu"."""
    if mx.default_device().type == mx.DeviceType.gpu:
        if mx.metal.is_available():
            return "metal"
        if mx.cuda.is_available():
            return "cuda"
    return "cpu"


def stock_quantized_matmul(x, weight, scales, biases):
    return mx.quantized_matmul(
        x, weight, scales, biases, transpose=True, group_size=GROUP_SIZE, bits=BITS
    )


def stock_rows(x, weight, scales, biases):
    """One stock single-row call per row: the reference every kernel must equal."""
    rows = [stock_quantized_matmul(x[m : m + 1], weight, scales, biases) for m in range(x.shape[0])]
    return mx.concatenate(rows, axis=0)


# ---------------------------------------------------------------------------
# CUDA

# MIT License, Copyright (c) 2023 Apple Inc. (arithmetic of
# mlx/backend/cuda/quantized/qmm/qmv.cu, MLX 0.32.2). See NOTICE.txt.
_CUDA_HEADER = r"""
namespace dflash2 {

constexpr int kLaneElems = 16;                 // elements one lane takes per step
constexpr int kStepElems = 32 * kLaneElems;    // 512: elements a warp takes per step

__device__ __forceinline__ __half2 bits_to_half2(uint32_t bits) {
  return *reinterpret_cast<__half2*>(&bits);
}

__device__ __forceinline__ uint32_t half2_to_bits(__half2 h) {
  return *reinterpret_cast<uint32_t*>(&h);
}

// PTX prmt: byte i of the result is byte (selector nibble i) of {hi, lo}; only
// the low 16 bits of the selector count. (__byte_perm would mask every nibble.)
__device__ __forceinline__ uint32_t permute_bytes(uint32_t lo, uint32_t hi, uint32_t selector) {
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(lo), "r"(hi), "r"(selector));
  return out;
}

// MLX dequantizes w = code * scale + bias as one fp16 fma per element (ptxas
// fuses its mul and add into HFMA2). A code takes 4 values, so we compute those 4
// fmas and pick from them with byte permutes: same bits, fewer instructions.
// Element e's code is at bits 2e..2e+1 of q; w[t] holds elements 2t, 2t+1.
__device__ __forceinline__ void dequantize16(
    uint32_t q, __half scale, __half bias, __half2 (&w)[8]) {
  const __half2 scale2 = __half2half2(scale);
  const __half2 bias2 = __half2half2(bias);
  const uint32_t values01 = half2_to_bits(__hfma2(__floats2half2_rn(0.0f, 1.0f), scale2, bias2));
  const uint32_t values23 = half2_to_bits(__hfma2(__floats2half2_rn(2.0f, 3.0f), scale2, bias2));
  // One code per byte: codes_r holds elements r, r+4, r+8, r+12.
  const uint32_t codes0 = q & 0x03030303u;
  const uint32_t codes1 = (q >> 2) & 0x03030303u;
  const uint32_t codes2 = (q >> 4) & 0x03030303u;
  const uint32_t codes3 = (q >> 6) & 0x03030303u;
  // Byte c * 0x22 + 0x10 holds the nibbles (2c, 2c + 1): the bytes of value c.
  // Each selector word serves two pairs: its low half, then its high half.
  const uint32_t sel_0_1_4_5 = __byte_perm(codes0, codes1, 0x5140) * 0x22u + 0x10101010u;
  const uint32_t sel_8_9_12_13 = __byte_perm(codes0, codes1, 0x7362) * 0x22u + 0x10101010u;
  const uint32_t sel_2_3_6_7 = __byte_perm(codes2, codes3, 0x5140) * 0x22u + 0x10101010u;
  const uint32_t sel_10_11_14_15 = __byte_perm(codes2, codes3, 0x7362) * 0x22u + 0x10101010u;
  w[0] = bits_to_half2(permute_bytes(values01, values23, sel_0_1_4_5));
  w[1] = bits_to_half2(permute_bytes(values01, values23, sel_2_3_6_7));
  w[2] = bits_to_half2(permute_bytes(values01, values23, sel_0_1_4_5 >> 16));
  w[3] = bits_to_half2(permute_bytes(values01, values23, sel_2_3_6_7 >> 16));
  w[4] = bits_to_half2(permute_bytes(values01, values23, sel_8_9_12_13));
  w[5] = bits_to_half2(permute_bytes(values01, values23, sel_10_11_14_15));
  w[6] = bits_to_half2(permute_bytes(values01, values23, sel_8_9_12_13 >> 16));
  w[7] = bits_to_half2(permute_bytes(values01, values23, sel_10_11_14_15 >> 16));
}

// One 512-wide step for R output rows and M activation rows: each activation
// load serves all R output rows, each dequantized weight all M activation rows.
template <int M, int R>
__device__ __forceinline__ void accumulate_step(
    const __half* x_step,
    int k,
    const uint32_t (&q)[R],
    const __half (&scale)[R],
    const __half (&bias)[R],
    __half2 (&acc)[R][M][8]) {
  __half2 w[R][8];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    dequantize16(q[j], scale[j], bias[j], w[j]);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const uint4* xv = reinterpret_cast<const uint4*>(x_step + m * k);
    const uint4 lo = __ldg(xv);
    const uint4 hi = __ldg(xv + 1);
    const __half2 xh[8] = {
        bits_to_half2(lo.x), bits_to_half2(lo.y), bits_to_half2(lo.z), bits_to_half2(lo.w),
        bits_to_half2(hi.x), bits_to_half2(hi.y), bits_to_half2(hi.z), bits_to_half2(hi.w)};
#pragma unroll
    for (int j = 0; j < R; ++j) {
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        acc[j][m][t] = __hfma2(xh[t], w[j][t], acc[j][m][t]);
      }
    }
  }
}

// This lane's weight words, scales and biases of C steps in R output rows.
template <int R, int C>
struct WeightChunk {
  uint32_t q[C][R];
  __half scale[C][R];
  __half bias[C][R];

  __device__ __forceinline__ void load(
      const uint32_t* const (&w_lane)[R],
      const __half* const (&s_lane)[R],
      const __half* const (&b_lane)[R],
      int first_step,
      int steps) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (first_step + c < steps) {
#pragma unroll
        for (int j = 0; j < R; ++j) {
          q[c][j] = __ldg(w_lane[j] + (first_step + c) * 32);
          scale[c][j] = __ldg(s_lane[j] + (first_step + c) * 4);
          bias[c][j] = __ldg(b_lane[j] + (first_step + c) * 4);
        }
      }
    }
  }
};

// y[m, first..first+R) for one warp; C steps of weights are loaded at once,
// with PREFETCH the next C steps' loads fly while this chunk is computed.
// Launch: block (32, warps), grid.x = blocks.
template <int M, int R, int C, bool PREFETCH>
__device__ __forceinline__ void qmv_rows(
    const __half* __restrict__ x,
    const uint32_t* __restrict__ w,
    const __half* __restrict__ scales,
    const __half* __restrict__ biases,
    __half* __restrict__ y,
    int n,
    int k) {
  const int lane = threadIdx.x;
  const int first = (blockIdx.x * blockDim.y + threadIdx.y) * R;
  if (first >= n) {
    return;
  }
  const int words_per_row = k / 16;
  const int groups_per_row = k / 128;
  const int steps = k / kStepElems;

  // This lane's word, scale and bias of step 0 in each output row. Rows past n
  // (last warp only) recompute row n - 1 and are never stored.
  const uint32_t* w_lane[R];
  const __half* s_lane[R];
  const __half* b_lane[R];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int64_t row = first + j < n ? first + j : n - 1;
    w_lane[j] = w + row * words_per_row + lane;
    s_lane[j] = scales + row * groups_per_row + lane / 8;
    b_lane[j] = biases + row * groups_per_row + lane / 8;
  }
  const __half* x_lane = x + lane * kLaneElems;

  // MLX's fp16 accumulators, one per element slot, starting at +0.
  __half2 acc[R][M][8];
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int t = 0; t < 8; ++t)
        acc[j][m][t] = __float2half2_rn(0.0f);

  WeightChunk<R, C> chunk;
  chunk.load(w_lane, s_lane, b_lane, 0, steps);
  for (int s0 = 0; s0 < steps; s0 += C) {
    WeightChunk<R, C> next;
    if (PREFETCH) {
      next.load(w_lane, s_lane, b_lane, s0 + C, steps);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (s0 + c < steps) {
        accumulate_step<M, R>(
            x_lane + (s0 + c) * kStepElems, k, chunk.q[c], chunk.scale[c], chunk.bias[c], acc);
      }
    }
    if (PREFETCH) {
      chunk = next;
    } else {
      chunk.load(w_lane, s_lane, b_lane, s0 + C, steps);
    }
  }

  // MLX's tail for K % 512: lanes whose 16 elements start before k take one more step.
  const int rest = k % kStepElems;
  if (rest && lane * kLaneElems < rest) {
    const int base = k - rest;
    uint32_t q[R];
    __half sc[R], bi[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      q[j] = __ldg(w_lane[j] + base / 16);
      sc[j] = __ldg(s_lane[j] + base / 128);
      bi[j] = __ldg(b_lane[j] + base / 128);
    }
    accumulate_step<M, R>(x_lane + base, k, q, sc, bi, acc);
  }

  // Slots summed in float from +0 in slot order, then the xor butterfly of
  // cg::reduce, then lane 0 stores round-to-nearest fp16.
#pragma unroll
  for (int j = 0; j < R; ++j) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float sum = 0.0f;
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        sum += __low2float(acc[j][m][t]);
        sum += __high2float(acc[j][m][t]);
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      }
      if (lane == 0 && first + j < n) {
        y[m * n + first + j] = __float2half_rn(sum);
      }
    }
  }
}

}  // namespace dflash2
"""

_CUDA_SOURCE = "dflash2::qmv_rows<M, R, C, PREFETCH>(x, w, scales, biases, y, w_shape[0], w_shape[1] * 16);"

# Launch shape by activation rows M: (output rows per warp R, weight steps per
# load C, prefetch the next C steps). R * M accumulators of 8 registers bound R.
# Chosen by `tools/kernel_parity.py --tune` on an H200 (evidence/kernel-parity-cuda.md).
CUDA_LAUNCH = {
    1: (2, 4, 0), 2: (2, 4, 1), 3: (2, 4, 1), 4: (2, 4, 1),
    5: (2, 2, 1), 6: (2, 2, 1), 7: (2, 2, 1), 8: (2, 2, 1),
}
CUDA_WARPS_PER_BLOCK = 4


@cache
def _cuda_kernel():
    return mx.fast.cuda_kernel(
        name="dflash2_qmv_2bit_g128",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=_CUDA_SOURCE,
        header=_CUDA_HEADER,
    )


def cuda_matmul(x, weight, scales, biases, launch=None):
    """(M, K) fp16 rows -> (M, N) through the CUDA kernel; no self-test gate.

    launch: (R, C, prefetch) to override CUDA_LAUNCH (for the tuning sweep)."""
    rows, n = x.shape[0], weight.shape[0]
    rows_per_warp, chunk, prefetch = launch or CUDA_LAUNCH[rows]
    warps = -(-n // rows_per_warp)
    blocks = -(-warps // CUDA_WARPS_PER_BLOCK)
    return _cuda_kernel()(
        inputs=[x, weight, scales, biases],
        template=[("M", rows), ("R", rows_per_warp), ("C", chunk), ("PREFETCH", bool(prefetch))],
        grid=(32 * blocks, CUDA_WARPS_PER_BLOCK, 1),
        threadgroup=(32, CUDA_WARPS_PER_BLOCK, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[mx.float16],
    )[0]


# ---------------------------------------------------------------------------
# Metal

# load_vector and qdot below are copied from MLX 0.32.2,
# mlx/backend/metal/kernels/quantized.h (their 2-bit branches), under:
#
# MIT License
#
# Copyright (c) 2023 Apple Inc.
#
# Permission is hereby granted, free of charge, to any person obtaining a copy
# of this software and associated documentation files (the "Software"), to deal
# in the Software without restriction, including without limitation the rights
# to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
# copies of the Software, and to permit persons to whom the Software is
# furnished to do so, subject to the following conditions:
#
# The above copyright notice and this permission notice shall be included in all
# copies or substantial portions of the Software.
#
# THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
# IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
# FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
# AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
# LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
# OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
# SOFTWARE.
_METAL_HEADER = r"""
// Copyright (c) 2023-2024 Apple Inc. (MIT License; load_vector and qdot from
// MLX's mlx/backend/metal/kernels/quantized.h, 2-bit branches, unchanged.)
#include <metal_simdgroup>
#include <metal_stdlib>

using namespace metal;

namespace dflash2 {

template <typename T, typename U, int values_per_thread, int bits>
inline U load_vector(const device T* x, thread U* x_thread) {
  static_assert(bits == 2, "dflash2 copies the 2-bit branch only");

  U sum = 0;

  if (bits == 2) {
    for (int i = 0; i < values_per_thread; i += 4) {
      sum += x[i] + x[i + 1] + x[i + 2] + x[i + 3];
      x_thread[i] = x[i];
      x_thread[i + 1] = x[i + 1] / 4.0f;
      x_thread[i + 2] = x[i + 2] / 16.0f;
      x_thread[i + 3] = x[i + 3] / 64.0f;
    }
  }

  return sum;
}

template <typename U, int values_per_thread, int bits>
inline U qdot(
    const device uint8_t* w,
    const thread U* x_thread,
    U scale,
    U bias,
    U sum) {
  static_assert(bits == 2, "dflash2 copies the 2-bit branch only");

  U accum = 0;

  if (bits == 2) {
    for (int i = 0; i < (values_per_thread / 4); i++) {
      accum +=
          (x_thread[4 * i] * (w[i] & 0x03) +
           x_thread[4 * i + 1] * (w[i] & 0x0c) +
           x_thread[4 * i + 2] * (w[i] & 0x30) +
           x_thread[4 * i + 3] * (w[i] & 0xc0));
    }
  }

  return scale * accum + sum * bias;
}

}  // namespace dflash2
"""

# qmv_fast_impl (quantized.h) for bits 2, group 128, with a loop over the M
# activation rows inside each 512-wide block: the same lane, simdgroup and row
# mapping, so every simd_sum gets the same 32 values as MLX's single-row call.
_METAL_SOURCE = r"""
  constexpr int bits = 2;
  constexpr int group_size = 128;
  constexpr int packs_per_thread = 1;
  constexpr int num_simdgroups = 2;
  constexpr int results_per_simdgroup = 4;
  constexpr int pack_factor = 16;
  constexpr int bytes_per_pack = 4;
  constexpr int values_per_thread = pack_factor * packs_per_thread;
  constexpr int block_size = values_per_thread * 32;
  constexpr int scale_step_per_thread = group_size / values_per_thread;
  typedef float U;

  const int in_vec_size = w_shape[1] * pack_factor;
  const int out_vec_size = w_shape[0];
  const uint simd_gid = simdgroup_index_in_threadgroup;
  const uint simd_lid = thread_index_in_simdgroup;

  const device uint8_t* ws = (const device uint8_t*)w;
  const device T* sc = scales;
  const device T* bi = biases;
  const device T* xs = x;

  thread U x_thread[values_per_thread];
  thread U result[M][results_per_simdgroup] = {{0}};

  const int in_vec_size_w = in_vec_size * bytes_per_pack / pack_factor;
  const int in_vec_size_g = in_vec_size / group_size;
  const int out_row = threadgroup_position_in_grid.y * (num_simdgroups * results_per_simdgroup) +
      simd_gid * results_per_simdgroup;

  ws += out_row * in_vec_size_w + simd_lid * packs_per_thread * bytes_per_pack;
  sc += out_row * in_vec_size_g + simd_lid / scale_step_per_thread;
  bi += out_row * in_vec_size_g + simd_lid / scale_step_per_thread;
  xs += simd_lid * values_per_thread;

  for (int k = 0; k < in_vec_size; k += block_size) {
    for (int m = 0; m < M; m++) {
      U sum = dflash2::load_vector<T, U, values_per_thread, bits>(xs + m * in_vec_size, x_thread);

      for (int row = 0; row < results_per_simdgroup; row++) {
        auto wl = (const device uint8_t*)(ws + row * in_vec_size_w);
        const device T* sl = sc + row * in_vec_size_g;
        const device T* bl = bi + row * in_vec_size_g;

        U s = sl[0];
        U b = bl[0];
        result[m][row] += dflash2::qdot<U, values_per_thread, bits>(wl, x_thread, s, b, sum);
      }
    }

    ws += block_size * bytes_per_pack / pack_factor;
    sc += block_size / group_size;
    bi += block_size / group_size;
    xs += block_size;
  }

  for (int m = 0; m < M; m++) {
    for (int row = 0; row < results_per_simdgroup; row++) {
      U r = simd_sum(result[m][row]);
      if (simd_lid == 0) {
        y[m * out_vec_size + out_row + row] = static_cast<T>(r);
      }
    }
  }
"""


@cache
def _metal_kernel():
    return mx.fast.metal_kernel(
        name="dflash2_qmv_fast_2bit_g128",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=_METAL_SOURCE,
        header=_METAL_HEADER,
        compile_options={"math_mode": "safe"},  # no reassociation: MLX builds with -fno-fast-math
    )


def metal_matmul(x, weight, scales, biases):
    """(M, K) fp16 rows -> (M, N) through the Metal kernel; no self-test gate."""
    rows, n = x.shape[0], weight.shape[0]
    return _metal_kernel()(
        inputs=[x, weight, scales, biases],
        template=[("T", mx.float16), ("M", rows)],
        grid=(32, n // 4, 1),  # threadgroups (32, 2): one per 8 output rows, as MLX
        threadgroup=(32, 2, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[mx.float16],
    )[0]


# ---------------------------------------------------------------------------
# Dispatch


def kernel_supports(backend: str, n: int, k: int) -> bool:
    """Shapes the backend's kernel takes. Metal: only those MLX sends to qmv_fast."""
    if backend == "metal":
        return n % 8 == 0 and k % 512 == 0
    return True


def backend_kernel(backend: str) -> Kernel:
    if backend == "cuda":
        return cuda_matmul
    if backend == "metal":
        return metal_matmul
    return stock_rows


# backend -> whether the last self-test of the real kernel passed.
_verified: dict = {}
_warned: set = set()


def _serving_kernel(backend: str, n: int, k: int, rows: int) -> Optional[Kernel]:
    if rows == 1 and backend != "cuda":
        return None  # MLX's own single-row call is the reference itself
    if backend not in _verified:
        self_test()
    if not _verified[backend]:
        if backend not in _warned:
            _warned.add(backend)
            warnings.warn(
                f"dflash2 {backend} kernel failed its self-test; exact matmuls run row by row"
            )
        return None
    if not kernel_supports(backend, n, k):
        return None
    return backend_kernel(backend)


def _check_arguments(x, weight, scales, biases):
    if x.dtype != mx.float16:
        raise TypeError(f"x must be float16, got {x.dtype}")
    if weight.dtype != mx.uint32 or weight.ndim != 2:
        raise TypeError(f"weight must be a 2-D uint32 array, got {weight.dtype} {weight.shape}")
    n, k = weight.shape[0], weight.shape[1] * 32 // BITS
    for name, array in (("scales", scales), ("biases", biases)):
        if array.dtype != mx.float16 or tuple(array.shape) != (n, k // GROUP_SIZE):
            raise TypeError(
                f"{name} must be float16 {(n, k // GROUP_SIZE)}, got {array.dtype} {array.shape}"
            )
    if x.ndim == 0 or x.shape[-1] != k:
        raise ValueError(f"x must end in K={k}, got shape {x.shape}")
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of the group size {GROUP_SIZE}")
    rows = x.size // k
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"exact_quantized_matmul takes 1..{MAX_ROWS} rows, got {rows}")


def exact_quantized_matmul(x, weight, scales, biases):
    """x @ W.T for 1..8 fp16 rows, each row bitwise MLX's single-row result.

    x: float16 (..., K), at most 8 rows once the leading dims are flattened.
    weight: uint32 (N, K/16); scales, biases: float16 (N, K/128); 2-bit affine,
    group 128. Returns float16 (..., N). On CUDA one row also goes through the
    kernel (faster than MLX's own and bitwise equal): use it for plain decode too.
    """
    _check_arguments(x, weight, scales, biases)
    n, k = weight.shape[0], x.shape[-1]
    rows = x.reshape(-1, k)
    kernel = _serving_kernel(backend_name(), n, k, rows.shape[0])
    y = kernel(rows, weight, scales, biases) if kernel else stock_rows(rows, weight, scales, biases)
    return y.reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------------------
# Self-test


@dataclass
class SelfTestResult:
    ok: bool
    backend: str
    reason: Optional[str]
    mismatches: int  # elements whose bits differ from the single-row calls
    stock_mismatches: int  # the same for MLX's own multi-row call (negative control)
    cases: list = field(default_factory=list)


def make_weights(n: int, k: int, key) -> tuple:
    """Random packed 2-bit weights; scales span 2^-8..2^3 so that `large`
    activations overflow CUDA's fp16 accumulators in some rows and not others."""
    k_low, k_high, k_scale, k_exp, k_bias = mx.random.split(key, 5)
    low = mx.random.randint(0, 1 << 16, (n, k // 16), dtype=mx.uint32, key=k_low)
    high = mx.random.randint(0, 1 << 16, (n, k // 16), dtype=mx.uint32, key=k_high)
    weight = (high << 16) | low  # every 2-bit code pattern is a valid word
    magnitude = mx.power(2.0, mx.random.randint(-8, 4, (n, 1), key=k_exp).astype(mx.float32))
    scales = mx.random.uniform(0.5, 1.5, (n, k // GROUP_SIZE), key=k_scale) * magnitude
    biases = -1.5 * scales * mx.random.uniform(0.8, 1.2, scales.shape, key=k_bias)
    return weight, scales.astype(mx.float16), biases.astype(mx.float16)


def make_inputs(kind: str, rows: int, k: int, key) -> mx.array:
    """fp16 activations of one kind (see INPUT_KINDS)."""
    k1, k2 = mx.random.split(key)
    normal = mx.random.normal((rows, k), key=k1)
    if kind == "normal":
        x = normal
    elif kind == "large":  # up to ~6e4: fp16 accumulators overflow to inf, sums to nan
        x = mx.clip(normal * 1000.0 * mx.power(2.0, mx.arange(rows)[:, None] % 4), -6e4, 6e4)
    elif kind == "tiny":  # mostly fp16 subnormals, some normals
        x = normal * 1e-5
    elif kind == "subnormal":  # every value an fp16 subnormal or zero
        x = mx.random.randint(-1023, 1024, (rows, k), key=k1).astype(mx.float32) * 2.0**-24
    elif kind == "signed_zero":  # row 0 all -0, row 1 all +-0, later rows +-0 and 1 in 16 normal
        sign = mx.where(mx.random.bernoulli(0.5, (rows, k), key=k2), -1.0, 1.0)
        sign = mx.where(mx.arange(rows)[:, None] == 0, -1.0, sign)
        keep = mx.random.bernoulli(1 / 16, (rows, k), key=k1) & (mx.arange(rows)[:, None] >= 2)
        x = mx.where(keep, normal, 0.0 * sign)
    elif kind == "cancellation":  # (a, -a) pairs: 4-value sums and dot products cancel
        a = normal[:, ::2] * 100.0
        x = mx.stack([a, -a], axis=-1).reshape(rows, k)
    else:
        raise ValueError(f"unknown input kind {kind!r}")
    return x.astype(mx.float16)


def _bits(a: mx.array) -> mx.array:
    return a.view(mx.uint16)


def _describe_difference(got, want, n, k, rows, kind) -> str:
    differ = _bits(got) != _bits(want)
    flat = mx.argmax(differ.reshape(-1)).item()
    row, column = divmod(flat, n)
    return (
        f"differs from MLX's single-row matmul at shape (N={n}, K={k}), rows={rows}, "
        f"input={kind}: {differ.sum().item()} elements, first at row {row} column {column} "
        f"(got 0x{_bits(got)[row, column].item():04x}, "
        f"want 0x{_bits(want)[row, column].item():04x})"
    )


def self_test(kernel: Optional[Kernel] = None, shapes=None, seed: int = 0) -> SelfTestResult:
    """Check a kernel bit for bit against MLX's single-row calls on this backend.

    kernel: (x (M, K), weight, scales, biases) -> (M, N); default: this
    backend's own, whose serving is then switched on or off by the outcome.
    shapes: (N, K) pairs; default DEFAULT_SHAPES. For each shape, every input
    kind and rows 1..8 the kernel's rows must equal the single-row calls; MLX's
    own multi-row call is counted alongside as the negative control.
    """
    backend = backend_name()
    own = kernel is None
    kernel = kernel or backend_kernel(backend)
    shapes = [tuple(s) for s in (shapes or DEFAULT_SHAPES)]
    cases, mismatches, stock_mismatches, reason = [], 0, 0, None
    key = mx.random.key(seed)
    try:
        for n, k in shapes:
            if own and not kernel_supports(backend, n, k):
                continue  # served row by row, nothing to prove
            key, weight_key = mx.random.split(key)
            weight, scales, biases = make_weights(n, k, weight_key)
            for kind in INPUT_KINDS:
                key, input_key = mx.random.split(key)
                x = make_inputs(kind, MAX_ROWS, k, input_key)
                want = stock_rows(x, weight, scales, biases)
                got = [kernel(x[:rows], weight, scales, biases) for rows in range(1, MAX_ROWS + 1)]
                stock = [stock_quantized_matmul(x[:rows], weight, scales, biases) for rows in range(1, MAX_ROWS + 1)]
                mx.eval(want, got, stock)
                for rows in range(1, MAX_ROWS + 1):
                    out = got[rows - 1]
                    if out.shape != (rows, n) or out.dtype != mx.float16:
                        raise ValueError(
                            f"kernel returned {out.dtype} {out.shape} for {rows} rows, N={n}"
                        )
                    differ = (_bits(out) != _bits(want[:rows])).sum().item()
                    stock_differ = (_bits(stock[rows - 1]) != _bits(want[:rows])).sum().item()
                    cases.append(
                        {
                            "shape": [n, k],
                            "rows": rows,
                            "input": kind,
                            "mismatches": differ,
                            "stock_mismatches": stock_differ,
                        }
                    )
                    mismatches += differ
                    stock_mismatches += stock_differ
                    if differ and reason is None:
                        reason = f"{backend} kernel " + _describe_difference(
                            out, want[:rows], n, k, rows, kind
                        )
    except Exception as error:  # a kernel that fails to build or run fails the test
        reason = f"{backend} kernel raised {type(error).__name__}: {error}"
    ok = reason is None
    if own:
        _verified[backend] = ok
    return SelfTestResult(ok, backend, reason, mismatches, stock_mismatches, cases)
