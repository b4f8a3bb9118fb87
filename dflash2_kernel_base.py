"""Shared by the kernel families: the backend, the self-test result, test inputs, bitwise
comparison, CUDA kernel building, and the helpers of variant kernels and gemv replicas."""

import hashlib
import os
import stat
import tempfile
from dataclasses import dataclass, field
from functools import cache
from typing import Optional

import mlx.core as mx
import numpy as np

import dflash2_kernel_cache

# ===========================================================================
# Shared: backend, result type, test inputs, bitwise comparison

MAX_ROWS = 8  # rows (verify positions) one kernel call takes
INPUT_KINDS = ("normal", "large", "tiny", "subnormal", "signed_zero", "cancellation")
# fp32 activations: the fp16 kinds' ranges do not reach fp32's edges, so these do.
FP32_INPUT_KINDS = ("normal", "large", "tiny", "signed_zero", "cancellation")
NO_KERNEL = "stock calls on this backend"  # a self-test's reason when nothing was tested


def backend_name() -> str:
    """Where MLX runs ops by default here: "cuda", "metal" or "cpu"."""
    if mx.default_device().type == mx.DeviceType.gpu:
        if mx.metal.is_available():
            return "metal"
        if mx.cuda.is_available():
            return "cuda"
    return "cpu"


@dataclass
class SelfTestResult:
    """One kernel's self-test. reason: why it failed, or NO_KERNEL when the
    backend has no kernel to test; with variants, each failed variant's first
    difference (even when another variant passed)."""

    ok: bool
    backend: str
    reason: Optional[str]
    mismatches: int  # elements whose bits differ from the reference (the serving variant's)
    stock_mismatches: int  # the same for MLX's own multi-row path (negative control)
    cases: list = field(default_factory=list)
    variant: Optional[str] = None  # the variant that serves (variant kernels only)
    variants: dict = field(default_factory=dict)  # variant -> differing elements
    controls: dict = field(default_factory=dict)  # negative control -> differing elements
    seconds: float = 0.0  # the test's wall time (set by verify_kernel_self_tests)


def _no_kernel_result(backend: str) -> SelfTestResult:
    return SelfTestResult(True, backend, NO_KERNEL, 0, 0)


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
        a = normal[:, ::2] * 100.0  # an odd width ends on an a without its -a
        x = mx.stack([a, -a], axis=-1).reshape(rows, -1)[:, :k]
    else:
        raise ValueError(f"unknown input kind {kind!r}")
    return x.astype(mx.float16)


def make_inputs_fp32(kind: str, rows: int, k: int, key) -> mx.array:
    """fp32 activations of one kind (FP32_INPUT_KINDS)."""
    k1, k2 = mx.random.split(key)
    normal = mx.random.normal((rows, k), key=k1)
    if kind == "normal":
        return normal
    if kind == "large":  # 1e34, times 16 a row up to 4096: later rows' sums overflow to inf or nan
        return normal * 1e34 * mx.power(2.0, (mx.arange(rows)[:, None] % 4).astype(mx.float32) * 4)
    if kind == "tiny":  # fp32 subnormals and the smallest normals
        return normal * 1e-39
    if kind == "signed_zero":  # row 0 all -0, later rows +-0 and 1 in 16 normal
        sign = mx.where(mx.random.bernoulli(0.5, (rows, k), key=k2), -1.0, 1.0)
        sign = mx.where(mx.arange(rows)[:, None] == 0, -1.0, sign)
        keep = mx.random.bernoulli(1 / 16, (rows, k), key=k1) & (mx.arange(rows)[:, None] >= 1)
        return mx.where(keep, normal, 0.0 * sign)
    if kind == "cancellation":  # (a, -a) pairs: products cancel across slots and lanes
        a = normal[:, ::2] * 1e4
        return mx.stack([a, -a], axis=-1).reshape(rows, -1)[:, :k]
    raise ValueError(f"unknown input kind {kind!r}")


def make_inputs_for(dtype):
    """The activation maker of rows of this dtype: make_inputs (fp16) or make_inputs_fp32."""
    return make_inputs_fp32 if dtype == mx.float32 else make_inputs


def input_kinds_for(dtype) -> tuple:
    """The input kinds make_inputs_for(dtype) takes."""
    return FP32_INPUT_KINDS if dtype == mx.float32 else INPUT_KINDS


def raw_bits(a: mx.array) -> mx.array:
    """a's raw bits, as unsigned integers of its element size (bytes for other sizes)."""
    return a.view({2: mx.uint16, 4: mx.uint32}.get(a.dtype.size, mx.uint8))


def _differing(got: mx.array, want: mx.array) -> int:
    """Elements whose bits differ; a wrong shape or dtype raises (and fails the test)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ValueError(f"got {got.dtype} {got.shape}, want {want.dtype} {want.shape}")
    return (raw_bits(got) != raw_bits(want)).sum().item()


def _first_difference(got: mx.array, want: mx.array) -> tuple:
    """(how many elements differ and the first one's bits, that element's index)."""
    got_bits, want_bits = np.array(raw_bits(got)), np.array(raw_bits(want))
    differ = got_bits != want_bits
    index = tuple(int(i) for i in np.argwhere(differ)[0])
    digits = 2 * got.dtype.size
    text = (
        f"{int(differ.sum())} elements, first at {list(index)} "
        f"(got 0x{got_bits[index]:0{digits}x}, want 0x{want_bits[index]:0{digits}x})"
    )
    return text, index

def run_case(name, compare, case: dict, where: str, differing: dict, failures: dict, cases: list):
    """One variant on one self-test case: compare() -> {part: (got, want)}. Adds its differing
    elements to differing[name] (a raise counts one), records the case, and keeps the
    variant's first failure, named by `where` and the part. Returns the case's differing
    elements (None: it raised)."""
    try:
        pairs = compare()
        diffs = {part: _differing(*pair) for part, pair in pairs.items()}
    except Exception as error:  # a kernel that fails to build or run fails
        failures.setdefault(name, f"{name} raised {type(error).__name__}: {error}")
        differing[name] += 1
        return None
    diff = sum(diffs.values())
    cases.append({**case, "variant": name, "mismatches": diff})
    differing[name] += diff
    if diff and name not in failures:
        part = next(part for part, count in diffs.items() if count)
        failures[name] = f"{name} differs at {where}, {part}: " + _first_difference(*pairs[part])[0]
    return diff


# ===========================================================================
# CUDA kernel sources


# The element type a CUDA kernel argument points to, `dflash2_types::Element<decltype(arg)>::type`:
# one source for a kernel's fp16 and fp32 builds (MLX writes each argument's pointer type).
CUDA_ELEMENT_TYPE = r"""
#ifndef DFLASH2_ELEMENT_TYPE
#define DFLASH2_ELEMENT_TYPE
namespace dflash2_types {

template <typename P> struct Element;
template <typename T> struct Element<T*> { using type = T; };
template <typename T> struct Element<const T*> { using type = T; };

}  // namespace dflash2_types
#endif
"""


@cache
def _private_header_folder() -> str:
    return tempfile.mkdtemp(prefix="dflash2-cuda-")


def cuda_header(text: str) -> str:
    """An #include of `text`, written once to a file named by its sha256.

    MLX copies a CUDA kernel's header into every call's primitive and hashes it at every
    eval: for our 4-8 KB headers ~3-4 us a call on the H200 (.gpu launch probe), and a
    verify makes ~1,000 calls. NVRTC reads the file only when it compiles; the content
    hash in the name keeps MLX's PTX cache from serving an old header's build."""
    folder = os.path.join(tempfile.gettempdir(), f"dflash2-cuda-{os.getuid()}")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        owner = os.lstat(folder)  # another user could swap the text, or repoint a link they made
        shared = not stat.S_ISDIR(owner.st_mode) or owner.st_uid != os.getuid() or owner.st_mode & 0o022
    except OSError:  # a file, or a link to one, in the folder's place
        shared = True
    if shared:
        folder = _private_header_folder()
    path = os.path.join(folder, hashlib.sha256(text.encode()).hexdigest()[:32] + ".cuh")
    try:
        with open(path) as existing:
            current = existing.read()
    except FileNotFoundError:
        current = None
    if current != text:
        partial_path = f"{path}.{os.getpid()}"
        with open(partial_path, "w") as out:
            out.write(text)
        os.replace(partial_path, path)
    return f'#include "{path}"\n'


class BakedCudaKernel:
    """mx.fast.cuda_kernel made once per template, with the template's constants written into
    its source as MLX writes them at every call (build_kernel in
    mlx/backend/cuda/custom_kernel.cpp: `constexpr` lines, then a blank line) and MLX's template
    suffix in its name: MLX compiles the same source under the same kernel name, but a call no
    longer hands MLX a template to convert and format again (on the H200 about 2 us of a
    13 us call: evidence/launch-cost-cuda.md; a verify round makes about 450 calls).
    Called as the kernel it wraps: template=[(name, int or bool), ...] and the launch."""

    def __init__(self, name: str, source: str, **made):
        self._name, self._source, self._made = name, source, made
        self._by_template = {}

    def __call__(self, *, template=(), **launch):
        key = tuple(template)
        kernel = self._by_template.get(key)
        if kernel is None:
            source = _template_lines(key) + self._source  # first: it refuses what MLX's suffix cannot name
            name = self._name + _template_suffix(key)
            kernel = self._by_template[key] = mx.fast.cuda_kernel(name=name, source=source, **self._made)
            # The binary for this first launch's dtypes; a later launch with others MLX compiles.
            dflash2_kernel_cache.prepare(name, self._made.get("header", ""), source, self._made["input_names"],
                                         launch["inputs"], self._made["output_names"], launch["output_dtypes"])
        return kernel(**launch)


def _template_suffix(template) -> str:
    """MLX's template_arguments_hash: "_<int>" or "_t" / "_f" per argument."""
    return "".join(f"_{'t' if value else 'f'}" if isinstance(value, (bool, np.bool_)) else f"_{int(value)}"
                   for _, value in template)


def _template_lines(template) -> str:
    """The lines build_kernel writes for a template: none for an empty one."""
    lines = []
    for name, value in template:
        if isinstance(value, (bool, np.bool_)):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        elif isinstance(value, (int, np.integer)):
            lines.append(f"  constexpr int {name} = {int(value)};\n")
        else:  # MLX's Dtype arguments: none of these kernels takes one
            raise TypeError(f"template argument {name} must be an int or a bool, got {value!r}")
    lines = "".join(lines)
    return lines + "\n" if lines else ""


def gemv_elements_per_lane(k: int) -> int:
    """gemv's n_per_thread (gemv.cu:242-249) for aligned pointers (every fresh or
    row-sliced array, the KV cache's buffers): used by dense rows and attention scores."""
    return 4 if k % 128 == 0 else 2 if k % 64 == 0 else 1


def cuda_serving_variant(serving: dict, self_test_function):
    """The variant a CUDA-only kernel serves here (serving: backend -> variant or None),
    its self-test run first on this backend's first call; None: the stock calls."""
    backend = backend_name()
    if backend == "cuda" and backend not in serving:
        self_test_function()
    return serving.get(backend)


def _variants_result(backend, differing, failures, controls, cases) -> SelfTestResult:
    """The result of a test over kernel variants: the first variant with no
    differing element serves (None: the stock calls)."""
    variant = next((name for name, count in differing.items() if count == 0), None)
    return SelfTestResult(
        ok=variant is not None,
        backend=backend,
        reason="; ".join(failures.values()) or None,
        mismatches=differing[variant or next(iter(differing))],
        stock_mismatches=sum(count for count in controls.values() if count > 0),
        cases=cases,
        variant=variant,
        variants=differing,
        controls=controls,
    )


# ===========================================================================
# A kernel's variants against decode's calls (the fused steps' and the rotary's self-tests)


def _self_test_cases(kernel, variants: dict, serving: dict, shapes, seed, make_case, stock,
                     failed_are_controls=False, rows=range(1, MAX_ROWS + 1), kinds=INPUT_KINDS) -> SelfTestResult:
    """A kernel's variants against decode's calls, as bits, at each of `rows` and every input kind:
    make_case(kind, rows, shape, key) -> (arguments, where); kernel, each variant and stock
    take the arguments and return {part: array}. kernel: tested alone as variant "kernel",
    serving untouched; else serving[backend] becomes the first variant that passed (None: the
    stock calls). failed_are_controls: the variants that differ are the passing one's
    negative controls. kinds: the input kinds make_case takes (INPUT_KINDS: fp16's)."""
    backend = backend_name()
    if kernel is None and backend != "cuda":
        return _no_kernel_result(backend)
    variants = {"kernel": kernel} if kernel else variants
    differing = {name: 0 for name in variants}
    failures, cases = {}, []
    key = mx.random.key(seed)
    for shape in shapes:
        for kind in kinds:
            key, case_key = mx.random.split(key)
            for count in rows:
                arguments, where = make_case(kind, count, shape, case_key)
                want = stock(*arguments)
                for name, function in variants.items():
                    def compare(function=function):
                        return {part: (got, want[part]) for part, got in function(*arguments).items()}

                    run_case(name, compare, {"shape": list(shape), "rows": count, "input": kind},
                              f"{where} input={kind}", differing, failures, cases)
    controls = {name: count for name, count in differing.items() if count} if failed_are_controls else {}
    result = _variants_result(backend, differing, failures, controls, cases)
    if kernel is None:
        serving[backend] = result.variant
    return result
