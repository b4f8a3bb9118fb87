"""The oracle drafter's stochastic acceptance model (tools/oracle_drafter.DepthAcceptance):
each profile's curve gives its published tokens per round at block 8, the draws are the
same in every arm of a pass whatever its block, and in the real round loop on the tiny pack
(greedy and seeded sampled) the oracle accepts exactly what the model's simulation says,
the tokens plain decoding's."""

import statistics

import pytest

from conftest import GENERATED, raw_ids
from oracle_drafter import DEFAULT_DEPTH_DECAY, DepthAcceptance, OracleDrafter

PROFILES = {"zero": 1.0, "chat": 2.0, "median": 2.71, "code": 4.5}


def test_each_profile_s_curve_gives_its_tokens_per_round_at_block_8():
    from bench import PROFILE_TOKENS_PER_ROUND

    assert PROFILE_TOKENS_PER_ROUND == PROFILES
    for profile, tokens in PROFILES.items():
        model = DepthAcceptance.calibrated(tokens)
        assert model.expected_tokens_per_round(8) == pytest.approx(tokens, abs=1e-9), profile
        curve = model.curve()
        assert len(curve) == 7 and curve == sorted(curve, reverse=True)  # deeper drafts are right less often
        assert all(b == pytest.approx(a * DEFAULT_DEPTH_DECAY) for a, b in zip(curve, curve[1:]))
        # Smaller blocks give fewer tokens a round: at block 2 chat no longer accepts every draft.
        by_block = [model.expected_tokens_per_round(b) for b in range(2, 9)]
        assert by_block == sorted(by_block)
    assert DepthAcceptance.calibrated(1.0).curve() == [0.0] * 7
    assert DepthAcceptance.calibrated(2.0).expected_tokens_per_round(2) < 1.6
    with pytest.raises(ValueError, match="out of reach"):
        DepthAcceptance.calibrated(7.0)  # more than decay 0.9 can give at a = 1


def test_the_draws_are_the_same_in_every_arm_of_a_pass_and_differ_between_passes():
    chat = DepthAcceptance.calibrated(2.0)
    again = DepthAcceptance.calibrated(2.0)  # another arm's oracle, the same seed
    draws = [[chat.right(3, index, depth) for depth in range(1, 8)] for index in range(200)]
    assert draws == [[again.right(3, index, depth) for depth in range(1, 8)] for index in range(200)]
    assert draws != [[chat.right(4, index, depth) for depth in range(1, 8)] for index in range(200)]
    # Block 2 accepts continuation index i exactly where depth 1's draw for i says.
    accepted, emitted = chat.simulate(2, 60, seed=3), 1
    for count in accepted:
        assert count == int(chat.right(3, emitted, 1))
        emitted += count + 1
    # Over many passes each profile's mean tokens per round at block 8 is its figure (full
    # rounds; the simulation is what the round loop does with the oracle, checked below).
    for profile, tokens in PROFILES.items():
        model = DepthAcceptance.calibrated(tokens)
        rounds = [count + 1 for seed in range(200) for count in model.simulate(8, 256, seed)[:-1]]
        assert statistics.mean(rounds) == pytest.approx(tokens, rel=0.03), profile


@pytest.mark.usefixtures("gpu_like_rounding")
@pytest.mark.parametrize("temperature", [None, 0.6], ids=["greedy", "sampled"])
def test_the_round_loop_accepts_what_the_model_draws_and_gives_plain_s_tokens(target, temperature):
    """Fixed blocks 2, 5 and 8 at the code profile, two seeds: the oracle (proposing the
    reference, a wrong token where the draws say) accepts per round exactly the model's
    simulation, and the tokens are the reference's (plain greedy, or plain seeded sampling)."""
    from bench import sampled_sampler
    from parity import FIXED_BLOCK_COSTS, PROMPTS, greedy, served_rounds

    model, processor, _ = target
    ids = raw_ids(processor, PROMPTS[1])
    sampler = sampled_sampler(temperature)
    plain = greedy(model, ids, GENERATED, sampler=sampler)
    code = DepthAcceptance.calibrated(4.5)
    seen = set()
    for seed in (0, 1):
        for block in (2, 5, 8):
            oracle = OracleDrafter(plain, prompt_length=ids.shape[1], vocab_size=model.language_model.lm_head.weight.shape[0],
                                   acceptance=code, seed=seed, block_size=block)
            with served_rounds(oracle, FIXED_BLOCK_COSTS, fixed_block=True):
                assert greedy(model, ids, GENERATED, drafter=oracle, block_size=block, sampler=sampler) == plain
            assert oracle.accept_lens == code.simulate(block, GENERATED, seed), (seed, block)
            seen.add(tuple(oracle.accept_lens))
    assert len(seen) > 3  # the draws really vary with the seed and the block
