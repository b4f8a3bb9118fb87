"""The exact 2-bit matmul on Metal: MLX's affine_qmv_fast with its load_vector and qdot copied
verbatim, several rows at once (dflash2_kernel_qmv dispatches to it and self-tests it).

- `metal_matmul(x, weight, scales, biases)`: (..., K) fp16 or fp32 rows -> (..., N), each row
  the single-row call's arithmetic (N % 8 == 0 and K % 512 == 0 only, as MLX). metal only.
"""

from functools import cache

import mlx.core as mx

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
  const device S* sc = scales;  // fp16, read as float exactly (MLX casts them to T for fp32 x)
  const device S* bi = biases;
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
        const device S* sl = sc + row * in_vec_size_g;
        const device S* bl = bi + row * in_vec_size_g;

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
    """(..., K) fp16 or fp32 rows (T: MLX's qmv_fast<float> for fp32 x, whose fp16 scales and
    biases MLX casts to float first: read here as half and widened, the same values), M in
    all -> (..., N) through the Metal kernel (which reads M rows of K, K from the weight); no
    self-test gate."""
    rows, n = x.size // x.shape[-1], weight.shape[0]
    return _metal_kernel()(
        inputs=[x, weight, scales, biases],
        template=[("T", x.dtype), ("S", scales.dtype), ("M", rows)],
        grid=(32, n // 4, 1),  # threadgroups (32, 2): one per 8 output rows, as MLX
        threadgroup=(32, 2, 1),
        output_shapes=[(*x.shape[:-1], n)],
        output_dtypes=[x.dtype],
    )[0]
