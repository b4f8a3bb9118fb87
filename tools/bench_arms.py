"""The round phase's arms (tools/bench.py, tools/lab/profile_verify.py): a prompt prefilled on
the target, then plain decode steps, exact verify rounds by block, drafter passes and the
server's own round, each as steps(count) that dflash2_timing.steady_ms samples.
"""

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import dflash2_runtime  # noqa: E402  (first: it sets MLX's CUDA graph cache before MLX starts)

import mlx.core as mx  # noqa: E402
from mlx_vlm.speculative import dflash as dflash_rounds  # noqa: E402
from mlx_vlm.speculative.cache_state import commit_speculative_round  # noqa: E402
from mlx_vlm.speculative.drafters import load_drafter  # noqa: E402

import dflash2_decode_arms  # noqa: E402
import dflash2_drafter  # noqa: E402
import dflash2_rounds  # noqa: E402
import dflash2_timing  # noqa: E402
import dflash2_verify  # noqa: E402
from make_synthetic_pack import SIZES, build_target_model, synthetic_prompt, write_drafter  # noqa: E402

BLOCK = 8
# Blocks whose verify round is also timed with the forward handed to the device every
# EVAL_EVERY_ARMS layers (0 would be: evaluated once at its end), beside the runtime's own
# dflash2_verify.VERIFY_EVAL_EVERY. One eval at the end was the slowest at blocks 2 and 8 in
# sessions 23 and 24 (1.17-1.86 decode steps); every 16 layers beat every 8 at block 2 in
# both, and lost at block 8: block 4 joins, so a per-block interval can be read off the record.
EARLY_EVAL_BLOCKS = (2, 4, 8)
EVAL_EVERY_ARMS = (4, 16)
# Pipelined decode steps a sample times: its first step has nothing to overlap, so a sample
# reads high by about 1/PIPELINED_RUN of a step's host time (measure_round_costs takes that
# refill out as a difference of two arms; here a longer run keeps it small instead).
PIPELINED_RUN = 16


def prefill(lm, tokens, taps):
    """The prompt in one forward, capturing the drafter's taps: the state the round arms
    start from (a token-by-token prefill compiled for each new length: over a minute cold)."""
    cache = lm.make_cache()
    out = lm(mx.array([tokens]), cache=cache, capture_layer_ids=taps)
    hidden = mx.concatenate(out.hidden_states, axis=-1)
    mx.eval(hidden, dflash2_rounds.cache_arrays(cache))
    return cache, hidden


def configured(drafters: dict) -> dict:
    """The drafters, their weights evaluated and each configured as the server configures its
    drafter (blocks 2..8)."""
    mx.eval([drafter.parameters() for drafter in drafters.values()])
    for drafter in drafters.values():
        dflash2_drafter.configure_drafter(drafter, dflash2_drafter.RuntimeOptions())
    return drafters


def random_drafters(size: str, forms) -> dict:
    """form -> the random-weight DFlash2 drafter of `size` in that form (bf16, 4bit), written to a
    temporary folder and loaded, configured()."""
    drafters = {}
    with tempfile.TemporaryDirectory() as folder:
        for form in forms:
            write_drafter(Path(folder) / form, size, seed=0, form=form)
            drafters[form], _ = load_drafter(Path(folder) / form)
        return configured(drafters)  # its weights read while the folder is there


def prefilled_target(size: str, context: int) -> tuple:
    """(language model, cache, drafter taps, runtime status, the prompt's tap hidden states): the
    random-weight target of `size` with the runtime installed (exiting where exact verify is
    off), a prompt of `context` tokens prefilled."""
    model = build_target_model(size, seed=0)
    status = dflash2_runtime.install(model)
    if not status.speculative:
        sys.exit(f"exact verify is off on this machine: {status.reason}")
    lm = model.language_model
    taps = list(SIZES[size]["drafter"]["target_layer_ids"])
    cache, hidden = prefill(lm, synthetic_prompt(context), taps)
    return lm, cache, taps, status, hidden


def cache_settler(cache):
    """settle(): evaluate what steps on `cache` left lazy (its KV and recurrent states)."""
    return lambda: mx.eval(dflash2_rounds.cache_arrays(cache))


def decode_steps(lm, cache):
    """steps(count): `count` plain decode steps of one token on `cache`, each evaluated."""
    token = mx.array([[7]])

    def steps(count):
        for _ in range(count):
            mx.eval(lm(token, cache=cache).logits)

    return steps


def verify_round_steps(lm, cache, taps, length, accepted=None, commit=dflash2_rounds.commit_round):
    """steps(count): `count` exact verify rounds of `length` positions on `cache` (forward,
    greedy choice, commit of `accepted` drafts: half the block unless given), committed as
    the server commits (or by `commit`)."""
    block = mx.array([[11 + i for i in range(length)]])

    def steps(count):
        for _ in range(count):
            hidden_out, states, tokens = dflash_rounds._dflash_verify_greedy(
                lm, block, cache, taps, lambda logits: mx.argmax(logits, axis=-1)
            )
            mx.eval(tokens, hidden_out)
            commit(lm, cache, states, length // 2 if accepted is None else accepted, length)

    return steps


def handed_off_every(layers, steps):
    """steps(count) with each verify forward handed to the device every `layers` layers (0:
    evaluated once at its end), not dflash2_verify.VERIFY_EVAL_EVERY: a side-by-side arm."""
    def run(count):
        with dflash2_verify.verify_eval_every(layers):
            steps(count)

    return run


def served_round_steps(lm, cache, hidden, drafter, bf16: bool, length: int):
    """(steps(count): `count` rounds of `length` as the server runs them, settle()): the
    request loop's RequestDecoder.round (draft, verify, walk, commit, all on mlx-vlm's
    generation stream), the drafter in bf16 or promoted. Built before any arm runs, while
    `hidden` still covers every position `cache` holds; the other arms then grow `cache`
    past what its drafter has read, which changes the target's key lengths, as a longer
    request would, and not what a round runs."""
    decoder = dflash2_rounds.RequestDecoder(lm, drafter, cache, hidden, 7, lambda logits: mx.argmax(logits, axis=-1),
                                            mx.int32)

    def steps(count):
        dflash2_drafter.use_drafter_bf16(bf16)
        for _ in range(count):
            decoder.round(length, length)

    return steps, lambda: dflash2_timing.settle_decoder(decoder)


def on_stream(steps, stream=dflash2_rounds.generation_stream):
    """steps(count) run on `stream` (default: the rounds' generation stream)."""
    def run(count):
        with mx.stream(stream):
            steps(count)

    return run


def round_arms(lm, cache, taps, drafters, hidden, served, run=3):
    """Samples (dflash2_timing.steady_ms: `run` back to back after a lead-in, per step) of:
    a decode step, PIPELINED_RUN pipelined decode steps, an exact verify round per block (forward, greedy choice, commit of half
    the block), the same at EARLY_EVAL_BLOCKS handed off every EVAL_EVERY_ARMS layers, a draft
    of 8 per drafter form, in bf16 and in the dtype its inputs promote to, and at block 8 the
    server's whole round with `served` (drafter, bf16) beside the verify round on the stream
    that round runs on: what the server's cost table times, taken apart."""
    settle = cache_settler(cache)
    served_steps, served_settle = served_round_steps(lm, cache, hidden, *served, BLOCK)
    arms = {"decode": dflash2_timing.steady_ms(decode_steps(lm, cache), run, settle),
            "decode, pipelined": dflash2_timing.steady_ms(
                dflash2_decode_arms.pipelined_decode_steps(lm, cache), PIPELINED_RUN, settle)}
    for length in range(2, BLOCK + 1):
        arms[f"verify {length}"] = dflash2_timing.steady_ms(verify_round_steps(lm, cache, taps, length), run, settle)
    for length in EARLY_EVAL_BLOCKS:
        for layers in EVAL_EVERY_ARMS:
            arms[f"verify {length}, eval every {layers}"] = dflash2_timing.steady_ms(
                handed_off_every(layers, verify_round_steps(lm, cache, taps, length)), run, settle)
    # Drafter passes as serving drafts them, each at a new key length (as
    # dflash2_drafter.choose_drafter_dtype's arms).
    for form, drafter in drafters.items():
        for name, bf16 in (("bf16", True), ("promoted", False)):
            drafts = dflash2_drafter.drafter_passes(lm, drafter, hidden, bf16, BLOCK)
            arms[f"draft {form}, {name}"] = dflash2_timing.steady_ms(drafts, run, settle)
    # The commit as mlx-vlm leaves it, lazy for the next round's first evaluation: its graphs
    # change shape and MLX instantiates them anew (dflash2_rounds.commit_round).
    arms[f"verify {BLOCK}, commit left lazy"] = dflash2_timing.steady_ms(
        verify_round_steps(lm, cache, taps, BLOCK, commit=commit_speculative_round), run, settle)
    arms[f"verify {BLOCK}, generation stream"] = dflash2_timing.steady_ms(
        on_stream(verify_round_steps(lm, cache, taps, BLOCK)), run, settle)
    arms[f"served round {BLOCK}"] = dflash2_timing.steady_ms(served_steps, run, served_settle)
    return arms
