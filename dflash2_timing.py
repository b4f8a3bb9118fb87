"""Times the device's work, arms interleaved pass by pass, and the round costs at start-up.

`measure_round_costs` times plain steps, drafter passes and whole rounds per block, in
units of one plain decode step on this machine: the table dflash2_policy chooses each
round's block from. The helpers before it (timed_ms, interleaved_ms, paired_ratio,
steady_ms) time any arms side by side, for the runtime's start-up choices and the tools.
"""

import math
import statistics
import time
from typing import Optional

import mlx.core as mx
from mlx_vlm.generate.common import generation_stream as batch_stream
from mlx_vlm.speculative.common import _dflash_block_total, generation_stream

from dflash2_policy import RoundCosts
from dflash2_rounds import RequestDecoder, argmax_tokens, cache_arrays


def _synchronize() -> None:
    """Wait for every stream the pack's work runs on (the default one, the server's batch
    stream and mlx-vlm's speculative stream)."""
    for stream in (mx.default_stream(mx.default_device()), batch_stream, generation_stream):
        mx.synchronize(stream)


def timed_ms(fn):
    """A sample for interleaved_ms: fn's wall time in ms, the device idle before and after."""
    def sample():
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        return 1000 * (time.perf_counter() - start)

    return sample


def interleaved_ms(arms: dict, repeats: int = 5, deadline: Optional[float] = None) -> dict:
    """Median, min and max ms of each arm, measured side by side, and its samples by pass.

    arms: name -> function that runs one sample and returns its ms. One warm-up
    pass first, then the arms interleaved (ABAB...) `repeats` times, in pass_order: each
    arm first in turn, and no arm always after the same one. deadline (a
    time.monotonic() value): after each timed pass, raises TimeoutError at once if the
    passes left, each as long as that one, would end past it (the warm-up pass compiles,
    so it says little of how long a timed one takes).
    """
    names = list(arms)
    samples = {name: [] for name in names}
    for repeat in range(repeats + 1):
        started = time.monotonic()
        for name in pass_order(names, repeat):
            ms = arms[name]()
            if repeat:  # the first pass is the warm-up
                samples[name].append(ms)
        left = repeats - repeat
        if repeat and left and deadline is not None:
            pass_s = time.monotonic() - started
            late_s = time.monotonic() + left * pass_s - deadline
            if late_s > 0:
                raise TimeoutError(f"{len(arms)} arms: timed pass {repeat} took {pass_s:.0f} s, so {left} more "
                                   f"would end {late_s:.0f} s past the deadline")
    return {
        name: {"median": statistics.median(s), "min": min(s), "max": max(s), "samples": s}
        for name, s in samples.items()
    }


def pass_order(names: list, index: int) -> list:
    """The arms' order in pass `index`: the next arm in turn first, then every arm by a step
    through the list that changes from pass to pass (each step prime to the count, so each
    pass runs every arm once), so an arm has a different one before it in each pass, up to
    as many passes as there are such steps. A rotation alone keeps each arm behind the same
    one in nearly every pass, and an arm may slow the one after it: on the H200 (two
    sessions), bench.py's plain arm, behind stock mlx's in nearly every pass, ran 15-21%
    slower than the same plain requests in the arm behind it. The step count - 1 (the list
    backwards) is left out: its pass ends on the next pass's first arm, which would then run
    twice in a row, its second sample spared the switch every other one pays."""
    count = len(names)
    steps = [step for step in range(1, max(2, count - 1)) if math.gcd(step, count) == 1]
    step = steps[index % len(steps)]
    return [names[(index + k * step) % count] for k in range(count)]


def paired_ratio(numerator: dict, denominator: dict) -> float:
    """The median over passes of numerator / denominator within a pass (two arms of one
    interleaved_ms): a slow pass slows both sides of its ratio, not one side of a median."""
    return statistics.median(a / b for a, b in zip(numerator["samples"], denominator["samples"]))

def settle_decoder(decoder: "RequestDecoder") -> None:
    """Evaluate what an arm leaves lazy (a commit's recurrent states, a step's taps), so
    each arm pays for its own work and not for the one before."""
    mx.eval(cache_arrays(decoder.prompt_cache), cache_arrays(decoder.draft_cache or []), decoder.context)


def steady_ms(steps, run: int, settle):
    """A sample for interleaved_ms, in ms per step: steps(1) as an untimed lead-in (the
    switch from the previous arm), then steps(run) back to back, and settle() (evaluate
    what they left lazy) inside the time."""
    def sample():
        steps(1)
        settle()
        return timed_ms(lambda: (steps(run), settle()))() / run

    return sample


def measure_round_costs(model, draft_model, *, repeats=5, prompt_length=16, run=3, plain_run=8,
                        candidate_selector=False) -> RoundCosts:
    """Time plain steps, drafter passes and whole rounds for blocks 2..the drafter's ceiling,
    and the refill of a plain step right after a round.

    Runs the request loop's own code on a scratch cache after a short synthetic prompt. Each
    sample is a steady run as a request has it: one untimed lead-in (switching from the
    previous arm), then `run` rounds (or drafter passes, or `plain_run` plain steps: the
    refill their first step pays, a noisy difference of two arms, is a smaller share of
    them to take out) back to back,
    their host work overlapping the GPU as it does in generation, and the state they leave
    evaluated (settle_decoder). Samples are interleaved after a warm-up pass (interleaved_ms);
    each figure is an arm's median ratio to the plain steps of the same pass over `repeats`
    passes, times their median. What the policy uses is a whole round (draft,
    verify, commit); its verify part is that minus the drafter's pass, for the log.
    """
    lm = getattr(model, "language_model", model)
    blocks = list(range(2, _dflash_block_total(draft_model, None) + 1))
    vocab = int(lm.args.vocab_size)
    ids = (mx.arange(prompt_length, dtype=mx.int32)[None] * 7 + 3) % vocab
    cache = lm.make_cache()
    taps = list(draft_model.config.target_layer_ids)
    # One prefill forward (on the H200 a whole forward of up to 4096 tokens works at the 27B shape).
    with mx.stream(generation_stream):
        out = lm(ids, cache=cache, capture_layer_ids=taps)
    hidden = mx.concatenate(out.hidden_states, axis=-1)
    first = int(mx.argmax(out.logits[0, -1]).item())

    # On the stream the server's batch generator runs requests on, as in serving.
    with mx.stream(batch_stream):
        decoder = RequestDecoder(model, draft_model, cache, hidden, first, argmax_tokens, mx.int32,
                                 candidate_selector)
        one_row = hidden[:, -1:]

        def steady(steps, count=run):
            return steady_ms(steps, count, lambda: settle_decoder(decoder))

        def rounds(block):
            return lambda count: [decoder.round(block, block) for _ in range(count)]

        def drafts(block):
            return lambda count: [decoder.draft(block, one_row) for _ in range(count)]

        arms = {"decode": steady(lambda count: list(decoder.plain_steps(count)), plain_run)}
        for block in blocks:
            arms[("draft", block)] = steady(drafts(block))
            arms[("round", block)] = steady(rounds(block))
        # A round of the smallest block, then one plain step (a run of one: all refill).
        arms["refill"] = steady(lambda count: [(decoder.round(2, 2), list(decoder.plain_steps(1)))
                                               for _ in range(count)])
        stats = interleaved_ms(arms, repeats)
    # Each arm as its median ratio to the plain steps of the same pass, in ms of their median:
    # a pass the machine ran slow moves both sides of a ratio, not one arm's median.
    ms = {name: paired_ratio(arm, stats["decode"]) * stats["decode"]["median"] for name, arm in stats.items()}
    # Leave the target as a fresh request expects it.
    lm._position_ids = lm._rope_deltas = None
    draft_model.reset(model)

    # A "decode" sample's first step refills too: per step it took steady + refill / plain_run,
    # and a round's plain step took steady + refill.
    after_round = ms["refill"] - ms[("round", 2)]
    refill_ms = max(0.0, (after_round - ms["decode"]) * plain_run / (plain_run - 1)) if plain_run > 1 else 0.0
    refill_ms = min(refill_ms, ms["decode"] * plain_run / 2)  # noise cannot take the steady step below half
    step_ms = ms["decode"] - refill_ms / plain_run
    draft = {block: min(ms[("draft", block)], ms[("round", block)]) for block in blocks}
    return RoundCosts(
        decode_step_ms=step_ms,
        verify_steps_by_block={block: (ms[("round", block)] - draft[block]) / step_ms for block in blocks},
        draft_steps_by_block={block: draft[block] / step_ms for block in blocks},
        refill_steps=refill_ms / step_ms,
        learning=True,
    )
