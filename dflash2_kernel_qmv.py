"""Exact 2-bit matmul (qmv): stock reference, CUDA, dispatch, self-test (Metal's kernel:
dflash2_kernel_qmv_metal).

- `exact_quantized_matmul(x, weight, scales, biases)`: y = x @ W.T for a 2-bit
  affine, group-128 packed W (the pack's format) and 1..8 fp16 rows, each row
  MLX's single-row `mx.quantized_matmul`, the weights read once for all rows.
  MLX's multi-row call is not exact (CUDA: 8 rows take a tensor-core kernel;
  Metal: 2+ rows on M3+, 6+ on M1/M2 take kernels that round differently).
  cuda: `mx.fast.cuda_kernel` with qmv.cu's arithmetic (lane l owns elements
  16l + 512r, one fp16 fma chain per element slot, slots summed in float from +0,
  xor butterfly 16..1, round-to-nearest fp16 store), several output rows a warp.
  metal: affine_qmv_fast's arithmetic with MLX's load_vector/qdot copied verbatim
  (N % 8 == 0 and K % 512 == 0 only, as MLX). cpu: one stock single-row call per
  row (MLX's batched CPU call happens to equal it today, but nothing promises that;
  the tests' GPU-like CPU backend, tests/gpu_rounding.py, makes it differ). One row on Metal or CPU
  is MLX's own call; on CUDA it takes the kernel (about twice as fast, H200).
"""

import hashlib
import itertools
import math
import warnings
from functools import cache
from typing import Callable, Optional

import mlx.core as mx

from dflash2_kernel_base import (
    INPUT_KINDS, MAX_ROWS, BakedCudaKernel, SelfTestResult, _differing, _first_difference, _no_kernel_result,
    backend_name, cuda_header, make_inputs,
)
from dflash2_kernel_qmv_metal import metal_matmul

# ===========================================================================
# Exact 2-bit matmul (qmv)

BITS = 2
GROUP_SIZE = 128
# Small shapes, cheap on a 2-core CPU: K = 512 and 1536 take the plain K loop,
# 640 and 384 MLX's tail for K % 512 (384: tail only), N = 42 a partial last warp.
DEFAULT_SHAPES = ((16, 512), (24, 1536), (42, 640), (24, 384))
# (N, K) of every packed matrix of the 27B target: what it is, and its calls per decode step.
PACKED_SHAPES_27B = {
    (12288, 5120): ("attention q_proj", 16),
    (1024, 5120): ("attention k_proj, v_proj", 32),
    (5120, 6144): ("attention o_proj, GDN out_proj", 64),
    (10240, 5120): ("GDN in_proj_qkv", 48),
    (6144, 5120): ("GDN in_proj_z", 48),
    (17408, 5120): ("MLP gate_proj, up_proj", 128),
    (5120, 17408): ("MLP down_proj", 64),
    (248320, 5120): ("lm_head", 1),
}

Kernel = Callable[[mx.array, mx.array, mx.array, mx.array], mx.array]


# ---------------------------------------------------------------------------
# qmv: stock reference


def stock_quantized_matmul(x, weight, scales, biases):
    return mx.quantized_matmul(
        x, weight, scales, biases, transpose=True, group_size=GROUP_SIZE, bits=BITS
    )


def packed_width(weight) -> int:
    """K, the input width of a packed 2-bit weight (32 // BITS values per uint32)."""
    return weight.shape[1] * 32 // BITS


def stock_rows(x, weight, scales, biases):
    """One stock single-row call per row of (..., K) x: the reference every kernel must equal."""
    rows = x.reshape(-1, x.shape[-1])
    y = mx.concatenate([stock_quantized_matmul(rows[m : m + 1], weight, scales, biases)
                        for m in range(rows.shape[0])], axis=0)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ---------------------------------------------------------------------------
# qmv: CUDA

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

// One 512-wide step for R output rows and M activation rows (x_step: this lane's first
// element of the step in row 0, rows k apart): each activation load serves all R output
// rows, each dequantized weight all M activation rows. SWIZZLED x (swizzle_steps: each
// step holds the 32 lanes' first 8 elements, then their last 8) puts each 16-byte load of
// the warp on 512 contiguous bytes, where plain rows spread it over 1,024: half the L1
// wavefronts, the same elements in the same registers.
template <int M, int R, bool SWIZZLED>
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
    const uint4 hi = __ldg(xv + (SWIZZLED ? 32 : 1));
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

// This lane's step-0 weight word, scale and bias in each of a tile's R output rows
// (first.. first + R). Rows past n (the last tile only) recompute row n - 1 and are never
// stored.
template <int R>
struct TileRows {
  const uint32_t* w_lane[R];
  const __half* s_lane[R];
  const __half* b_lane[R];

  __device__ __forceinline__ TileRows(
      const uint32_t* w, const __half* scales, const __half* biases, int n, int k, int first, int lane) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int64_t row = first + j < n ? first + j : n - 1;
      w_lane[j] = w + row * (k / 16) + lane;
      s_lane[j] = scales + row * (k / 128) + lane / 8;
      b_lane[j] = biases + row * (k / 128) + lane / 8;
    }
  }
};

// This lane's weight words, scales and biases of C steps in R output rows.
template <int R, int C>
struct WeightChunk {
  uint32_t q[C][R];
  __half scale[C][R];
  __half bias[C][R];

  __device__ __forceinline__ void load(const TileRows<R>& rows, int first_step, int steps) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (first_step + c < steps) {
#pragma unroll
        for (int j = 0; j < R; ++j) {
          q[c][j] = __ldg(rows.w_lane[j] + (first_step + c) * 32);
          scale[c][j] = __ldg(rows.s_lane[j] + (first_step + c) * 4);
          bias[c][j] = __ldg(rows.b_lane[j] + (first_step + c) * 4);
        }
      }
    }
  }
};

// y[m, first..first+R) for one warp and M activation rows, then (tile_stride > 0: TILES, the
// grid capped, possibly below the tiles) the same for the output rows tile_stride further on,
// while any are left. C steps of weights are loaded at once; the load after a tile's last
// chunk is the next tile's first, in flight while that chunk is computed (PREFETCH bit 0) or
// the tail and the sums are (without it), not at the next tile's start. PREFETCH bit 0: the next
// C steps' loads fly while this chunk is computed (in registers); bit 1: the warp first asks
// L2 for its tile's whole weight slice (no registers, so more loads in flight where
// registers limit the resident warps).
template <int M, int R, int C, int PREFETCH, bool SWIZZLED>
__device__ __forceinline__ void qmv_rows(
    const __half* __restrict__ x,
    const uint32_t* __restrict__ w,
    const __half* __restrict__ scales,
    const __half* __restrict__ biases,
    __half* __restrict__ y,
    int n,
    int k,
    int first,
    int tile_stride) {
  const int lane = threadIdx.x;
  if (first >= n) {
    return;
  }
  const int groups_per_row = k / 128;
  const int steps = k / kStepElems;
  // Swizzled rows (K a multiple of 512: no tail) put this lane's first 8 elements at 8 * lane.
  const __half* x_lane = x + lane * (SWIZZLED ? kLaneElems / 2 : kLaneElems);
  TileRows<R> rows(w, scales, biases, n, k, first, lane);
  WeightChunk<R, C> chunk;
  chunk.load(rows, 0, steps);
  while (true) {
    const int following = first + tile_stride;
    const bool more = tile_stride > 0 && following < n;
    if (PREFETCH & 2) {
      // One 128-byte line per lane and request: the words of step s (a tail step too),
      // then the scales' and biases' lines (64 groups each, and the row's last group: a
      // row's scales need not start on a line).
#pragma unroll
      for (int j = 0; j < R; ++j) {
        for (int s = lane; s * kStepElems < k; s += 32) {
          asm volatile("prefetch.global.L2 [%0];" :: "l"(rows.w_lane[j] - lane + s * 32));
        }
        for (int g = lane * 64; g < groups_per_row + 64; g += 32 * 64) {
          const int group = g < groups_per_row ? g : groups_per_row - 1;
          asm volatile("prefetch.global.L2 [%0];" :: "l"(rows.s_lane[j] - lane / 8 + group));
          asm volatile("prefetch.global.L2 [%0];" :: "l"(rows.b_lane[j] - lane / 8 + group));
        }
      }
    }

    // MLX's fp16 accumulators, one per element slot, starting at +0.
    __half2 acc[R][M][8];
#pragma unroll
    for (int j = 0; j < R; ++j)
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int t = 0; t < 8; ++t)
          acc[j][m][t] = __float2half2_rn(0.0f);

    for (int s0 = 0; s0 < steps; s0 += C) {
      // After this tile's last chunk comes the next tile's first.
      const bool last = s0 + C >= steps;
      WeightChunk<R, C> next;
      if (PREFETCH & 1) {
        if (!last) {
          next.load(rows, s0 + C, steps);
        } else if (more) {
          next.load(TileRows<R>(w, scales, biases, n, k, following, lane), 0, steps);
        }
      }
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int step = s0 + c;
        if (step < steps) {
          accumulate_step<M, R, SWIZZLED>(x_lane + step * kStepElems, k, chunk.q[c], chunk.scale[c], chunk.bias[c], acc);
        }
      }
      if (PREFETCH & 1) {
        chunk = next;
      } else if (!last) {
        chunk.load(rows, s0 + C, steps);
      } else if (more) {
        chunk.load(TileRows<R>(w, scales, biases, n, k, following, lane), 0, steps);
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
        q[j] = __ldg(rows.w_lane[j] + base / 16);
        sc[j] = __ldg(rows.s_lane[j] + base / 128);
        bi[j] = __ldg(rows.b_lane[j] + base / 128);
      }
      accumulate_step<M, R, false>(x_lane + steps * kStepElems, k, q, sc, bi, acc);
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
    if (!more) {
      return;
    }
    first = following;
    rows = TileRows<R>(w, scales, biases, n, k, first, lane);
  }
}

// The M activation rows split over S warps (M / S rows each, consecutive warps of a
// block): S warps share each output row group's weights through L1, each with M / S rows
// of accumulators (fewer registers: more warps resident). Every (row, output) pair keeps
// qmv_rows' arithmetic. Launch: block (32, warps), grid.x = blocks; warp w takes activation
// rows (w % S) * M / S.. and output rows (w / S) * R.., and where TILES (a grid capped
// below the tiles: see _cuda_launch) those a grid's worth of warps further on.
template <int M, int S, int R, int C, int PREFETCH, bool TILES, bool SWIZZLED>
__device__ __forceinline__ void qmv_split_rows(
    const __half* __restrict__ x,
    const uint32_t* __restrict__ w,
    const __half* __restrict__ scales,
    const __half* __restrict__ biases,
    __half* __restrict__ y,
    int n,
    int k) {
  static_assert(M % S == 0, "S must divide M");
  constexpr int kRows = M / S;
  const int warp = blockIdx.x * blockDim.y + threadIdx.y;
  const int part = warp % S;
  const int tile_stride = TILES ? gridDim.x * blockDim.y / S * R : 0;
  qmv_rows<kRows, R, C, PREFETCH, SWIZZLED>(
      x + part * kRows * k, w, scales, biases, y + part * kRows * n, n, k, (warp / S) * R, tile_stride);
}

}  // namespace dflash2
"""

_CUDA_SOURCE = "dflash2::qmv_split_rows<M, S, R, C, PREFETCH, TILES, SWIZZLED>(x, w, scales, biases, y, w_shape[0], w_shape[1] * 16);"

# Launch shape by activation rows M: (output rows per warp R, weight steps per
# load C, prefetch bits (1: the next C steps into registers, 2: the warp's whole weight
# slice into L2 first)[, warps S the M rows split over, 1 if absent[, blocks B the grid is
# capped at, each warp then taking several tiles of R output rows: none if absent]]).
# R * M / S accumulators of 8 registers bound R.
# Tuned on an H200 (tools/lab/kernel_parity.py --tune, evidence/kernel-parity-cuda.md), whose
# last tuning chose capped grids (B: about one wave of resident warps on 132 SMs) for rows
# 3-8; two interleaved runs of tools/lab/compare_qmv_launch.py against the launches before
# (evidence/qmv-launch-cuda*.md) kept them at 4 and 7 rows (0.84-0.94x), and at 8 (0.98-0.99x,
# inside the runs' noise), and the launches before at 3, 5 and 6 rows, where they were not
# faster in both runs. Session 32 capped 5 and 6 rows too: a sweep of launch shapes
# (evidence/qmv-shapes-cuda.md, docs/lab.md) found the capped grid the fastest single launch there, and
# compare_qmv_launch against the uncapped ones put them at 0.94x and 0.91x. A capped grid's
# warp loads its next tile's first chunk while it finishes the one before, instead of waiting
# on DRAM at every tile's start.
CUDA_LAUNCH = {
    1: (2, 4, 0), 2: (2, 2, 3), 3: (2, 2, 3), 4: (2, 2, 1, 1, 396),
    5: (3, 2, 1, 1, 264), 6: (4, 2, 1, 2, 264), 7: (2, 2, 1, 1, 264), 8: (2, 2, 1, 1, 264),
}
CUDA_WARPS_PER_BLOCK = 4


def cuda_qmv_source_digest() -> str:
    """sha256 (first 12 hex digits) of the CUDA qmv kernel's source: which kernel a record of
    its parity or timing ran (the records' code digest changes with any file)."""
    return hashlib.sha256((_CUDA_HEADER + _CUDA_SOURCE).encode()).hexdigest()[:12]


@cache
def _cuda_kernel():
    return BakedCudaKernel(
        name="dflash2_qmv_2bit_g128",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=_CUDA_SOURCE,
        header=cuda_header(_CUDA_HEADER),
    )


def cuda_launch_fields(launch: tuple) -> tuple:
    """(R, C, prefetch, S, B) of a CUDA_LAUNCH entry, its optional fields filled in (S 1,
    B None: no cap)."""
    rows_per_warp, chunk, prefetch, *more = launch
    return rows_per_warp, chunk, prefetch, more[0] if more else 1, more[1] if len(more) > 1 else None


@cache
def _cuda_launch(leading: tuple, n: int, launch=None, swizzled=False) -> dict:
    """The kernel call's arguments for (..., K) rows of leading dims `leading` (M rows in all)
    and N outputs (built once: ~400 calls a verify)."""
    rows = math.prod(leading)
    rows_per_warp, chunk, prefetch, split, max_blocks = cuda_launch_fields(launch or CUDA_LAUNCH[rows])
    if max_blocks and CUDA_WARPS_PER_BLOCK % split:
        # With the grid's warps not a multiple of S, the last warps' tiles (qmv_split_rows'
        # stride rounds down) would repeat tiles other warps compute: same bits, wasted work.
        raise ValueError(f"a capped grid needs S ({split}) to divide {CUDA_WARPS_PER_BLOCK} warps a block")
    warps = -(-n // rows_per_warp) * split
    blocks = -(-warps // CUDA_WARPS_PER_BLOCK)
    if max_blocks:
        blocks = min(blocks, max_blocks)
    return dict(
        template=[("M", rows), ("S", split), ("R", rows_per_warp), ("C", chunk), ("PREFETCH", int(prefetch)),
                  ("TILES", bool(max_blocks)), ("SWIZZLED", swizzled)],
        grid=(32 * blocks, CUDA_WARPS_PER_BLOCK, 1),
        threadgroup=(32, CUDA_WARPS_PER_BLOCK, 1),
        output_shapes=[(*leading, n)],
        output_dtypes=[mx.float16],
    )


SWIZZLE_WIDTH = 512  # a warp's step: swizzled rows permute each 512 elements


def swizzle_steps(x):
    """(..., K) rows, K a multiple of 512, in the order the CUDA kernels' SWIZZLED layout
    holds them (the rotation writes it, the qmv reads it): in each 512-wide step, the 32
    lanes' first 8 elements (16 * lane + 0..7), then their last 8."""
    k = x.shape[-1]
    steps = x.reshape(*x.shape[:-1], k // SWIZZLE_WIDTH, 32, 2, 8)
    return mx.swapaxes(steps, -3, -2).reshape(x.shape)


def _swizzled_cuda_matmul(x, weight, scales, biases):
    """cuda_matmul of plain rows through its swizzled layout (the self-test's second layout)."""
    return cuda_matmul(swizzle_steps(x), weight, scales, biases, swizzled=True)


def cuda_matmul(x, weight, scales, biases, launch=None, swizzled=False):
    """(..., K) fp16 rows, M in all -> (..., N) through the CUDA kernel; no self-test gate.
    The kernel reads M rows of K from x's row-contiguous data (K from the weight), so no
    reshape is built around it.

    launch: (R, C, prefetch[, S[, B]]) to override CUDA_LAUNCH (for the tuning sweep).
    swizzled: x's rows are in swizzle_steps' order (K a multiple of 512)."""
    if swizzled and packed_width(weight) % SWIZZLE_WIDTH:
        raise ValueError(f"swizzled rows need K a multiple of {SWIZZLE_WIDTH}, got {packed_width(weight)}")
    call = _cuda_launch(x.shape[:-1], weight.shape[0], launch and tuple(launch), swizzled)
    return _cuda_kernel()(inputs=[x, weight, scales, biases], **call)[0]


# ---------------------------------------------------------------------------
# qmv: dispatch


def kernel_supports(backend: str, n: int, k: int) -> bool:
    """Shapes the backend's kernel takes. Metal: only those MLX sends to qmv_fast."""
    if backend == "metal":
        return n % 8 == 0 and k % 512 == 0
    return True


def backend_kernel(backend: str) -> Optional[Kernel]:
    """The backend's qmv kernel; None where per-row stock calls serve (CPU)."""
    return {"cuda": cuda_matmul, "metal": metal_matmul}.get(backend)


# backend -> whether the last self-test of the real kernel passed.
_verified: dict = {}
_warned: set = set()


def _serving_kernel(backend: str, n: int, k: int, rows: int) -> Optional[Kernel]:
    if rows == 1 and backend != "cuda":
        return None  # MLX's own single-row call is the reference itself
    if backend_kernel(backend) is None:
        return None  # no kernel here: the reference's per-row calls serve
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


def check_packed_weights(weight, scales, biases):
    """TypeError unless weight, scales and biases are a 2-bit, group-128 packed matrix
    (ValueError where its K is not a whole number of groups)."""
    if weight.dtype != mx.uint32 or weight.ndim != 2:
        raise TypeError(f"weight must be a 2-D uint32 array, got {weight.dtype} {weight.shape}")
    n, k = weight.shape[0], packed_width(weight)
    if k % GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of the group size {GROUP_SIZE}")
    for name, array in (("scales", scales), ("biases", biases)):
        if array.dtype != mx.float16 or tuple(array.shape) != (n, k // GROUP_SIZE):
            raise TypeError(
                f"{name} must be float16 {(n, k // GROUP_SIZE)}, got {array.dtype} {array.shape}"
            )


def _check_arguments(x, weight, scales, biases):
    if x.dtype != mx.float16:
        raise TypeError(f"x must be float16, got {x.dtype}")
    check_packed_weights(weight, scales, biases)
    k = packed_width(weight)
    if x.ndim == 0 or x.shape[-1] != k:
        raise ValueError(f"x must end in K={k}, got shape {x.shape}")
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
    return exact_rows(x, weight, scales, biases)


def exact_rows(x, weight, scales, biases):
    """exact_quantized_matmul's work on (..., K) fp16 rows, at most 8 in all, without its
    argument checks: for callers whose weights check_packed_weights passed (the verify
    forward's, about 400 calls a round) and whose rows they count themselves."""
    k = x.shape[-1]
    kernel = _serving_kernel(backend_name(), weight.shape[0], k, x.size // k)
    return kernel(x, weight, scales, biases) if kernel else stock_rows(x, weight, scales, biases)


# ---------------------------------------------------------------------------
# qmv: self-test


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


def self_test(kernel: Optional[Kernel] = None, shapes=None, seed: int = 0) -> SelfTestResult:
    """Check a kernel bit for bit against MLX's single-row calls on this backend.

    kernel: (x (M, K), weight, scales, biases) -> (M, N); default: this
    backend's own, whose serving is then switched on or off by the outcome.
    shapes: (N, K) pairs; default DEFAULT_SHAPES. For each shape, every input
    kind and rows 1..8 the kernel's rows must equal the single-row calls; MLX's
    own multi-row call is counted alongside as the negative control. The CUDA
    kernel is checked in both its layouts where K allows the swizzled one (the
    rotation hands it swizzled rows). Off the kernels' backends the per-row calls
    serve themselves: nothing to test.
    """
    backend = backend_name()
    own = kernel is None
    if own and backend_kernel(backend) is None:
        return _no_kernel_result(backend)
    kernel = kernel or backend_kernel(backend)
    shapes = [tuple(s) for s in (shapes or DEFAULT_SHAPES)]
    cases, mismatches, stock_mismatches, reason = [], 0, 0, None
    key = mx.random.key(seed)
    try:
        for n, k in shapes:
            if own and not kernel_supports(backend, n, k):
                continue  # served row by row, nothing to prove
            layouts = {"rows": kernel}
            if own and backend == "cuda" and k % SWIZZLE_WIDTH == 0:
                layouts["swizzled"] = _swizzled_cuda_matmul
            key, weight_key = mx.random.split(key)
            weight, scales, biases = make_weights(n, k, weight_key)
            for kind in INPUT_KINDS:
                key, input_key = mx.random.split(key)
                x = make_inputs(kind, MAX_ROWS, k, input_key)
                want = stock_rows(x, weight, scales, biases)
                got = {layout: [call(x[:rows], weight, scales, biases) for rows in range(1, MAX_ROWS + 1)]
                       for layout, call in layouts.items()}
                stock = [stock_quantized_matmul(x[:rows], weight, scales, biases) for rows in range(1, MAX_ROWS + 1)]
                mx.eval(want, got, stock)
                for (layout, outs), rows in itertools.product(got.items(), range(1, MAX_ROWS + 1)):
                    out = outs[rows - 1]
                    differ = _differing(out, want[:rows])
                    stock_differ = _differing(stock[rows - 1], want[:rows]) if layout == "rows" else None
                    cases.append(
                        {
                            "shape": [n, k],
                            "rows": rows,
                            "input": kind,
                            "layout": layout,
                            "mismatches": differ,
                            "stock_mismatches": stock_differ,
                        }
                    )
                    mismatches += differ
                    stock_mismatches += stock_differ or 0
                    if differ and reason is None:
                        reason = (
                            f"{backend} kernel differs from MLX's single-row matmul at shape "
                            f"(N={n}, K={k}), rows={rows}, input={kind}, layout={layout}: "
                        ) + _first_difference(out, want[:rows])[0]
    except Exception as error:  # a kernel that fails to build or run fails the test
        reason = f"{backend} kernel raised {type(error).__name__}: {error}"
    ok = reason is None
    if own:
        _verified[backend] = ok
    return SelfTestResult(ok, backend, reason, mismatches, stock_mismatches, cases)
