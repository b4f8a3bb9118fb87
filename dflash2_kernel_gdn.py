"""GatedDeltaNet recurrence and dense rows: stock reference, CUDA, Metal, dispatch,
self-test.

- `gdn_recurrence(q, k, v, g, beta, state)`: L GatedDeltaNet steps in one launch,
  each decode's own recurrence step, with the state after every step for rollback.
  cuda: decode's compiled `_gated_delta_step_ops`, in the variant ("fma": NVRTC
  contracts `state + k * delta`, or "mul_add") that its self-test found bitwise
  equal; fp32 q, k, v (the real file's) under their own self-test and verdict (gdn32).
  metal: decode runs mlx-vlm's fused kernel (`gated_delta_kernel`, T=1 a step, fp16);
  its with-states twin (stock verify's, the same per-step statements) runs all L steps
  once its self-test found it equal, else the fused kernel a step at a time.
- `dense_rows(x, weight)`: 1..8 rows of x @ weight.T, each decode's one-row
  `nn.Linear` (MLX's gemv), fp16 or fp32 (the dtypes its self-test covers). cuda only.
"""

import itertools
from functools import cache, partial

import mlx.core as mx
from mlx_vlm.models.qwen3_5 import gated_delta as gated_delta_module
from mlx_vlm.models.qwen3_5.gated_delta import (
    _compute_g_beta,
    _gated_delta_step_ops,
    _gated_delta_with_states_ops,
    gated_delta_chunked,
    gated_delta_ops,
)

from dflash2_kernel_base import (
    FP32_INPUT_KINDS, INPUT_KINDS, MAX_ROWS, BakedCudaKernel, SelfTestResult, _differing, _first_difference,
    _no_kernel_result, _variants_result, backend_name, cuda_header, cuda_serving_variant, gemv_elements_per_lane,
    make_inputs, make_inputs_fp32, run_case,
)

# ===========================================================================
# GatedDeltaNet recurrence and dense rows

# "fma": state + k * delta as one fused multiply-add; "mul_add": rounded product,
# then the add. MLX's NVRTC call sets no --fmad (jit_module.cpp:329-345), and
# nvcc 13.0.88 with that default turns the fused kernel's Multiply-then-Add
# (compiled.cpp:165-181) into fma.rn.f32 in PTX, so "fma" is expected to pass.
# metal: "with_states", mlx-vlm's with-states kernel (stock verify's on Metal), whose loop
# body is decode's fused kernel's statement for statement, but which is its own pipeline.
GDN_VARIANTS = {"cuda": ("fma", "mul_add"), "metal": ("with_states",)}
# The gemv replica (CUDA only): "gemv" fuses each lane's product and sum (nvcc contracts
# gemv_impl's `sum += a * b` by default), "gemv_mul_add" rounds the product first. fp16
# and bf16 products are exact in fp32, so only fp32 rows (the real file's) tell them apart.
DENSE_VARIANTS = ("gemv", "gemv_mul_add")
MAX_DK = 512  # one 32-thread block in row_reduce_simple up to here
GDN_INPUT_KINDS = ("normal", "large", "tiny", "extreme_gates", "signed_zero")

# (B, Hk, Hv, Dk, Dv); every shape runs L = 1..GDN_MAX_STEPS.
GDN_SHAPES_27B = ((1, 16, 48, 128, 128),)
# Tiny pack (Dk 64: half the lanes add zeros), B 2 with Dk 256 (two chunks a
# lane), Dk 96 with Dv 6 (partial chunk, partial block).
GDN_SHAPES_SMALL = ((1, 1, 2, 64, 64), (2, 2, 4, 256, 32), (1, 1, 3, 96, 6))
GDN_MAX_STEPS = 8
# (N, K): 27B in_proj_a/b alone and concatenated; tiny pack; K % 128 != 0 with
# K % 64 == 0 (two elements a lane); K = 102 (one element a lane, uneven lanes).
DENSE_SHAPES_27B = ((48, 5120), (96, 5120))
DENSE_SHAPES_SMALL = ((2, 512), (7, 320), (5, 102))
# (weight and activation dtype, input kinds, their maker) the dense self-test runs.
DENSE_TEST_DTYPES = ((mx.float16, INPUT_KINDS, make_inputs), (mx.float32, FP32_INPUT_KINDS, make_inputs_fp32))


# ---------------------------------------------------------------------------
# gdn, dense: stock references (decode's own calls)


def decode_recurrence_on_metal() -> bool:
    """Whether decode's recurrence step is mlx-vlm's fused Metal kernel here: the test
    gated_delta_update makes (use_kernel is on at inference), read through its module."""
    mlx = gated_delta_module.mx
    return mlx.default_device() == mlx.gpu and mlx.metal.is_available()


def stock_recurrence(q, k, v, g, beta, state, eval_each_step=False):
    """Decode's recurrence call L times, a step each, as gated_delta_update makes it here:
    mlx-vlm's fused Metal kernel with T=1 (key heads not repeated) where decode runs it,
    else the compiled `_gated_delta_step_ops` after the head repeat (gated_delta_ops).
    Returns y (B, L, Hv, Dv) and the state after each step. eval_each_step: evaluate
    every step on its own, as decode does."""
    on_metal = decode_recurrence_on_metal()
    if not on_metal and (repeat := v.shape[2] // q.shape[2]) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    ys, states = [], []
    for t in range(q.shape[1]):
        if on_metal:
            step = slice(t, t + 1)
            y, state = gated_delta_module.gated_delta_kernel(
                q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step], state)
            y = y[:, 0]
        else:
            y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        if eval_each_step:
            mx.eval(y, state)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), mx.stack(states, axis=1)


def stock_dense_rows(x, weight):
    """Decode's one-row `nn.Linear` (no bias) once per row."""
    rows = x.reshape(-1, x.shape[-1])
    out = [rows[m : m + 1][None] @ weight.T for m in range(rows.shape[0])]
    return mx.concatenate(out, axis=1).reshape(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------
# gdn, dense: CUDA (Metal: mlx-vlm's recurrence kernel below; dense rows run the stock calls)

# MIT License, Copyright (c) 2023 Apple Inc. (arithmetic of MLX 0.32.2:
# mlx/backend/cuda/reduce/row_reduce.cu, reduce/reduce_utils.cuh,
# gemms/gemv.cu, compiled.cpp). See NOTICE.txt.
_GDN_CUDA_HEADER = r"""
#if __has_include(<cooperative_groups/reduce.h>)
#include <cooperative_groups/reduce.h>
#define DFLASH2_CG_REDUCE 1
#endif

namespace dflash2_gdn {

namespace cg = cooperative_groups;
using mlx::core::cu::AlignedVector;
using mlx::core::cu::unsafe_load_vector;

// MLX's Sum (reduce/reduce_ops.cuh:33-37) with the add spelled __fadd_rn, so
// nothing can be contracted into it. cg::plus<float> (gemv) is the same a + b.
struct Sum {
  __device__ __forceinline__ float operator()(float a, float b) {
    return __fadd_rn(a, b);
  }
};

// A warp's sum as MLX takes it: cg::reduce(warp, val, op). For a float and a
// 32-thread tile cg::reduce is the xor butterfly of coalesced_reduce (CUDA 13.0
// cooperative_groups/details/coalesced_reduce.h:62-71), copied here for CUDA
// header sets without cooperative_groups/reduce.h.
template <typename Warp>
__device__ __forceinline__ float warp_sum(Warp& warp, float val) {
  Sum op;
#ifdef DFLASH2_CG_REDUCE
  return cg::reduce(warp, val, op);
#else
  for (int mask = 16; mask > 0; mask >>= 1) {
    val = op(val, warp.shfl_xor(val, mask));
  }
  return val;
#endif
}

// Dk elements of one state row per warp: lane l owns the 4 elements at
// 4l + 128c for chunk c, as row_reduce_simple's thread l reads them
// (row_reduce.cu:99-117, N_READS = 4, a 32-thread block for Dk <= 512).
template <int Dk>
constexpr int chunks_of = (Dk + 127) / 128;

// row_reduce_simple's per-thread sum of products a*b over the lane's elements:
// from +0, chunk by chunk in element order; a chunk past the row end adds four
// +0 as its tail does (row_reduce.cu:119-131). Then block_reduce's warp step,
// cg::reduce with Sum (reduce_utils.cuh:64-66; one warp, so nothing more).
template <int Dk, typename Warp>
__device__ __forceinline__ float row_dot(
    Warp& warp, const float (&a)[chunks_of<Dk>][4], const float (&b)[chunks_of<Dk>][4]) {
  const int lane = warp.thread_rank();
  float acc = 0.0f;
#pragma unroll
  for (int c = 0; c < chunks_of<Dk>; ++c) {
    const bool own = 4 * lane + 128 * c < Dk;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc = __fadd_rn(acc, own ? __fmul_rn(a[c][i], b[c][i]) : 0.0f);
    }
  }
  return warp_sum(warp, acc);
}

template <int Dk, typename T>
__device__ __forceinline__ void load_row(const T* row, int lane, float (&out)[chunks_of<Dk>][4]) {
#pragma unroll
  for (int c = 0; c < chunks_of<Dk>; ++c) {
    if (4 * lane + 128 * c < Dk) {
      auto vals = unsafe_load_vector<4>(row + 4 * lane + 128 * c, 0);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        out[c][i] = static_cast<float>(vals[i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        out[c][i] = 0.0f;
      }
    }
  }
}

// All L steps of decode's compiled _gated_delta_step_ops for one (b, hv, dv):
// one warp, the state row in registers. Per step, exactly the graph of
// fused kernels that mx.compile builds for that function:
//   s = state * g                      CompiledBroadcastMultiply
//   kv = Sum(s * k)                    CompiledBroadcastMultiply, row_reduce_simple
//   delta = (v - kv) * beta            CompiledAsTypeSubtractAsTypeBroadcastMultiply
//   s = s + k * delta; p = s * q       Compiled...MultiplyAdd...Multiply (kFma: fused)
//   y = half(Sum(p))                   row_reduce_simple, AsType
// Every rounding is an explicit intrinsic, so nvcc/NVRTC cannot contract
// anything the stock kernels keep apart; kFma picks the one place they may fuse.
// Launch: block (32, warps), grid (1, ceil(Dv / warps), B * Hv).
template <int Dk, bool kFma, typename In, typename G, typename Bt, typename Out>
__device__ __forceinline__ void gated_delta_steps(
    const In* __restrict__ q,
    const In* __restrict__ k,
    const In* __restrict__ v,
    const G* __restrict__ g,
    const Bt* __restrict__ beta,
    const float* __restrict__ state,
    Out* __restrict__ y,
    float* __restrict__ states,
    int steps,
    int hk_heads,
    int hv_heads,
    int dv_size) {
  constexpr int kChunks = chunks_of<Dk>;
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane = warp.thread_rank();
  const int dv = blockIdx.y * blockDim.y + threadIdx.y;
  if (dv >= dv_size) {
    return;
  }
  const int n = blockIdx.z;  // b * Hv + hv
  const int b = n / hv_heads;
  const int hv = n % hv_heads;
  const int hk = hv / (hv_heads / hk_heads);  // mx.repeat(x, Hv / Hk, -2) order

  float s[kChunks][4];
  load_row<Dk>(state + ((int64_t)n * dv_size + dv) * Dk, lane, s);

  for (int t = 0; t < steps; ++t) {
    const int64_t bt = (int64_t)b * steps + t;
    const int64_t head = bt * hv_heads + hv;
    float kf[kChunks][4], qf[kChunks][4];
    load_row<Dk>(k + (bt * hk_heads + hk) * Dk, lane, kf);
    load_row<Dk>(q + (bt * hk_heads + hk) * Dk, lane, qf);
    const float decay = static_cast<float>(g[head]);
    const float gate = static_cast<float>(beta[head]);
    const float value = static_cast<float>(v[head * dv_size + dv]);

#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        s[c][i] = __fmul_rn(s[c][i], decay);

    const float kv_mem = row_dot<Dk>(warp, s, kf);
    const float delta = __fmul_rn(__fsub_rn(value, kv_mem), gate);

#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        s[c][i] = kFma ? __fmaf_rn(kf[c][i], delta, s[c][i])
                       : __fadd_rn(s[c][i], __fmul_rn(kf[c][i], delta));

    const float out = row_dot<Dk>(warp, s, qf);
    if (lane == 0) {
      y[head * dv_size + dv] = static_cast<Out>(out);  // AsType: round to nearest
    }
    float* row = states + (head * dv_size + dv) * Dk;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (4 * lane + 128 * c < Dk) {
        AlignedVector<float, 4> vals;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          vals[i] = s[c][i];
        }
        *reinterpret_cast<AlignedVector<float, 4>*>(row + 4 * lane + 128 * c) = vals;
      }
    }
  }
}

// gemv_impl (gemms/gemv.cu:55-84) for M = 1 with a transposed b: one warp per
// output column (= weight row), lane l owns elements NPT*l + 32*NPT*r, fp32 sums
// from +0, cg::reduce (cg::plus<float>), lane 0 stores static_cast<T>. Here
// each warp does that for every activation row, reading the weight row once.
// FMA: the lane's sum += w * x as one fma (what nvcc makes of it by default), else the
// product rounded first; the same for fp16 and bf16, whose products are exact in fp32.
// Launch: block (32, 8), grid (1, ceil(N / 8)).
constexpr int kMaxRows = 8;

template <int NPT, bool FMA, typename T>
__device__ __forceinline__ void gemv_rows(
    const T* __restrict__ x,
    const T* __restrict__ w,
    T* __restrict__ out,
    int rows,
    int n,
    int k) {
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int col = blockIdx.y * blockDim.y + threadIdx.y;
  if (col >= n) {
    return;
  }
  float sum[kMaxRows];
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) {
    sum[m] = 0.0f;
  }
  for (int c = NPT * warp.thread_rank(); c < k; c += 32 * NPT) {
    auto wv = unsafe_load_vector<NPT>(w + (int64_t)col * k + c, 0);
#pragma unroll
    for (int m = 0; m < kMaxRows; ++m) {
      if (m < rows) {
        auto xv = unsafe_load_vector<NPT>(x + (int64_t)m * k + c, 0);
#pragma unroll
        for (int j = 0; j < NPT; ++j) {
          const float a = static_cast<float>(wv[j]), b = static_cast<float>(xv[j]);
          sum[m] = FMA ? __fmaf_rn(a, b, sum[m]) : __fadd_rn(sum[m], __fmul_rn(a, b));
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) {
    if (m < rows) {
      const float total = warp_sum(warp, sum[m]);
      if (warp.thread_rank() == 0) {
        out[(int64_t)m * n + col] = static_cast<T>(total);
      }
    }
  }
}

}  // namespace dflash2_gdn
"""

_GDN_SOURCE = (
    "dflash2_gdn::gated_delta_steps<Dk, FMA>("
    "q, k, v, g, beta, state, y, states, v_shape[1], q_shape[2], v_shape[2], v_shape[3]);"
)
_DENSE_SOURCE = "dflash2_gdn::gemv_rows<NPT, FMA>(x, w, out, x_shape[0], w_shape[0], w_shape[1]);"
GDN_WARPS_PER_BLOCK = 4
GEMV_ROWS_PER_BLOCK = 8  # MLX's rows_per_block (gemv.cu:14)


@cache
def _gdn_kernel():
    return BakedCudaKernel(
        name="dflash2_gated_delta_steps",
        input_names=["q", "k", "v", "g", "beta", "state"],
        output_names=["y", "states"],
        source=_GDN_SOURCE,
        header=cuda_header(_GDN_CUDA_HEADER),
    )


@cache
def _dense_kernel():
    return BakedCudaKernel(
        name="dflash2_gemv_rows",
        input_names=["x", "w"],
        output_names=["out"],
        source=_DENSE_SOURCE,
        header=cuda_header(_GDN_CUDA_HEADER),
    )


def cuda_recurrence(q, k, v, g, beta, state, variant):
    """The recurrence kernel with one variant; no self-test gate."""
    B, L, _, Dk = q.shape
    Hv, Dv = v.shape[2:]
    return _gdn_kernel()(
        inputs=[q, k, v, g, beta, state],
        template=[("Dk", Dk), ("FMA", variant == "fma")],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, GDN_WARPS_PER_BLOCK, 1),
        output_shapes=[(B, L, Hv, Dv), (B, L, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, mx.float32],
    )


def metal_recurrence(q, k, v, g, beta, state):
    """All L steps in one launch of mlx-vlm's with-states Metal kernel, as its
    gated_delta_update_with_states launches it (stock verify's on Metal): decode's fused
    kernel's loop body, every step's state written. No self-test gate."""
    B, L, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    y, _, states = gated_delta_module._gated_delta_with_states_kernel(
        inputs=[q, k, v, g, beta, state, L],
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv),
                  ("StateT", L)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, L, Hv, Dv), state.shape, (B, L, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, state.dtype, state.dtype],
    )
    return y, states


def cuda_dense_rows(x, weight, variant="gemv"):
    """(R, K) rows -> (R, N) through the gemv replica, one of DENSE_VARIANTS; no self-test gate."""
    n, k = weight.shape
    return _dense_kernel()(
        inputs=[x, weight],
        template=[("NPT", gemv_elements_per_lane(k)), ("FMA", variant == "gemv")],
        grid=(32, n, 1),
        threadgroup=(32, GEMV_ROWS_PER_BLOCK, 1),
        output_shapes=[(x.shape[0], n)],
        output_dtypes=[x.dtype],
    )[0]


# ---------------------------------------------------------------------------
# gdn, dense: dispatch

# backend -> the variant the last self-test verified, or None after a failure (the
# recurrence: fp16 q, k, v; fp32 ones).
_gdn_serving: dict = {}
_gdn32_serving: dict = {}
_dense_serving: dict = {}


def gdn_kernel_supports(backend, q, k, v, g, beta, state) -> bool:
    B, L, Hk, Dk = q.shape
    if backend == "metal":  # mlx-vlm's kernel (Dk / 32 elements a lane, scalar gates) as tested
        return (Dk % 32 == 0 and v.shape[2] % Hk == 0 and g.ndim == 3
                and q.dtype == k.dtype == v.dtype == mx.float16 and state.dtype == mx.float32)
    return (
        Dk % 4 == 0
        and Dk <= MAX_DK
        and v.shape[2] % Hk == 0
        and g.ndim == 3
        and state.dtype == g.dtype == mx.float32
        # one element type In in the kernel, as the self-tests take it (beta: the gates')
        and q.dtype == k.dtype == v.dtype == beta.dtype and q.dtype in (mx.float16, mx.float32)
    )


def recurrence_backend() -> str:
    """The backend whose recurrence decode runs: "metal" where it is mlx-vlm's fused kernel."""
    return "metal" if decode_recurrence_on_metal() else backend_name()


def gdn_variant(backend: str, name: str):
    """The recurrence kernel of one of GDN_VARIANTS[backend]."""
    return metal_recurrence if backend == "metal" else partial(cuda_recurrence, variant=name)


def dense_kernel_supports(x, weight) -> bool:
    """x and weight of one dtype the self-test covers (DENSE_TEST_DTYPES)."""
    return x.dtype == weight.dtype and x.dtype in [dtype for dtype, _, _ in DENSE_TEST_DTYPES]


def gdn_recurrence(q, k, v, g, beta, state, variant=None):
    """L decode steps of the GDN recurrence, each bitwise decode's.

    q, k: (B, L, Hk, Dk), normalized, before the head repeat; v: (B, L, Hv, Dv);
    g, beta: (B, L, Hv) from `_compute_g_beta`; state: (B, Hv, Dv, Dk) float32.
    Returns y (B, L, Hv, Dv) in q's dtype and states (B, L, Hv, Dv, Dk) float32,
    states[:, t] being the state after step t. variant: force one kernel variant
    (no gate); default: the variant the self-test verified on this machine.
    """
    if q.shape[1] < 1 or v.shape[:2] != q.shape[:2] or state.shape != (
        q.shape[0], v.shape[2], v.shape[3], q.shape[3]
    ):
        raise ValueError(
            f"gdn_recurrence: shapes q {q.shape} v {v.shape} state {state.shape} do not match"
        )
    backend = recurrence_backend()
    if variant is None:
        if not gdn_kernel_supports(backend, q, k, v, g, beta, state):  # tests nothing
            return stock_recurrence(q, k, v, g, beta, state)
        fp32 = q.dtype == mx.float32 and backend == "cuda"  # Metal's kernel is fp16's
        serving, self_test = (_gdn32_serving, self_test_gdn32) if fp32 else (_gdn_serving, self_test_gdn)
        if backend in GDN_VARIANTS and backend not in serving:
            self_test()
        variant = serving.get(backend)
        if variant is None:
            return stock_recurrence(q, k, v, g, beta, state)
    return tuple(gdn_variant(backend, variant)(q, k, v, g, beta, state))


def dense_rows(x, weight, variant=None):
    """x @ weight.T for 1..8 rows, each row bitwise decode's one-row nn.Linear.

    x: (..., K) with at most 8 rows; weight: (N, K), same dtype. Returns (..., N).
    variant: one of DENSE_VARIANTS forces that kernel (no gate); default: the self-test's verdict.
    """
    k = x.shape[-1]
    rows = x.size // k if k else 0
    if weight.ndim != 2 or weight.shape[1] != k or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"dense_rows: x {x.shape} and weight {weight.shape} need 1..8 rows of K")
    if variant is None:  # the inputs first: a call the kernel never takes tests nothing
        variant = dense_kernel_supports(x, weight) and cuda_serving_variant(_dense_serving, self_test_dense)
        if not variant:
            return stock_dense_rows(x, weight)
    out = cuda_dense_rows(x.reshape(rows, k), weight, variant)
    return out.reshape(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------
# gdn, dense: self-tests


def make_gdn_inputs(kind: str, B, L, Hk, Hv, Dk, Dv, key, dtype=mx.float16):
    """fp16 (or fp32) q, k, v, fp32 state and real gates g (float32), beta (in q's dtype)
    from `_compute_g_beta`, as the model feeds them (q, k normalized as `_normalize_qk`)."""
    keys = mx.random.split(key, 8)
    q = mx.random.normal((B, L, Hk, Dk), key=keys[0])
    k = mx.random.normal((B, L, Hk, Dk), key=keys[1])
    v = mx.random.normal((B, L, Hv, Dv), key=keys[2])
    state = mx.random.normal((B, Hv, Dv, Dk), key=keys[3]) * 0.1
    a = mx.random.normal((B, L, Hv), key=keys[4])
    b = mx.random.normal((B, L, Hv), key=keys[5])
    A_log = mx.log(mx.random.uniform(0.5, 16.0, (Hv,), key=keys[6]))
    dt_bias = 1.0 + 0.1 * mx.random.normal((Hv,), key=keys[7])
    normalize = True
    if kind == "large":  # unnormalized q, k; values and state far from 1 (some y overflow fp16)
        q, k, v, state, normalize = q * 10.0, k * 10.0, v * 100.0, state * 1e4, False
    elif kind == "tiny":  # subnormal q, k, v (fp16's, or fp32's); fp32 subnormal state
        tiny = 1e-5 if dtype == mx.float16 else 1e-39
        q, k, v, state, normalize = q * tiny, k * tiny, v * tiny, state * 1e-38, False
    elif kind == "extreme_gates":  # g underflowing to 0 or near 1, beta near 0 or 1
        a, b = a * 12.0, b * 12.0
    elif kind == "signed_zero":  # +-0 state and v, k mostly +-0
        sign = mx.where(mx.random.bernoulli(0.5, state.shape, key=keys[3]), -1.0, 1.0)
        state = 0.0 * sign
        v = mx.where(v > 0, 0.0, -0.0)
        k = mx.where(mx.random.bernoulli(0.125, k.shape, key=keys[1]), k, -0.0 * mx.sign(k))
        normalize = False
    elif kind != "normal":
        raise ValueError(f"unknown input kind {kind!r}")
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    if normalize:  # Qwen3_5GatedDeltaNet._normalize_qk
        q = (Dk**-1.0) * mx.fast.rms_norm(q, None, 1e-6)
        k = (Dk**-0.5) * mx.fast.rms_norm(k, None, 1e-6)
    g, beta = _compute_g_beta(A_log, a.astype(dtype), b.astype(dtype), dt_bias.astype(dtype))
    return q, k, v, g, beta, state


def _gdn_negative_controls(inputs, want_y, want_states) -> dict:
    """Stock multi-position paths against the per-step reference (-1: raised). Off Metal
    the ops paths are stock verify's and prefill's; on Metal decode's step is the fused
    kernel, so every ops path is a control there."""
    y_ws, _, states_ws = _gated_delta_with_states_ops(*inputs)  # stock verify off Metal
    y_ch, final_ch = gated_delta_chunked(*inputs)  # stock prefill off Metal
    y_ops, _ = gated_delta_ops(*inputs)  # off Metal the same compiled step as decode's
    controls = {
        "with_states_ops y": (y_ws, want_y),
        "with_states_ops states": (states_ws, want_states),
        "chunked y": (y_ch, want_y),
        "chunked final state": (final_ch, want_states[:, -1]),
        "gated_delta_ops(T=L) y, 0 expected off Metal": (y_ops, want_y),
    }
    counts = {}
    for name, (got, want) in controls.items():
        try:
            counts[name] = _differing(got, want)
        except Exception:
            counts[name] = -1
    return counts


def self_test_gdn(
    shapes=None, seed: int = 0, max_steps: int = GDN_MAX_STEPS, kernel=None
) -> SelfTestResult:
    """Check the recurrence bit for bit against decode's per-step calls.

    kernel: (q, k, v, g, beta, state) -> (y, states), tested as variant "kernel";
    default: each of this backend's GDN_VARIANTS, serving then switched to the first
    that passed (None: the stock steps). Off CUDA and Metal there is no kernel to test.
    shapes: (B, Hk, Hv, Dk, Dv) tuples, default the 27B and the small shapes.
    For every shape, input kind and L = 1..max_steps, each variant's y and states
    must equal the stepwise reference (decode's own call a step at a time); stock
    multi-position paths are the controls.
    """
    return _self_test_recurrence(mx.float16, _gdn_serving, shapes, seed, max_steps, kernel)


def self_test_gdn32(
    shapes=None, seed: int = 0, max_steps: int = GDN_MAX_STEPS, kernel=None
) -> SelfTestResult:
    """self_test_gdn on fp32 q, k, v and beta (the real file's), CUDA only (Metal's kernel
    is fp16's): each of GDN_VARIANTS["cuda"], fp32's serving then switched to the first
    that passed."""
    return _self_test_recurrence(mx.float32, _gdn32_serving, shapes, seed, max_steps, kernel)


def _self_test_recurrence(dtype, serving: dict, shapes, seed, max_steps, kernel) -> SelfTestResult:
    fp32 = dtype == mx.float32
    backend = recurrence_backend()
    if kernel is None and (backend not in GDN_VARIANTS or fp32 and backend != "cuda"):
        return _no_kernel_result(backend)
    variants = {"kernel": kernel} if kernel else {
        name: gdn_variant(backend, name) for name in GDN_VARIANTS[backend]
    }
    shapes = [tuple(s) for s in (shapes or GDN_SHAPES_27B + GDN_SHAPES_SMALL)]
    differing = {name: 0 for name in variants}
    failures, negative, cases = {}, {}, []
    key = mx.random.key(seed)
    for shape in shapes:
        B, Hk, Hv, Dk, Dv = shape
        for kind in GDN_INPUT_KINDS:
            key, input_key = mx.random.split(key)
            inputs = make_gdn_inputs(kind, B, max_steps, Hk, Hv, Dk, Dv, input_key, dtype)
            mx.eval(inputs)
            want_y, want_states = stock_recurrence(*inputs, eval_each_step=True)
            for name, count in _gdn_negative_controls(inputs, want_y, want_states).items():
                negative[name] = negative.get(name, 0) + count
            for name, recurrence in variants.items():
                for steps in range(1, max_steps + 1):
                    q, k, v, g, beta = (a[:, :steps] for a in inputs[:5])
                    try:
                        got_y, got_states = recurrence(q, k, v, g, beta, inputs[5])
                        mx.eval(got_y, got_states)
                        diff_y = _differing(got_y, want_y[:, :steps])
                        diff_states = _differing(got_states, want_states[:, :steps])
                    except Exception as error:  # a kernel that fails to build or run fails
                        failures.setdefault(name, f"{name} raised {type(error).__name__}: {error}")
                        differing[name] += 1
                        continue
                    cases.append(
                        {"shape": list(shape), "steps": steps, "input": kind, "variant": name,
                         "y": diff_y, "states": diff_states, "mismatches": diff_y + diff_states}
                    )
                    differing[name] += diff_y + diff_states
                    if (diff_y or diff_states) and name not in failures:
                        bad, want = (got_y, want_y) if diff_y else (got_states, want_states)
                        failures[name] = (
                            f"{name} differs at (B, Hk, Hv, Dk, Dv)={shape} L={steps}{' fp32' * fp32} input={kind}: "
                            f"{diff_y} of y, {diff_states} of states; "
                            + _first_difference(bad, want[:, :steps])[0]
                        )
    result = _variants_result(backend, differing, failures, negative, cases)
    if kernel is None:
        serving[backend] = result.variant
    return result


def make_dense_weight(n: int, k: int, key, dtype=mx.float16) -> mx.array:
    """(N, K) of dtype; row magnitudes 2^-8..2^3 so some `large` rows overflow fp16."""
    k_values, k_exp = mx.random.split(key)
    magnitude = mx.power(2.0, mx.random.randint(-8, 4, (n, 1), key=k_exp).astype(mx.float32))
    return (mx.random.normal((n, k), key=k_values) * 0.02 * magnitude).astype(dtype)


def self_test_dense(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """Check dense rows bit for bit against decode's one-row calls, rows 1..8, in fp16 and in
    fp32 (the real file's gate weights and activations).

    kernel: (x (R, K), weight) -> (R, N), tested as variant "kernel"; default:
    the CUDA gemv replica's DENSE_VARIANTS, the first that passes both dtypes then serving
    (off CUDA there is no kernel to test). shapes: (N, K) pairs, default the 27B and the
    small shapes. MLX's own multi-row `x @ weight.T` is counted alongside (the control).
    """
    backend = backend_name()
    if kernel is None and backend != "cuda":
        return _no_kernel_result(backend)
    variants = ({"kernel": kernel} if kernel else
                {name: partial(cuda_dense_rows, variant=name) for name in DENSE_VARIANTS})
    shapes = [tuple(s) for s in (shapes or DENSE_SHAPES_27B + DENSE_SHAPES_SMALL)]
    differing = {name: 0 for name in variants}
    failures, cases = {}, []
    negative = {f"x[:{rows}] @ weight.T": 0 for rows in range(2, MAX_ROWS + 1)}
    key = mx.random.key(seed)
    for (n, k), (dtype, kinds, inputs) in itertools.product(shapes, DENSE_TEST_DTYPES):
        dtype_name = str(dtype).removeprefix("mlx.core.")
        key, weight_key = mx.random.split(key)
        weight = make_dense_weight(n, k, weight_key, dtype)
        for kind in kinds:
            key, input_key = mx.random.split(key)
            x = inputs(kind, MAX_ROWS, k, input_key)
            want = []
            for m in range(MAX_ROWS):  # each one-row call evaluated on its own
                want.append((x[m : m + 1][None] @ weight.T).reshape(1, n))
                mx.eval(want[-1])
            want = mx.concatenate(want, axis=0)
            for rows in range(2, MAX_ROWS + 1):
                stock = x[:rows] @ weight.T
                negative[f"x[:{rows}] @ weight.T"] += _differing(stock, want[:rows])
            for name, dense in variants.items():
                for rows in range(1, MAX_ROWS + 1):
                    def compare(dense=dense, rows=rows, x=x, weight=weight, want=want):
                        return {"out": (dense(x[:rows], weight), want[:rows])}

                    run_case(name, compare, {"shape": [n, k], "dtype": dtype_name, "rows": rows, "input": kind},
                             f"(N, K)={(n, k)} {dtype_name} rows={rows} input={kind}", differing, failures, cases)
    result = _variants_result(backend, differing, failures, negative, cases)
    if kernel is None:
        _dense_serving[backend] = result.variant
    return result
