"""Position-keyed sampling: the token at generated position p is drawn with a key from
(request seed, p) alone, on every route, so a sampled request's tokens do not depend on
whether they came from plain steps or from a verify block.

mlx-vlm 0.7.2's server already draws this way (server/generation.py _PositionedTargetSampler:
top_k, then top_p or a plain categorical, with `_position_seed(seed, row, position)` keys).
`PositionSampler` is that sampler plus min_p (which mlx-vlm's server accepts and then ignores)
and `sample_block`, which draws a verify block's tokens. A block's rows may be drawn in one
call only where `self_test_block_sampling` finds every row's logprobs and token bitwise what
decode's single-row call gives on this backend; otherwise each row runs decode's own call.
"""

import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_vlm.sample_utils import apply_min_p, apply_top_k
from mlx_vlm.server.generation import _position_keys, _PositionedTargetSampler

# None until the start-up self-test ran: then whether a block's rows may share one call.
_batched_rows = None


def logprobs_like_decode(logits: mx.array) -> mx.array:
    """Plain decode's log-probabilities of its logits (generate/ar.py), row-wise."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def draw_rows(logprobs: mx.array, keys: mx.array, temperature: float, top_p: float, top_k: int,
              min_p: float) -> tuple:
    """(tokens (n,), the stages that decide them) for logprobs (n, V), row i drawn with keys[i].

    mlx-vlm's position-keyed draw written out in steps (its _sample_one and _sample_top_p_one
    under vmap give these tokens): top_k, min_p, then either the tempered logprobs or the
    top-p nucleus, and `categorical`'s argmax of them plus the key's Gumbel noise. The noise
    is integer random bits and element-wise functions of them, so it is the same bits for a
    row alone or among others; the stages are what may round otherwise (the self-test
    compares them)."""
    stages = []
    if top_k > 0:
        logprobs = apply_top_k(logprobs, top_k)
    if min_p > 0:
        logprobs = apply_min_p(logprobs, min_p)
    noise = mx.vmap(lambda key: mx.random.gumbel(shape=logprobs.shape[-1:], key=key))(keys)
    if 0 < top_p < 1:
        if logprobs.dtype == mx.bfloat16:
            logprobs = logprobs.astype(mx.float32)
        probs = mx.softmax(logprobs / temperature, axis=-1)
        order = mx.argsort(probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        cumulative = mx.cumsum(sorted_probs, axis=-1)
        nucleus = mx.log(mx.where(cumulative > 1 - top_p, sorted_probs, mx.zeros_like(sorted_probs)))
        picked = mx.argmax(nucleus + noise, axis=-1)
        stages += [logprobs, probs, order, cumulative, nucleus]
        return mx.take_along_axis(order, picked[:, None], axis=-1)[:, 0], stages
    scaled = logprobs * (1 / temperature)
    return mx.argmax(scaled + noise, axis=-1), stages + [logprobs, scaled]


class PositionSampler(_PositionedTargetSampler):
    """mlx-vlm's position-keyed server sampler (same keys, same draws), with min_p applied
    after top_k, and a verify block's draws."""

    def __init__(self, *, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0, seed):
        super().__init__(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        self.min_p = float(min_p)

    def draw(self, logprobs: mx.array, positions: list) -> tuple:
        keys = _position_keys(self.seed, [0] * len(positions), positions)
        return draw_rows(logprobs, keys, self.temperature, self.top_p, self.top_k, self.min_p)

    def sample_target(self, logprobs: mx.array, *, row_ids: list, positions: list) -> mx.array:
        """Every route's draw (plain decoding calls it with one row); row ids are 0 on every
        route the pack serves."""
        if logprobs.shape[0] != len(positions) or any(row_ids):
            raise ValueError("one row id 0 and one position per row of logprobs")
        return self.draw(logprobs, positions)[0]

    def sample_position(self, logits: mx.array, position: int) -> mx.array:
        """Decode's draw for one row of logits (1, V) at generated position `position`."""
        return self.draw(logprobs_like_decode(logits), [position])[0]

    def sample_block(self, logits: mx.array, first_position: int) -> mx.array:
        """Tokens (1, L) for a verify block's logits (1, L, V): row j is drawn as decode draws
        generated position first_position + j from the same logits."""
        length = logits.shape[1]
        positions = list(range(first_position, first_position + length))
        if _batched_rows:
            return self.draw(logprobs_like_decode(logits[0]), positions)[0][None]
        return mx.concatenate([self.sample_position(logits[:, j, :], p) for j, p in enumerate(positions)])[None]


def is_position_keyed(sampler) -> bool:
    return isinstance(sampler, PositionSampler)


# ---------------------------------------------------------------------------
# Start-up self-test: one call over a block's rows against decode's call per row

SELF_TEST_SETTINGS = (
    dict(temperature=0.6, top_p=0.95, top_k=20),
    dict(temperature=1.0, top_p=1.0),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=0.7, top_p=1.0, min_p=0.05),
    dict(temperature=1.0, top_p=0.8, top_k=50, min_p=0.1),
)
SELF_TEST_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def block_differences(vocab: int, rows: int, settings: dict, dtype, seed: int) -> int:
    """Rows whose logprobs, draw stages or token differ between one call over `rows` rows and
    decode's call for each row. The logits hold many ties (values on a coarse grid), as real
    half-precision logits over a large vocabulary do: ties are where sorts may disagree."""
    logits = (mx.round(mx.random.normal((1, rows, vocab), key=mx.random.key(seed)) * 8) / 4).astype(dtype)
    sampler = PositionSampler(**settings, seed=seed)
    positions = list(range(seed % 97, seed % 97 + rows))
    batched_logprobs = logprobs_like_decode(logits[0])
    tokens, stages = sampler.draw(batched_logprobs, positions)
    differing = 0
    for j, position in enumerate(positions):
        row_logprobs = logprobs_like_decode(logits[:, j, :])
        token, row_stages = sampler.draw(row_logprobs, [position])
        same = [mx.array_equal(a[0], b[j], equal_nan=True) for a, b in
                zip([row_logprobs, token, *row_stages], [batched_logprobs, tokens, *stages])]
        differing += not all(flag.item() for flag in same)
    return differing


def self_test_block_sampling(vocab: int, blocks=range(2, 9)) -> int:
    """Differing rows over every setting, dtype and block size at this vocabulary."""
    differing = 0
    for index, settings in enumerate(SELF_TEST_SETTINGS):
        for dtype in SELF_TEST_DTYPES:
            for rows in blocks:
                differing += block_differences(vocab, rows, settings, dtype, seed=1000 * index + rows)
    return differing


@dataclass(frozen=True)
class BlockSampling:
    """The self-test's verdict: whether a block's rows may share one call."""

    differing: int  # rows that differed from decode's per-row call
    seconds: float

    @property
    def batched(self) -> bool:
        return self.differing == 0

    def summary(self) -> str:
        how = ("one call over a block's rows, bitwise decode's per row" if self.batched else
               f"decode's call per row (one call over the rows differed in {self.differing} rows)")
        return f"sampled verify draws: {how} ({self.seconds:.1f} s)"


def check_block_sampling(vocab: int) -> BlockSampling:
    started = time.perf_counter()
    differing = self_test_block_sampling(vocab)
    return BlockSampling(differing, round(time.perf_counter() - started, 2))


def choose_block_sampling(vocab: int) -> BlockSampling:
    """Runs the self-test and sets how sample_block draws by its verdict."""
    verdict = check_block_sampling(vocab)
    use_batched_rows(verdict.batched)
    return verdict


def use_batched_rows(flag) -> None:
    """Sets how sample_block draws (tests; choose_block_sampling at start-up)."""
    global _batched_rows
    _batched_rows = flag

