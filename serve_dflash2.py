"""Serve the pack with DFlash2 speculative decoding, routed request by request.

    python serve_dflash2.py [--port 8080] [--enable-thinking] [--no-dflash2] [--pack DIR]
    python serve_dflash2.py --demo        # serves the trained tiny pair in fixtures/tiny-pair

Speculation reproduces plain decoding's tokens, greedy or sampled (every draw keyed by seed
and position: dflash2_sampling), so each chat request is routed, and every response says
how in its x-dflash2 header:
- speculative: greedy or sampled, no logprobs, no penalties, no logit_bias, n=1
  (images too, unless --dflash2-multimodal plain);
- fallback; reason=R: served plain. Per request R is logprobs, penalties, logit-bias,
  multimodal-plain, or rounds-cannot-pay (a request while the round cost table has no block that beats
  plain decoding by 5% even at full acceptance, or none at the acceptance the drafter's
  recent rounds showed); for every request it is no-dflash2
  (--no-dflash2), packed-weights-unsupported, kernel-self-test-failed,
  verify-self-check-failed or speculative-warm-up-failed;
- refused; reason=R: thinking-budget, structured-output, n-above-1, and the gateway's
  refusals (dflash2_gateway.py, dflash2_routing.py, dflash2_requests.py; docs/routing.md lists them all).
Responses that generate nothing (/v1/models, /health) carry the server's mode.
A speculative request runs rounds only while they pay: dflash2_policy picks each round's
block, or plain decode steps, from a round cost table measured at start-up (in /health) and
the request's acceptance; its timings say how many tokens came from rounds and from plain steps.
Start-up only: the routing is dflash2_routing.py's, the drafter's start-up dflash2_speculation.py's,
and the hardening (loopback only, exact pass-through options, refused environment, path
scrubbing, one sequence at a time) is shared with serve.py (dflash2_launch.py,
dflash2_options.py, dflash2_gateway.py).
"""

import os
import sys

# First, before any other import (os and sys are Python's own, frozen or built in): the pack's
# folder off the module path, here and in any child Python (a file beside the pack's modules,
# logging.py say, would run in place of the real one), then the pack's own modules from their
# checked sources alone (dflash2_source.py says why). serve.py and serve_dflash2.py open alike.
if __name__ == "__main__":  # Python's own entry, and any PYTHONPATH one ('.', or empty: the current folder)
    script = os.path.abspath(__file__)
    folders = {os.path.realpath(os.path.dirname(path)) for path in (script, os.path.realpath(script))}
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or ".") not in folders]
    os.environ["PYTHONSAFEPATH"] = "1"
import runpy  # noqa: E402  (frozen into Python: nothing of this folder's)
from pathlib import Path  # noqa: E402

# The pack's folder: this script's, as it was started (not resolved): a Hugging Face cache
# snapshot links each file into blobs/, and the pack is the links' folder.
HERE = Path(__file__).absolute().parent
runpy.run_path(str(HERE / "dflash2_source.py"))["load_from_source"](str(HERE))
import logging

from dflash2_engine import warm_up
from dflash2_gateway import Gateway, serve
from dflash2_launch import compiling_alone, open_pack, read_options, start_pack_engine
from dflash2_options import interrupted_start_exits, make_parser, pack_folder
from dflash2_routing import decider, route_chat
from dflash2_speculation import DrafterSetup, read_round_costs

logger = logging.getLogger("dflash2.server")

# The demo's fixed verify block. On a CPU no round pays for itself (a verify of B tokens costs
# about B decode steps), so the adaptive policy would serve plain steps and the drafter's work
# would not show; a fixed block runs a round every time.
DEMO_BLOCK_SIZE = 4


# The DFlash2 options that shape speculation.
DRAFTER_OPTIONS = ("dflash2_multimodal", "dflash2_block_size", "dflash2_block_cap", "dflash2_candidate_selector",
                   "dflash2_sliding_window", "dflash2_round_costs")


def make_dflash2_parser():
    parser = make_parser("serve_dflash2.py", "Serve the pack's model with DFlash2 speculative decoding.")
    parser.add_argument("--demo", action="store_true",
                        help="serve the trained tiny target + drafter pair (fixtures/tiny-pair of the "
                             f"source repository; a fixture, not the 27B) with a fixed block of {DEMO_BLOCK_SIZE}")
    parser.add_argument("--verify-pack", action="store_true",
                        help="check the pack (SHA256SUMS, pins, schema, drafter fit, kernel self-test), "
                             "print a pass/fail table and exit 0 or 1 without serving")
    parser.add_argument("--no-dflash2", action="store_true",
                        help="serve the same wrapper without the drafter (like-for-like baseline)")
    parser.add_argument("--recheck", action="store_true",
                        help="run every start-up check and measurement again instead of taking the verdicts "
                             "an earlier start cached for this machine, runtime and pack (the exact verify "
                             "self-check runs at every start)")
    dflash2 = parser.add_argument_group("DFlash2 options")
    dflash2.add_argument("--dflash2-multimodal", choices=["speculative", "plain"], default="speculative",
                         help="route requests with images speculative (default) or plain")
    # Their range is the drafter's (its trained block, up to the kernels' rows): start checks
    # both once it has read the drafter's config.json.
    dflash2.add_argument("--dflash2-block-size", type=int,
                         help="experimental: fixed verify block instead of the adaptive one")
    dflash2.add_argument("--dflash2-block-cap", type=int,
                         help="experimental: upper bound for the adaptive verify block")
    dflash2.add_argument("--dflash2-candidate-selector", action="store_true",
                         help="experimental: draft greedily through the trained candidate selector")
    dflash2.add_argument("--dflash2-sliding-window", action="store_true",
                         help="experimental: the drafter attends to its sliding_window last context "
                              "positions only (flat drafter memory)")
    dflash2.add_argument("--dflash2-round-costs", type=Path, metavar="FILE",
                         help="use this round cost table (JSON, as /health's round_costs, measured on "
                              "this machine) instead of measuring it at start-up")
    return parser


# ---------------------------------------------------------------------------------------


def drafter_setup(parser, args, pack) -> DrafterSetup:
    """The drafter's start-up as the options ask; a block the drafter cannot take stops the
    start here (exit 2), before any weight loads."""
    from dflash2_drafter import RuntimeOptions, block_limits
    from dflash2_pack import drafter_trained_block
    from dflash2_verdicts import VerdictCache, pack_key

    drafter_dir = pack.drafter_dir or pack.pack_dir / "drafter"
    try:
        blocks = block_limits(drafter_trained_block(drafter_dir), args.dflash2_block_size, args.dflash2_block_cap)
    except ValueError as error:
        parser.error(str(error))
    # The verdicts' key holds the options as given: a start with other ones checks again.
    given = dict(block_size=args.dflash2_block_size, block_cap=args.dflash2_block_cap,
                 candidate_selector=args.dflash2_candidate_selector, sliding_window=args.dflash2_sliding_window)
    verdicts = VerdictCache(pack_key(pack.pack_dir, pack.target_dir, pack.drafter_dir, given), recheck=args.recheck)
    options = RuntimeOptions(blocks, candidate_selector=args.dflash2_candidate_selector,
                             sliding_window=args.dflash2_sliding_window)
    costs = read_round_costs(args.dflash2_round_costs) if args.dflash2_round_costs else None
    return DrafterSetup(drafter_dir, options, costs, verdicts)


def main(argv=None):
    with interrupted_start_exits():
        gateway, args = start(argv)
    serve(gateway, args)


def start(argv=None):
    """Everything before serving: options, pack checks, the engine, its warm-ups; the gateway."""
    parser = make_dflash2_parser()
    args = read_options(parser, argv)
    if args.demo and args.verify_pack:
        parser.error("--verify-pack checks a built pack folder; --demo's fixture is checked against "
                     "its SHA256SUMS at every start")
    drafter_options = [f"--{name.replace('_', '-')}" for name in DRAFTER_OPTIONS
                       if getattr(args, name) != parser.get_default(name)]
    if args.no_dflash2 and drafter_options:
        parser.error(f"{', '.join(drafter_options)} set the drafter's work; --no-dflash2 serves without it")
    if args.demo and args.dflash2_block_size is None:
        args.dflash2_block_size = DEMO_BLOCK_SIZE
    if args.verify_pack:  # serves nothing: a server may run on its address
        from dflash2_pack import format_verify_table, verify_pack

        with compiling_alone():  # its kernel self-tests compile
            results = verify_pack(pack_folder(parser, args, HERE))
        print(format_verify_table(results))
        sys.exit(0 if all(ok for _, ok, _ in results) else 1)
    pack = open_pack(parser, args, HERE, with_drafter=not args.no_dflash2)
    with compiling_alone():
        drafter = None if args.no_dflash2 else drafter_setup(parser, args, pack)
        verdicts = drafter and drafter.verdicts
        generator, inner_app = start_pack_engine(pack, args, drafter)
        if generator.speculation.error:
            generator.stop_and_join()
            sys.exit(f"error: {generator.speculation.error}")
        server_reason = "no-dflash2" if args.no_dflash2 else generator.speculation.reason
        if not server_reason:
            try:
                warm_up(generator, "speculative")
            except Exception:
                # Serving plain beats failing every greedy request; the header says why.
                logger.exception("the speculative warm-up failed; every request is served plain")
                server_reason = "speculative-warm-up-failed"
                generator.serve_plain(server_reason)
        warm_up(generator, "plain")

    server_mode = ("fallback", server_reason) if server_reason else ("speculative", None)

    decide = decider(pack.limits, lambda body: route_chat(body, server_reason=server_reason,
                                                          multimodal_plain=args.dflash2_multimodal == "plain",
                                                          rounds_pay=generator.rounds_can_pay))

    def health():
        speculation = generator.speculation
        # A measured cost table keeps learning from requests: /health shows it as it is now.
        state = speculation.state
        costs = state.round_costs.to_json() if state and state.round_costs else speculation.round_costs
        return {"dflash2": server_mode[0], "reason": server_reason, "runtime": speculation.runtime,
                "round_costs": costs, "start_up_checks": verdicts and verdicts.to_json()}

    return Gateway(inner_app, limits=pack.limits, scrubber=pack.scrubber, decide=decide, header="x-dflash2",
                   server_mode=server_mode, health=health, request_timeout=args.request_timeout), args


if __name__ == "__main__":
    main()
