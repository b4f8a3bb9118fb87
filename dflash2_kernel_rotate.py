"""Hadamard rotation: stock reference, CUDA (one x by one or several sign vectors), Metal,
dispatch, self-test. dflash2_kernel_linear puts it ahead of the qmv.

- `rotate(x, block, signs)`: mlx-vlm's four-primitive `hadamard_transform`
  (astype fp32, times the fp32 signs, `mx.hadamard_transform`, astype back) in one
  launch with the same fp32 arithmetic (sign multiply never fused, MLX's
  hadamard_n radix-16 butterflies, fp32 scale multiply, round to fp16). fp32 rows (the
  real file's; cuda only): the same, the astypes no-ops (MLX returns the array itself),
  so the store is MLX's float one.
  cuda: copies hadamard.cuh; metal: copies hadamard.h; cpu: the stock chain.
  Gated per (K, block) and dtype; qmv, gdn and dense per backend.
"""

import itertools
import math
import struct
import warnings
from functools import cache

import mlx.core as mx
import numpy as np
from mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35 import hadamard_transform

from dflash2_kernel_base import (
    FP32_INPUT_KINDS, INPUT_KINDS, MAX_ROWS, BakedCudaKernel, SelfTestResult, _differing, _first_difference,
    _no_kernel_result, _variants_result, backend_name, cuda_header, make_inputs, make_inputs_fp32, run_case,
)
from dflash2_kernel_qmv import SWIZZLE_WIDTH, swizzle_steps

# ===========================================================================
# Hadamard rotation

# mlx-vlm 0.7.2's `hadamard_transform(x, block, signs)` (prism_hadamard_qwen35.py:11-23)
# is four primitives: astype float32, multiply by the fp32 signs,
# `mx.hadamard_transform(x.reshape(-1, block), scale=1/sqrt(block))`, astype back.
# `rotate(x, block, signs)` does the same in one kernel launch with the same fp32
# arithmetic, so its fp16 bits equal the chain's on this backend:
# - load: fp16 -> fp32 (exact), times the sign: one fp32 multiply, never fused
#   into the first butterfly (CUDA `__fmul_rn`);
# - MLX's `hadamard_n` for N = block <= 8192 (one launch, m = 1): radix-16 steps
#   and a final radix, i.e. radix-2 butterflies x[j] = a + b, x[j+h] = a - b on
#   strides 1, 2, 4, ..., N/2 in that order, in a fp32 shared buffer (MLX's T is
#   float32 here, so its buffer stores are exact);
# - store: one fp32 multiply by the scale (the fp32 rounding of the double
#   1/sqrt(block), as nanobind passes it), then fp32 -> fp16 round-to-nearest-even.

ROTATE_BLOCKS = (512, 1024, 2048, 4096)  # the blocks mlx-vlm accepts (prism_hadamard_qwen35.py:33)
ROTATE_INPUT_KINDS = INPUT_KINDS + ("nonfinite",)
ROTATE32_INPUT_KINDS = FP32_INPUT_KINDS + ("nonfinite",)  # fp32 rows' (make_rotate_inputs_fp32)
SIGN_KINDS = ("pm1", "general")  # the pack's +-1 signs; any fp32 values (one multiply, like MLX)
# (K, block): the 27B pack's rotated widths with every block that divides them;
# tiny widths covering the other block sizes (the tiny synthetic pack rotates K = 512).
ROTATE_SHAPES_27B = (
    (5120, 512), (5120, 1024),
    (6144, 512), (6144, 1024), (6144, 2048),
    (17408, 512), (17408, 1024),
)
ROTATE_SHAPES_SMALL = ((512, 512), (2048, 2048), (4096, 4096))


# ---------------------------------------------------------------------------
# rotate: stock reference


def stock_rotate(x, block, signs):
    """mlx-vlm's four-primitive chain: the reference every kernel must equal."""
    return hadamard_transform(x, block, signs)


def scale_bits(block: int) -> int:
    """Bits of the fp32 scale MLX receives: nanobind rounds the double 1/sqrt(block)."""
    return struct.unpack("<i", struct.pack("<f", 1 / math.sqrt(block)))[0]


# ---------------------------------------------------------------------------
# rotate: CUDA

# MIT License, Copyright (c) 2025 Apple Inc. (hadamard_radix_pow2 and hadamard_n of
# mlx/backend/cuda/device/hadamard.cuh, MLX 0.32.2, with T = float). See NOTICE.txt.
_CUDA_ROTATE_HEADER = r"""
namespace dflash2 {

template <int N>
struct Pow2Log2 {
  static_assert((N > 0) && ((N & (N - 1)) == 0), "N must be a positive power of two.");
  static constexpr int value = 1 + Pow2Log2<N / 2>::value;
};

template <>
struct Pow2Log2<1> {
  static constexpr int value = 0;
};

// fp16 rows: exact widening, and the chain's last astype rounds to nearest. fp32 rows: the
// chain's astypes are no-ops, so what MLX's hadamard stores is the result.
__device__ __forceinline__ float widened(__half v) { return __half2float(v); }
__device__ __forceinline__ float widened(float v) { return v; }
__device__ __forceinline__ void store_as(__half* out, float v) { *out = __float2half_rn(v); }
__device__ __forceinline__ void store_as(float* out, float v) { *out = v; }

// hadamard.cuh:24-41, unchanged.
template <int R>
__device__ __forceinline__ void hadamard_radix_pow2(float* x) {
  constexpr int kLogR = Pow2Log2<R>::value;
  int h = 1;
#pragma unroll
  for (int s = 0; s < kLogR; ++s) {
#pragma unroll
    for (int i = 0; i < R / 2; ++i) {
      int k = i & (h - 1);
      int j = ((i - k) << 1) + k;
      float a = x[j];
      float b = x[j + h];
      x[j] = a + b;
      x[j + h] = a - b;
    }
    h <<= 1;
  }
}

// hadamard_n<float, N, min(N, 16), read_width, 1> (hadamard.cuh:43-146; launch
// parameters hadamard.cu:98-104) for the one transform of this block, with the
// chain's first two primitives fused into the load and its last into the store.
// Launch: one block of N / 16 threads per transform (MLX loops blocks over
// transforms; each transform's arithmetic is the same). SWIZZLED: each element stored at its
// place in the qmv's swizzled rows (swizzle_steps), which the transform's N >= 512 keeps
// inside its own block.
template <int N, int BLOCKS, int SCALE_BITS, bool SWIZZLED, typename T>
__device__ __forceinline__ void rotate_block(
    const T* __restrict__ in, const float* __restrict__ signs, T* __restrict__ out) {
  constexpr int max_radix = N < 16 ? N : 16;
  constexpr int read_width = N == 2 ? 2 : 4;
  constexpr int kNumThreads = N / max_radix;
  constexpr int kLogN = Pow2Log2<N>::value;
  constexpr int kLogR = Pow2Log2<max_radix>::value;
  constexpr int kNumSteps = kLogN / kLogR;
  constexpr int kLogFinal = kLogN % kLogR;
  constexpr int kFinalRadix = 1 << kLogFinal;

  if (threadIdx.x >= kNumThreads) {
    return;
  }

  __shared__ float buf[N];
  int i = threadIdx.x;
  const long long transform = blockIdx.x;
  const long long base = transform * N;
  const float* sign = signs + (transform % BLOCKS) * N;  // signs span K = BLOCKS * N
  const float scale = __int_as_float(SCALE_BITS);

  // x.astype(float32) * signs: exact widening, one fp32 multiply (never an fma).
#pragma unroll
  for (int j = 0; j < max_radix / read_width; ++j) {
    int index = j * read_width * kNumThreads + i * read_width;
#pragma unroll
    for (int r = 0; r < read_width; ++r) {
      buf[index + r] = __fmul_rn(widened(in[base + index + r]), sign[index + r]);
    }
  }
  __syncthreads();

  float x[max_radix];
  int h = 1;

#pragma unroll
  for (int s = 0; s < kNumSteps; ++s) {
    int k = i & (h - 1);
    int j = ((i - k) << kLogR) + k;

#pragma unroll
    for (int r = 0; r < max_radix; ++r) {
      x[r] = buf[j + h * r];
    }

    hadamard_radix_pow2<max_radix>(x);

#pragma unroll
    for (int r = 0; r < max_radix; ++r) {
      buf[j + h * r] = x[r];
    }

    h <<= kLogR;
    __syncthreads();
  }

  if constexpr (kFinalRadix > 1) {
#pragma unroll
    for (int t = 0; t < max_radix / kFinalRadix; ++t) {
      int index = i + t * kNumThreads;
      int k = index & (h - 1);
      int j = ((index - k) << kLogFinal) + k;
#pragma unroll
      for (int r = 0; r < kFinalRadix; ++r) {
        x[r] = buf[j + h * r];
      }

      hadamard_radix_pow2<kFinalRadix>(x);

#pragma unroll
      for (int r = 0; r < kFinalRadix; ++r) {
        buf[j + h * r] = x[r];
      }
    }
    __syncthreads();
  }

  // MLX stores float(val * scale); for fp16 rows the chain's astype rounds it (RN).
#pragma unroll
  for (int j = 0; j < max_radix / read_width; ++j) {
    int index = j * read_width * kNumThreads + i * read_width;
#pragma unroll
    for (int r = 0; r < read_width; ++r) {
      const long long at = base + index + r;  // element 16 * lane + 8 * half + i of a 512 step
      const long long place = SWIZZLED ? (at & ~511LL) | ((at & 8) << 5) | ((at >> 1) & 0xF8) | (at & 7) : at;
      store_as(out + place, __fmul_rn(buf[index + r], scale));
    }
  }
}

}  // namespace dflash2
"""

_CUDA_ROTATE_SOURCE = "dflash2::rotate_block<N, BLOCKS, SCALE_BITS, SWIZZLED>(x, signs, y);"


@cache
def _cuda_rotate_kernel(outputs: int = 1):
    """The rotation kernel; with several outputs, one x rotated by each of `outputs` sign
    vectors in one launch (grid.y picks the signs and the output): the rotations of linears
    that share their input (q/k/v, a GatedDeltaNet's in_proj_qkv and in_proj_z, an MLP's gate
    and up), each rotate_block's arithmetic."""
    if outputs == 1:
        return BakedCudaKernel(name="dflash2_hadamard_rotate", input_names=["x", "signs"], output_names=["y"],
                               source=_CUDA_ROTATE_SOURCE, header=cuda_header(_CUDA_ROTATE_HEADER))

    def pick(name):  # blockIdx.y == 2 ? name2 : blockIdx.y == 1 ? name1 : name0
        chosen = f"{name}0"
        for index in range(1, outputs):
            chosen = f"blockIdx.y == {index} ? {name}{index} : {chosen}"
        return chosen

    return BakedCudaKernel(
        name=f"dflash2_hadamard_rotate_{outputs}",
        input_names=["x", *(f"signs{index}" for index in range(outputs))],
        output_names=[f"y{index}" for index in range(outputs)],
        source=f"dflash2::rotate_block<N, BLOCKS, SCALE_BITS, SWIZZLED>(x, {pick('signs')}, {pick('y')});",
        header=cuda_header(_CUDA_ROTATE_HEADER),
    )


@cache
def cuda_rotate_plan(k: int, block: int, swizzled: bool = False, outputs: int = 1, dtype=mx.float16):
    """(x, signs) -> rotated x for rows of width k, fp16 (or dtype float32) (swizzled: in
    swizzle_steps' order, for the fp16 qmv; K a multiple of 512); with several outputs
    (x, [signs, ...]) -> [x rotated by each], in one launch. No self-test gate."""
    if swizzled and k % SWIZZLE_WIDTH:
        raise ValueError(f"swizzled rows need K a multiple of {SWIZZLE_WIDTH}, got {k}")
    kernel = _cuda_rotate_kernel(outputs)
    launch = dict(template=[("N", block), ("BLOCKS", k // block), ("SCALE_BITS", scale_bits(block)),
                            ("SWIZZLED", swizzled)],
                  threadgroup=(block // 16, 1, 1), output_dtypes=[dtype] * outputs)
    # grid counts threads: block / 16 per transform, x.size / block transforms (and y: which output).
    if outputs == 1:
        def run(x, signs):
            return kernel(inputs=[x, signs], grid=(x.size // 16, 1, 1), output_shapes=[x.shape], **launch)[0]
    else:
        def run(x, signs):
            return kernel(inputs=[x, *signs], grid=(x.size // 16, outputs, 1), output_shapes=[x.shape] * outputs,
                          **launch)

    return run


# ---------------------------------------------------------------------------
# rotate: Metal

# MIT License, Copyright (c) 2024 Apple Inc. (radix_func and hadamard_n of
# mlx/backend/metal/kernels/hadamard.h, MLX 0.32.2, with T = float). See NOTICE.txt.
_METAL_ROTATE_HEADER = r"""
#include <metal_stdlib>

using namespace metal;

namespace dflash2 {

// hadamard.h:9-27, unchanged (STEEL_PRAGMA_UNROLL spelled out).
template <short R>
METAL_FUNC void radix_func(thread float* x) {
  constexpr short logR = __builtin_ctz(R);
  short h = 1;
  _Pragma("clang loop unroll(full)")
  for (short s = 0; s < logR; s++) {
    _Pragma("clang loop unroll(full)")
    for (short i = 0; i < R / 2; i++) {
      short k = i & (h - 1);
      short j = ((i - k) << 1) + k;
      float a = x[j];
      float b = x[j + h];
      x[j] = a + b;
      x[j + h] = a - b;
    }
    h <<= 1;
  }
}

}  // namespace dflash2
"""

# hadamard_n<float, N, min(N, 16), read_width, 1> (hadamard.h:29-139; launch
# hadamard.cpp:70-82: threadgroup N / 16, grid (N / 16, transforms)), with the
# chain's astype and sign multiply fused into the load and its astype into the store.
_METAL_ROTATE_SOURCE = r"""
  constexpr short max_radix = N < 16 ? N : 16;
  constexpr short read_width = N == 2 ? 2 : 4;
  constexpr short num_threads = N / max_radix;
  constexpr short logN = __builtin_ctz(N);
  constexpr short logR = __builtin_ctz(max_radix);
  constexpr short num_steps = logN / logR;
  constexpr short logFinal = logN % logR;
  constexpr short final_radix = 1 << (logFinal);
  const float scale = as_type<float>(SCALE_BITS);

  uint3 elem = thread_position_in_grid;
  int batch_idx = elem.y * N;
  short i = elem.x;
  const device float* sign = signs + (elem.y % BLOCKS) * N;  // signs span K = BLOCKS * N

  threadgroup float buf[N];

  // x.astype(float32) * signs: exact widening, one fp32 multiply.
  _Pragma("clang loop unroll(full)")
  for (short j = 0; j < max_radix / read_width; j++) {
    short index = j * read_width * num_threads + i * read_width;
    _Pragma("clang loop unroll(full)")
    for (short r = 0; r < read_width; r++) {
      buf[index + r] = static_cast<float>(x[batch_idx + index + r]) * sign[index + r];
    }
  }

  threadgroup_barrier(mem_flags::mem_threadgroup);

  float v[max_radix];
  short h = 1;

  _Pragma("clang loop unroll(full)")
  for (short s = 0; s < num_steps; s++) {
    short k = i & (h - 1);
    short j = ((i - k) << logR) + k;

    _Pragma("clang loop unroll(full)")
    for (short r = 0; r < max_radix; r++) {
      v[r] = buf[j + h * r];
    }

    dflash2::radix_func<max_radix>(v);

    _Pragma("clang loop unroll(full)")
    for (short r = 0; r < max_radix; r++) {
      buf[j + h * r] = v[r];
    }

    h <<= logR;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (final_radix > 1) {
    _Pragma("clang loop unroll(full)")
    for (int t = 0; t < max_radix / final_radix; t++) {
      short index = i + t * num_threads;
      short k = index & (h - 1);
      short j = ((index - k) << logFinal) + k;
      _Pragma("clang loop unroll(full)")
      for (short r = 0; r < final_radix; r++) {
        v[r] = buf[j + h * r];
      }

      dflash2::radix_func<final_radix>(v);

      _Pragma("clang loop unroll(full)")
      for (short r = 0; r < final_radix; r++) {
        buf[j + h * r] = v[r];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // MLX stores float(buf * scale); the chain's astype rounds it to fp16.
  _Pragma("clang loop unroll(full)")
  for (short j = 0; j < max_radix / read_width; j++) {
    short index = j * read_width * num_threads + i * read_width;
    _Pragma("clang loop unroll(full)")
    for (short r = 0; r < read_width; r++) {
      float val = buf[index + r] * scale;
      y[batch_idx + index + r] = static_cast<half>(val);
    }
  }
"""


@cache
def _metal_rotate_kernel():
    return mx.fast.metal_kernel(
        name="dflash2_hadamard_rotate",
        input_names=["x", "signs"],
        output_names=["y"],
        source=_METAL_ROTATE_SOURCE,
        header=_METAL_ROTATE_HEADER,
        compile_options={"math_mode": "safe"},  # MLX JIT-builds its hadamard in safe mode too
    )


@cache
def metal_rotate_plan(k: int, block: int):
    """(x, signs) -> rotated x for fp16 rows of width k; no self-test gate."""
    kernel = _metal_rotate_kernel()
    template = [("N", block), ("BLOCKS", k // block), ("SCALE_BITS", scale_bits(block))]
    threads = block // 16

    def run(x, signs):
        return kernel(
            inputs=[x, signs],
            template=template,
            grid=(threads, x.size // block, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=[x.shape],
            output_dtypes=[mx.float16],
        )[0]

    return run


# ---------------------------------------------------------------------------
# rotate: dispatch

_ROTATE_PLANS = {"cuda": cuda_rotate_plan, "metal": metal_rotate_plan}


def backend_rotate(backend: str):
    """This backend's rotation with no self-test gate: its kernel, or the stock chain."""
    kernel_plan = _ROTATE_PLANS.get(backend)
    if kernel_plan is None:
        return stock_rotate

    def run(x, block, signs):
        return kernel_plan(x.shape[-1], block)(x, signs)

    return run


def _stock_rotate_plan(block: int):
    def run(x, signs):
        return stock_rotate(x, block, signs)

    return run


# (backend, K, block) -> whether the kernel passed its self-test there (fp16 rows, fp32 rows).
_rotate_verified: dict = {}
_rotate_fp32_verified: dict = {}
# (K, block, dtype) -> (x, signs) -> rotated x, chosen once.
_rotate_plans: dict = {}


def _rotate_kernel(backend: str, dtype):
    """(plan maker, its verdicts, its self-test, the self-test's name) for rows of this dtype
    on this backend, or None where only the stock chain serves."""
    if dtype == mx.float16 and backend in _ROTATE_PLANS:
        return _ROTATE_PLANS[backend], _rotate_verified, self_test_rotate, "self-test"
    if dtype == mx.float32 and backend == "cuda":
        return (lambda k, block: cuda_rotate_plan(k, block, dtype=mx.float32),
                _rotate_fp32_verified, self_test_rotate_fp32, "fp32 self-test")
    return None


def _choose_rotate_plan(k: int, block: int, dtype):
    backend = backend_name()
    kernel = _rotate_kernel(backend, dtype)
    plan = _stock_rotate_plan(block)
    if kernel and block in ROTATE_BLOCKS and k % block == 0:
        kernel_plan, verified, self_test, test_name = kernel
        if (backend, k, block) not in verified:
            result = self_test([(k, block)])
            if not result.ok:
                warnings.warn(f"dflash2 {backend} rotation kernel failed its {test_name}: {result.reason}")
        if verified[(backend, k, block)]:
            plan = kernel_plan(k, block)
    _rotate_plans[(k, block, dtype)] = plan
    return plan


def rotation_serves(k: int, block: int) -> bool:
    """Whether the CUDA kernel rotates fp16 rows at (K, block) here (its self-test run first
    where none has run at that shape)."""
    if (k, block, mx.float16) not in _rotate_plans:
        _choose_rotate_plan(k, block, mx.float16)  # the self-test at (K, block), both layouts
    return backend_name() == "cuda" and bool(_rotate_verified.get(("cuda", k, block)))


def rotate(x, block, signs):
    """`hadamard_transform(x, block, signs)` of mlx-vlm in one launch, same bits.

    x: (..., K) activations, any number of rows; block divides K; signs: float32 (K,).
    fp16 x with a block in ROTATE_BLOCKS goes through the backend's kernel once its
    self-test passed at (K, block), fp32 x through the CUDA kernel once its fp32 self-test
    passed there; anything else runs the stock chain.
    """
    plan = _rotate_plans.get((x.shape[-1], block, x.dtype))
    if plan is None:
        plan = _choose_rotate_plan(x.shape[-1], block, x.dtype)
    return plan(x, signs)


# ---------------------------------------------------------------------------
# rotate: self-test


def make_rotate_inputs(kind: str, rows: int, k: int, key) -> mx.array:
    """fp16 activations of one kind (ROTATE_INPUT_KINDS). `nonfinite` puts, per row,
    +inf (rows 0, 3, ...), an adjacent +inf/-inf pair (rows 1, 4, ...: inf - inf in the
    first butterfly) or a NaN (rows 2, 5, ...) at a random even column of normal values."""
    if kind != "nonfinite":
        return make_inputs(kind, rows, k, key)
    k1, k2 = mx.random.split(key)
    x = mx.random.normal((rows, k), key=k1)
    column = mx.arange(k)[None, :]
    at = mx.random.randint(0, k // 2, (rows, 1), key=k2) * 2
    pattern = mx.arange(rows)[:, None] % 3
    x = mx.where((column == at) & (pattern < 2), math.inf, x)
    x = mx.where((column == at + 1) & (pattern == 1), -math.inf, x)
    x = mx.where((column == at) & (pattern == 2), math.nan, x)
    return x.astype(mx.float16)


def make_rotate_inputs_fp32(kind: str, rows: int, k: int, key) -> mx.array:
    """fp32 activations of one of ROTATE32_INPUT_KINDS: `nonfinite`'s rows in fp32, the others
    make_inputs_fp32's."""
    if kind == "nonfinite":
        return make_rotate_inputs(kind, rows, k, key).astype(mx.float32)
    return make_inputs_fp32(kind, rows, k, key)


def make_signs(kind: str, k: int, key) -> mx.array:
    """float32 signs: the pack's +-1 (tools/make_synthetic_pack.py, dflash2_pack.py
    checks |s| == 1), or `general` +-[0.5, 2) values that make the multiply round."""
    k1, k2 = mx.random.split(key)
    sign = mx.random.randint(0, 2, (k,), key=k1).astype(mx.float32) * 2 - 1
    if kind == "pm1":
        return sign
    return sign * mx.random.uniform(0.5, 2.0, (k,), key=k2)


def _fp16_chain(x, block, signs):
    """Negative control: the rotation in fp16 arithmetic; it differs from the chain's bits."""
    rotated = mx.hadamard_transform(
        (x * signs.astype(x.dtype)).reshape(-1, block), scale=1 / math.sqrt(block)
    )
    return rotated.reshape(x.shape)


def self_test_rotate(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """Check a rotation bit for bit against mlx-vlm's chain, one row at a time.

    kernel: (x (M, K), block, signs) -> (M, K); default: this backend's own, whose
    serving at each tested (K, block) is then switched on or off by the outcome.
    shapes: (K, block) pairs; default ROTATE_SHAPES_27B + ROTATE_SHAPES_SMALL. For
    each shape, sign kind,
    input kind and rows 1..8 the kernel's rows must equal the chain's single-row
    results (the CUDA kernel's in both its layouts where K allows the swizzled one the
    qmv reads). `stock_mismatches` counts the fp16-arithmetic rotation (negative
    control: nonzero shows the comparison sees rounding differences). Off the
    kernels' backends `rotate` is the stock chain itself: nothing to test.
    """
    backend = backend_name()
    own = kernel is None
    if own and backend not in _ROTATE_PLANS:
        return _no_kernel_result(backend)
    kernel = kernel or backend_rotate(backend)
    shapes = [tuple(s) for s in (shapes or ROTATE_SHAPES_27B + ROTATE_SHAPES_SMALL)]

    def swizzles(k):  # the CUDA kernel's second layout, for the qmv: checked where it serves
        return own and backend == "cuda" and k % SWIZZLE_WIDTH == 0

    cases, mismatches, control_mismatches, reason = [], 0, 0, None
    key = mx.random.key(seed)
    try:
        for k, block in shapes:
            for sign_kind in SIGN_KINDS:
                key, sign_key = mx.random.split(key)
                signs = make_signs(sign_kind, k, sign_key)
                for kind in ROTATE_INPUT_KINDS:
                    key, input_key = mx.random.split(key)
                    x = make_rotate_inputs(kind, MAX_ROWS, k, input_key)
                    want = mx.concatenate(
                        [stock_rotate(x[m : m + 1], block, signs) for m in range(MAX_ROWS)]
                    )
                    got = {"rows": [kernel(x[:rows], block, signs) for rows in range(1, MAX_ROWS + 1)]}
                    if swizzles(k):
                        swizzled = cuda_rotate_plan(k, block, swizzled=True)
                        got["swizzled"] = [swizzled(x[:rows], signs) for rows in range(1, MAX_ROWS + 1)]
                    control = _fp16_chain(x, block, signs)
                    mx.eval(want, got, control)
                    control_differ = _differing(control, want)
                    control_mismatches += control_differ
                    for (layout, outs), rows in itertools.product(got.items(), range(1, MAX_ROWS + 1)):
                        out = outs[rows - 1]
                        wanted = swizzle_steps(want[:rows]) if layout == "swizzled" else want[:rows]
                        differ = _differing(out, wanted)
                        mismatches += differ
                        cases.append(
                            {
                                "shape": [k, block],
                                "signs": sign_kind,
                                "input": kind,
                                "rows": rows,
                                "layout": layout,
                                "mismatches": differ,
                                "stock_mismatches": control_differ if rows == MAX_ROWS and layout == "rows" else None,
                            }
                        )
                        if differ and reason is None:
                            reason = (
                                f"{backend} rotation differs from the stock chain at K={k}, "
                                f"block={block}, rows={rows}, input={kind}, signs={sign_kind}, layout={layout}: "
                            ) + _first_difference(out, wanted)[0]
    except Exception as error:  # a kernel that fails to build or run fails the test
        reason = f"{backend} rotation raised {type(error).__name__}: {error}"
    ok = reason is None
    if own:
        for k, block in shapes:
            _rotate_verified[(backend, k, block)] = ok
    return SelfTestResult(ok, backend, reason, mismatches, control_mismatches, cases)



@cache
def _hadamard_matrix(block: int) -> mx.array:
    """Sylvester's (block, block) Hadamard matrix, fp32, made once per block."""
    hadamard = np.ones((1, 1), dtype=np.float32)
    while hadamard.shape[0] < block:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    return mx.array(hadamard)


def _matrix_chain(x, block, signs):
    """Negative control for fp32 rows: the same rotation as one fp32 GEMM with the Hadamard
    matrix, whose sums run in another order than the butterflies."""
    rows = (x * signs).reshape(-1, block) @ _hadamard_matrix(block)
    return (rows * mx.array(1 / math.sqrt(block), dtype=mx.float32)).reshape(x.shape)


def self_test_rotate_fp32(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """Check the CUDA rotation on fp32 rows (the real file's) bit for bit against mlx-vlm's
    chain, one row at a time, rows 1..8, every fp32 input kind and non-finite values.

    kernel: (x (M, K), block, signs) -> (M, K), tested as variant "kernel"; default: the CUDA
    kernel, whose fp32 serving at each tested (K, block) is then switched on or off (off CUDA
    the stock chain serves: nothing to test). shapes: (K, block), default the 27B and small
    ones. The Hadamard-matrix GEMM is counted alongside (the control)."""
    backend = backend_name()
    if kernel is None and backend != "cuda":
        return _no_kernel_result(backend)
    name = "kernel" if kernel else "butterflies"
    kernel = kernel or (lambda x, block, signs: cuda_rotate_plan(x.shape[-1], block, dtype=mx.float32)(x, signs))
    shapes = [tuple(s) for s in (shapes or ROTATE_SHAPES_27B + ROTATE_SHAPES_SMALL)]
    differing, failures, cases, control = {name: 0}, {}, [], {"Hadamard-matrix GEMM": 0}
    key = mx.random.key(seed)
    for k, block in shapes:
        for sign_kind, kind in itertools.product(SIGN_KINDS, ROTATE32_INPUT_KINDS):
            key, sign_key, input_key = mx.random.split(key, 3)
            signs = make_signs(sign_kind, k, sign_key)
            x = make_rotate_inputs_fp32(kind, MAX_ROWS, k, input_key)
            want = mx.concatenate([stock_rotate(x[m : m + 1], block, signs) for m in range(MAX_ROWS)])
            if kind != "nonfinite":
                control["Hadamard-matrix GEMM"] += _differing(_matrix_chain(x, block, signs), want)
            for rows in range(1, MAX_ROWS + 1):
                def compare(x=x, rows=rows, signs=signs, want=want):
                    return {"y": (kernel(x[:rows], block, signs), want[:rows])}

                run_case(name, compare, {"shape": [k, block], "signs": sign_kind, "input": kind, "rows": rows},
                         f"K={k}, block={block}, rows={rows}, input={kind}, signs={sign_kind}", differing, failures,
                         cases)
    result = _variants_result(backend, differing, failures, control, cases)
    if name == "butterflies":
        for k, block in shapes:
            _rotate_fp32_verified[(backend, k, block)] = result.ok
    return result
