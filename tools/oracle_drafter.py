"""A test drafter that proposes the true greedy continuation, corrupted at a chosen rate.

It plays the DFlash drafter's part in mlx-vlm's round loop, so partial acceptance
and rollback happen at acceptance levels the test or benchmark chooses, without a
trained drafter. It needs the plain greedy continuation it should propose (or plain
seeded sampling's, for sampled requests). Three ways to choose which drafts are wrong:

- error_rate: each draft wrong with this probability (may be a function of the
  continuation index: acceptance that changes mid-request);
- accepted_per_round: a fixed count right per round, whatever the block (exact rate, no
  noise; optimistic at small blocks: at block 2 it accepts every draft);
- acceptance (a DepthAcceptance): the draft at depth k of its block (k = 1 the first) is
  right with probability p_k = a r^(k-1), drawn from a generator keyed by the seed and the
  continuation index, so every arm of a pass (same seed) sees the same draws whatever its
  block. DepthAcceptance.calibrated(t) solves a for a profile's tokens per round t at
  block 8 (r fixed, DEFAULT_DEPTH_DECAY).

Where a draft is right the oracle proposes the reference token, where wrong another
(reference + 1), so the verify accepts it exactly where the draws say, greedy or sampled.
"""

import random
from types import SimpleNamespace

import mlx.core as mx


# r of the stochastic model's curve p_k = a r^(k-1): each draft deeper in a block is right 0.9
# times as often as the one before, given those before were right. An assumption, not a
# measurement (no record here measures a real drafter's acceptance by depth); the round
# policy's own prior decays faster (dflash2_policy.PRIOR_DEPTH_DECAY), so the model is not
# the policy's assumption.
DEFAULT_DEPTH_DECAY = 0.9
CALIBRATION_BLOCK = 8
MAX_DEPTH = 16  # draws kept per continuation index: deeper than any block the server runs


class DepthAcceptance:
    """A stochastic acceptance model: the draft at depth k (1-based within its block) is
    right with probability p_k = first * decay^(k-1), independently, given a seeded draw
    u(seed, index, k) per continuation index and depth (right where u < p_k). A round
    accepts its leading right drafts, so at block b it gives, in expectation,
    1 + sum_{j<b} prod_{k<=j} p_k tokens."""

    def __init__(self, first: float, decay: float = DEFAULT_DEPTH_DECAY):
        if not (0.0 <= first <= 1.0 and 0.0 <= decay <= 1.0):
            raise ValueError(f"p_k = a r^(k-1) needs a and r in [0, 1], not a={first}, r={decay}")
        self.first, self.decay = first, decay
        self._draws = {}

    @classmethod
    def calibrated(cls, tokens_per_round: float, block: int = CALIBRATION_BLOCK, decay: float = DEFAULT_DEPTH_DECAY):
        """The curve of this decay whose expected tokens per round at `block` is
        `tokens_per_round` (a found by bisection: the expectation rises with a)."""
        top = cls(1.0, decay).expected_tokens_per_round(block)
        if not 1.0 <= tokens_per_round <= top + 1e-12:
            raise ValueError(f"{tokens_per_round} tokens per round at block {block} is out of reach at "
                             f"decay {decay} (1 to {top:.3f})")
        low, high = 0.0, 1.0
        for _ in range(100):
            middle = (low + high) / 2
            if cls(middle, decay).expected_tokens_per_round(block) < tokens_per_round:
                low = middle
            else:
                high = middle
        return cls(0.0 if tokens_per_round == 1.0 else (low + high) / 2, decay)

    def p(self, depth: int) -> float:
        return self.first * self.decay ** (depth - 1)

    def curve(self, block: int = CALIBRATION_BLOCK) -> list:
        """p_1 .. p_(block-1): each draft's chance, given the drafts before it were right."""
        return [self.p(k) for k in range(1, block)]

    def expected_tokens_per_round(self, block: int) -> float:
        total, reach = 1.0, 1.0
        for k in range(1, block):
            reach *= self.p(k)
            total += reach
        return total

    def right(self, seed: int, index: int, depth: int) -> bool:
        """Whether the draft of continuation `index` at `depth` of its block is right."""
        key = (seed, index)
        if key not in self._draws:
            generator = random.Random(f"oracle acceptance {seed} {index}")  # str seeds: stable across processes
            self._draws[key] = [generator.random() for _ in range(MAX_DEPTH)]
        return self._draws[key][depth - 1] < self.p(depth)

    def accepted(self, seed: int, index: int, block: int) -> int:
        """The drafts a round of `block` accepts when its first draft is continuation `index`:
        its leading right ones."""
        right = 0
        while right < block - 1 and self.right(seed, index + right, right + 1):
            right += 1
        return right

    def simulate(self, block: int, tokens: int, seed: int) -> list:
        """Accepted drafts per round of a request of `tokens` tokens at a fixed `block`, as
        the round loop runs it with this model's oracle (the first token from the prefill,
        the last rounds' blocks cut to the tokens left): the measured tokens per round
        without running a model."""
        accepted, emitted = [], 1
        while emitted < tokens:
            accepted.append(self.accepted(seed, emitted, min(block, tokens - emitted + 1)))
            emitted += accepted[-1] + 1
        return accepted

    def to_json(self, block: int = CALIBRATION_BLOCK) -> dict:
        return {"curve": "p_k = a * r^(k-1), k = 1 the first draft of a block", "a": self.first, "r": self.decay,
                "p_by_depth": [round(p, 6) for p in self.curve(block)],
                "expected_tokens_per_round_by_block": {str(b): round(self.expected_tokens_per_round(b), 6)
                                                        for b in range(2, block + 1)}}


class OracleDrafter:
    def __init__(
        self,
        continuation: list[int],
        *,
        prompt_length: int,
        vocab_size: int,
        error_rate: float = 0.0,
        accepted_per_round: float = None,
        acceptance: DepthAcceptance = None,
        block_size: int = 8,
        target_layer_ids=(0,),
        seed: int = 0,
        cost_drafter=None,
    ):
        self.continuation = list(continuation)
        self.prompt_length = prompt_length  # the target's hidden rows before the first token
        self.vocab_size = vocab_size
        self.error_rate = error_rate
        # If set, round r gets floor((r + 1) a) - floor(r a) right proposals and then a
        # wrong one, so accepted drafts average exactly a per round (no sampling noise).
        self.accepted_per_round = accepted_per_round
        # If set, which drafts are right follows its per-depth draws at `seed`.
        self.acceptance = acceptance
        self.seed = seed
        # A real drafter run each round so timings pay its cost: the proposal depends on its
        # lazy output (times zero), so the round loop evaluates it as it evaluates a real draft.
        self.cost_drafter = cost_drafter
        self.config = SimpleNamespace(
            model_type="dflash2-oracle",
            target_layer_ids=list(target_layer_ids),
            block_size=block_size,
            runtime_block_size=block_size,
        )
        self.accept_lens, self.draft_lens = [], []

    def reset(self, target_model):
        """Called by the round loop at the start of each generation."""
        self.accept_lens, self.draft_lens = [], []
        self._rng = random.Random(self.seed)
        self._cost_cache = self.cost_drafter.reset(target_model) if self.cost_drafter else None
        self._rows = 0  # rows of target hidden states handed over so far
        return []

    def draft_block(self, last_bonus, hidden, cache, block_size, sampler, token_dtype=mx.int32):
        del cache
        # The drafter sees one hidden row per token the target processed: the prompt's, then
        # one per token since (rounds or plain steps; a request the policy starts with plain
        # steps hands them over with the prompt's). The bonus token is continuation[emitted - 1],
        # so the proposal starts at `emitted`.
        self._rows += int(hidden.shape[1])
        if self._rows < self.prompt_length:
            raise ValueError(f"the drafter saw {self._rows} hidden rows, fewer than the prompt's {self.prompt_length}")
        start = 1 + self._rows - self.prompt_length
        if self.accepted_per_round is not None:
            rounds, rate = len(self.accept_lens), self.accepted_per_round
            right = int((rounds + 1) * rate) - int(rounds * rate)
        proposal = []
        for offset, index in enumerate(range(start, start + block_size - 1)):
            token = self.continuation[index] if index < len(self.continuation) else 0
            if self.acceptance is not None:
                wrong = not self.acceptance.right(self.seed, index, offset + 1)
            elif self.accepted_per_round is not None:
                wrong = offset >= right
            else:
                rate = self.error_rate(index) if callable(self.error_rate) else self.error_rate
                wrong = self._rng.random() < rate
            if wrong:
                token = (token + 1) % self.vocab_size
            proposal.append(token)
        proposal = mx.array([proposal], dtype=token_dtype)
        if self.cost_drafter is None:
            return proposal
        real = self.cost_drafter.draft_block_greedy(
            last_bonus, hidden, self._cost_cache, block_size, sampler, token_dtype)
        return proposal + 0 * real

    draft_block_greedy = draft_block
