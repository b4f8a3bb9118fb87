"""dflash2_kernel_rotate on CPU: the rotation equals mlx-vlm's stock chain bit for bit, its
self-tests catch wrong kernels, and rotated rows reach the qmv swizzled only where both
kernels passed."""

import mlx.core as mx
import pytest

import dflash2_kernel_base
import dflash2_kernel_linear
import dflash2_kernel_qmv
import dflash2_kernel_rotate
import dflash2_kernels as dk
from kernel_cases import RecordingKernel, one_bit_off, patch_kernels, same_bits


def test_rotate_equals_the_stock_chain():
    k, block = 1024, 512
    signs = dflash2_kernel_rotate.make_signs("general", k, mx.random.key(1))
    x = dflash2_kernel_rotate.make_rotate_inputs("nonfinite", 5, k, mx.random.key(2)).reshape(5, 1, k)
    assert same_bits(dk.rotate(x, block, signs), dflash2_kernel_rotate.stock_rotate(x, block, signs))


def test_wrong_rotation_fails_naming_the_case():
    result = dflash2_kernel_rotate.self_test_rotate([(512, 512)], kernel=one_bit_off(dflash2_kernel_rotate.stock_rotate, 4))
    assert not result.ok and result.mismatches == len(dflash2_kernel_rotate.SIGN_KINDS) * len(dflash2_kernel_rotate.ROTATE_INPUT_KINDS)
    assert "K=512, block=512, rows=4, input=normal, signs=pm1" in result.reason
    assert "first at [0, 0]" in result.reason
    fp16 = dflash2_kernel_rotate.self_test_rotate([(512, 512)], kernel=lambda x, block, signs: dflash2_kernel_rotate._fp16_chain(x, block, signs))
    assert not fp16.ok and fp16.stock_mismatches > 0  # the control sees fp16 rounding


@pytest.mark.parametrize(
    ("block", "bits"), [(512, 0x3D3504F3), (1024, 0x3D000000), (2048, 0x3CB504F3), (4096, 0x3C800000)]
)
def test_scale_bits(block, bits):
    # 1/sqrt(block) rounded to fp32: 2^-5 and 2^-6 exactly, else 2^-k times fp32(1/sqrt 2) = 0x3F3504F3.
    assert dflash2_kernel_rotate.scale_bits(block) == bits


@pytest.mark.parametrize("rotation_passed", [True, False])
def test_rotated_rows_reach_the_qmv_swizzled_only_where_both_kernels_passed(monkeypatch, rotation_passed):
    """exact_linear_rows on CUDA: the rotation writes swizzled rows for the qmv where it
    passed its self-test at (K, block) (every rotated K is whole 512-wide steps: blocks are
    512 or more); otherwise the stock chain rotates and the qmv reads plain rows."""
    k = 1024
    qmv, rotation = RecordingKernel(), RecordingKernel()
    monkeypatch.setattr(dflash2_kernel_qmv, "_cuda_kernel", lambda: qmv)
    monkeypatch.setattr(dflash2_kernel_rotate, "_cuda_rotate_kernel", lambda outputs=1: rotation)
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setitem(dflash2_kernel_qmv._verified, "cuda", True)
    monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_plans", {})
    monkeypatch.setattr(dflash2_kernel_linear, "_swizzled_rotations", {})
    monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_verified", {("cuda", k, 512): rotation_passed})
    dflash2_kernel_qmv._cuda_launch.cache_clear()
    dflash2_kernel_rotate.cuda_rotate_plan.cache_clear()
    weight, scales, biases = dflash2_kernel_qmv.make_weights(16, k, mx.random.key(1))
    x = dflash2_kernel_base.make_inputs("normal", 3, k, mx.random.key(2)).reshape(1, 3, k)
    signs = dflash2_kernel_rotate.make_signs("pm1", k, mx.random.key(3))
    try:
        assert dk.exact_linear_rows(x, 512, signs, weight, scales, biases).shape == (1, 3, 16)
    finally:
        dflash2_kernel_qmv._cuda_launch.cache_clear()
        dflash2_kernel_rotate.cuda_rotate_plan.cache_clear()
    assert qmv.launches[-1]["template"]["SWIZZLED"] is rotation_passed
    if rotation_passed:
        assert [launch["template"]["SWIZZLED"] for launch in rotation.launches] == [True]
    else:
        assert not rotation.launches  # the stock chain rotates


def test_group_rotation_self_test_fails_naming_the_output():
    """The group rotation's check, with stand-in kernels (CUDA has the real one; here the
    default says there is none): the chain per sign vector, in plain rows or swizzled as asked,
    passes; outputs in another order, or one layout whatever is asked, fail naming the case."""
    assert dflash2_kernel_linear.self_test_rotate_group().reason == (dflash2_kernel_base.NO_KERNEL if dk.backend_name() != "cuda" else None)
    shape = [(1024, 512, 3)]

    def chain(x, block, signs, swizzled):
        rotated = [dflash2_kernel_rotate.stock_rotate(x, block, sign) for sign in signs]
        return [dflash2_kernel_qmv.swizzle_steps(out) for out in rotated] if swizzled else rotated

    assert dflash2_kernel_linear.self_test_rotate_group(shape, kernel=chain).ok
    swapped = dflash2_kernel_linear.self_test_rotate_group(shape, kernel=lambda x, block, signs, swizzled:
                                        chain(x, block, signs[::-1], swizzled))
    assert not swapped.ok and "outputs=3, output 0, rows=1" in swapped.reason and "got 0x" in swapped.reason
    for layout, always in (("swizzled", False), ("rows", True)):
        one_layout = dflash2_kernel_linear.self_test_rotate_group(shape, kernel=lambda x, block, signs, swizzled:
                                               chain(x, block, signs, always))
        assert not one_layout.ok and f"layout={layout}" in one_layout.reason and one_layout.stock_mismatches > 0


@pytest.mark.parametrize("group_passed", [True, False])
def test_rotated_linears_sharing_their_input_take_one_rotation_launch_where_it_passed(monkeypatch, group_passed):
    """exact_linear_group on CUDA: where the group rotation passed its self-test at (K, block,
    count), one launch rotates x by every sign vector (grid.y: which) and each qmv reads its
    swizzled rows; otherwise a rotation each, as exact_linear_rows runs them. rotate_group
    (decode's, for MLX's matmuls) likewise, in plain rows."""
    qmv, rotation, group = RecordingKernel(), RecordingKernel(), RecordingGroupRotation()
    monkeypatch.setattr(dflash2_kernel_qmv, "_cuda_kernel", lambda: qmv)
    monkeypatch.setattr(dflash2_kernel_rotate, "_cuda_rotate_kernel", lambda outputs=1: rotation if outputs == 1 else group)
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setitem(dflash2_kernel_qmv._verified, "cuda", True)
    monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_plans", {})
    monkeypatch.setattr(dflash2_kernel_linear, "_swizzled_rotations", {})
    monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_verified", {("cuda", 1024, 512): True})
    monkeypatch.setattr(dflash2_kernel_linear, "_rotate_group_verified", {(1024, 512, 3): group_passed})
    for cached in (dflash2_kernel_qmv._cuda_launch, dflash2_kernel_rotate.cuda_rotate_plan):
        cached.cache_clear()
    matrices = [dflash2_kernel_qmv.make_weights(n, 1024, mx.random.key(n)) for n in (48, 16, 16)]
    signs = [dflash2_kernel_rotate.make_signs("pm1", 1024, mx.random.key(10 + index)) for index in range(3)]
    x = dflash2_kernel_base.make_inputs("normal", 4, 1024, mx.random.key(2)).reshape(1, 4, 1024)
    try:
        outputs = dk.exact_linear_group(x, 512, signs, matrices)
        decode_qmv, decode_group, decode_rotation = RecordingKernel(), RecordingGroupRotation(), RecordingKernel()
        monkeypatch.setattr(dflash2_kernel_qmv, "_cuda_kernel", lambda: decode_qmv)
        monkeypatch.setattr(dflash2_kernel_rotate, "_cuda_rotate_kernel",
                            lambda outputs=1: decode_rotation if outputs == 1 else decode_group)
        monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_plans", {})  # each plan holds the kernel it was made with
        dflash2_kernel_rotate.cuda_rotate_plan.cache_clear()
        rotated = dk.rotate_group(x, 512, signs)
    finally:
        for cached in (dflash2_kernel_qmv._cuda_launch, dflash2_kernel_rotate.cuda_rotate_plan):
            cached.cache_clear()
    assert len(rotated) == 3 and not decode_qmv.launches
    if group_passed:
        assert not decode_rotation.launches and [launch["grid"][1] for launch in decode_group.launches] == [3]
        assert decode_group.launches[0]["template"]["SWIZZLED"] is False and list(rotated) == decode_group.outputs
    else:
        assert not decode_group.launches
        assert [launch["template"]["SWIZZLED"] for launch in decode_rotation.launches] == [False] * 3
    assert [out.shape for out in outputs] == [(1, 4, 48), (1, 4, 16), (1, 4, 16)]
    assert [launch["template"]["SWIZZLED"] for launch in qmv.launches] == [True] * 3
    if group_passed:
        assert not rotation.launches and len(group.launches) == 1
        assert group.launches[0]["grid"][1] == 3 and group.launches[0]["template"]["SWIZZLED"] is True
        assert [launch["x"] for launch in qmv.launches] == group.outputs  # each qmv reads its own rotation
    else:
        assert not group.launches and len(rotation.launches) == 3


class RecordingGroupRotation(RecordingKernel):
    """The group rotation's stand-in: one output per sign vector, kept to follow them."""

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        super().__call__(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                         output_shapes=output_shapes, output_dtypes=output_dtypes)
        self.outputs = [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return self.outputs


def test_the_pack_s_shared_input_linears_are_its_rotation_groups():
    """kernel_shapes names the 27B pack's groups of rotated linears that share their input, for
    the start-up self-test of the group rotation: q/k/v (3), in_proj_qkv and in_proj_z, gate and up (2)."""
    from make_synthetic_pack import target_config

    from dflash2_pack import build_skeleton, kernel_shapes

    shapes = kernel_shapes(build_skeleton(target_config("27b"), "config.json"))  # fp32 norms: fp32 rows
    assert shapes["rotation_groups_fp32"] == [(5120, 1024, 2), (5120, 1024, 3)]


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernels")
def test_group_rotation_and_qmvs_equal_the_stock_chain_and_single_row_calls_on_cuda():
    """One rotation launch for three linears sharing x, each qmv on its swizzled rows: every
    row of every output is the stock chain's and MLX's single-row call's; decode's group
    rotation (plain rows, for MLX's matmuls) the stock chain's."""
    k, block = 1024, 512
    matrices = [dflash2_kernel_qmv.make_weights(n, k, mx.random.key(n)) for n in (48, 16, 24)]
    signs = [dflash2_kernel_rotate.make_signs(kind, k, mx.random.key(index)) for index, kind in enumerate(("pm1", "general", "pm1"))]
    for rows in range(1, dk.MAX_ROWS + 1):
        x = dflash2_kernel_base.make_inputs("normal", rows, k, mx.random.key(3 + rows))
        got = dk.exact_linear_group(x, block, signs, matrices)
        for out, sign, matrix in zip(got, signs, matrices):
            assert dflash2_kernel_base._differing(out, dk.stock_rows(dflash2_kernel_rotate.stock_rotate(x, block, sign), *matrix)) == 0
        for out, sign in zip(dk.rotate_group(x, block, signs), signs):  # decode's, in plain rows
            assert dflash2_kernel_base._differing(out, dflash2_kernel_rotate.stock_rotate(x, block, sign)) == 0
    assert dflash2_kernel_linear._rotate_group_verified[(k, block, 3)]  # the group kernel served, with the qmv:
    assert all(dflash2_kernel_qmv._serving_kernel("cuda", n, k, dk.MAX_ROWS) for n in (48, 16, 24))


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernels")
def test_swizzled_rotation_and_qmv_equal_the_stock_chain_and_single_row_calls_on_cuda():
    """The served rotated linear (rotation writing swizzled rows, qmv reading them) gives
    every row the stock chain's and MLX's single-row bits; each kernel reading or writing
    the other layout is caught by its self-test (the layout check can fail)."""
    k, block = 1024, 512
    weight, scales, biases = dflash2_kernel_qmv.make_weights(24, k, mx.random.key(1))
    signs = dflash2_kernel_rotate.make_signs("pm1", k, mx.random.key(2))
    for rows in range(1, dk.MAX_ROWS + 1):
        x = dflash2_kernel_base.make_inputs("normal", rows, k, mx.random.key(3 + rows))
        want = dk.stock_rows(dflash2_kernel_rotate.stock_rotate(x, block, signs), weight, scales, biases)
        assert dflash2_kernel_base._differing(dk.exact_linear_rows(x, block, signs, weight, scales, biases), want) == 0
    assert dflash2_kernel_linear._swizzled_rotation(k, block) is not None and dflash2_kernel_qmv._serving_kernel("cuda", 24, k, dk.MAX_ROWS)
    plain_read_as_swizzled = dk.self_test(
        kernel=lambda x, w, s, b: dflash2_kernel_qmv.cuda_matmul(x, w, s, b, swizzled=True), shapes=[(16, k)])
    assert not plain_read_as_swizzled.ok and "layout=rows" in plain_read_as_swizzled.reason
    swizzled_as_plain = dflash2_kernel_rotate.self_test_rotate(
        [(k, block)], kernel=lambda x, block, signs: dflash2_kernel_rotate.cuda_rotate_plan(k, block, swizzled=True)(x, signs))
    assert not swizzled_as_plain.ok and "layout=rows" in swizzled_as_plain.reason


def test_the_fp32_rotation_s_self_test_passes_the_chain_and_fails_another_order():
    """fp32 rows (the real file's): the stock chain injected passes at every row count, kind
    (non-finite values too) and sign kind, while the Hadamard-matrix GEMM, the same maths
    summed otherwise, differs (the control) and, injected, fails naming the case; an
    injected kernel never switches serving, and off CUDA nothing of its own is tested."""
    serving = dict(dflash2_kernel_rotate._rotate_fp32_verified)
    passed = dflash2_kernel_rotate.self_test_rotate_fp32(shapes=[(1024, 512)], kernel=dflash2_kernel_rotate.stock_rotate)
    assert passed.ok and passed.mismatches == 0 and passed.stock_mismatches > 0, passed.reason
    assert {case["rows"] for case in passed.cases} == set(range(1, 9))
    assert "nonfinite" in {case["input"] for case in passed.cases}
    failed = dflash2_kernel_rotate.self_test_rotate_fp32(shapes=[(1024, 512)], kernel=dflash2_kernel_rotate._matrix_chain)
    assert not failed.ok and "K=1024, block=512, rows=1" in failed.reason and "got 0x" in failed.reason
    assert dflash2_kernel_rotate._rotate_fp32_verified == serving
    if dk.backend_name() != "cuda":
        assert dflash2_kernel_rotate.self_test_rotate_fp32().reason == dflash2_kernel_base.NO_KERNEL


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
def test_the_cuda_rotation_equals_the_chain_on_fp32_rows_at_the_27b_shapes():
    result = dflash2_kernel_rotate.self_test_rotate_fp32(shapes=list(dflash2_kernel_rotate.ROTATE_SHAPES_27B))
    assert result.ok and result.variant == "butterflies", result.reason
    assert result.controls["Hadamard-matrix GEMM"] > 0


@pytest.mark.parametrize("verified", [True, False])
def test_fp32_rows_take_the_cuda_rotation_only_where_its_fp32_self_test_passed(monkeypatch, verified):
    k, block = 1024, 512
    signs = dflash2_kernel_rotate.make_signs("pm1", k, mx.random.key(0))
    x = dflash2_kernel_base.make_inputs_fp32("normal", 3, k, mx.random.key(1))
    calls = []

    def plan(k_, block_, swizzled=False, outputs=1, dtype=mx.float16):
        calls.append((k_, block_, dtype))
        return lambda rows, sign: dflash2_kernel_rotate.stock_rotate(rows, block_, sign)

    monkeypatch.setattr(dflash2_kernel_rotate, "backend_name", lambda: "cuda")
    monkeypatch.setattr(dflash2_kernel_rotate, "cuda_rotate_plan", plan)
    monkeypatch.setattr(dflash2_kernel_rotate, "_rotate_plans", {})
    monkeypatch.setitem(dflash2_kernel_rotate._rotate_fp32_verified, ("cuda", k, block), verified)
    got = dk.rotate(x, block, signs)
    assert calls == ([(k, block, mx.float32)] if verified else [])
    assert same_bits(got, dflash2_kernel_rotate.stock_rotate(x, block, signs))


def test_an_fp32_pack_s_start_up_tests_the_fp32_rotation_at_its_widths(target, float32_target):
    from dflash2_pack import kernel_shapes

    fp32 = kernel_shapes(float32_target[0])
    assert fp32["rotations_fp32"] and not fp32["rotations"]  # an fp32 pack tests no fp16 kernel
    assert kernel_shapes(target[0])["rotations_fp32"] == []
    assert dk.SELF_TESTS["rotate32"][0] == "rotations_fp32" and "rotate32" in dk.VERDICT_TABLES
