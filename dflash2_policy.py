"""Chooses each round's block, or plain steps, from measured costs and the request's acceptance.

A speculative round of block B (B - 1 drafts) costs the drafter's pass plus one verify
forward, and yields 1 + the accepted drafts. At warm-up dflash2_timing.measure_round_costs
times both, per block, in units of one plain decode step on this machine. Per request,
`RoundPolicy` keeps an estimate of how often each draft position is accepted and, before
every round, picks the block with the most expected tokens per decode-step-equivalent. When
no block beats plain decoding (one token per step) by PAY_MARGIN, the request continues with
plain decode steps, which give the same tokens, and probes with a round again once the steps
lost to unpaid rounds fit in a small share of the request (PROBE_BUDGET).

dflash2_rounds runs the rounds and plain steps chosen here.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

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
# the weight of two rounds (at half a round, one rejected first draft put a chat request's
# estimate at 0.17 and the rest of it on plain steps); an unobserved deeper position is
# assumed PRIOR_DEPTH_DECAY times as good as the one before (at 1.0 a policy that only tried
# small blocks kept retrying block 8 on the unproven promise of its deeper positions).
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
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
# requests are routed plain (dflash2_rounds.rounds_can_pay) but for the probes above.
# These and PRIOR_WEIGHT were chosen with tools/simulate_policy.py, in the middle of the
# values that did best there: at 1 round and 0.9 (a memory of about 10 rounds), with the
# prior at half a round, one unlucky streak routed a median stream's requests plain; on
# other draws (evidence/policy-simulation.md) the worst cells of chat, median and mixed
# went from 0.82, 0.80 and 0.98 of their best fixed block to 0.86, 0.94 and 1.14.
MEMORY_WEIGHT = 4.0
MEMORY_DECAY = 0.97
# The memory routes requests plain only once it holds this many rounds of evidence (faded by
# MEMORY_DECAY: 6 rounds in a row): a routed-plain request teaches nothing, so a verdict from
# one round sticks for ROUTE_PROBE_EVERY requests. On the H100 one chat round whose first
# draft was rejected (at chat's acceptance, about every other round) routed the next chat
# requests plain, 1.00x over plain where a fixed block 4 gave 1.33x (bench-cuda-27b, 9e0552e).
ROUTE_EVIDENCE = 5.0
# For the same reason the verdict is taken on a hopeful estimate: the memory's plus this many
# rounds that accepted every draft. Where rounds barely pay (chat on the H100's tables) a few
# rejected drafts said no for the next 15 requests; under tools/simulate_policy.py, on draws
# from seeds 1000, 5000 and 9000, chat's worst cell went from 0.81-0.87 of its best fixed block
# to 0.87-0.89, mixed's from 1.00-1.14 to 1.15-1.16, zero's stayed at 0.99 of plain (at 2
# rounds zero fell to 0.97).
ROUTE_HOPE = 1.0
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
    def from_json(cls, data: dict, max_block: int) -> "RoundCosts":
        """The table to_json wrote (e.g. /health's round_costs), its blocks 2..max_block (the
        exact kernels' MAX_ROWS); ValueError names what is wrong."""
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
        blocks_in_range = all(2 <= block <= max_block for block in tables[0])
        if not blocks_in_range or not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"blocks must be 2..{max_block} and costs finite and non-negative")
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
        """Whether a request of this kind starting from this memory might expect a round to
        pay: fewer than ROUTE_EVIDENCE rounds of its kind seen, or, with ROUTE_HOPE more rounds
        that accepted every draft, some block up to `ceiling` beating plain decoding by
        PAY_MARGIN."""
        estimate = self.estimates[kind]
        if estimate.tried[0] < ROUTE_EVIDENCE:
            return True
        hopeful = estimate.seeded(MEMORY_WEIGHT)
        hopeful.accepted = [value + ROUTE_HOPE for value in hopeful.accepted]
        hopeful.tried = [value + ROUTE_HOPE for value in hopeful.tried]
        policy = RoundPolicy(costs, ceiling, estimate=hopeful)
        return policy.pays(policy.best_block(ceiling))


class FixedBlock:
    """Per request under --dflash2-block-size: every round verifies the block (or what the
    request has left), whatever a cost table says; no plain steps."""

    def __init__(self, block: int):
        self.block = block

    def choose_block(self, remaining: int) -> int:
        return min(self.block, remaining + 1)

    def record_round(self, block: int, accepted: int, tokens: int) -> None:
        """Nothing to learn: the block stays."""


class RoundPolicy:
    """Per request: the next round's block, or how many plain steps come first."""

    def __init__(self, costs: RoundCosts, ceiling: int, estimate: AcceptanceEstimate = None):
        self.costs = costs
        self.blocks = [block for block in costs.blocks if block <= ceiling]
        # A seed holds as many positions as the largest block drafts, or more.
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
        best = self.best_block(remaining)
        if best is None:
            return None
        # A request's first round runs whatever it is expected to give: the server routes a
        # greedy request speculative only where rounds pay or as a probe
        # (dflash2_rounds.SpeculativeRoute).
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
