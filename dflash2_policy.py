"""Chooses each round's block, or plain steps, from measured costs and the request's acceptance.

A speculative round of block B (B - 1 drafts) costs the drafter's pass plus one verify
forward, and yields 1 + the accepted drafts. At warm-up dflash2_timing.measure_round_costs
times both, per block, in units of one plain decode step on this machine. Per request,
`RoundPolicy` keeps an estimate of how often each draft position is accepted and, before
every round, picks the block with the most expected tokens per decode-step-equivalent. When
no block beats plain decoding (one token per step) by PAY_MARGIN, the request continues with
plain decode steps, which give the same tokens, and probes with a round again once the steps
lost to unpaid rounds fit in a small share of the request (PROBE_BUDGET).

`policy_rounds` replaces mlx-vlm's greedy DFlash round loop (dflash2_audit.REPLACED). Plain
steps are decode's own call and greedy rule; the drafter still needs the target's tap hidden
states of the tokens they produce, which `keep_tap_output` records during a plain step.
"""

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
from mlx_vlm.speculative import dflash as dflash_rounds
from mlx_vlm.speculative.cache_state import abort_speculative_round, commit_speculative_round
from mlx_vlm.speculative.common import (
    _dflash_block_total,
    _record_speculative_round,
    _speculative_walk,
    generation_stream,
)

from dflash2_kernels import MAX_ROWS
from dflash2_sampling import is_position_keyed, logprobs_like_decode

# A round is chosen over plain steps only when its expected tokens per decode-step-equivalent
# beat plain's one by this factor: the table is a noisy measurement (on the H200 a block's
# start-up and learned figures differ by up to a third), and within it a round gains little
# while a misjudged one loses as much, so near break-even plain, the safe side, wins.
PAY_MARGIN = 1.05
# Share of a request's decode steps that rounds which did not pay for themselves may cost
# (a request's first round may be tried regardless: see MEMORY_WEIGHT).
PROBE_BUDGET = 0.03
# Acceptance evidence weighs less with every token emitted since (half-life ~23 tokens).
ACCEPTANCE_DECAY = 0.97
# Before any evidence, a draft is accepted half the time (about a chat-like drafter), with
# the weight of half a round; an unobserved deeper position is assumed PRIOR_DEPTH_DECAY times
# as good as the one before (at 1.0 a policy that only tried small blocks kept retrying block 8
# on the unproven promise of its deeper positions).
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 0.5
PRIOR_DEPTH_DECAY = 0.8
# While a learning table, or the drafter's remembered acceptance, says no block pays, one
# greedy request in this many still goes speculative (its first round runs, then the policy
# decides), so the table and the memory keep learning; the others are routed plain.
ROUTE_PROBE_EVERY = 16
# Across requests (the engine keeps an AcceptanceMemory on a drafter whose table it
# measured; with a table given on the command line every request starts from the prior),
# the drafter's recent rounds seed each request's acceptance estimate, weighing as much as
# this many rounds; each round recorded there ages the rest by MEMORY_DECAY (plain steps
# teach nothing, so they forget nothing). Where that estimate says no block pays, greedy
# requests are routed plain (rounds_can_pay) but for the probes above.
MEMORY_WEIGHT = 1.0
MEMORY_DECAY = 0.9
# Acceptance kinds: sampled requests accept fewer drafts than greedy ones (a draft is the
# drafter's most likely token, the target's token a draw), so each kind has its own memory.
GREEDY, SAMPLED = "greedy", "sampled"
# How far an observed round or plain run moves a learning cost table toward what it took:
# the start-up measurement counts as one observation and the first ones as many (a running
# mean, so a wrong start-up figure is corrected within a few rounds), then this much.
LEARNING_WEIGHT = 0.1


def learning_weight(observations: int) -> float:
    """The weight of an observation, `observations` counting it (1: the first)."""
    return max(LEARNING_WEIGHT, 1.0 / (observations + 1))


# ---------------------------------------------------------------------------
# Costs, measured at warm-up


@dataclass
class RoundCosts:
    """A round's cost per block, in plain decode steps of this machine."""

    decode_step_ms: float
    verify_steps_by_block: dict  # block -> verify, walk and commit, in decode steps
    draft_steps_by_block: dict  # block -> the drafter's pass, in decode steps
    # What the first plain step after a round costs above a steady one, in decode steps:
    # plain steps queue the next before reading a token, a round reads its tokens before
    # anything follows, so the queue starts empty (on the H200 about one more step).
    refill_steps: float = 0.0
    # A measured table keeps learning from the rounds and plain runs requests time; one given
    # on the command line stays as given.
    learning: bool = field(default=False, compare=False)
    observed: dict = field(default_factory=dict, compare=False)  # block or "plain" -> observations

    def round_steps(self, block: int) -> float:
        return self.verify_steps_by_block[block] + self.draft_steps_by_block[block]

    def observe_plain(self, steps: int, ms: float) -> None:
        """A run of `steps` plain decode steps took `ms` (tokens handed on included)."""
        if not self.learning or steps < 1:
            return
        weight = self._weight("plain")
        old = self.decode_step_ms
        self.decode_step_ms = (1 - weight) * old + weight * ms / steps
        for table in (self.verify_steps_by_block, self.draft_steps_by_block):
            for block in table:  # a round's ms stays what it was, and so does the refill's
                table[block] *= old / self.decode_step_ms
        self.refill_steps *= old / self.decode_step_ms

    def observe_refill(self, ms: float) -> None:
        """The first plain step after a round took `ms` (its token handed on included)."""
        if not self.learning:
            return
        weight = self._weight("refill")
        observed = max(0.0, ms / self.decode_step_ms - 1)
        self.refill_steps = (1 - weight) * self.refill_steps + weight * observed

    def observe_round(self, block: int, ms: float) -> None:
        """A round of `block` took `ms`, draft to the last token handed on. Its verify and
        draft shares keep their proportion (a round can turn out cheaper than the
        start-up table's drafter share alone)."""
        if not self.learning or block not in self.verify_steps_by_block:
            return
        weight = self._weight(block)
        old = self.round_steps(block)
        steps = (1 - weight) * old + weight * ms / self.decode_step_ms
        if old > 0:
            self.verify_steps_by_block[block] *= steps / old
            self.draft_steps_by_block[block] *= steps / old
        else:
            self.verify_steps_by_block[block] = steps

    def _weight(self, key) -> float:
        self.observed[key] = self.observed.get(key, 0) + 1
        return learning_weight(self.observed[key])

    @property
    def blocks(self) -> list:
        return sorted(self.verify_steps_by_block)

    def can_pay(self, ceiling: int = 8) -> bool:
        """Whether any block up to `ceiling` beats plain decoding (by PAY_MARGIN) at full acceptance."""
        return any(block > PAY_MARGIN * self.round_steps(block) for block in self.blocks if block <= ceiling)

    def to_json(self) -> dict:
        return {
            "decode_step_ms": round(self.decode_step_ms, 3),
            "verify_steps_by_block": {str(b): round(v, 3) for b, v in sorted(self.verify_steps_by_block.items())},
            "draft_steps_by_block": {str(b): round(v, 3) for b, v in sorted(self.draft_steps_by_block.items())},
            "refill_steps": round(self.refill_steps, 3),
        }

    @classmethod
    def from_json(cls, data: dict) -> "RoundCosts":
        """The table to_json wrote (e.g. /health's round_costs); ValueError names what is wrong."""
        try:
            step = float(data["decode_step_ms"])
            tables = [{int(block): float(steps) for block, steps in data[key].items()}
                      for key in ("verify_steps_by_block", "draft_steps_by_block")]
            refill = float(data.get("refill_steps", 0.0))  # tables written before it: none
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"not a round cost table ({error!r})") from None
        if tables[0].keys() != tables[1].keys() or not tables[0]:
            raise ValueError("verify_steps_by_block and draft_steps_by_block need the same blocks")
        values = [step, refill, *tables[0].values(), *tables[1].values()]
        blocks_in_range = all(2 <= block <= MAX_ROWS for block in tables[0])
        if not blocks_in_range or not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"blocks must be 2..{MAX_ROWS} and costs finite and non-negative")
        return cls(step, *tables, refill)

    def summary(self) -> str:
        rounds = ", ".join(
            f"{block}: {self.verify_steps_by_block[block]:.2f}+{self.draft_steps_by_block[block]:.2f}"
            for block in self.blocks
        )
        verdict = "can pay" if self.can_pay() else "cannot pay at any acceptance"
        return (f"decode step {self.decode_step_ms:.2f} ms; round cost in decode steps "
                f"(block: verify+draft) {rounds}; the first plain step after a round "
                f"+{self.refill_steps:.2f}; speculation {verdict}")


def rounds_can_pay(draft_model, kind: str = GREEDY) -> bool:
    """Whether requests of this acceptance kind on this drafter should go speculative: its cost table as it
    is now has a block up to the drafter's ceiling that beats plain decoding (by PAY_MARGIN)
    at full acceptance and, where the drafter remembers its acceptance across requests, at
    the acceptance its recent rounds showed (or the block is fixed, and rounds run whatever
    they cost). When not, the policy would serve the request with plain steps, so the server
    routes it plain: same tokens, decoded by mlx-vlm's own plain loop (on the H200 the round
    loop's plain steps ran slower than it), and its prefill skips capturing the drafter's taps."""
    costs = getattr(draft_model, "round_costs", None)
    if costs is None or getattr(draft_model, "prefer_requested_block_size", False):
        return True
    ceiling = _dflash_block_total(draft_model, None)
    memory = getattr(draft_model, "acceptance_memory", None)
    return costs.can_pay(ceiling) and (memory is None or memory.rounds_pay(costs, ceiling, kind))


class SpeculativeRoute:
    """Whether a request of an acceptance kind goes speculative: while the drafter's rounds
    pay (rounds_can_pay), or, while they do not by a measured table, every
    ROUTE_PROBE_EVERY-th such request of that kind, whose rounds the table and the
    acceptance memory learn from (plain-routed requests teach them nothing)."""

    def __init__(self):
        self.unpaid = {GREEDY: 0, SAMPLED: 0}

    def __call__(self, draft_model, kind: str = GREEDY) -> bool:
        if draft_model is None or rounds_can_pay(draft_model, kind):
            return True
        if not draft_model.round_costs.learning:
            return False
        self.unpaid[kind] += 1
        return self.unpaid[kind] % ROUTE_PROBE_EVERY == 0


# ---------------------------------------------------------------------------
# Per request: acceptance and the choice


class AcceptanceEstimate:
    """How often each draft position is accepted, given the ones before it were."""

    def __init__(self, positions: int):
        self.accepted = [0.0] * positions
        self.tried = [0.0] * positions

    def age(self, tokens: int) -> None:
        self.fade(ACCEPTANCE_DECAY**tokens)

    def fade(self, factor: float) -> None:
        self.accepted = [value * factor for value in self.accepted]
        self.tried = [value * factor for value in self.tried]

    def record(self, drafted: int, accepted: int) -> None:
        # Position k was reached when the k drafts before it were accepted.
        for position in range(min(drafted, accepted + 1)):
            self.tried[position] += 1
            self.accepted[position] += position < accepted

    def seeded(self, weight: float) -> "AcceptanceEstimate":
        """A fresh estimate holding this one's rates, its first position tried `weight` times
        at most."""
        scale = min(1.0, weight / self.tried[0]) if self.tried[0] else 0.0
        seed = AcceptanceEstimate(len(self.tried))
        seed.accepted = [value * scale for value in self.accepted]
        seed.tried = [value * scale for value in self.tried]
        return seed

    def conditional(self) -> list:
        rates, prior = [], PRIOR_ACCEPTANCE
        for accepted, tried in zip(self.accepted, self.tried):
            rate = (accepted + PRIOR_WEIGHT * prior) / (tried + PRIOR_WEIGHT)
            rates.append(rate)
            prior = rate * PRIOR_DEPTH_DECAY
        return rates

    def expected_tokens(self, block: int) -> float:
        """1 + the expected accepted drafts of a block (its first block - 1 positions)."""
        total, reach = 1.0, 1.0
        for rate in self.conditional()[: block - 1]:
            reach *= rate
            total += reach
        return total


@dataclass
class RoundCounts:
    """Where a request's generated tokens came from (the first comes from prefill)."""

    tokens_from_rounds: int = 0
    tokens_from_plain_steps: int = 0


class AcceptanceMemory:
    """A drafter's acceptance across requests (MEMORY_WEIGHT, MEMORY_DECAY), one estimate per
    acceptance kind."""

    def __init__(self, positions: int):
        self.estimates = {kind: AcceptanceEstimate(positions) for kind in (GREEDY, SAMPLED)}
        self.requests = 0

    @property
    def estimate(self) -> AcceptanceEstimate:
        """The greedy requests' estimate."""
        return self.estimates[GREEDY]

    def forget(self) -> None:
        self.__init__(len(self.estimate.tried))

    def record(self, drafted: int, accepted: int, kind: str = GREEDY) -> None:
        self.estimates[kind].fade(MEMORY_DECAY)
        self.estimates[kind].record(drafted, accepted)

    def start_request(self, kind: str = GREEDY) -> AcceptanceEstimate:
        """The new request's acceptance estimate."""
        self.requests += 1
        return self.estimates[kind].seeded(MEMORY_WEIGHT)

    def rounds_pay(self, costs: RoundCosts, ceiling: int, kind: str = GREEDY) -> bool:
        """Whether a request of this kind starting from this memory would expect a round to
        pay: no round of its kind seen yet, or some block up to `ceiling` beating plain
        decoding by PAY_MARGIN."""
        estimate = self.estimates[kind]
        if not estimate.tried[0]:
            return True
        policy = RoundPolicy(costs, ceiling, estimate=estimate.seeded(MEMORY_WEIGHT))
        return policy.pays(policy.best_block(ceiling))


class RoundPolicy:
    """Per request: the next round's block, or how many plain steps come first."""

    def __init__(self, costs: RoundCosts, ceiling: int, fixed_block: Optional[int] = None,
                 estimate: AcceptanceEstimate = None):
        self.costs = costs
        self.blocks = [block for block in costs.blocks if block <= ceiling]
        self.fixed_block = fixed_block
        # A seed holds MAX_ROWS positions, as many as any block drafts or more.
        self.estimate = estimate if estimate is not None else AcceptanceEstimate(max(self.blocks, default=1))
        self.can_pay = costs.can_pay(ceiling)
        self.rounds = 0
        self.tokens = 1  # the prefill's token
        self.lost_steps = 0.0  # decode steps by which rounds fell short of paying (by PAY_MARGIN)

    def value(self, block: int) -> float:
        """Expected tokens per decode-step-equivalent of a round of this block."""
        return self.estimate.expected_tokens(block) / self.costs.round_steps(block)

    def probe_loss(self, block: int) -> float:
        """Decode steps a round of this block is expected to fall short of paying (by
        PAY_MARGIN), with the refill of the plain steps that follow a probe that does not
        pay: what a probe draws from the budget."""
        return (PAY_MARGIN * self.costs.round_steps(block) + self.costs.refill_steps
                - self.estimate.expected_tokens(block))

    def best_block(self, remaining: int) -> Optional[int]:
        """The most valuable block that wants no more than `remaining` tokens."""
        blocks = [block for block in self.blocks if block <= remaining]
        return max(blocks, key=self.value) if blocks and self.can_pay else None

    def pays(self, block: Optional[int]) -> bool:
        """Whether a round of this block is expected to beat plain decoding by PAY_MARGIN."""
        return block is not None and self.value(block) > PAY_MARGIN

    def choose_block(self, remaining: int) -> Optional[int]:
        """The next round's block, or None for plain steps; `remaining` tokens are wanted."""
        if self.fixed_block is not None:
            return min(self.fixed_block, remaining + 1)
        best = self.best_block(remaining)
        if best is None:
            return None
        # A request's first round runs whatever it is expected to give: the server routes a
        # greedy request speculative only where rounds pay or as a probe (SpeculativeRoute).
        if self.pays(best) or self.rounds == 0:
            return best
        # Otherwise a round runs only as a probe, within the budget for rounds that do not pay.
        if self.lost_steps + self.probe_loss(best) <= PROBE_BUDGET * self.tokens:
            return best
        return None

    def plain_run(self, remaining: int) -> int:
        """Plain steps until a probe fits the budget (or the request ends)."""
        best = self.best_block(remaining)
        if best is None:
            return remaining
        wanted = (self.lost_steps + self.probe_loss(best)) / PROBE_BUDGET - self.tokens
        return max(1, min(remaining, math.ceil(wanted)))

    def record_round(self, block: int, accepted: int, tokens: int) -> None:
        self.estimate.age(tokens)
        self.estimate.record(block - 1, accepted)
        # Counted against the margin, as probe_loss: a round short of it draws on the budget.
        self.lost_steps = max(0.0, self.lost_steps + PAY_MARGIN * self.costs.round_steps(block) - tokens)
        self.tokens += tokens
        self.rounds += 1

    def record_refill(self) -> None:
        """Plain steps follow a round: their first refills the queue (probe_loss priced it)."""
        self.lost_steps += self.costs.refill_steps

    def record_plain(self, tokens: int) -> None:
        self.estimate.age(tokens)
        self.tokens += tokens


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


def serves_rounds(draft_model, greedy_sampling: bool, sampler=None) -> bool:
    """Whether policy_rounds runs a request's rounds itself (RequestDecoder) rather than
    handing it to mlx-vlm's loop: a greedy request, or one sampled by position
    (dflash2_sampling.PositionSampler), on a drafter with a cost table whose drafter reads
    the target's taps as they are."""
    return (getattr(draft_model, "round_costs", None) is not None
            and (greedy_sampling or is_position_keyed(sampler))
            and not callable(getattr(draft_model, "prepare_target_hidden", None)))


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

    def __init__(self, model, draft_model, prompt_cache, hidden, bonus, sampler, token_dtype):
        self.lm = getattr(model, "language_model", model)
        self.draft_model = draft_model
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
        draft = getattr(self.draft_model, "draft_block_greedy", self.draft_model.draft_block)
        sampler = argmax_tokens if self.sampled else self.sampler
        tokens = draft(self.bonus, hidden, self.draft_cache, block, sampler, self.token_dtype)
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

    Without a measured cost table on the drafter (`draft_model.round_costs`), for other
    samplers, or for drafters that prepare the target's hidden states themselves, mlx-vlm's
    own loop runs.
    """
    if not serves_rounds(draft_model, greedy_sampling, sampler):
        yield from dflash_rounds._dflash_rounds(
            model, draft_model, prompt_cache, hidden, first_bonus=first_bonus,
            max_tokens=max_tokens, sampler=sampler, draft_block_size=draft_block_size,
            token_dtype=token_dtype, use_model_initial_block_size=use_model_initial_block_size,
            greedy_sampling=greedy_sampling,
        )
        return
    costs = draft_model.round_costs
    ceiling = _dflash_block_total(draft_model, draft_block_size)
    fixed = ceiling if getattr(draft_model, "prefer_requested_block_size", False) else None
    memory = getattr(draft_model, "acceptance_memory", None)  # the engine's, with a measured table
    kind = GREEDY if greedy_sampling else SAMPLED
    policy = RoundPolicy(costs, ceiling, fixed, memory.start_request(kind) if memory is not None else None)
    decoder = RequestDecoder(model, draft_model, prompt_cache, hidden, first_bonus, sampler, token_dtype)
    with mx.stream(generation_stream):
        dflash_rounds._reserve_dflash_target_cache(prompt_cache, ceiling)
    counts = draft_model.round_counts = RoundCounts()
    listener = getattr(draft_model, "round_counts_listener", None)
    if listener is not None:
        listener(counts)

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
        if not first_round:
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
    mx.async_eval(cache_arrays(cache))


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
