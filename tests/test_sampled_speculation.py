"""Sampled speculation: a sampled request's rounds give plain seeded sampling's tokens.

Every token at generated position p is drawn with a key from (seed, p) alone
(dflash2_sampling.PositionSampler), from logits that verify computes bitwise as decode does,
so a round that accepts drafts while each equals the target's draw gives plain decoding's
tokens. Runs on the trained tiny pair (drafts get accepted) under the GPU-like rounding of
tests/gpu_rounding.py. The negative controls: a draw keyed by the wrong position, and a
batched sampler step that rounds differently (the start-up self-test must catch it).
"""

import mlx.core as mx
import pytest
from mlx_vlm.generate import generate_step
from mlx_vlm.server.generation import _PositionedTargetSampler

import dflash2_runtime
import dflash2_sampling
from acceptance import served_rounds
from dflash2_sampling import PositionSampler
from conftest import load_fp16_pair
from gpu_rounding import swap_row_variant_ops
from test_tiny_pair import PAYING_COSTS

GENERATED = 12
PROMPTS = ["    if not isinstance(name, str):\n", "def read(path):\n"]
SETTINGS = [dict(temperature=0.6, top_p=0.95, top_k=20), dict(temperature=1.0, top_p=1.0),
            dict(temperature=0.8, top_p=1.0, min_p=0.05), dict(temperature=0.7, top_p=0.9, min_p=0.02)]
CASES = [(prompt, settings, seed) for seed, (prompt, settings) in
         enumerate((p, s) for p in PROMPTS for s in SETTINGS)]


@pytest.fixture(scope="module")
def pair():
    model, processor, drafter = load_fp16_pair()  # fp16: where the rounding backend changes tokens
    assert dflash2_runtime.install().speculative
    ids = [mx.array([processor.tokenizer.encode(text, add_special_tokens=False)]) for text in PROMPTS]
    return model, dict(zip(PROMPTS, ids)), drafter


def sampled(model, ids, settings, seed, drafter=None, block_size=None):
    sampler = PositionSampler(**settings, seed=seed)
    steps = generate_step(ids, model, None, None, max_tokens=GENERATED, sampler=sampler, draft_model=drafter,
                          draft_kind="dflash", draft_block_size=block_size)
    return [int(token) for token, _ in steps]


@pytest.fixture(scope="module")
def plain(pair):
    model, ids, _ = pair
    with pytest.MonkeyPatch.context() as monkeypatch:
        swap_row_variant_ops(monkeypatch)
        return [sampled(model, ids[prompt], settings, seed) for prompt, settings, seed in CASES]


@pytest.fixture
def batched_rows(request):
    dflash2_sampling.use_batched_rows(request.param)
    yield request.param
    dflash2_sampling.use_batched_rows(None)


def speculative(pair, fixed_block=True, cases=CASES):
    model, ids, drafter = pair
    results, accepted = [], 0
    with served_rounds(drafter, PAYING_COSTS, fixed_block=fixed_block):
        for prompt, settings, seed in cases:
            results.append(sampled(model, ids[prompt], settings, seed, drafter=drafter, block_size=4 if fixed_block else None))
            accepted += int(sum(drafter.accept_lens))
    return results, accepted


@pytest.mark.usefixtures("gpu_like_rounding")
@pytest.mark.parametrize("batched_rows, fixed_block", [(True, True), (False, False)], indirect=["batched_rows"],
                         ids=["one-call-block-4", "per-row-policy"])
def test_sampled_rounds_give_plain_seeded_sampling_s_tokens(pair, plain, batched_rows, fixed_block):
    results, accepted = speculative(pair, fixed_block)
    assert results == plain
    assert accepted > 0
    assert len({tuple(tokens) for tokens in plain}) == len(CASES)  # seeds and settings matter


@pytest.mark.usefixtures("gpu_like_rounding")
def test_a_draw_keyed_by_the_wrong_position_differs(pair, plain, monkeypatch):
    """Negative control: verify rows drawn one position late (the first prompt's four cases)."""
    block = PositionSampler.sample_block
    monkeypatch.setattr(PositionSampler, "sample_block", lambda self, logits, first: block(self, logits, first + 1))
    results, _ = speculative(pair, cases=CASES[:4])
    assert sum(a != b for a, b in zip(results, plain)) >= 2  # all 4 differ


def test_the_self_test_catches_a_batched_step_that_rounds_differently(pair, plain, monkeypatch):
    """Negative control: a softmax over several rows that rounds otherwise than over one (as a
    GPU kernel might) fails the self-test, and the rounds then draw row by row, exactly."""
    assert dflash2_sampling.self_test_block_sampling(512) == 0
    softmax = mx.softmax

    def rounds_otherwise(x, *args, **kwargs):
        probs = softmax(x, *args, **kwargs)
        return probs * (1 + 2**-20) if x.ndim > 1 and x.shape[0] > 1 else probs

    monkeypatch.setattr(mx, "softmax", rounds_otherwise)
    assert dflash2_sampling.self_test_block_sampling(512) > 0
    try:
        assert not dflash2_sampling.choose_block_sampling(512).batched
        swap_row_variant_ops(monkeypatch)
        assert speculative(pair, cases=CASES[:4])[0] == plain[:4]
    finally:
        dflash2_sampling.use_batched_rows(None)


@pytest.mark.parametrize("settings", SETTINGS[:2] + [dict(temperature=0.9, top_p=0.8, top_k=7)], ids=str)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=str)
def test_without_min_p_the_draws_are_mlx_vlm_s(settings, dtype):
    logits = (mx.random.normal((6, 512), key=mx.random.key(3)) * 3).astype(dtype)
    logprobs = dflash2_sampling.logprobs_like_decode(logits)
    positions = list(range(10, 16))
    stock = _PositionedTargetSampler(**settings, seed=11).sample_target(logprobs, row_ids=[0] * 6, positions=positions)
    ours = PositionSampler(**settings, seed=11).sample_target(logprobs, row_ids=[0] * 6, positions=positions)
    assert ours.tolist() == stock.tolist()


def test_min_p_keeps_only_tokens_near_the_likeliest():
    logits = mx.random.normal((1, 512), key=mx.random.key(4))
    sampler = PositionSampler(temperature=1.0, top_p=1.0, min_p=1.0, seed=0)
    assert {sampler.sample_position(logits, p).item() for p in range(20)} == {mx.argmax(logits).item()}
