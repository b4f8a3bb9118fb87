"""The trained tiny pair (fixtures/tiny-pair): the pack's real drafter gets drafts accepted.

Speculative decoding with the trained drafter equals plain decoding with acceptance above
zero; after rounds that accept some of their drafts, the drafter's own cache holds exactly
the context the target committed (and drafts as a fresh drafter fed that context at once
does); the round policy, given costs under which rounds pay, varies the block.
"""

import hashlib

import mlx.core as mx
import pytest

import dflash2_runtime
from acceptance import PAIR, acceptance_cases, all_prompt_ids
from dflash2_policy import RequestDecoder, RoundCosts
from parity import greedy

GENERATED = 12
BLOCKS = range(2, 9)


def short_prompts(tokenizer):
    """Code and prose prompts: on CPU the exact path prefills row by row, and the tool-call
    prompts' tools preamble makes them slow (tools/acceptance.py measures them)."""
    return [prompt for prompt in all_prompt_ids(tokenizer, per_kind=2) if prompt[0] != "tool-call"]


@pytest.fixture(scope="module")
def pair():
    from dflash2_pack import load_pack

    model, processor, drafter = load_pack(PAIR / "target", PAIR / "drafter")
    assert dflash2_runtime.install(model).speculative
    return model, processor, drafter


def test_fixture_matches_its_sha256sums():
    lines = (PAIR / "SHA256SUMS").read_text().splitlines()
    assert {line.split()[1] for line in lines} >= {"target/model.safetensors", "drafter/model.safetensors"}
    for line in lines:
        digest, name = line.split()
        assert hashlib.sha256((PAIR / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.usefixtures("gpu_like_rounding")
def test_speculative_equals_plain_with_accepted_drafts(pair):
    model, processor, drafter = pair
    cases = acceptance_cases(model, processor.tokenizer, drafter, short_prompts(processor.tokenizer),
                             GENERATED, blocks=(4,))
    assert len(cases) == 4 and [c for c in cases if not c["identical"]] == []
    for kind in ("code", "prose"):
        assert sum(c["accepted"] for c in cases if c["kind"] == kind) > 0, kind
    # Full and partial rounds both happened.
    assert any(0 < c["accepted"] < c["drafted"] for c in cases)


def greedy_argmax(logits):
    return mx.argmax(logits, axis=-1)


def test_partial_acceptance_leaves_the_drafter_exactly_the_committed_context(pair):
    model, processor, drafter = pair
    lm, taps, block = model.language_model, list(drafter.config.target_layer_ids), 5
    accepted_counts = set()
    for _, _, ids in short_prompts(processor.tokenizer):
        cache = lm.make_cache()
        out = lm(ids, cache=cache, capture_layer_ids=taps)
        bonus = int(mx.argmax(out.logits[0, -1]).item())
        decoder = RequestDecoder(model, drafter, cache, mx.concatenate(out.hidden_states, axis=-1),
                                 bonus, greedy_argmax, mx.int32)
        committed, read = [], ids.shape[1]  # context positions the drafter must have read
        for _ in range(4):
            committed += decoder.context
            accepted, tokens = decoder.round(block, block)
            accepted_counts.add(accepted)
            # The drafter read every committed position once, and keeps the accepted ones' features next.
            assert [c.offset for c in decoder.draft_cache] == [read] * len(decoder.draft_cache)
            assert [h.shape[1] for h in decoder.context] == [accepted + 1]
            assert len(tokens) == accepted + 1
            read += accepted + 1
        # Drafting on from this cache equals a fresh drafter fed the whole context at once.
        pending = mx.concatenate(decoder.context, axis=1)
        incremental = drafter.draft_block_greedy(decoder.bonus, pending, decoder.draft_cache, block,
                                                 greedy_argmax)
        fresh = drafter.draft_block_greedy(decoder.bonus, mx.concatenate(committed + [pending], axis=1),
                                           drafter.make_cache(), block, greedy_argmax)
        assert incremental.tolist() == fresh.tolist()
        lm._position_ids = lm._rope_deltas = None  # as a fresh request expects the target
    # Partial acceptance at several counts (neither none nor the whole block).
    assert len(accepted_counts & set(range(1, block - 1))) >= 2, accepted_counts


def test_round_policy_varies_the_block_when_rounds_pay(pair):
    model, processor, drafter = pair
    # Rounds pay (as on a GPU) and cost a little more with every block: how deep a block
    # pays depends on how far the drafts are being accepted.
    drafter.round_costs = RoundCosts(
        decode_step_ms=1.0,
        verify_steps_by_block={b: 1.0 + 0.1 * b for b in BLOCKS},
        draft_steps_by_block={b: 0.05 for b in BLOCKS},
    )
    blocks, accepted = set(), 0
    try:
        for _, _, ids in short_prompts(processor.tokenizer):
            plain = greedy(model, ids, GENERATED)
            assert greedy(model, ids, GENERATED, drafter=drafter) == plain
            blocks |= {drafted + 1 for drafted in drafter.draft_lens}
            accepted += sum(drafter.accept_lens)
            counts = drafter.round_counts
            assert counts.tokens_from_rounds + counts.tokens_from_plain_steps == len(plain) - 1
    finally:
        del drafter.round_costs
    assert accepted > 0
    assert len(blocks) >= 2, blocks
