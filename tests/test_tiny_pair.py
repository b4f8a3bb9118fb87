"""The trained tiny pair (fixtures/tiny-pair): the pack's real drafter gets drafts accepted.

Speculative decoding with the trained drafter equals plain decoding with acceptance above
zero; after rounds that accept some of their drafts, the drafter's own cache holds exactly
the context the target committed (and drafts as a fresh drafter fed that context at once
does); the round policy, given costs under which rounds pay, raises the block as drafts
are accepted; and sixteen varied chat requests get distinct answers.
"""

import mlx.core as mx
import pytest

import dflash2_runtime
from acceptance import PAIR, VARIED_PROMPTS, served_rounds, varied_answers
from dflash2_pack import drafter_trained_block, read_sha256sums, sha256_file
from dflash2_policy import RoundCosts
from dflash2_rounds import RequestDecoder
from conftest import load_fp16_pair
from gpu_rounding import swap_row_variant_ops
from parity import chat_ids, greedy

GENERATED = 12
BLOCKS = range(2, 9)
# Short prompts: the exact path prefills row by row on CPU, so prompt length is test time
# (tools/acceptance.py measures the longer chat prompts). Raw stdlib-like code and prose,
# and one chat turn as the server renders it.
RAW_PROMPTS = ["    if not isinstance(name, str):\n", "The module provides functions for "]
CHAT_PROMPT = "Hi"
# Rounds pay (as on a GPU) and cost a little more with every block: how deep a block pays
# depends on how far the drafts are being accepted.
PAYING_COSTS = RoundCosts(
    decode_step_ms=1.0,
    verify_steps_by_block={b: 1.0 + 0.1 * b for b in BLOCKS},
    draft_steps_by_block={b: 0.05 for b in BLOCKS},
)


@pytest.fixture(scope="module")
def pair():
    model, processor, drafter = load_fp16_pair()  # fp16: where the rounding backend changes tokens
    # The patches only: these tests check exactness themselves, so the model's self-check
    # and decode-arm timing (install(model)) would only cost time.
    assert dflash2_runtime.install().speculative
    return model, processor, drafter


@pytest.fixture(scope="module")
def prompts(pair):
    tokenizer = pair[1].tokenizer
    raw = [mx.array([tokenizer.encode(text, add_special_tokens=False)]) for text in RAW_PROMPTS]
    return raw + [chat_ids(tokenizer, CHAT_PROMPT, thinking=False)]


@pytest.fixture(scope="module")
def plain(pair, prompts):
    """Plain greedy tokens of every prompt on the GPU-like CPU backend."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        swap_row_variant_ops(monkeypatch)
        return [greedy(pair[0], ids, GENERATED) for ids in prompts]


def test_fixture_matches_its_sha256sums():
    listed, problems = read_sha256sums(PAIR)
    assert problems == []
    weights = {path.relative_to(PAIR).as_posix() for path in PAIR.glob("*/*") if path.is_file()}
    assert set(listed) == weights | {"dflash2-pack.json"}
    assert [name for name, digest in listed.items() if sha256_file(PAIR / name) != digest] == []


@pytest.mark.usefixtures("gpu_like_rounding")
def test_speculative_equals_plain_with_accepted_drafts(pair, prompts, plain):
    model, _, drafter = pair
    accepted = []
    with served_rounds(drafter, PAYING_COSTS, fixed_block=True) as state:  # as the demo serves
        for ids, expected in zip(prompts, plain):
            assert greedy(model, ids, GENERATED, drafter=drafter, block_size=4) == expected
            assert state.round_counts.tokens_from_plain_steps == 0
            accepted.append(list(drafter.accept_lens))
    # Drafts accepted for every prompt, in rounds that accepted part of their block too.
    assert all(sum(counts) > 0 for counts in accepted), accepted
    assert any(0 < count < 3 for counts in accepted for count in counts), accepted


def greedy_argmax(logits):
    return mx.argmax(logits, axis=-1)


def decoded_features(lm, taps, ids, tokens=()):
    """The target's tap hidden states of ids (one prefill) and of tokens (one decode step
    each, the arithmetic verify must reproduce), with the cache and the last logits."""
    lm._position_ids = lm._rope_deltas = None  # a fresh request's prefill
    cache = lm.make_cache()
    out = lm(ids, cache=cache, capture_layer_ids=taps)
    features = [mx.concatenate(out.hidden_states, axis=-1)]
    for token in tokens:
        out = lm(mx.array([[token]]), cache=cache, capture_layer_ids=taps)
        features.append(mx.concatenate(out.hidden_states, axis=-1))
    return mx.concatenate(features, axis=1), cache, out.logits[0, -1]


@pytest.mark.usefixtures("gpu_like_rounding")
def test_partial_acceptance_leaves_the_drafter_exactly_the_committed_context(pair, prompts):
    model, _, drafter = pair
    lm, taps, block = model.language_model, list(drafter.config.target_layer_ids), 5
    accepted_counts = set()
    for ids in prompts:
        features, cache, logits = decoded_features(lm, taps, ids)
        bonus = int(mx.argmax(logits).item())
        decoder = RequestDecoder(model, drafter, cache, features, bonus, greedy_argmax, mx.int32)
        fed, read, committed = [], ids.shape[1], [bonus]  # what the drafter read; the target's tokens
        for _ in range(3):
            fed += decoder.context
            accepted, tokens = decoder.round(block, block)
            accepted_counts.add(accepted)
            # The drafter read every committed position once, and keeps the accepted ones' features next.
            assert [c.offset for c in decoder.draft_cache] == [read] * len(decoder.draft_cache)
            assert [h.shape[1] for h in decoder.context] == [accepted + 1]
            assert len(tokens) == accepted + 1
            read += accepted + 1
            committed += tokens
        # Fed and pending features are the target's own for the prompt and every committed
        # token (the last token is the next bonus, not yet run through the target).
        context = mx.concatenate(fed + decoder.context, axis=1)
        expected = decoded_features(lm, taps, ids, committed[:-1])[0]
        assert mx.array_equal(context, expected).item()
        # Drafting on from the drafter's cache equals a fresh drafter fed that context at once.
        pending = mx.concatenate(decoder.context, axis=1)
        incremental = drafter.draft_block_greedy(decoder.bonus, pending, decoder.draft_cache, block,
                                                 greedy_argmax)
        fresh = drafter.draft_block_greedy(decoder.bonus, expected, drafter.make_cache(), block, greedy_argmax)
        assert incremental.tolist() == fresh.tolist()
    lm._position_ids = lm._rope_deltas = None  # as the next fresh request expects the target
    # Partial acceptance at several counts (neither none nor the whole block).
    assert len(accepted_counts & set(range(1, block - 1))) >= 2, accepted_counts


@pytest.mark.usefixtures("gpu_like_rounding")
def test_round_policy_raises_the_block_when_rounds_pay(pair, prompts, plain):
    model, _, drafter = pair
    raised, accepted = False, 0
    with served_rounds(drafter, PAYING_COSTS) as state:
        for ids, expected in zip(prompts, plain):
            assert greedy(model, ids, GENERATED, drafter=drafter) == expected
            blocks = [drafted + 1 for drafted in drafter.draft_lens]
            # A block larger than the round before it: the policy's choice, since the tokens
            # still wanted only ever shrink a block.
            raised |= any(later > earlier for earlier, later in zip(blocks, blocks[1:]))
            accepted += sum(drafter.accept_lens)
            counts = state.round_counts
            assert counts.tokens_from_rounds + counts.tokens_from_plain_steps == len(expected) - 1
    assert accepted > 0
    assert raised


# What the pack once wrote onto mlx-vlm's drafter object; dflash2_rounds.DrafterState carries it.
PACK_STATE_NAMES = {"round_costs", "acceptance_memory", "round_counts", "round_counts_listener",
                    "prefer_requested_block_size", "draft_block_greedy"}


# A table without the fixed block's row (as one saved from a start capped below it).
BLOCK_2_COSTS = RoundCosts(1.0, {2: 1.2}, {2: 0.05})


@pytest.mark.usefixtures("gpu_like_rounding")
@pytest.mark.parametrize("costs", [PAYING_COSTS, None, BLOCK_2_COSTS], ids=["given", "none", "without-the-block"])
def test_the_served_drafter_carries_none_of_the_pack_s_state(pair, prompts, plain, monkeypatch, costs):
    """load_speculation, as the engine starts the drafter (a fixed block, the candidate
    selector, a table given or none): its DrafterState carries the pack's state and the round
    loop serves it; none of it is written onto the drafter (an mlx nn.Module: a dict too),
    before or after a request's rounds, and each request's counts go where counts_to says.
    A fixed block reads no table: none is measured, and one without its row serves alike."""
    import dflash2_drafter
    import dflash2_speculation
    import dflash2_rounds

    model = pair[0]
    status = dflash2_runtime.install()  # the patches only, as the pair fixture installs them
    monkeypatch.setattr(dflash2_runtime, "install", lambda model, verdicts: status)
    blocks = dflash2_drafter.block_limits(drafter_trained_block(PAIR / "drafter"), block_size=4)
    options = dflash2_drafter.RuntimeOptions(blocks, candidate_selector=True)
    setup = dflash2_speculation.DrafterSetup(PAIR / "drafter", options, costs)
    handed = []
    try:
        speculation = dflash2_speculation.load_speculation(model, setup, counts_to=handed.append)
        state = speculation.state
        drafter = state.drafter
        assert speculation.error is None and dflash2_rounds.served_state(drafter) is state
        assert state.fixed_block and state.candidate_selector and state.round_costs is costs
        assert state.acceptance_memory is None  # a fixed block decides nothing by acceptance
        assert not PACK_STATE_NAMES & (set(vars(drafter)) | set(drafter.keys()))
        assert greedy(model, prompts[0], GENERATED, drafter=drafter) == plain[0]
        assert handed == [state.round_counts] and state.round_counts.tokens_from_plain_steps == 0
        assert drafter.draft_lens[0] == 3  # the fixed block, 4 (later ones fit the tokens left)
        assert not PACK_STATE_NAMES & (set(vars(drafter)) | set(drafter.keys()))
    finally:
        dflash2_rounds.serve_rounds_with(None)


def test_varied_requests_get_distinct_answers():
    """The demo answers code, prose, questions and a tool call differently: at least 12
    distinct greedy answers (chat template, no thinking, as the demo serves them) of 16.
    The pair before the prose turns and the longer training answered 6 distinctly, most
    prose requests with one tool call."""
    from dflash2_pack import load_pack

    model, processor, _ = load_pack(PAIR / "target", PAIR / "drafter")  # as the demo serves it: fp32
    record = varied_answers(model, processor.tokenizer)
    assert record["prompts"] == len(VARIED_PROMPTS) == 16
    texts = [(a["prompt"], a["text"]) for a in record["answers"]]
    assert record["distinct_answers"] >= 12, texts
