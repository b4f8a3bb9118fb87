"""Exact 2-bit matmul for fp32 rows (qmv32): stock reference, CUDA, dispatch, self-test.

The real file's unpacked tensors (norms, convolution, gates) are fp32, so its residual
stream and every packed matmul's input are fp32. MLX's single-row call then runs
`qmv<float>` (mlx/backend/cuda/quantized/qmm/qmv.cu, MLX 0.32.2; quantized_matmul casts
the fp16 scales and biases to fp32 first, exactly), whose arithmetic differs from the
fp16 one in dflash2_kernel_qmv:

- a lane takes 8 elements a step, not 16: lane l owns elements 8l + 256r + i, i < 8,
  one fp32 accumulator per slot i, from +0;
- each weight is dequantized in fp32, code * scale + bias (nvcc contracts it into one
  fma by default: variant "fma"; "mul_add" rounds the product first, for a build that
  does not), then the slot's accumulator takes fma(x, w, acc);
- K % 256: lanes whose 8 elements start before K take one more step;
- the 8 slots are summed in float from +0 in slot order, then cg::reduce's xor
  butterfly 16..1; lane 0 stores the float as is.

`exact_rows_fp32(x, weight, scales, biases)` gives 1..8 fp32 rows at once, each row MLX's
single-row result bit for bit, the weights read once for all rows. (MLX's own call sends 2..7
rows to qmv too, one grid row each, so exact but reading the weights once per row; 8 rows go
to qmm_naive, a SIMT GEMM that sums in another order: the self-test's negative control.) On
CUDA one row takes the kernel too: MLX's fp32 call first converts the fp16 scales and biases
to fp32 (ops.cpp quantized_matmul: two more launches, every call), where the kernel reads
them as fp16, exactly. On Metal MLX's fp32 single row is qmv_fast with T float, which
dflash2_kernel_qmv_metal's kernel copies for any T (never run: no Mac; its self-test gates it
there), for 2..8 rows; one row there is MLX's own call. On CPU the rows take MLX's single-row
calls one by one.
"""

from functools import cache, partial

import mlx.core as mx

from dflash2_kernel_base import (
    FP32_INPUT_KINDS, MAX_ROWS, BakedCudaKernel, SelfTestResult, _differing, _no_kernel_result, _variants_result,
    backend_name, cuda_header, make_inputs_fp32, run_case,
)
from dflash2_kernel_qmv import (
    DEFAULT_SHAPES, kernel_supports, make_weights, stock_quantized_matmul, stock_rows,
)
from dflash2_kernel_qmv_metal import metal_matmul

# backend -> its kernel's variants. cuda: the dequantization fused (nvcc's default) or not;
# metal: qmv_fast's arithmetic as MLX's source writes it (dflash2_kernel_qmv_metal's kernel).
QMV32_VARIANTS = {"cuda": ("fma", "mul_add"), "metal": ("qmv_fast",)}
# A tail-only K (128), a tail after steps (640), and a partial last warp of output rows (42).
FP32_SHAPES_SMALL = DEFAULT_SHAPES + ((20, 128),)

# ---------------------------------------------------------------------------
# qmv32: CUDA

# MIT License, Copyright (c) 2023 Apple Inc. (arithmetic of
# mlx/backend/cuda/quantized/qmm/qmv.cu, MLX 0.32.2, for T = float). See NOTICE.txt.
_CUDA_HEADER = r"""
#include <cuda_fp16.h>

namespace dflash2_qmv32 {

constexpr int kLaneElems = 8;                  // elements one lane takes per step
constexpr int kStepElems = 32 * kLaneElems;    // 256: elements a warp takes per step

// This lane's pointers at the current step: its 8 elements of x in each of M activation
// rows and, in each of R output rows, the word holding their codes (the half `half` of it),
// their group's scale and bias. Made once and advanced a step (256 elements: 16 words, 2
// groups) at a time, so a step's loads need no index arithmetic.
template <int M, int R>
struct LanePointers {
  const float* x[M];
  const uint32_t* w[R];
  const __half* s[R];
  const __half* b[R];
  int half;

  __device__ __forceinline__ void advance() {
#pragma unroll
    for (int m = 0; m < M; ++m) x[m] += kStepElems;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      w[j] += kStepElems / 16;
      s[j] += kStepElems / 128;
      b[j] += kStepElems / 128;
    }
  }
};

// This lane's 8 elements of the step `at` points at, in R output rows and M activation rows:
// the weights dequantized once, each used by all M rows.
template <int M, int R, bool FMA>
__device__ __forceinline__ void accumulate_step(const LanePointers<M, R>& at, float (&acc)[R][M][kLaneElems]) {
  float xs[M][kLaneElems];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float4* xv = reinterpret_cast<const float4*>(at.x[m]);
    const float4 lo = __ldg(xv);
    const float4 hi = __ldg(xv + 1);
    xs[m][0] = lo.x; xs[m][1] = lo.y; xs[m][2] = lo.z; xs[m][3] = lo.w;
    xs[m][4] = hi.x; xs[m][5] = hi.y; xs[m][6] = hi.z; xs[m][7] = hi.w;
  }
#pragma unroll
  for (int j = 0; j < R; ++j) {
    // Element e of a word sits at bits 2e..2e+1.
    const uint32_t codes = __ldg(at.w[j]) >> (16 * at.half);
    const float scale = __half2float(__ldg(at.s[j]));
    const float bias = __half2float(__ldg(at.b[j]));
#pragma unroll
    for (int i = 0; i < kLaneElems; ++i) {
      const float code = static_cast<float>((codes >> (2 * i)) & 3u);
      const float w = FMA ? __fmaf_rn(code, scale, bias) : __fadd_rn(__fmul_rn(code, scale), bias);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        acc[j][m][i] = __fmaf_rn(xs[m][i], w, acc[j][m][i]);
      }
    }
  }
}

// y[m, first..first+R) for M activation rows: one warp, lane = threadIdx.x. Rows past n
// (the last warp only) recompute row n - 1 and are never stored.
template <int M, int R, bool FMA>
__device__ __forceinline__ void qmv32_rows(
    const float* __restrict__ x,
    const uint32_t* __restrict__ w,
    const __half* __restrict__ scales,
    const __half* __restrict__ biases,
    float* __restrict__ y,
    int n,
    int k) {
  const int lane = threadIdx.x;
  const int first = (blockIdx.x * blockDim.y + threadIdx.y) * R;
  if (first >= n) {
    return;
  }
  // Lane l's elements start at 8 l: word l / 2 (its half l % 2), group l / 16.
  LanePointers<M, R> at;
#pragma unroll
  for (int m = 0; m < M; ++m) at.x[m] = x + int64_t(m) * k + lane * kLaneElems;
  at.half = lane & 1;
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int64_t row = first + j < n ? first + j : n - 1;
    at.w[j] = w + row * (k / 16) + lane / 2;
    at.s[j] = scales + row * (k / 128) + lane / 16;
    at.b[j] = biases + row * (k / 128) + lane / 16;
  }

  // MLX's fp32 accumulators, one per element slot, starting at +0.
  float acc[R][M][kLaneElems];
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int i = 0; i < kLaneElems; ++i)
        acc[j][m][i] = 0.0f;

  const int steps = k / kStepElems;
#pragma unroll 4
  for (int r = 0; r < steps; ++r) {
    accumulate_step<M, R, FMA>(at, acc);
    at.advance();
  }
  // MLX's tail for K % 256: lanes whose 8 elements start before k take one more step.
  const int rest = k % kStepElems;
  if (rest && lane * kLaneElems < rest) {
    accumulate_step<M, R, FMA>(at, acc);
  }

  // Slots summed in float from +0 in slot order, then the xor butterfly of cg::reduce;
  // lane 0 stores the float.
#pragma unroll
  for (int j = 0; j < R; ++j) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kLaneElems; ++i) {
        sum = __fadd_rn(sum, acc[j][m][i]);
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset));
      }
      if (lane == 0 && first + j < n) {
        y[m * n + first + j] = sum;
      }
    }
  }
}

}  // namespace dflash2_qmv32
"""

_CUDA_SOURCE = "dflash2_qmv32::qmv32_rows<M, R, FMA>(x, w, scales, biases, y, w_shape[0], w_shape[1] * 16);"
CUDA_WARPS_PER_BLOCK = 4
# Output rows a warp takes, by activation rows: R * M * 8 accumulators in registers.
CUDA_ROWS_PER_WARP = {1: 4, 2: 4, 3: 2, 4: 2, 5: 1, 6: 1, 7: 1, 8: 1}


@cache
def _cuda_kernel():
    return BakedCudaKernel(
        name="dflash2_qmv32_2bit_g128",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=_CUDA_SOURCE,
        header=cuda_header(_CUDA_HEADER),
    )


def cuda_template(rows: int, variant: str) -> list:
    """The CUDA kernel's template for `rows` activation rows and one of QMV32_VARIANTS["cuda"]."""
    return [("M", rows), ("R", CUDA_ROWS_PER_WARP[rows]), ("FMA", variant == "fma")]


def cuda_matmul_fp32(x, weight, scales, biases, variant="fma"):
    """(..., K) fp32 rows, M in all (1..8) -> (..., N) fp32 through the kernel; no self-test
    gate. The kernel reads M rows of K from x's row-contiguous data (K from the weight)."""
    rows, n = x.size // x.shape[-1], weight.shape[0]
    warps = -(-n // CUDA_ROWS_PER_WARP[rows])  # a warp per R output rows
    blocks = -(-warps // CUDA_WARPS_PER_BLOCK)
    return _cuda_kernel()(
        inputs=[x, weight, scales, biases],
        template=cuda_template(rows, variant),
        grid=(32 * blocks, CUDA_WARPS_PER_BLOCK, 1),
        threadgroup=(32, CUDA_WARPS_PER_BLOCK, 1),
        output_shapes=[(*x.shape[:-1], n)],
        output_dtypes=[mx.float32],
    )[0]


# ---------------------------------------------------------------------------
# qmv32: dispatch

# backend -> the variant the last self-test verified, or None after a failure.
_qmv32_serving: dict = {}


def variant_kernel(backend: str, variant: str):
    """The kernel of one variant: CUDA's qmv<float> replica, or Metal's qmv_fast one (the
    fp16 kernel's source with T float: dflash2_kernel_qmv_metal.metal_matmul)."""
    if backend == "metal":
        return metal_matmul
    return partial(cuda_matmul_fp32, variant=variant)


def exact_rows_fp32(x, weight, scales, biases):
    """x @ W.T for 1..8 fp32 rows (..., K) of a packed 2-bit, group-128 W whose weights
    check_packed_weights passed, each row bitwise MLX's single-row call; (..., N) fp32."""
    k = x.shape[-1]
    rows, backend = x.size // k, backend_name()
    if (rows > 1 or backend == "cuda") and backend in QMV32_VARIANTS and kernel_supports(backend, weight.shape[0], k):
        if backend not in _qmv32_serving:
            self_test_qmv32()
        variant = _qmv32_serving.get(backend)
        if variant is not None:
            return variant_kernel(backend, variant)(x, weight, scales, biases)
    return stock_rows(x, weight, scales, biases)


# ---------------------------------------------------------------------------
# qmv32: self-test


def self_test_qmv32(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """Check fp32 rows 1..8 bit for bit against MLX's single-row calls (2..8 on Metal, whose
    one row exact_rows_fp32 leaves to MLX).

    kernel: (x (M, K), weight, scales, biases) -> (M, N), tested as variant "kernel";
    default: this backend's variants (QMV32_VARIANTS), the first that passes then serves (cpu:
    no kernel to test), at the shapes the backend's kernel takes. shapes: (N, K) pairs, default
    the small ones. MLX's own 8-row call is counted alongside (the control: on CUDA its
    qmm_naive sums in another order; at 2..7 rows MLX's call is qmv, exact per row, so no control).
    """
    backend = backend_name()
    if kernel is None and backend not in QMV32_VARIANTS:
        return _no_kernel_result(backend)
    variants = ({"kernel": kernel} if kernel else
                {name: variant_kernel(backend, name) for name in QMV32_VARIANTS[backend]})
    shapes = [tuple(s) for s in (shapes or FP32_SHAPES_SMALL)
              if kernel is not None or kernel_supports(backend, *s)]
    differing = {name: 0 for name in variants}
    failures, cases = {}, []
    negative = {f"quantized_matmul(x[:{MAX_ROWS}])": 0}
    key = mx.random.key(seed)
    for n, k in shapes:
        key, weight_key = mx.random.split(key)
        weight, scales, biases = make_weights(n, k, weight_key)
        for kind in FP32_INPUT_KINDS:
            key, input_key = mx.random.split(key)
            x = make_inputs_fp32(kind, MAX_ROWS, k, input_key)
            want = stock_rows(x, weight, scales, biases)
            mx.eval(want)
            negative[f"quantized_matmul(x[:{MAX_ROWS}])"] += _differing(
                stock_quantized_matmul(x, weight, scales, biases), want)
            for name, matmul in variants.items():
                for rows in range(1 if backend == "cuda" or kernel else 2, MAX_ROWS + 1):
                    def compare(matmul=matmul, rows=rows):
                        return {"y": (matmul(x[:rows], weight, scales, biases), want[:rows])}

                    run_case(name, compare, {"shape": [n, k], "rows": rows, "input": kind},
                             f"(N, K)={(n, k)} rows={rows} input={kind}", differing, failures, cases)
    result = _variants_result(backend, differing, failures, negative, cases)
    if kernel is None:
        _qmv32_serving[backend] = result.variant
    return result
