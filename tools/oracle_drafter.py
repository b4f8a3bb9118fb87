"""A test drafter that proposes the true greedy continuation, corrupted at a chosen rate.

It plays the DFlash drafter's part in mlx-vlm's round loop, so partial acceptance
and rollback happen at acceptance levels the test or benchmark chooses, without a
trained drafter. It needs the plain greedy continuation it should propose. The error
rate may be a function of the continuation index (acceptance that changes mid-request).
"""

import random
from types import SimpleNamespace

import mlx.core as mx


class OracleDrafter:
    def __init__(
        self,
        continuation: list[int],
        *,
        prompt_length: int,
        vocab_size: int,
        error_rate: float = 0.0,
        accepted_per_round: float = None,
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
        # Always verify the full requested block: acceptance is what we control.
        self.prefer_requested_block_size = True
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
            if self.accepted_per_round is not None:
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
