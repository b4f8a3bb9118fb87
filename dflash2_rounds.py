"""Runs one request's rounds and plain steps on its target and drafter, as dflash2_policy chooses.

`policy_rounds` replaces mlx-vlm's greedy DFlash round loop (dflash2_audit.REPLACED). It runs
the rounds of one drafter, the one whose `DrafterState` `serve_rounds_with` holds (the engine's,
set once at start-up; a tool's, per run); any other drafter's rounds are mlx-vlm's own loop.
Plain steps are decode's own call and greedy rule; the drafter still needs the target's tap
hidden states of the tokens they produce, which `keep_tap_output` records during a plain step.
`rounds_can_pay` and `SpeculativeRoute` say which requests the server routes to this loop:
they read the drafter's block ceiling through mlx-vlm, so they live here, not in the policy.
"""

import time
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
from mlx_vlm.speculative import dflash as dflash_rounds
from mlx_vlm.speculative.cache_state import abort_speculative_round, commit_speculative_round
from mlx_vlm.speculative.common import (
    _dflash_block_total,
    _record_speculative_round,
    _speculative_walk,
    generation_stream,
)

from dflash2_policy import (GREEDY, ROUTE_PROBE_EVERY, SAMPLED, AcceptanceMemory, FixedBlock, RoundCosts, RoundCounts,
                           RoundPolicy)
from dflash2_sampling import is_position_keyed, logprobs_like_decode


# ---------------------------------------------------------------------------
# The drafter the round loop serves


@dataclass
class DrafterState:
    """The pack's state for the drafter it serves, set once (dflash2_speculation.load_speculation;
    a tool, per run) and read by name; nothing of it is written onto the drafter."""

    drafter: object
    round_costs: Optional[RoundCosts]  # a round's and a plain step's cost; a measured table learns as rounds
    # run; None: a fixed block, whose rounds run whatever a table says
    fixed_block: bool = False  # every round verifies the ceiling, whatever rounds cost (--dflash2-block-size)
    candidate_selector: bool = False  # draft greedily through the trained selector (--dflash2-candidate-selector)
    acceptance_memory: Optional[AcceptanceMemory] = None  # the drafter's recent acceptance across requests
    counts_to: Optional[Callable[[RoundCounts], None]] = None  # handed each request's counts as its loop starts
    round_counts: Optional[RoundCounts] = None  # the last request's, filled as its loop runs


_served: Optional[DrafterState] = None  # the state whose drafter's rounds policy_rounds runs


def serve_rounds_with(state: Optional[DrafterState]) -> Optional[DrafterState]:
    """From now on policy_rounds runs `state.drafter`'s rounds by `state` (None: none, every
    drafter's rounds are mlx-vlm's loop). Returns the state served before."""
    global _served
    previous, _served = _served, state
    return previous


def served_state(draft_model) -> Optional[DrafterState]:
    """The state policy_rounds serves `draft_model`'s rounds by, or None."""
    return _served if _served is not None and draft_model is not None and _served.drafter is draft_model else None


def greedy_drafting(draft_model, candidate_selector: bool = False):
    """The drafter's call that proposes a block greedily: draft_block_greedy (stock greedy
    drafting, which bypasses the trained candidate selector), or with candidate_selector
    draft_block, which drafts through it."""
    if candidate_selector:
        return draft_model.draft_block
    return getattr(draft_model, "draft_block_greedy", draft_model.draft_block)


# ---------------------------------------------------------------------------
# Which requests go speculative


def rounds_can_pay(state: Optional[DrafterState], kind: str = GREEDY) -> bool:
    """Whether requests of this acceptance kind on this drafter should go speculative: its cost table as it
    is now has a block up to the drafter's ceiling that beats plain decoding (by PAY_MARGIN)
    at full acceptance and, where the drafter remembers its acceptance across requests, at
    the acceptance its recent rounds showed (or the block is fixed, and rounds run whatever
    they cost). When not, the policy would serve the request with plain steps, so the server
    routes it plain: same tokens, decoded by mlx-vlm's own plain loop (on the H200 the round
    loop's plain steps ran slower than it), and its prefill skips capturing the drafter's taps."""
    if state is None or state.fixed_block:
        return True
    costs, memory = state.round_costs, state.acceptance_memory
    ceiling = _dflash_block_total(state.drafter, None)
    return costs.can_pay(ceiling) and (memory is None or memory.rounds_pay(costs, ceiling, kind))


class SpeculativeRoute:
    """Whether a request of an acceptance kind goes speculative: while the drafter's rounds
    pay (rounds_can_pay), or, while they do not by a measured table, every
    ROUTE_PROBE_EVERY-th such request of that kind, whose rounds the table and the
    acceptance memory learn from (plain-routed requests teach them nothing)."""

    def __init__(self):
        self.unpaid = {GREEDY: 0, SAMPLED: 0}

    def __call__(self, state: Optional[DrafterState], kind: str = GREEDY) -> bool:
        if state is None or rounds_can_pay(state, kind):
            return True
        if not state.round_costs.learning:
            return False
        self.unpaid[kind] += 1
        return self.unpaid[kind] % ROUTE_PROBE_EVERY == 0


# ---------------------------------------------------------------------------
# Plain steps record the drafter's tap hidden states

_tap_recorder = None  # (ids of the tap layers, their outputs) while a plain step builds


def keep_tap_output(layer, output) -> None:
    """During a plain step, keep a tap layer's output (the decoder layer's replacement,
    dflash2_runtime._decoder_layer_call, hands over each layer's)."""
    if _tap_recorder is not None and id(layer) in _tap_recorder[0]:
        _tap_recorder[1].append(output)


# ---------------------------------------------------------------------------
# One request's target and drafter


def serves_rounds(state: Optional[DrafterState], greedy_sampling: bool, sampler=None) -> bool:
    """Whether policy_rounds runs a request's rounds itself (RequestDecoder) rather than
    handing it to mlx-vlm's loop: a greedy request, or one sampled by position
    (dflash2_sampling.PositionSampler), on a served drafter (served_state) that reads the
    target's taps as they are."""
    return (state is not None
            and (greedy_sampling or is_position_keyed(sampler))
            and not callable(getattr(state.drafter, "prepare_target_hidden", None)))


def argmax_tokens(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def context_window(draft_model) -> Optional[int]:
    """How many of its context positions the drafter still reads at a round: with every
    layer sliding, its window less one (mlx-vlm's sliding layers keep that many and skip the
    rest, so the prompt's earlier taps are never read); otherwise None, all of them."""
    layers = getattr(draft_model, "layers", None)
    if not layers or not all(getattr(layer.self_attn, "is_sliding", False) for layer in layers):
        return None
    return int(draft_model.config.sliding_window) - 1


def processed_tokens(prompt_cache) -> int:
    """Positions the target's cache holds (one row): its first attention layer's offset."""
    for layer in prompt_cache:
        if getattr(layer, "keys", None) is not None:
            offset = layer.offset
            return offset if isinstance(offset, int) else int(mx.max(offset).item())
    raise ValueError("the target's cache has no attention layer with positions")


class RequestDecoder:
    """Rounds and plain steps on one request's caches, keeping the drafter's context whole.

    `context` holds the target's tap hidden states of the tokens the target processed
    since the drafter last read them; a round hands them all to the drafter. With a sliding
    drafter the prefill may have kept only the prompt's last taps (dflash2_prefix_cache): the
    drafter's cache then starts past the positions left out, where its sliding layers would
    have skipped them, so every position keeps its rotary offset.

    A sampled request (a dflash2_sampling.PositionSampler) draws each token with its
    generated position's key, from the same logits plain decoding has there: `position`
    counts the generated tokens (the prefill's was position 0).
    """

    def __init__(self, model, draft_model, prompt_cache, hidden, bonus, sampler, token_dtype,
                 candidate_selector=False):
        self.lm = getattr(model, "language_model", model)
        self.draft_model = draft_model
        self.drafts = greedy_drafting(draft_model, candidate_selector)
        self.prompt_cache = prompt_cache
        self.taps = list(draft_model.config.target_layer_ids)
        self.tap_layers = {id(self.lm.model.layers[index]) for index in self.taps}
        self.draft_cache = draft_model.reset(model)
        left_out = processed_tokens(prompt_cache) - hidden.shape[1]
        if left_out:
            window = context_window(draft_model)
            if window is None or hidden.shape[1] < window:
                raise ValueError(f"the drafter's context lacks positions it reads ({left_out} left out, "
                                 f"{hidden.shape[1]} kept, window {window})")
            for layer in self.draft_cache:
                layer.offset += left_out
        self.context = [hidden]
        self.bonus = bonus
        self.sampler = sampler
        self.sampled = is_position_keyed(sampler)
        self.position = 1  # of the next token: the caller handed out the prefill's
        self.token_dtype = token_dtype

    def draft(self, block: int, hidden: mx.array) -> mx.array:
        """The drafter's proposals, its most likely tokens for sampled requests too."""
        sampler = argmax_tokens if self.sampled else self.sampler
        tokens = self.drafts(self.bonus, hidden, self.draft_cache, block, sampler, self.token_dtype)
        mx.async_eval(tokens)
        return tokens

    def round(self, block: int, budget: int):
        """mlx-vlm's DFlash round (draft, verify, walk, commit); returns (accepted, tokens).
        Drafts are accepted while each equals the target's token there: greedy, decode's
        argmax; sampled, decode's draw at that position. Every op on generation_stream, as
        _plain_step's."""
        with mx.stream(generation_stream):
            hidden = self.context[0] if len(self.context) == 1 else mx.concatenate(self.context, axis=1)
            self.context = []
            draft_tokens = self.draft(block, hidden)
            gdn_states = None
            try:
                verify_input = mx.concatenate(
                    [mx.array([[self.bonus]], dtype=self.token_dtype), draft_tokens], axis=1
                )
                if self.sampled:
                    verify_out, gdn_states = dflash_rounds._dflash_verify(
                        self.lm, verify_input, self.prompt_cache, self.taps)
                    captured = verify_out.hidden_states
                    target_tokens = self.sampler.sample_block(verify_out.logits, self.position)
                else:
                    captured, gdn_states, target_tokens = dflash_rounds._dflash_verify_greedy(
                        self.lm, verify_input, self.prompt_cache, self.taps, self.sampler
                    )
                hidden = mx.concatenate(captured, axis=-1)
                mx.async_eval(target_tokens, hidden)
                accepted, tokens = _speculative_walk(draft_tokens, target_tokens, budget)
                _record_speculative_round(self.draft_model, accepted, block - 1)
                commit_round(self.lm, self.prompt_cache, gdn_states, accepted, block)
            except BaseException:
                abort_speculative_round(gdn_states)
                raise
            self.context.append(hidden[:, : accepted + 1])
        self.bonus = tokens[-1] if tokens else self.bonus
        self.position += len(tokens)
        return accepted, tokens

    def _plain_step(self, token: mx.array) -> mx.array:
        """One decode step as plain generation runs it: fp16 logits - logsumexp, then argmax
        or the draw at the next position.

        Every op on generation_stream, the token's reshape included: on CUDA an op built on
        another stream (the caller's) that feeds this step in the same evaluation makes MLX
        wait on the host, in a fence, until the previous step has finished on the GPU. The
        overlap of building a step with running the one before is then lost (mlx
        backend/cuda/fence.cpp: Fence::wait ignores the stream; on the H200 the speculative
        server's plain steps ran at 0.67x serve.py's)."""
        global _tap_recorder
        with mx.stream(generation_stream):
            _tap_recorder = (self.tap_layers, [])
            try:
                logits = self.lm(token.reshape(1, 1), cache=self.prompt_cache).logits[:, -1, :]
                if self.sampled:
                    next_token = self.sampler.sample_position(logits, self.position)
                else:
                    next_token = mx.argmax(logprobs_like_decode(logits), axis=-1)
                self.position += 1
            finally:
                taps, _tap_recorder = _tap_recorder[1], None
            self.context.append(mx.concatenate(taps, axis=-1))
        mx.async_eval(next_token)
        return next_token

    def plain_steps(self, count: int):
        """Yield `count` tokens; each step is queued before the previous token is read."""
        pending = self._plain_step(mx.array([[self.bonus]], dtype=self.token_dtype))
        for index in range(count):
            token = pending
            if index + 1 < count:
                pending = self._plain_step(token)
            self.bonus = int(token.item())
            yield self.bonus


# ---------------------------------------------------------------------------
# The round loop


def policy_rounds(
    model,
    draft_model,
    prompt_cache,
    hidden,
    *,
    first_bonus,
    max_tokens,
    sampler,
    draft_block_size=None,
    token_dtype=mx.int32,
    use_model_initial_block_size=True,
    greedy_sampling=True,
):
    """Replaces mlx-vlm's _dflash_rounds (same arguments, same tokens) for greedy requests and
    requests sampled by position.

    For a drafter serve_rounds_with does not hold (served_state), for other samplers, or for
    drafters that prepare the target's hidden states themselves, mlx-vlm's own loop runs.
    """
    state = served_state(draft_model)
    if not serves_rounds(state, greedy_sampling, sampler):
        yield from dflash_rounds._dflash_rounds(
            model, draft_model, prompt_cache, hidden, first_bonus=first_bonus,
            max_tokens=max_tokens, sampler=sampler, draft_block_size=draft_block_size,
            token_dtype=token_dtype, use_model_initial_block_size=use_model_initial_block_size,
            greedy_sampling=greedy_sampling,
        )
        return
    costs = state.round_costs
    ceiling = _dflash_block_total(draft_model, draft_block_size)
    memory = state.acceptance_memory  # the engine's, where a measured table decides
    kind = GREEDY if greedy_sampling else SAMPLED
    if state.fixed_block:
        policy = FixedBlock(ceiling)
    else:
        policy = RoundPolicy(costs, ceiling, memory.start_request(kind) if memory is not None else None)
    decoder = RequestDecoder(model, draft_model, prompt_cache, hidden, first_bonus, sampler, token_dtype,
                             state.candidate_selector)
    with mx.stream(generation_stream):
        dflash_rounds._reserve_dflash_target_cache(prompt_cache, ceiling)
    counts = state.round_counts = RoundCounts()
    if state.counts_to is not None:
        state.counts_to(counts)

    emitted = 1  # the caller yielded the prefill's token
    first_round, after_round = True, False
    while emitted < max_tokens:
        remaining = max_tokens - emitted
        block = policy.choose_block(remaining)
        # Each round and plain run is timed up to its last token handed on, and the cost
        # table learns from it (the first round is left out: its drafter reads the prompt).
        # A plain run's first step is timed apart: it starts with an empty queue (after a
        # round, that is the round's refill); steady_plain_steps says what the rest teach.
        started = time.perf_counter()
        if block is None:
            steps = policy.plain_run(remaining)
            arrivals_ms = []
            for token in decoder.plain_steps(steps):
                policy.record_plain(1)
                counts.tokens_from_plain_steps += 1
                emitted += 1
                yield token, None
                arrivals_ms.append(1000 * (time.perf_counter() - started))
            if after_round:
                policy.record_refill()
                costs.observe_refill(arrivals_ms[0])
            costs.observe_plain(*steady_plain_steps(arrivals_ms))
            after_round = False
            continue
        accepted, tokens = decoder.round(block, remaining)
        policy.record_round(block, accepted, len(tokens))
        if memory is not None:
            memory.record(block - 1, accepted, kind)
        for token in tokens:
            counts.tokens_from_rounds += 1
            emitted += 1
            yield token, None
        if not first_round and costs is not None:
            costs.observe_round(block, 1000 * (time.perf_counter() - started))
        first_round, after_round = False, True


def steady_plain_steps(arrivals_ms: list) -> tuple:
    """(steps, ms) a plain run's steady steps took, from each token's time since the run began.

    The first token's time is the queue's refill, timed apart. Each later token's gap also
    builds the step after it (RequestDecoder.plain_steps queues one ahead, and on CUDA the
    building bounds a decode step), but the last gap builds nothing: it is the device's time
    alone, shorter than a step, so it is left out too. (On the H200 a table that counted it
    learned a 26-31 ms decode step from runs whose steady gaps were 36.5 ms, and rounds
    counted in those steps looked too dear to run at chat-like acceptance.)"""
    if len(arrivals_ms) < 3:
        return 0, 0.0
    return len(arrivals_ms) - 2, arrivals_ms[-2] - arrivals_ms[0]


def commit_round(lm, cache, gdn_states, accepted: int, block: int) -> None:
    """mlx-vlm's commit of a verified round, queued at once as an evaluation of its own.

    Left lazy, the commit joins the next round's first evaluation, whose CUDA graphs then
    change shape from round to round: MLX instantiates each new one (4-9 in many rounds,
    graph_misses' 'commit left lazy' arm in evidence/graph-misses-cuda.md) where a queued
    commit's rounds repeat their graphs and update them in place. Same ops, same bits."""
    commit_speculative_round(lm, cache, gdn_states, accepted, block)
    own_recurrent_states(lm.model.layers, cache)
    mx.async_eval(cache_arrays(cache))


def own_recurrent_states(layers, cache) -> None:
    """Copies the recurrent states a commit kept out of the round's states buffers.

    A GatedDeltaNet layer's verify computes its state after every position in one buffer, and
    mlx-vlm's commit keeps the accepted position's as a view of it: the whole buffer stayed
    allocated until the next step replaced the state, and beside the next round's own during
    its verify (at the 27B shape 48 layers x 3 MiB a position: 1 GB more at block 8). One
    concatenation (a copy: the same bits) gives the kept states one buffer of plain decoding's
    size, each layer a slice of it; MLX's concatenate of a single array is that array, so a
    lone layer's state is copied by a gather."""
    linear = [layer_cache for layer, layer_cache in zip(layers, cache) if layer.is_linear]
    states = [layer_cache[1] for layer_cache in linear]
    if len(states) == 1:
        linear[0][1] = mx.take(states[0], mx.arange(states[0].shape[0]), axis=0)
    elif states:
        kept, batch = mx.concatenate(states), states[0].shape[0]
        for index, layer_cache in enumerate(linear):
            layer_cache[1] = kept[index * batch:(index + 1) * batch]


def cache_arrays(cache) -> list:
    """The state a cache carries forward: KV up to its offset (a batch cache's offsets are
    per row: its buffers whole), recurrent states."""
    arrays = []
    for layer in cache:
        if getattr(layer, "keys", None) is not None and isinstance(layer.offset, int):
            arrays += [layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]]
        elif getattr(layer, "keys", None) is not None:
            arrays += [layer.keys, layer.values]
        elif hasattr(layer, "cache"):
            arrays += [state for state in layer.cache if state is not None]
    return arrays
