"""dflash2_kernel_rope on CPU: the rotary of queries and keys equals mlx-vlm's compiled call bit
for bit, and its self-test catches wrong kernels; on CUDA the kernel at the 27B shape."""

import mlx.core as mx
import pytest

import dflash2_kernel_base
import dflash2_kernel_rope
import dflash2_kernels as dk
from kernel_cases import flip_first_bit, same_bits


def test_rope_rows_equals_mlx_vlm_rotary():
    """Queries and keys (transposed views, as the model hands them over) rotated in their
    first R features, the rest passed through, as arrays of their shapes; on
    CUDA through the variant the kernel's self-test chose."""
    from mlx_vlm.models.rope_utils import rotate_half

    q, k, cos, sin = dflash2_kernel_rope.make_rope_case("normal", 2, 3, 1, 32, 16, 5, mx.random.key(1))
    variant = None
    if dk.backend_name() == "cuda":
        dflash2_kernel_rope.self_test_rope()
        variant = dflash2_kernel_rope._rope_serving["cuda"]
        assert variant in dflash2_kernel_rope.ROPE_VARIANTS
    got = dk.rope_rows(q, k, cos, sin, variant=variant)
    for x, rotated in zip((q, k), got):
        head, tail = x[..., :16], x[..., 16:]
        want = mx.concatenate([head * cos[:, None] + rotate_half(head) * sin[:, None], tail], axis=-1)
        assert rotated.shape == x.shape
        if variant is None:  # MLX's ops one at a time; a GPU contracts one product (rope_rows)
            assert same_bits(rotated, want)
        assert same_bits(rotated, dflash2_kernel_rope.stock_rope_rows(q, k, cos, sin)[x is k])


def test_wrong_rope_fails_naming_the_case():
    def wrong(q, k, cos, sin):  # the keys' first element one bit off at 8 positions
        q_out, k_out = dflash2_kernel_rope.stock_rope_rows(q, k, cos, sin)
        return q_out, flip_first_bit(k_out) if q.shape[2] == 8 else k_out

    result = dflash2_kernel_rope.self_test_rope([(1, 2, 1, 32, 16)], kernel=wrong)
    assert not result.ok and result.mismatches == len(dflash2_kernel_base.INPUT_KINDS)
    assert "(B, Hq, Hk, D, R)=(1, 2, 1, 32, 16) rows=8 input=normal, k" in result.reason
    assert dflash2_kernel_rope.self_test_rope([(1, 2, 1, 32, 16)], kernel=dflash2_kernel_rope.stock_rope_rows).ok


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
def test_rope_kernel_equals_mlx_vlm_at_the_27b_shape_on_cuda():
    """The 27B's attention rotary (24 query and 4 key heads of 256, the first 64 rotated)
    and the small shapes, 1..8 positions and a prefill's: a variant serves."""
    result = dflash2_kernel_rope.self_test_rope([(1, 24, 4, 256, 64), *dflash2_kernel_rope.ROPE_SHAPES_SMALL])
    assert result.ok and result.variant in dflash2_kernel_rope.ROPE_VARIANTS, result.reason
    print("rope variants, differing elements:", result.variants)
