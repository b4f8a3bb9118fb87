"""Rotated packed linears: the rotation ahead of the exact matmul, alone or for the
linears that share their input, and the group rotation that serves them.

- `exact_linear_rows(x, block, signs, weight, scales, biases)`: `rotate` then `exact_rows`,
  on CUDA the rotation writing the swizzled rows the qmv reads.
- `exact_linear_group(x, block, signs, matrices)`, `rotate_group(x, block, signs)`: x rotated
  by each linear's signs (q/k/v, a GatedDeltaNet's in_proj_qkv and in_proj_z, an MLP's gate
  and up) in one launch on CUDA where the group rotation passed its self-test, each output
  `rotate`'s bits; then each linear's exact matmul (or, rotate_group, decode's MLX matmuls).
  fp16 rows, and fp32 rows (the real file's) where the group's fp32 self-test passed: the
  kernel's arithmetic is rotate's on fp32 rows, whose chain's astypes are no-ops.
"""

import itertools

import mlx.core as mx

from dflash2_kernel_base import (
    MAX_ROWS, SelfTestResult, _differing, _first_difference, _no_kernel_result, _variants_result, backend_name,
    run_case,
)
from dflash2_kernel_qmv import SWIZZLE_WIDTH, _serving_kernel, cuda_matmul, exact_rows, swizzle_steps
from dflash2_kernel_qmv32 import exact_rows_fp32
from dflash2_kernel_rotate import (
    ROTATE32_INPUT_KINDS, ROTATE_BLOCKS, ROTATE_INPUT_KINDS, SIGN_KINDS, _fp16_chain, _matrix_chain, cuda_rotate_plan,
    make_rotate_inputs, make_rotate_inputs_fp32, make_signs, rotate, rotation_serves, stock_rotate,
)

# ===========================================================================
# Rotated linears: dispatch

# (K, block) -> the CUDA rotation writing swizzled rows where it passed its self-test at
# (K, block), else None; chosen once.
_swizzled_rotations: dict = {}


def _swizzled_rotation(k: int, block: int):
    plan = _swizzled_rotations.get((k, block), False)
    if plan is False:
        serves = k % SWIZZLE_WIDTH == 0 and rotation_serves(k, block)
        plan = _swizzled_rotations[(k, block)] = cuda_rotate_plan(k, block, swizzled=True) if serves else None
    return plan


# (K, block, outputs) -> whether the CUDA group rotation passed its self-test there (fp16
# rows, fp32 rows).
_rotate_group_verified: dict = {}
_rotate_group_fp32_verified: dict = {}


def _rotate_group_serves(k: int, block: int, outputs: int, dtype=mx.float16) -> bool:
    shape = (k, block, outputs)
    fp32 = dtype == mx.float32
    verified = _rotate_group_fp32_verified if fp32 else _rotate_group_verified
    if shape not in verified:  # first use: its self-test at this shape
        if backend_name() == "cuda" and k % SWIZZLE_WIDTH == 0 and block in ROTATE_BLOCKS and k % block == 0:
            (self_test_rotate_group_fp32 if fp32 else self_test_rotate_group)([shape])
        else:
            verified[shape] = False
    return verified[shape]


def rotate_group(x, block, signs):
    """(rotate(x, block, s) for s in signs), the same bits: the rotations of linears that share
    x ((..., K) fp16 or fp32 rows). On CUDA, where the group rotation passed its self-test
    (fp16's or fp32's) at (K, block, len(signs)), in one launch."""
    k = x.shape[-1]
    if (len(signs) > 1 and x.dtype in (mx.float16, mx.float32)
            and _rotate_group_serves(k, block, len(signs), x.dtype)):
        return tuple(cuda_rotate_plan(k, block, False, len(signs), x.dtype)(x, signs))
    return tuple(rotate(x, block, sign) for sign in signs)


def exact_linear_group(x, block, signs, matrices):
    """Rotated packed linears that share their input x ((..., K) fp16 or fp32 rows, at most 8):
    a tuple of each one's rotation (block 0: none) then exact matmul, every row bitwise
    decode's; fp16 rows as exact_linear_rows, fp32 rows through rotate_group and
    exact_rows_fp32. On CUDA, where the group rotation passed its self-test at (K, block,
    len(matrices)) (and, for fp16 rows, the qmv serves), one launch rotates x by every sign
    vector (fp16: swizzled rows for the qmv): len - 1 launches fewer than a rotation each.
    matrices: [(weight, scales, biases)]."""
    if x.dtype == mx.float32:
        rotated = rotate_group(x, block, signs) if block else [x] * len(matrices)
        return tuple(exact_rows_fp32(rows_in, *matrix) for rows_in, matrix in zip(rotated, matrices))
    k, rows = x.shape[-1], x.size // x.shape[-1]
    if (block and len(matrices) > 1 and _rotate_group_serves(k, block, len(matrices))
            and all(_serving_kernel("cuda", weight.shape[0], k, rows) for weight, _, _ in matrices)):
        rotated = cuda_rotate_plan(k, block, True, len(matrices))(x, signs)
        return tuple(cuda_matmul(rows_in, *matrix, swizzled=True) for rows_in, matrix in zip(rotated, matrices))
    return tuple(exact_linear_rows(x, block, sign, *matrix) for sign, matrix in zip(signs, matrices))


def exact_linear_rows(x, block, signs, weight, scales, biases):
    """A rotated packed linear on (..., K) fp16 rows, at most 8: rotate(x, block, signs)
    (block 0: none), then exact_rows; every row bitwise decode's. On CUDA, where both
    kernels passed their self-tests, the rotation writes its rows swizzled for the qmv
    (accumulate_step: the same bits from half the L1 wavefronts)."""
    k = x.shape[-1]
    if block:
        swizzled = _swizzled_rotation(k, block)
        if swizzled and _serving_kernel("cuda", weight.shape[0], k, x.size // k):
            return cuda_matmul(swizzled(x, signs), weight, scales, biases, swizzled=True)
        x = rotate(x, block, signs)
    return exact_rows(x, weight, scales, biases)


# ---------------------------------------------------------------------------
# Rotated linears: the group rotation's self-test

# (K, block, outputs): the 27B pack's groups of rotated linears that share their input, at both
# blocks that divide 5120 (attention q/k/v: 3; in_proj_qkv and in_proj_z, gate and up: 2).
ROTATE_GROUP_SHAPES_27B = ((5120, 512, 2), (5120, 512, 3), (5120, 1024, 2), (5120, 1024, 3))


def _group_signs(k: int, outputs: int, key) -> list:
    """A group's sign vectors, alternating the pack's +-1 and general values."""
    return [make_signs(SIGN_KINDS[index % len(SIGN_KINDS)], k, one_key)
            for index, one_key in enumerate(mx.random.split(key, outputs))]


def _stock_rows(x, block, signs) -> list:
    """x's MAX_ROWS rows rotated by each sign vector through mlx-vlm's chain, one row at a time."""
    return [mx.concatenate([stock_rotate(x[m : m + 1], block, sign) for m in range(MAX_ROWS)]) for sign in signs]


def _group_cases(shapes, kinds, make, seed: int):
    """The group self-tests' draws: for each (K, block, outputs) its sign vectors, then for each
    input kind MAX_ROWS rows of make(kind, ...): yields (shape, kind, x, signs, stock rows)."""
    key = mx.random.key(seed)
    for k, block, outputs in shapes:
        key, sign_key = mx.random.split(key)
        signs = _group_signs(k, outputs, sign_key)
        for kind in kinds:
            key, input_key = mx.random.split(key)
            x = make(kind, MAX_ROWS, k, input_key)
            yield (k, block, outputs), kind, x, signs, _stock_rows(x, block, signs)


def self_test_rotate_group(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """Check a group rotation bit for bit against mlx-vlm's chain, one row and one sign
    vector at a time: every output of each launch, in both layouts (plain rows for decode's
    MLX matmul, swizzled rows for the qmv).

    shapes: (K, block, outputs) triples; default ROTATE_GROUP_SHAPES_27B. kernel: (x (M, K),
    block, [signs], swizzled) -> [rotated]; default CUDA's own (the only backend with one),
    whose serving at each tested shape is then switched on or off by the outcome. The sign
    vectors alternate the pack's +-1 and general values; rows 1..8 of every input kind;
    stock_mismatches counts the fp16-arithmetic rotation (the negative control)."""
    backend = backend_name()
    own = kernel is None
    if own and backend != "cuda":
        return _no_kernel_result(backend)
    shapes = [tuple(s) for s in (shapes or ROTATE_GROUP_SHAPES_27B)]
    cases, mismatches, control_mismatches, reason = [], 0, 0, None
    try:
        for (k, block, outputs), kind, x, signs, want in _group_cases(shapes, ROTATE_INPUT_KINDS,
                                                                      make_rotate_inputs, seed):
            call = kernel or (lambda x, block, signs, swizzled, k=k, n=outputs:
                              cuda_rotate_plan(k, block, swizzled, n)(x, signs))
            got = {layout: [call(x[:rows], block, signs, layout == "swizzled") for rows in range(1, MAX_ROWS + 1)]
                   for layout in ("rows", "swizzled")}
            control = _fp16_chain(x, block, signs[0])
            mx.eval(want, got, control)
            control_differ = _differing(control, want[0])
            control_mismatches += control_differ
            for (layout, outs), rows, index in itertools.product(got.items(), range(1, MAX_ROWS + 1),
                                                                 range(outputs)):
                wanted = want[index][:rows]
                wanted = swizzle_steps(wanted) if layout == "swizzled" else wanted
                differ = _differing(outs[rows - 1][index], wanted)
                mismatches += differ
                cases.append({"shape": [k, block, outputs], "input": kind, "rows": rows, "output": index,
                              "layout": layout, "mismatches": differ,
                              "stock_mismatches": (control_differ if (rows, index, layout) == (MAX_ROWS, 0, "rows")
                                                   else None)})
                if differ and reason is None:
                    reason = (f"{backend} group rotation differs from the stock chain at K={k}, block={block}, "
                              f"outputs={outputs}, output {index}, rows={rows}, input={kind}, layout={layout}: "
                              ) + _first_difference(outs[rows - 1][index], wanted)[0]
    except Exception as error:  # a kernel that fails to build or run fails the test
        reason = f"{backend} group rotation raised {type(error).__name__}: {error}"
    ok = reason is None
    if own:
        for shape in shapes:
            _rotate_group_verified[shape] = ok
    return SelfTestResult(ok, backend, reason, mismatches, control_mismatches, cases)


def self_test_rotate_group_fp32(shapes=None, seed: int = 0, kernel=None) -> SelfTestResult:
    """Check the CUDA group rotation on fp32 rows (the real file's) bit for bit against
    mlx-vlm's chain, one row and one sign vector at a time: every output, rows 1..8, every fp32
    input kind and non-finite values, the sign vectors alternating the pack's +-1 and general
    values.

    shapes: (K, block, outputs), default ROTATE_GROUP_SHAPES_27B. kernel: (x (M, K), block,
    [signs]) -> [rotated], tested as variant "kernel"; default the CUDA kernel, whose fp32
    serving at each tested shape is then switched on or off (off CUDA nothing to test). The
    Hadamard-matrix GEMM of the first output is counted alongside (the control)."""
    backend = backend_name()
    if kernel is None and backend != "cuda":
        return _no_kernel_result(backend)
    name = "kernel" if kernel else "butterflies"
    shapes = [tuple(s) for s in (shapes or ROTATE_GROUP_SHAPES_27B)]
    differing, failures, cases, control = {name: 0}, {}, [], {"Hadamard-matrix GEMM": 0}
    for (k, block, outputs), kind, x, signs, want in _group_cases(shapes, ROTATE32_INPUT_KINDS,
                                                                  make_rotate_inputs_fp32, seed):
        call = kernel or (lambda x, block, signs, k=k, n=outputs:
                          cuda_rotate_plan(k, block, False, n, mx.float32)(x, signs))
        if kind != "nonfinite":
            control["Hadamard-matrix GEMM"] += _differing(_matrix_chain(x, block, signs[0]), want[0])
        for rows in range(1, MAX_ROWS + 1):
            def compare(x=x, rows=rows, signs=signs, want=want, call=call, block=block):
                got = call(x[:rows], block, signs)
                if len(got) != len(want):
                    raise ValueError(f"{len(got)} outputs for {len(want)} sign vectors")
                return {f"y{index}": (out, wanted[:rows]) for index, (out, wanted) in enumerate(zip(got, want))}

            run_case(name, compare, {"shape": [k, block, outputs], "input": kind, "rows": rows},
                     f"K={k}, block={block}, outputs={outputs}, rows={rows}, input={kind}", differing, failures,
                     cases)
    result = _variants_result(backend, differing, failures, control, cases)
    if name == "butterflies":
        for shape in shapes:
            _rotate_group_fp32_verified[shape] = result.ok
    return result
