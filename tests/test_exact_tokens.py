"""Greedy speculative tokens equal plain decoding on the tiny synthetic pack: an oracle
drafter at every block and acceptance, the pack's own drafter on the text, thinking,
tool-call and image fixtures, an image prompt at partial acceptance, and the
sliding-window drafter; seeded sampled tokens equal plain seeded sampling's at every block. The full matrix runs on a GPU through tools/parity.py.

Every test here runs on the GPU-like CPU backend (conftest's gpu_like_rounding), where
stock verify gives other tokens (test_exact_verify.py's negative control), so these
checks can fail.
"""

import pytest

import dflash2_drafter
import dflash2_sampling
from conftest import GENERATED, raw_ids
from dflash2_sampling import PositionSampler
from oracle_drafter import OracleDrafter
from parity import (FIXED_BLOCK_COSTS, PROMPTS, SAMPLED_ERROR_RATE, SAMPLED_SETTINGS, case_mismatches, chat_ids, fixture_cases, greedy,
                    image_inputs, oracle_token_case, sampled_token_cases, served_rounds)

# The pack's random drafter accepts nothing, so each token after the first costs a full
# round: five rounds a fixture.
FIXTURE_TOKENS = 6

pytestmark = pytest.mark.usefixtures("gpu_like_rounding")


def test_speculative_tokens_equal_plain_with_oracle_drafter(target, raw_plain):
    model, processor, _ = target
    # Every block size at partial acceptance, full and zero acceptance at the ends; the
    # prompts rotate, raw (the chat templates run in the fixture test below; the full
    # matrix runs on the GPU: tools/parity.py).
    prompts = [raw_ids(processor, text) for text in PROMPTS]
    cases = [
        oracle_token_case(model, prompts[block % len(PROMPTS)], raw_plain[block % len(PROMPTS)], block,
                          error_rate, GENERATED)
        for block in range(2, 9)
        for error_rate in ((0.0, 0.35, 1.0) if block in (2, 8) else (0.35,))
    ]
    assert [c for c in cases if not c["identical"]] == []
    # The oracle really exercised full, partial and zero acceptance.
    assert all(c["accepted"] == 0 for c in cases if c["error_rate"] == 1.0)
    assert all(c["accepted"] > 0 for c in cases if c["error_rate"] == 0.0)
    partial = [c for c in cases if c["error_rate"] == 0.35]
    assert any(0 < c["accepted"] < c["rounds"] * (c["block"] - 1) for c in partial)


@pytest.mark.parametrize("batched_rows", [True, False], ids=["one-call", "per-row"])
def test_sampled_speculative_tokens_equal_plain_seeded_sampling_s(target, batched_rows):
    """tools/parity.py's sampled cases, the oracle proposing plain seeded sampling's tokens:
    every setting at the smallest, a middle and the largest block (every block runs on the GPU)."""
    model, processor, _ = target
    dflash2_sampling.use_batched_rows(batched_rows)
    try:
        cases = sampled_token_cases(model, raw_ids(processor, PROMPTS[0]), GENERATED, blocks=(2, 5, 8))
    finally:
        dflash2_sampling.use_batched_rows(None)
    assert len(cases) == len(SAMPLED_SETTINGS) * 3
    assert sum(map(case_mismatches, cases)) == 0
    assert all(c["accepted"] > 0 for c in cases)  # rounds ran, in the server's round loop
    assert any(0 < c["accepted"] < c["rounds"] * (c["block"] - 1) for c in cases)


def test_a_sampled_case_seeded_otherwise_counts_a_mismatch(target):
    """Negative control: the speculative run seeded one past plain's."""
    model, processor, _ = target
    ids = raw_ids(processor, PROMPTS[0])
    plain = greedy(model, ids, GENERATED, sampler=PositionSampler(**SAMPLED_SETTINGS[1], seed=0))
    wrong = PositionSampler(**SAMPLED_SETTINGS[1], seed=1)
    assert case_mismatches(oracle_token_case(model, ids, plain, 4, SAMPLED_ERROR_RATE, GENERATED, wrong)) == 1


@pytest.mark.parametrize("proposes", ["sampled", "greedy"])
def test_bench_s_sampled_arms_accept_at_the_profile_s_rate_only_proposing_plain_sampling_s_tokens(target, proposes):
    """tools/bench.py's sampled arms: the oracle proposes plain seeded sampling's tokens, so
    rounds at block 8 give the chat profile's 2 tokens; proposing greedy's (the wrong variant)
    gives fewer. The tokens are plain seeded sampling's either way."""
    from bench import PROFILE_TOKENS_PER_ROUND, full_round_tokens, sampled_sampler

    model, processor, _ = target
    ids = raw_ids(processor, PROMPTS[0])  # where temperature 0.6 leaves greedy's tokens at the 4th
    plain = greedy(model, ids, GENERATED, sampler=sampled_sampler(0.6))
    proposals = plain if proposes == "sampled" else greedy(model, ids, GENERATED)
    oracle = OracleDrafter(proposals, prompt_length=ids.shape[1], vocab_size=model.language_model.lm_head.weight.shape[0],
                           accepted_per_round=PROFILE_TOKENS_PER_ROUND["chat"] - 1, block_size=8)
    with served_rounds(oracle, FIXED_BLOCK_COSTS, fixed_block=True):
        assert greedy(model, ids, GENERATED, drafter=oracle, block_size=8, sampler=sampled_sampler(0.6)) == plain
    tokens_per_round = full_round_tokens(oracle.accept_lens)
    assert (tokens_per_round == 2.0) == (proposes == "sampled"), tokens_per_round


def test_fixtures_with_the_packs_drafter_equal_plain(target):
    """Text, thinking, tool-call and image prompts with the synthetic DFlash2 drafter."""
    model, processor, drafter = target
    cases = fixture_cases(model, processor, drafter, FIXTURE_TOKENS)
    assert [c["fixture"] for c in cases] == ["text", "thinking", "tool-call", "image"]
    assert [c for c in cases if not c["identical"]] == []
    assert all(c["rounds"] > 0 for c in cases), "the drafter ran no round"


def test_image_prompt_with_partial_acceptance_equals_plain(target):
    model, processor, _ = target
    ids, image = image_inputs(processor)
    plain = greedy(model, ids, GENERATED, **image)
    vocab = model.language_model.lm_head.weight.shape[0]
    drafter = OracleDrafter(plain, prompt_length=ids.shape[-1], vocab_size=vocab, error_rate=0.35, block_size=5)
    assert greedy(model, ids, GENERATED, drafter=drafter, block_size=5, **image) == plain
    assert sum(drafter.accept_lens) > 0


def test_sliding_window_drafter_has_bounded_caches_and_plain_tokens(target, tiny_pack):
    from mlx_vlm.models.cache import RotatingKVCache
    from mlx_vlm.speculative.drafters import load_drafter

    model, processor, _ = target
    drafter, _ = load_drafter(tiny_pack["drafter"])  # its own copy: the option changes it
    drafter.config.sliding_window = 8  # shorter than the prompt, so the window trims
    dflash2_drafter.configure_drafter(
        drafter, dflash2_drafter.RuntimeOptions(sliding_window=True)
    )
    caches = drafter.make_cache()
    assert all(isinstance(c, RotatingKVCache) and c.max_size == 7 for c in caches)
    ids = chat_ids(processor.tokenizer, PROMPTS[0], thinking=False)
    assert ids.shape[1] > 8
    assert greedy(model, ids, GENERATED, drafter=drafter) == greedy(model, ids, GENERATED)
    assert drafter.accept_lens
