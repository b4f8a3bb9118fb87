"""Decode attention on Metal at L queries: MLX's multi-query sdpa_vector, split where decode's
routing would change (dflash2_kernel_attention dispatches to it and self-tests it).

- `metal_attention_rows(queries, keys, values, scale, first_length)`: where decode runs
  sdpa_vector (GQA 6 to 16, `metal_attention_supports`), each span of queries sharing
  decode's routing regime (`metal_attention_spans`) in one causal call.
"""

import bisect
from functools import partial

import mlx.core as mx

from dflash2_kernel_base import MAX_ROWS


# MLX 0.32.2's Metal sdpa_vector (metal/scaled_dot_product_attention.cpp:469-530, 661-708,
# 868-880), which decode runs at one query, takes up to 8 queries while queries x GQA <= 32.
# Each query's statements are the single-query call's (its causal test skips exactly the
# keys decode never sees); the one- or two-pass route and the two-pass block count follow
# the key length N, and n_simds = GQA x queries. Key lengths where either changes, on any
# GPU class ('s', 'd' and the rest):
METAL_SDPA_KEY_EDGES = (1024, 1025, 4096, 8192, 8193, 16384, 32769, 65536, 65537)
# From a GQA of 6, n_simds takes every branch (> 4, <= 2, >= 4, >= 6) as at one query.
METAL_SDPA_GQA = range(6, 17)  # 16: two queries a call at least
METAL_SDPA_HEAD_DIMS = (64, 96, 128, 256)  # sdpa_vector's; at 192 decode runs the unfused path
# One query, GQA 8, head dim 64 or 128 and N >= 8192: decode takes sdpa_vector_2pass_1_gqa
# (:469-473), which splits the keys otherwise; a multi-query call never does.
METAL_SDPA_ONE_QUERY_GQA = (8, (64, 128), 8192)


def metal_sdpa_regime(shape, keys: int):
    """Which of MLX's Metal routing regimes a (B, Hq, Hkv, D) call with `keys` keys falls
    in (an index), or None where no multi-query call can route as decode's does."""
    gqa, head_dims, first_keys = METAL_SDPA_ONE_QUERY_GQA
    if shape[1] // shape[2] == gqa and shape[3] in head_dims and keys >= first_keys:
        return None
    return bisect.bisect_right(METAL_SDPA_KEY_EDGES, keys)


def metal_attention_spans(shape, rows: int, first_length: int) -> list:
    """[start, end) spans of the L verify queries of a (B, Hq, Hkv, D) call, one sdpa_vector
    call each: at most min(8, 32 // GQA) queries, all in one routing regime (query j sees
    first_length + j keys); one query a span where no regime is shared (decode's call)."""
    limit = min(MAX_ROWS, 32 // (shape[1] // shape[2]))
    regime = partial(metal_sdpa_regime, shape)
    spans, start = [], 0
    for j in range(1, rows):
        current = regime(first_length + j)
        if j - start == limit or current is None or current != regime(first_length + start):
            spans.append((start, j))
            start = j
    return spans + [(start, rows)]


def metal_attention_supports(batch, q_heads, kv_heads, head_dim, dtype) -> bool:
    """Whether decode runs sdpa_vector here and several queries keep its routing."""
    return (
        q_heads % kv_heads == 0
        and q_heads // kv_heads in METAL_SDPA_GQA
        and head_dim in METAL_SDPA_HEAD_DIMS
        and dtype == mx.float16  # the self-test's (and the pack's) dtype
    )


def metal_attention_rows(queries, keys, values, scale, first_length):
    """The L queries in metal_attention_spans' calls of MLX's causal multi-query attention:
    a span's last query sees all its keys, each earlier one its own prefix. Each span's
    queries are made row-contiguous, so MLX runs its kernel with the query layout decode's
    one-query call and the self-test have, whatever view verify passes."""
    shape = (queries.shape[0], queries.shape[1], keys.shape[1], queries.shape[3])
    outputs = [
        mx.fast.scaled_dot_product_attention(
            mx.contiguous(queries[:, :, start:end]),
            keys[:, :, : first_length + end - 1],
            values[:, :, : first_length + end - 1],
            scale=scale,
            mask="causal",
        )
        for start, end in metal_attention_spans(shape, queries.shape[2], first_length)
    ]
    return mx.concatenate(outputs, axis=2)
