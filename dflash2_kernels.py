"""Exact kernels for DFlash2 verify, each proven by a self-test on this machine: the face
the runtime calls, the self-test registry, and start-up verification.

Verify runs up to 8 positions at once; decode runs one. Every kernel gives, for each
position, bit for bit what MLX 0.32.2 / mlx-vlm 0.7.2 compute for that position alone in
plain decode, on this backend. Each family lives in its own module, its arithmetic notes
beside its kernel (stock reference, CUDA, Metal, dispatch, self-test):

- dflash2_kernel_qmv: `exact_quantized_matmul`, `exact_rows` (the 2-bit packed matmul; Metal's kernel:
  dflash2_kernel_qmv_metal);
- dflash2_kernel_qmv32: `exact_rows_fp32` (the same for fp32 rows, the real file's activations);
- dflash2_kernel_rotate: `rotate` (the Hadamard rotation);
- dflash2_kernel_linear: `rotate_group`, `exact_linear_rows`, `exact_linear_group` (rotated linears);
- dflash2_kernel_gdn: `gdn_recurrence`, `dense_rows`;
- dflash2_kernel_fused: `conv_rows`, `add_rms_norm`, `gated_rms_norm`, `gdn_gates`;
- dflash2_kernel_rope: `rope_rows`;
- dflash2_kernel_conv32: `conv1d_rows` (fp32 convolution weights: MLX's one call where proven);
- dflash2_kernel_attention: `decode_attention_rows` (Metal's calls: dflash2_kernel_attention_metal);
- dflash2_kernel_prefill: the chunked scan's inverse (`inverse_candidates`);
- dflash2_kernel_base: what the families share.

Where a function has no kernel (cpu, metal where none is named above, shapes
or dtypes a kernel does not take) it runs the stock calls decode makes, one row /
step / query at a time: exact by construction, only slower. A kernel serves only
after its self-test passed on this machine: `verify_kernel_self_tests(shapes)`
runs them at the pack's shapes at start-up; a kernel not yet tested there tests
itself on first use. The Metal kernels are written from MLX's source and were
never run here (no Mac); the CUDA ones passed at the 27B shapes on an H200 (`gdn_gates` in
its "half" variant: MLX's Sigmoid on fp16, as the stock beta), those for fp32 rows (the real
file's: qmv32 from one row, conv32, the fp32 rotation, its group and dense rows) on an H100
(at 3b80a8a; qmv32's loads since rewritten, the fp32 rotary, gates, norms and attention,
and the recurrence's fp32 self-test, not yet run on a GPU).
"""

import time
from dataclasses import fields

from dflash2_kernel_attention import (  # noqa: F401
    _attention32_serving, _attention_verified, decode_attention_rows, self_test_attention, self_test_attention32,
)
from dflash2_kernel_base import MAX_ROWS, SelfTestResult, backend_name, raw_bits  # noqa: F401
from dflash2_kernel_conv32 import _conv32_serving, conv1d_rows, self_test_conv32  # noqa: F401
from dflash2_kernel_fused import (  # noqa: F401
    _add_norm32_serving, _add_norm_serving, _conv_serving, _gated_norm32_serving, _gated_norm_serving,
    _gates32_serving, _gates_serving, add_rms_norm, conv_rows, gated_rms_norm, gdn_gates, self_test_add_norm,
    self_test_add_norm32, self_test_conv, self_test_gated_norm, self_test_gated_norm32, self_test_gates,
    self_test_gates32,
)
from dflash2_kernel_gdn import (  # noqa: F401
    _dense_serving, _gdn32_serving, _gdn_serving, dense_rows, gdn_recurrence, self_test_dense, self_test_gdn,
    self_test_gdn32,
)
from dflash2_kernel_linear import (  # noqa: F401
    _rotate_group_fp32_verified, _rotate_group_verified, exact_linear_group, exact_linear_rows, rotate_group,
    self_test_rotate_group, self_test_rotate_group_fp32,
)
from dflash2_kernel_prefill import (  # noqa: F401
    calibrate_fused_inverse, inverse_candidates, self_test_inverse,
)
from dflash2_kernel_qmv import (  # noqa: F401
    _verified, check_packed_weights, exact_quantized_matmul, exact_rows, packed_width, self_test, stock_rows,
)
from dflash2_kernel_qmv32 import _qmv32_serving, exact_rows_fp32, self_test_qmv32  # noqa: F401
from dflash2_kernel_rope import (  # noqa: F401
    _rope32_serving, _rope_serving, rope_rows, self_test_rope, self_test_rope32,
)
from dflash2_kernel_rotate import (  # noqa: F401
    _rotate_fp32_verified, _rotate_verified, rotate, self_test_rotate, self_test_rotate_fp32,
)

# ===========================================================================
# Start-up

# Kernel name -> (the key of its shapes in verify_kernel_self_tests, its self-test).
SELF_TESTS = {
    "qmv": ("packed", self_test),
    "qmv32": ("packed_fp32", self_test_qmv32),
    "rotate": ("rotations", self_test_rotate),
    "rotate_group": ("rotation_groups", self_test_rotate_group),
    "rotate32": ("rotations_fp32", self_test_rotate_fp32),
    "rotate_group32": ("rotation_groups_fp32", self_test_rotate_group_fp32),
    "gdn": ("gdn", self_test_gdn),
    "gdn32": ("gdn_fp32", self_test_gdn32),
    "dense": ("dense", self_test_dense),
    "attention": ("attention", self_test_attention),
    "attention32": ("attention_fp32", self_test_attention32),
    "conv": ("conv", self_test_conv),
    "conv32": ("conv_fp32", self_test_conv32),
    "rope": ("rope", self_test_rope),
    "rope32": ("rope_fp32", self_test_rope32),
    "add_norm": ("norms", self_test_add_norm),
    "add_norm32": ("norms_fp32", self_test_add_norm32),
    "gated_norm": ("gated_norms", self_test_gated_norm),
    "gated_norm32": ("gated_norms_fp32", self_test_gated_norm32),
    "gates": ("gates", self_test_gates),
    "gates32": ("gates_fp32", self_test_gates32),
}


def verify_kernel_self_tests(shapes: dict) -> dict:
    """Self-test every kernel at the pack's shapes, rows / steps / queries 1..8.

    shapes: {"packed": [(N, K)], "packed_fp32": [(N, K)], "rotations": [(K, block)], "rotations_fp32":
    [(K, block)], "rotation_groups": [(K, block, outputs)], "rotation_groups_fp32": [(K, block, outputs)],
    "gdn": [(B, Hk, Hv, Dk, Dv)], "gdn_fp32": [(B, Hk, Hv, Dk, Dv)], "dense": [(N, K)],
    "attention": [(B, Hq, Hkv, D)], "attention_fp32": [(B, Hq, Hkv, D)], "conv": [(B, C, K)],
    "conv_fp32": [(B, C, K)], "rope": [(B, Hq, Hk, D, R)], "rope_fp32": [(B, Hq, Hk, D, R)],
    "norms": [(D,)], "norms_fp32": [(D,)], "gated_norms": [(heads, D)], "gated_norms_fp32": [(heads, D)],
    "gates": [(Hv,)], "gates_fp32": [(Hv,)]}; a missing or
    empty entry leaves that kernel to test itself on first use. Each kernel then
    serves only where its test passed. Returns {kernel name: SelfTestResult};
    off the kernels' backends the results say NO_KERNEL and take no time.
    """
    results = {}
    for name, (key, test) in SELF_TESTS.items():
        if shapes.get(key):
            started = time.perf_counter()
            results[name] = test(shapes=[tuple(s) for s in shapes[key]])
            results[name].seconds = time.perf_counter() - started
    return results


# The tables the self-tests fill, which decide what serves where (never rebound: filled in place).
VERDICT_TABLES = {
    "qmv": _verified, "qmv32": _qmv32_serving, "rotate": _rotate_verified, "rotate_group": _rotate_group_verified,
    "rotate32": _rotate_fp32_verified, "rotate_group32": _rotate_group_fp32_verified, "gdn": _gdn_serving,
    "gdn32": _gdn32_serving,
    "dense": _dense_serving, "attention": _attention_verified, "attention32": _attention32_serving, "conv": _conv_serving, "conv32": _conv32_serving,
    "rope": _rope_serving, "rope32": _rope32_serving, "add_norm": _add_norm_serving,
    "add_norm32": _add_norm32_serving, "gated_norm": _gated_norm_serving, "gated_norm32": _gated_norm32_serving,
    "gates": _gates_serving, "gates32": _gates32_serving,
}


def kernel_verdicts(results: dict) -> dict:
    """verify_kernel_self_tests' results (less their cases and seconds) and the tables they filled,
    as JSON, for dflash2_verdicts' cache."""
    kept = [f.name for f in fields(SelfTestResult) if f.name not in ("cases", "seconds")]
    return {"results": {name: {field_name: getattr(result, field_name) for field_name in kept}
                        for name, result in results.items()},
            "tables": {name: [[key, sorted(value, key=str) if isinstance(value, set) else value]
                              for key, value in table.items()] for name, table in VERDICT_TABLES.items()}}


def restore_kernel_verdicts(verdicts: dict) -> dict:
    """Fills the tables as the self-tests kernel_verdicts saw had; returns their results."""
    def tupled(key):
        return tuple(tupled(part) for part in key) if isinstance(key, list) else key

    for name, table in VERDICT_TABLES.items():
        for key, value in verdicts["tables"][name]:
            table[tupled(key)] = set(value) if table is _attention_verified else value
    results = verdicts["results"]
    return {name: SelfTestResult(**results[name]) for name in SELF_TESTS if name in results}  # in the tests' order
