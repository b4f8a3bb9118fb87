"""dflash2_kernel_linear on fp32 rows (the real file's): the group rotation's fp32 self-test
catches wrong kernels; linears sharing fp32 rows take one rotation launch where it passed,
then the fp32 matmul, equal to a rotation and a single-row call each; an fp32 pack's start-up
tests it, and verify hands it the shared rows."""

import mlx.core as mx
import pytest

import dflash2_kernel_base
import dflash2_kernel_linear
import dflash2_kernel_qmv
import dflash2_kernel_qmv32
import dflash2_kernel_rotate
import dflash2_kernels as dk
import dflash2_verify
from kernel_cases import RecordingKernel, flip_first_bit, patch_kernels, same_bits

SHAPE = [(1024, 512, 3)]


def chain(x, block, signs):
    return [dflash2_kernel_rotate.stock_rotate(x, block, sign) for sign in signs]


def test_the_fp32_group_rotation_self_test_fails_naming_the_case():
    """With stand-in kernels (CUDA has the real one; here the default says there is none): the
    chain per sign vector passes; outputs in another order or one bit off in the last output
    fail naming the shape and rows, one output short fails as a raise."""
    assert dflash2_kernel_linear.self_test_rotate_group_fp32().reason == (
        dflash2_kernel_base.NO_KERNEL if dk.backend_name() != "cuda" else None)
    passed = dflash2_kernel_linear.self_test_rotate_group_fp32(SHAPE, kernel=chain)
    assert passed.ok and passed.variant == "kernel" and passed.mismatches == 0, passed.reason
    assert {case["rows"] for case in passed.cases} == set(range(1, 9))
    assert {case["input"] for case in passed.cases} == set(dflash2_kernel_base.FP32_INPUT_KINDS + ("nonfinite",))
    assert passed.stock_mismatches > 0  # the Hadamard-matrix GEMM rounds otherwise
    short = dflash2_kernel_linear.self_test_rotate_group_fp32(SHAPE, kernel=lambda x, block, signs:
                                                              chain(x, block, signs[:-1]))
    assert not short.ok and "raised ValueError: 2 outputs for 3 sign vectors" in short.reason
    wrong = {
        "swapped": lambda x, block, signs: chain(x, block, signs[::-1]),
        "last bit": lambda x, block, signs: [*chain(x, block, signs[:-1]), flip_first_bit(chain(x, block, signs[-1:])[0])],
    }
    for name, kernel in wrong.items():
        result = dflash2_kernel_linear.self_test_rotate_group_fp32(SHAPE, kernel=kernel)
        assert not result.ok and result.variant is None, name
        assert "K=1024, block=512, outputs=3, rows=1" in result.reason, (name, result.reason)
    assert "y2" in dflash2_kernel_linear.self_test_rotate_group_fp32(SHAPE, kernel=wrong["last bit"]).reason


class RecordingRotation(RecordingKernel):
    """The rotation's stand-in, one output per sign vector: the stock chain's, so what follows
    it computes on the right rows."""

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        super().__call__(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                         output_shapes=output_shapes, output_dtypes=output_dtypes)
        x, *signs = inputs
        return chain(x, template[0][1], signs)


@pytest.mark.parametrize("group_passed", [True, False])
def test_fp32_rows_sharing_their_input_take_one_rotation_launch_where_it_passed(monkeypatch, group_passed):
    """As on CUDA (backend faked, kernels stand-ins): where the fp32 group rotation passed at
    (K, block, count), one launch rotates the fp32 rows by every sign vector (grid.y: which),
    fp32 out; otherwise a rotation each. Then each linear's fp32 matmul; every output equals
    the stock rotation and single-row calls."""
    rotation, group, qmv32 = RecordingRotation(), RecordingRotation(), RecordingKernel()
    monkeypatch.setattr(dflash2_kernel_rotate, "_cuda_rotate_kernel", lambda outputs=1: rotation if outputs == 1 else group)
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_plans", {})
    monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_fp32_verified", {("cuda", 1024, 512): True})
    monkeypatch.setattr(dflash2_kernel_linear, "_rotate_group_fp32_verified", {(1024, 512, 3): group_passed})
    monkeypatch.setattr(dflash2_kernel_qmv32, "_qmv32_serving", {"cuda": "fma"})
    monkeypatch.setattr(dflash2_kernel_qmv32, "cuda_matmul_fp32",
                        lambda x, *packed, variant: qmv32(inputs=[x], template=[], grid=None, threadgroup=None,
                                                          output_shapes=[x.shape], output_dtypes=[x.dtype])
                        and dk.stock_rows(x, *packed))
    dflash2_kernel_rotate.cuda_rotate_plan.cache_clear()
    matrices = [dflash2_kernel_qmv.make_weights(n, 1024, mx.random.key(n)) for n in (48, 16, 16)]
    signs = [dflash2_kernel_rotate.make_signs("pm1", 1024, mx.random.key(10 + index)) for index in range(3)]
    x = dflash2_kernel_base.make_inputs_fp32("normal", 4, 1024, mx.random.key(2)).reshape(1, 4, 1024)
    try:
        outputs = dk.exact_linear_group(x, 512, signs, matrices)
    finally:
        dflash2_kernel_rotate.cuda_rotate_plan.cache_clear()
    if group_passed:
        assert not rotation.launches and [launch["grid"][1] for launch in group.launches] == [3]
        assert group.launches[0]["dtypes"] == [mx.float32] * 3
    else:
        assert not group.launches and len(rotation.launches) == 3
    assert len(qmv32.launches) == 3
    for out, sign, matrix in zip(outputs, signs, matrices):
        assert same_bits(out, dk.stock_rows(dflash2_kernel_rotate.stock_rotate(x, 512, sign), *matrix))


def test_an_fp32_pack_s_start_up_tests_the_fp32_group_rotation(target, float32_target):
    """kernel_shapes hands the fp32 group rotation the pack's groups where its activations are
    fp32, and none to an fp16 pack's start-up."""
    from dflash2_pack import kernel_shapes

    fp32 = kernel_shapes(float32_target[0])
    assert fp32["rotation_groups_fp32"] and not fp32["rotation_groups"]  # no fp16 kernel tested
    assert kernel_shapes(target[0])["rotation_groups_fp32"] == []
    assert dk.SELF_TESTS["rotate_group32"][0] == "rotation_groups_fp32" and "rotate_group32" in dk.VERDICT_TABLES


def test_verify_hands_an_fp32_mlp_s_gate_and_up_to_the_group(float32_target, monkeypatch):
    """The exact verify's linears that share fp32 rows (an MLP's gate and up) make one
    exact_linear_group call for them, whose results it returns."""
    mlp = next(layer.mlp for layer in float32_target[0].language_model.model.layers)
    calls = []

    def spy(x, block, signs, matrices):
        calls.append((x.dtype, block, len(matrices)))
        return dflash2_kernel_linear.exact_linear_group(x, block, signs, matrices)

    monkeypatch.setattr(dk, "exact_linear_group", spy)
    k = dk.packed_width(mlp.gate_proj.weight)
    x = dflash2_kernel_base.make_inputs_fp32("normal", 3, k, mx.random.key(0)).reshape(1, 3, k)
    gate, up = dflash2_verify.ExactVerifier()._linears((mlp.gate_proj, mlp.up_proj), x)
    assert calls == [(mx.float32, mlp.gate_proj.block, 2)]
    assert same_bits(gate, mlp.gate_proj(x)) and same_bits(up, mlp.up_proj(x))
