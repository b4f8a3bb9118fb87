"""dflash2_kernel_attention on CPU: decode attention at L queries equals the single-query calls
bit for bit, and serves only where its self-test passed."""

import mlx.core as mx
import pytest

import dflash2_kernel_attention
import dflash2_kernel_attention_metal
import dflash2_kernels as dk
from kernel_cases import flip_first_bit, one_bit_off, patch_kernels, same_bits


def test_decode_attention_rows_equals_single_query_calls():
    queries, keys, values, _, _ = dflash2_kernel_attention._make_case((1, 4, 2, 64), 5, 3, "normal", mx.random.key(1))
    got = dk.decode_attention_rows(queries, keys, values, 0.125, 5)
    want = mx.concatenate(
        [
            mx.fast.scaled_dot_product_attention(
                queries[:, :, j : j + 1], keys[:, :, : 5 + j], values[:, :, : 5 + j], scale=0.125
            )
            for j in range(3)
        ],
        axis=2,
    )
    assert same_bits(got, want)
    with pytest.raises(ValueError, match="need 8 keys"):
        dk.decode_attention_rows(queries, keys[:, :, :6], values, 0.125, 6)


def test_attention_kernels_serve_only_the_softmax_block_dims_their_self_test_covered(monkeypatch):
    """Each softmax block dim is its own compiled kernel: a context whose queries need a
    block dim the self-test never ran takes the stock per-query calls."""
    shape = (1, 2, 2, 256)
    served = []
    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setattr(dflash2_kernel_attention, "cuda_attention_rows", lambda *args: served.append(args[-1]) or "kernel")
    monkeypatch.setitem(dflash2_kernel_attention._attention_verified, ("cuda", shape), {32, 64})
    for first_length, rows, kernel in ((250, 8, True), (509, 4, True), (510, 4, False), (600, 1, False)):
        queries, keys, values, _, _ = dflash2_kernel_attention._make_case(shape, first_length, rows, "normal", mx.random.key(1))
        got = dk.decode_attention_rows(queries, keys, values, 0.0625, first_length)
        assert (isinstance(got, str)) == kernel, (first_length, rows)
    assert served == [250, 509]


def test_metal_attention_spans_keep_decode_s_routing():
    """At most 32 // GQA queries a call (8 at most), never across a key length where MLX's
    Metal routing changes (query j sees first_length + j keys)."""
    pack, gqa_8, gqa_16 = dflash2_kernel_attention.ATTENTION_PACK_SHAPE, (1, 16, 2, 128), (1, 32, 2, 256)
    assert dflash2_kernel_attention_metal.metal_attention_spans(pack, 8, 100) == [(0, 5), (5, 8)]
    assert dflash2_kernel_attention_metal.metal_attention_spans(pack, 8, 1020) == [(0, 4), (4, 5), (5, 8)]  # 1024 and 1025 start regimes
    assert dflash2_kernel_attention_metal.metal_attention_spans(gqa_16, 3, 4094) == [(0, 2), (2, 3)]
    assert dflash2_kernel_attention_metal.metal_attention_spans(pack, 1, 7) == [(0, 1)]
    # GQA 8 at head dim 128: from 8192 keys decode's one query takes a kernel of its own.
    assert dflash2_kernel_attention_metal.metal_attention_spans(gqa_8, 6, 8188) == [(0, 4), (4, 5), (5, 6)]
    assert dflash2_kernel_attention_metal.metal_sdpa_regime(gqa_8, 8192) is None and dflash2_kernel_attention_metal.metal_sdpa_regime(pack, 8192) == 4
    assert not dflash2_kernel_attention_metal.metal_attention_supports(1, 8, 2, 256, mx.float16)  # GQA 4: its n_simds branches move
    assert not dflash2_kernel_attention_metal.metal_attention_supports(1, 24, 4, 192, mx.float16)  # decode runs the unfused path
    assert dflash2_kernel_attention_metal.metal_attention_supports(*dflash2_kernel_attention.ATTENTION_PACK_SHAPE, mx.float16)


def test_metal_attention_serves_multi_query_calls_only_where_its_self_test_passed(monkeypatch, on_cpu):
    """On Metal verify takes MLX's multi-query attention once the shape's self-test found it
    decode's per query; where multi-query calls round otherwise (the GPU-like backend) the
    test fails and each query is the stock call."""
    from gpu_rounding import swap_row_variant_ops

    shape = (1, 12, 2, 64)  # GQA 6: five queries a call
    patch_kernels(monkeypatch, "backend_name", lambda: "metal")
    monkeypatch.setattr(dflash2_kernel_attention, "_attention_verified", {})
    queries, keys, values, _, _ = dflash2_kernel_attention._make_case(shape, 250, 8, "normal", mx.random.key(2))
    calls = []
    spans = dflash2_kernel_attention_metal.metal_attention_spans
    monkeypatch.setattr(dflash2_kernel_attention_metal, "metal_attention_spans", lambda *args: calls.append(args) or spans(*args))
    want = dflash2_kernel_attention.stock_attention_rows(queries, keys, values, 0.125, 250)
    assert same_bits(dk.decode_attention_rows(queries, keys, values, 0.125, 250), want)
    assert dflash2_kernel_attention._attention_verified == {("metal", shape): {0}} and calls[-1] == (shape, 8, 250)

    swap_row_variant_ops(monkeypatch)
    monkeypatch.setattr(dflash2_kernel_attention, "_attention_verified", {})
    calls.clear()
    want = dflash2_kernel_attention.stock_attention_rows(queries, keys, values, 0.125, 250)
    with pytest.warns(UserWarning, match="metal attention failed its self-test"):
        got = dk.decode_attention_rows(queries, keys, values, 0.125, 250)
    assert same_bits(got, want) and dflash2_kernel_attention._attention_verified == {("metal", shape): set()}
    calls.clear()
    assert same_bits(dk.decode_attention_rows(queries, keys, values, 0.125, 250), want) and calls == []


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_attention_self_test_lengths_cover_every_softmax_block_dim_at_the_pack_shape(dtype):
    """fp16 rows read 8 a thread, fp32 rows 4 (MLX's softmax N_READS), so their block dims
    change at other key lengths; the pack's lengths reach all six either way."""
    reads = dflash2_kernel_attention.softmax_reads(dtype)
    lengths = {first + j for first in dflash2_kernel_attention.PACK_FIRST_LENGTHS for j in range(dflash2_kernel_attention.MAX_QUERIES)}
    assert {dflash2_kernel_attention.softmax_block_dim(t, reads) for t in lengths} == {32, 64, 128, 256, 512, 1024}


def test_wrong_attention_fails_naming_the_case():
    def wrong(queries, keys, values, scale, first_length):
        return one_bit_off(dflash2_kernel_attention.stock_attention_rows, 2)(queries, keys, values, scale, first_length, axis=2)

    serving = dict(dflash2_kernel_attention._attention_verified)
    result = dflash2_kernel_attention.self_test_attention([(1, 2, 1, 64)], first_lengths=(7,), max_queries=2, kernel=wrong)
    assert not result.ok
    assert "(B, Hq, Hkv, D)=(1, 2, 1, 64), first_length=7, L=2, input=normal" in result.reason
    assert "first at [0, 0, 0, 0]" in result.reason
    assert dflash2_kernel_attention._attention_verified == serving  # an injected kernel never switches serving


@pytest.mark.parametrize(
    ("axis_size", "block_dim"),
    [(1, 32), (256, 32), (257, 64), (512, 64), (513, 128), (1024, 128), (1025, 256),
     (2048, 256), (2049, 512), (4096, 512), (4097, 1024), (100000, 1024)],
)
def test_softmax_block_dim(axis_size, block_dim):
    # softmax.cu:145-147 with N_READS 8, kernel_utils.cuh:48-62: the smallest of
    # 32..512 holding ceil(axis_size / 8) threads, else 1024.
    assert dflash2_kernel_attention.softmax_block_dim(axis_size) == block_dim


def test_block_dim_runs_split_where_the_block_dim_changes():
    assert dflash2_kernel_attention._block_dim_runs(250, 8, 8) == [[0, 7, 32], [7, 8, 64]]
    assert dflash2_kernel_attention._block_dim_runs(1, 3, 8) == [[0, 3, 32]]
    assert dflash2_kernel_attention._block_dim_runs(126, 4, 4) == [[0, 3, 32], [3, 4, 64]]  # fp32 rows: 4 a thread


def test_fp32_attention_serves_by_its_own_self_test(monkeypatch):
    """fp32 rows (the real file's), as on CUDA with a stand-in for the kernels whose "fma" is
    one bit off: the fp32 self-test tries "fma" (it differs: the control), then "mul_add",
    which passes at every case and serves fp32 queries of that shape at the block dims it
    covered (4 reads a thread: keys 1..2 block dim 32, 250..251 64), in that variant, under
    fp32's own verdict; fp16 queries keep fp16's (none here: the stock call per query). A
    shape decode sends elsewhere (head dim 64: sdpa_vector) is stock against stock, and its
    test leaves the first shape's variant as it was."""
    shape = (1, 2, 2, 256)
    calls = []

    def stand_in(queries, keys, values, scale, first_length, variant="fma"):
        calls.append((queries.dtype, variant))
        out = dflash2_kernel_attention.stock_attention_rows(queries, keys, values, scale, first_length)
        return flip_first_bit(out) if variant == "fma" else out

    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setattr(dflash2_kernel_attention, "cuda_attention_rows", stand_in)
    monkeypatch.setattr(dflash2_kernel_attention, "_attention_verified", {})
    monkeypatch.setattr(dflash2_kernel_attention, "_attention32_serving", {})
    result = dflash2_kernel_attention.self_test_attention32([shape], first_lengths=(1, 250), max_queries=2)
    assert result.ok and result.variant == "mul_add" and result.controls == {"fma": result.variants["fma"]} != {"fma": 0}
    assert "fma: cuda kernels differ from decode at (B, Hq, Hkv, D)=(1, 2, 2, 256), first_length=1, L=1" in result.reason
    assert dflash2_kernel_attention._attention32_serving == {("cuda", shape, "float32"): "mul_add"}
    assert dflash2_kernel_attention._attention_verified == {("cuda", shape, "float32"): {32, 64}}
    assert {dtype for dtype, _ in calls} == {mx.float32}
    calls.clear()
    monkeypatch.setitem(dflash2_kernel_attention._attention_verified, ("cuda", shape), set())
    for dtype, first_length in ((mx.float32, 250), (mx.float16, 250), (mx.float32, 600)):
        queries, keys, values, _, _ = dflash2_kernel_attention._make_case(shape, first_length, 2, "normal",
                                                                          mx.random.key(1), dtype)
        got = dk.decode_attention_rows(queries, keys, values, 0.0625, first_length)
        assert got.dtype == dtype
    assert calls == [(mx.float32, "mul_add")]  # fp16: its verdict's none; 600 keys: block dim 256 untested
    calls.clear()
    other = dflash2_kernel_attention.self_test_attention32([(1, 2, 1, 64)], first_lengths=(7,), max_queries=2)
    assert other.ok and calls == [] and other.variant is None  # stock against stock: no variant serves
    assert dflash2_kernel_attention._attention32_serving[("cuda", shape, "float32")] == "mul_add"


def test_wrong_fp32_attention_fails_naming_the_case():
    def wrong(queries, keys, values, scale, first_length):
        assert queries.dtype == keys.dtype == mx.float32
        return one_bit_off(dflash2_kernel_attention.stock_attention_rows, 2)(queries, keys, values, scale, first_length, axis=2)

    result = dflash2_kernel_attention.self_test_attention32([(1, 2, 1, 64)], first_lengths=(7,), max_queries=2, kernel=wrong)
    assert not result.ok and result.variant is None
    assert "kernel: cpu attention differ from decode at (B, Hq, Hkv, D)=(1, 2, 1, 64), first_length=7, L=2" in result.reason
    passed = dflash2_kernel_attention.self_test_attention32([(1, 2, 1, 64)], first_lengths=(7,), max_queries=2,
                                                            kernel=dflash2_kernel_attention.stock_attention_rows)
    assert passed.ok and {case["queries"] for case in passed.cases} == {1, 2}


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernels")
def test_fp32_attention_kernels_equal_decode_at_the_27b_shape_on_cuda():
    """fp32 rows at the 27B's full-attention shape and the tiny ones: a variant serves (the
    other, where tried, differs)."""
    result = dk.self_test_attention32()
    assert result.ok and result.variant in dflash2_kernel_attention.ATTENTION32_VARIANTS, result.reason
    print("attention32 variants, differing elements:", result.variants)


def test_a_failed_fp32_attention_test_counts_its_differences(monkeypatch):
    """Where no variant passes at a shape, the result keeps the last one's cases up to its
    first difference, so it reports elements that differ (pack verify prints them), and that
    shape is served by no variant: the stock call per query."""
    shape = (1, 2, 2, 256)

    def stand_in(queries, keys, values, scale, first_length, variant="fma"):
        return flip_first_bit(dflash2_kernel_attention.stock_attention_rows(queries, keys, values, scale, first_length))

    patch_kernels(monkeypatch, "backend_name", lambda: "cuda")
    monkeypatch.setattr(dflash2_kernel_attention, "cuda_attention_rows", stand_in)
    monkeypatch.setattr(dflash2_kernel_attention, "_attention_verified", {})
    monkeypatch.setattr(dflash2_kernel_attention, "_attention32_serving", {})
    result = dflash2_kernel_attention.self_test_attention32([shape], first_lengths=(1,), max_queries=1)
    assert not result.ok and result.variant is None and result.mismatches > 0 and result.cases
    assert set(result.controls) == set(dflash2_kernel_attention.ATTENTION32_VARIANTS)
    key = ("cuda", shape, "float32")
    assert dflash2_kernel_attention._attention32_serving[key] is None
    assert dflash2_kernel_attention._attention_verified[key] == set()
