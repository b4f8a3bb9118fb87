"""The drafter's start-up: install the runtime, load and configure the drafter, take or
measure its verdicts, and say in one Speculation value what speculation came to.

Runs on mlx-vlm's worker thread right after the target loads (dflash2_engine): a drafter
state to serve with, or why every request is served plain, or an error that stops the start.
"""

import dataclasses
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import dflash2_audit

logger = logging.getLogger("dflash2.server")


@dataclass(frozen=True)
class DrafterSetup:
    """What the speculative server asks of the drafter's start-up."""

    drafter_dir: Path
    options: object = None  # dflash2_drafter.RuntimeOptions, its blocks checked; None: the pack's
    round_costs: object = None  # dflash2_policy.RoundCosts given on the command line; None: measure
    verdicts: object = None  # dflash2_verdicts.VerdictCache, not yet opened; None: every check runs


@dataclass(frozen=True)
class Speculation:
    """What the drafter's start-up came to. state None: every request is served plain,
    for `reason` (the x-dflash2 header's); error: the server must not start."""

    state: object = None  # dflash2_rounds.DrafterState: the drafter and the pack's state for it
    kind: str = None
    reason: str = None
    error: str = None
    round_costs: dict = None  # as /health shows them; None: a fixed block, none measured
    runtime: dict = None  # dflash2_runtime.RuntimeStatus.to_json(): kernels, self-check, decode path


def load_speculation(model, setup: DrafterSetup, counts_to=None) -> Speculation:
    """Installs the runtime and loads the drafter; runs on mlx-vlm's worker thread, right
    after it loaded the target. The round loop serves the drafter by the state made here
    (dflash2_rounds.serve_rounds_with), handing each request's RoundCounts to `counts_to`."""
    import dflash2_drafter
    import dflash2_kernels
    import dflash2_policy
    import dflash2_rounds
    import dflash2_runtime
    import dflash2_sampling
    import dflash2_timing
    import dflash2_verdicts
    from mlx_vlm.speculative.drafters import load_drafter, validate_drafter_compatibility

    verdicts = setup.verdicts or dflash2_verdicts.VerdictCache()
    verdicts.open()  # after dflash2_runtime's import: its key asks MLX for the device
    try:
        status = dflash2_runtime.install(model, verdicts)
    except dflash2_audit.SourceMismatch as mismatch:
        return Speculation(error=str(mismatch))
    logger.info("DFlash2 runtime: backend %s, speculation %s", status.backend,
                "on" if status.speculative else f"off ({status.reason})")
    for line in status.log_lines():
        logger.info("DFlash2 %s", line)
    runtime = status.to_json()
    if not status.speculative:
        # e.g. kernel-self-test-failed, verify-self-check-failed
        verdicts.discard()
        return Speculation(reason=status.reason.split(":")[0], runtime=runtime)
    # Sampled rounds draw a verify block's tokens as decode draws each: in one call where that
    # is bitwise decode's per row here, else row by row.
    vocab = int(model.language_model.args.vocab_size)
    sampling = verdicts.check("sampled verify draws", lambda: dflash2_sampling.check_block_sampling(vocab),
                              lambda value: dflash2_sampling.BlockSampling(**value))
    dflash2_sampling.use_batched_rows(sampling.batched)
    runtime["sampled_verify"] = sampling.summary()
    logger.info("DFlash2 %s (%s)", sampling.summary(), verdicts.source("sampled verify draws"))
    drafter, kind = load_drafter(str(setup.drafter_dir), kind="dflash")
    validate_drafter_compatibility(model, drafter, kind)
    options = setup.options or dflash2_drafter.RuntimeOptions()
    try:
        blocks = dflash2_drafter.configure_drafter(drafter, options)
    except ValueError as error:  # e.g. --dflash2-sliding-window on a drafter without a window
        return Speculation(error=f"--dflash2-* options: {error}", runtime=runtime)
    selector = options.candidate_selector
    # What a round costs here decides each greedy request's route, then each round's block or plain steps.
    try:
        dtype = verdicts.check("drafter activations",
                               lambda: dflash2_drafter.choose_drafter_dtype(model, drafter, candidate_selector=selector),
                               dflash2_drafter.DrafterDtypeChoice.from_json)
        dflash2_drafter.use_drafter_bf16(dtype.bf16)
        logger.info("DFlash2 %s (%s)", dtype.summary(), verdicts.source("drafter activations"))
        runtime["drafter_activations"] = dtype.summary()
        round_costs = setup.round_costs
        if round_costs:
            verdicts.skip("round costs", "given by --dflash2-round-costs")
        elif blocks.fixed:
            verdicts.skip("round costs", "the block is fixed (--dflash2-block-size), so no decision reads a table")
        else:  # a cached table keeps learning from requests, as one measured now does
            round_costs = verdicts.check(
                "round costs", lambda: dflash2_timing.measure_round_costs(model, drafter, candidate_selector=selector),
                lambda table: dataclasses.replace(dflash2_policy.RoundCosts.from_json(table, dflash2_kernels.MAX_ROWS),
                                                  learning=True),
                dflash2_policy.RoundCosts.to_json)
    except Exception:
        logger.exception("timing the drafter or the round costs failed; every request is served plain")
        return Speculation(reason="speculative-warm-up-failed", runtime=runtime)
    if round_costs:
        logger.info("DFlash2 round costs (%s): %s",
                    "from --dflash2-round-costs" if setup.round_costs else verdicts.source("round costs"),
                    round_costs.summary())
    verdicts.save()
    memory = None
    # A given table stays as given, so each request starts from the prior; a fixed block decides nothing.
    if not setup.round_costs and not blocks.fixed:
        memory = dflash2_policy.AcceptanceMemory(dflash2_kernels.MAX_ROWS)
        logger.info("DFlash2: each request's acceptance estimate starts from the drafter's recent rounds")
    state = dflash2_rounds.DrafterState(drafter, round_costs, fixed_block=blocks.fixed,
                                        candidate_selector=selector, acceptance_memory=memory, counts_to=counts_to)
    dflash2_rounds.serve_rounds_with(state)
    if state.fixed_block:
        logger.info("DFlash2: block fixed at %d (--dflash2-block-size): greedy and sampled requests run rounds of it "
                    "whatever they cost", blocks.ceiling)
    elif not dflash2_rounds.rounds_can_pay(state):
        logger.info("DFlash2: no block up to the drafter's ceiling pays, so greedy requests are routed plain "
                    "(fallback; reason=rounds-cannot-pay) while the table says so; a measured table still "
                    "gets one in %d to learn from", dflash2_policy.ROUTE_PROBE_EVERY)
    return Speculation(state, kind, round_costs=round_costs and round_costs.to_json(), runtime=runtime)


def read_round_costs(path: Path):
    """A --dflash2-round-costs table, or exit with what is wrong with the file."""
    from dflash2_kernels import MAX_ROWS
    from dflash2_policy import RoundCosts

    try:
        return RoundCosts.from_json(json.loads(path.read_text()), MAX_ROWS)
    except (OSError, ValueError) as error:
        sys.exit(f"error: --dflash2-round-costs {path.name}: {error}")
