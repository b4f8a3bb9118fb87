"""What the kernel tests share."""

import sys

import mlx.core as mx

import dflash2_kernels as dk
from dflash2_kernel_qmv import GROUP_SIZE, stock_quantized_matmul


def patch_kernels(monkeypatch, name: str, value):
    """monkeypatch.setattr(module, name, value) on every kernel module that binds `name`: the
    face re-exports what the families define, and each family looks up its own binding of a
    shared name (backend_name, say)."""
    for module_name, module in sorted(sys.modules.items()):
        if module_name.startswith("dflash2_kernel") and hasattr(module, name):
            monkeypatch.setattr(module, name, value)


def same_bits(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(dk.raw_bits(a), dk.raw_bits(b)).item()


def flip_first_bit(a):
    """a with the last bit of its first element flipped."""
    bits = dk.raw_bits(a).reshape(-1)
    return mx.concatenate([bits[:1] ^ 1, bits[1:]]).reshape(a.shape).view(a.dtype)


def one_bit_off(function, at_rows):
    """function, but the last bit of its first output element flipped when its
    first argument has `at_rows` rows (axis `axis`)."""

    def wrong(*args, axis=0):
        out = function(*args)
        first = out[0] if isinstance(out, tuple) else out
        if args[0].shape[axis] != at_rows:
            return out
        flipped = flip_first_bit(first)
        return (flipped, *out[1:]) if isinstance(out, tuple) else flipped

    return wrong


class RecordingKernel:
    """Stands in for mx.fast.cuda_kernel's callable: records each launch."""

    def __init__(self):
        self.launches = []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        self.launches.append({"template": dict(template), "grid": grid, "threadgroup": threadgroup,
                              "x": inputs[0], "dtypes": list(output_dtypes)})
        return [mx.zeros(output_shapes[0], dtype=output_dtypes[0])]


# Wrong packed matmuls (x, weight, scales, biases) -> y, for the qmv self-tests (fp16 and fp32 rows)


def split_k_halves(x, weight, scales, biases):
    """MLX's own kernel on each half of K, halves added: another accumulation order. The
    halves are copied contiguous: MLX CUDA's qmv takes only row-contiguous weights (and
    has no other kernel for a column slice of them)."""
    half = x.shape[-1] // 2
    words, groups = half // 16, half // GROUP_SIZE
    first, second = (
        stock_quantized_matmul(*(mx.contiguous(a) for a in arrays))
        for arrays in (
            (x[:, :half], weight[:, :words], scales[:, :groups], biases[:, :groups]),
            (x[:, half:], weight[:, words:], scales[:, groups:], biases[:, groups:]),
        )
    )
    return first + second


def one_bit_off_at_eight_rows(x, weight, scales, biases):
    """Exact except the last bit of y[7, 3] when given 8 rows (fp16 or fp32 rows)."""
    y = dk.stock_rows(x, weight, scales, biases)
    if x.shape[0] < 8:
        return y
    bits = dk.raw_bits(y)
    target = (mx.arange(8)[:, None] == 7) & (mx.arange(y.shape[1])[None] == 3)
    return mx.where(target, bits ^ 1, bits).view(y.dtype)
