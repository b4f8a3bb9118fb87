"""Decode speed of serve_dflash2's routes, side by side in one process.

    python tools/bench_routes.py --pack PACK [--max-tokens 32] [--repeats 7] [--out evidence/]

Starts serve_dflash2's engine in this process on a built pack, as serve_dflash2.py does
(drafter, start-up checks, round cost table, warm-ups), then sends one greedy chat request
through each arm, interleaved (ABAB) after a warm-up pass:
- plain: routed plain, decoded by mlx-vlm's own plain loop;
- speculative: routed as the server routes a greedy request (rounds_can_pay: the cost
  table and the drafter's acceptance memory, with its probe every ROUTE_PROBE_EVERY-th);
- speculative, plain steps only: routed speculative, its round policy never running a
  round, so every token after the first is a RequestDecoder plain step;
- two diagnostic variants of that arm (same tokens; neither is how the server runs): with
  each step's tap hidden states dropped instead of kept for the drafter, and with the
  steps on the worker's own stream (mlx-vlm's plain loop's) instead of mlx-vlm's
  speculative stream. On the H200 the round loop's plain steps ran slower than the plain
  loop; these say whether keeping the taps or the stream is why.
Per request the decode time per token is (last token - first token) / (tokens - 1), as
bench_server's client measures it, here without HTTP. It writes
evidence/bench-routes-<backend>.json and .md: per arm the median, min and max ms per token,
the paired ratio plain / arm, the routes taken and where the tokens came from, and whether
every arm gave plain's tokens. bench_server measures the same servers end to end; this
tells which part of the speculative server's time is its routing and which its plain steps.
"""

import argparse
import copy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from records import run_environment, write_record  # noqa: E402

PROMPT = "Write a short, friendly note inviting a neighbour to dinner on Friday."
# arm -> (route: "plain", "speculative" or "as routed"; the Variant flags it runs under)
ARMS = {
    "plain": ("plain", ()),
    "speculative": ("as routed", ()),
    "speculative, plain steps only": ("speculative", ("no_rounds",)),
    "plain steps only, taps dropped": ("speculative", ("no_rounds", "drop_taps")),
    "plain steps only, worker stream": ("speculative", ("no_rounds", "worker_stream")),
}


def start_engine(pack: Path):
    """serve_dflash2.main up to serving: the engine with its drafter, warmed up on both routes."""
    from dflash2_engine import start_engine, warm_up
    from dflash2_speculation import DrafterSetup
    from dflash2_options import make_parser, pack_limits, parse_args, pass_options_to_mlx_vlm
    from dflash2_pack import find_pack

    args = parse_args(make_parser("bench_routes.py", "serve_dflash2's defaults"), ["--pack", str(pack)])
    target_dir, drafter_dir = find_pack(pack)
    limits = pack_limits(target_dir, "bench-routes", args)
    pass_options_to_mlx_vlm(args)
    generator, _ = start_engine(target_dir, "bench-routes", limits.context_length,
                                drafter=DrafterSetup(drafter_dir or pack / "drafter"))
    if generator.speculation.reason:
        sys.exit(f"error: the engine serves every request plain ({generator.speculation.reason})")
    warm_up(generator, "speculative")
    warm_up(generator, "plain")
    return generator


class Variant:
    """The round loop's measurement variants, each off unless its flag is in `flags`:
    no_rounds (the policy chooses plain steps for the whole request), drop_taps (a plain
    step keeps no tap hidden states for the drafter) and worker_stream (the request's steps
    run on the calling thread's default stream)."""

    def __init__(self):
        import mlx.core as mx

        import dflash2_policy as policy
        import dflash2_rounds

        self.flags = ()
        rounds, decoder = policy.RoundPolicy, dflash2_rounds.RequestDecoder
        choose_block, plain_run = rounds.choose_block, rounds.plain_run
        plain_step, start = decoder._plain_step, decoder.__init__
        speculative_stream = dflash2_rounds.generation_stream
        rounds.choose_block = lambda p, remaining: None if "no_rounds" in self.flags else choose_block(p, remaining)
        rounds.plain_run = lambda p, remaining: remaining if "no_rounds" in self.flags else plain_run(p, remaining)

        def drop_taps(decoder, token):
            next_token = plain_step(decoder, token)
            if "drop_taps" in self.flags:
                decoder.context.pop()
            return next_token

        def choose_stream(decoder, *args, **kwargs):  # read when each round or step is built
            worker = "worker_stream" in self.flags
            dflash2_rounds.generation_stream = mx.default_stream(mx.default_device()) if worker else speculative_stream
            start(decoder, *args, **kwargs)

        decoder._plain_step, decoder.__init__ = drop_taps, choose_stream
        self.restore_stream = lambda: setattr(dflash2_rounds, "generation_stream", speculative_stream)


def timed_request(generator, prompt, max_tokens: int, speculative: bool) -> dict:
    """One greedy request on a route: ms per token after the first, tokens, token sources."""
    from mlx_vlm.server.generation import GenerationArguments

    from dflash2_record import RequestRecord, current_request

    record = RequestRecord(0, "POST", "/v1/chat/completions", mode="speculative" if speculative else "plain",
                           speculative=speculative, announced=True)
    context = current_request.set(record)
    arrivals, tokens = [], []
    try:
        _, stream = generator.generate(prompt, args=GenerationArguments(max_tokens=max_tokens, temperature=0.0))
        for item in stream:
            arrivals.append(time.perf_counter())
            tokens.append(item.token)
    finally:
        current_request.reset(context)
    counts = record.round_counts
    return {
        "ms_per_token": 1000 * (arrivals[-1] - arrivals[0]) / max(1, len(arrivals) - 1),
        "tokens": tokens,
        "route": "speculative" if speculative else "plain",
        "tokens_from_rounds": counts.tokens_from_rounds if counts else 0,
    }


def measure(generator, max_tokens: int, repeats: int) -> tuple:
    """interleaved_ms over the arms; returns (timings, each arm's requests)."""
    from mlx_vlm.prompt_utils import apply_chat_template

    import dflash2_timing

    prompt = apply_chat_template(generator.processor, generator.config, [{"role": "user", "content": PROMPT}])
    variant = Variant()
    requests = {arm: [] for arm in ARMS}

    def arm(name):
        route, flags = ARMS[name]

        def sample():
            speculative = generator.rounds_can_pay() if route == "as routed" else route == "speculative"
            state = generator.speculation.state
            table = state.round_costs
            if flags:  # a variant's timings must not teach the table the server's routes read
                state.round_costs = copy.deepcopy(table)
            variant.flags = flags
            try:
                request = timed_request(generator, prompt, max_tokens, speculative)
            finally:
                variant.flags = ()
                variant.restore_stream()
                state.round_costs = table
            requests[name].append(request)
            return request["ms_per_token"]

        return sample

    timings = dflash2_timing.interleaved_ms({name: arm(name) for name in ARMS}, repeats)
    return timings, requests


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", type=Path, required=True, help="a pack folder built by tools/build_pack.py")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7, help="measured passes after the warm-up (>= 5)")
    parser.add_argument("--out", type=Path, default=REPO / "evidence")
    args = parser.parse_args(argv)
    if args.repeats < 5 or args.max_tokens < 2:
        parser.error("--repeats must be at least 5 and --max-tokens at least 2")
    import dflash2_timing

    started = time.time()
    generator = start_engine(args.pack.resolve())
    timings, requests = measure(generator, args.max_tokens, args.repeats)
    plain_tokens = requests["plain"][0]["tokens"]
    record = {
        **run_environment("bench_routes.py", args.pack.name, argv),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "prompt": PROMPT,
        "round_costs": generator.speculation.state.round_costs.to_json(),
        "ms_per_token": {arm: {key: stats[key] for key in ("median", "min", "max", "samples")}
                         for arm, stats in timings.items()},
        "plain_over_arm": {arm: dflash2_timing.paired_ratio(timings["plain"], stats) for arm, stats in timings.items()},
        # Every request, warm-up pass included: its route and the tokens its rounds gave.
        "routes": {arm: [request["route"] for request in done] for arm, done in requests.items()},
        "tokens_from_rounds": {arm: [request["tokens_from_rounds"] for request in done]
                               for arm, done in requests.items()},
        "tokens_identical": all(request["tokens"] == plain_tokens for done in requests.values() for request in done),
        "seconds": round(time.time() - started, 1),
    }
    write_record(args.out, f"bench-routes-{record['backend']}", record, summary_markdown(record))
    print(summary_markdown(record), flush=True)
    generator.stop_and_join()
    if not record["tokens_identical"]:
        sys.exit("error: an arm's tokens differ from plain's (see the record)")


def summary_markdown(r) -> str:
    lines = [
        f"# serve_dflash2's routes on {r['backend']} ({r['device']}): {r['pack']}", "",
        f"Command: `{r['command']}`; mlx {r['versions']['mlx']}, mlx-vlm {r['versions']['mlx_vlm']}", "",
        f"One greedy request of {r['max_tokens']} tokens per arm and pass, arms interleaved after a warm-up pass, "
        f"{r['repeats']} passes; ms per token after the first; plain / arm is the median over passes of "
        "the ratio within a pass.", "",
        f"Tokens identical to plain in every request: {r['tokens_identical']}.", "",
        "| arm | ms per token, median (min-max) | plain / arm | routes | tokens from rounds |",
        "|---|---|---|---|---|",
    ]
    for arm, stats in r["ms_per_token"].items():
        routes = r["routes"][arm]
        lines.append(f"| {arm} | {stats['median']:.2f} ({stats['min']:.2f}-{stats['max']:.2f}) | "
                     f"{r['plain_over_arm'][arm]:.3f} | {routes.count('speculative')} speculative, "
                     f"{routes.count('plain')} plain | {r['tokens_from_rounds'][arm]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
