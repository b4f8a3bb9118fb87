"""Why the round phase's plain decode step is slower than the one generation runs: the same
steps timed under each condition that differs between them, interleaved in one process.

    python tools/lab/decode_probe.py --size 27b --out /root/out [--dense-dtype float32] [--verdict-cache]

At 7d92955 on the H100 (fp16) the start-up timed the chosen decode arm's pipelined steps at
19.9 ms (median) on a fresh four-token cache, the server's warm-up at 25.3 ms, and
tools/bench.py's round phase at 34.1 ms evaluated alone and 32.8 ms pipelined (the
denominator of its verify / decode ratios). The arms, each on its own cache, ms per step
over bench_arms.PIPELINED_RUN steps:
- `pipelined, 4-token cache`: the start-up's measurement (choose_decode_path);
- `pipelined, prompt cache`: bench's prefilled prompt of --context tokens instead;
- `pipelined, prompt cache, batch stream`: on mlx-vlm's generation stream, as bench's round
  phase and the server run requests;
- `evaluated alone, batch stream`: bench's `decode` arm, each step's logits evaluated;
- `pipelined, long cache`: the prompt cache grown by --long tokens (a long round phase's);
- `pipelined, after a verify round`: one block-8 exact verify round first (untimed), as the
  round phase interleaves its arms.
Writes decode-probe-<backend>.json and .md to --out.
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from bench import install_runtime  # noqa: E402  (first: MLX's environment as bench's records had it)
import mlx.core as mx  # noqa: E402

import dflash2_decode_arms  # noqa: E402
import dflash2_timing  # noqa: E402
from bench_arms import PIPELINED_RUN, cache_settler, decode_steps, on_stream, prefill, verify_round_steps  # noqa: E402
from make_synthetic_pack import SIZES, build_target_model, synthetic_prompt  # noqa: E402
from records import add_dense_dtype_argument, layout_suffix, run_environment, write_record  # noqa: E402


def probe_arms(lm, taps, context: int, long: int) -> dict:
    """name -> a sample (ms per step) of each condition, each on a cache of its own."""
    def prompt_cache(extra=0):
        cache, _ = prefill(lm, synthetic_prompt(context + extra), taps)
        return cache

    fresh = lm.make_cache()
    mx.eval(lm(mx.array([[1, 2, 3, 4]]), cache=fresh).logits)
    caches = {"fresh": fresh, "prompt": prompt_cache(), "batch": prompt_cache(), "alone": prompt_cache(),
              "long": prompt_cache(long), "verify": prompt_cache()}
    after_verify = verify_round_steps(lm, caches["verify"], taps, 8)
    pipelined = {name: dflash2_decode_arms.pipelined_decode_steps(lm, cache) for name, cache in caches.items()}

    def sample(steps, cache, lead_in=None):
        """steady_ms's sample, its lead-in one step of the arm's own or `lead_in`'s."""
        settle = cache_settler(cache)

        def timed():
            (lead_in or steps)(1)
            settle()
            return dflash2_timing.timed_ms(lambda: (steps(PIPELINED_RUN), settle()))() / PIPELINED_RUN

        return timed

    return {
        "pipelined, 4-token cache": sample(pipelined["fresh"], caches["fresh"]),
        "pipelined, prompt cache": sample(pipelined["prompt"], caches["prompt"]),
        "pipelined, prompt cache, batch stream": sample(on_stream(pipelined["batch"], dflash2_timing.batch_stream),
                                                        caches["batch"]),
        "evaluated alone, batch stream": sample(on_stream(decode_steps(lm, caches["alone"]), dflash2_timing.batch_stream),
                                                caches["alone"]),
        f"pipelined, prompt + {long} tokens": sample(pipelined["long"], caches["long"]),
        "pipelined, after a verify round": sample(pipelined["verify"], caches["verify"], lead_in=after_verify),
    }


def summary(record: dict) -> str:
    lines = [f"# Plain decode steps under the round phase's conditions on {record['backend']} ({record['device']})", "",
             f"Command: `{record['command']}`; commit {record['git_commit']} (clean: {record['git_clean']}); plain "
             f"decode path `{record['plain_decode_path']}`. Interleaved after a warm-up, {record['repeats']} passes; "
             "ms per step, median (min-max); ratio: the median over passes of the arm over the first arm of the "
             "same pass.", "", "| arm | ms per step | over the first |", "|---|---|---|"]
    for name, stats in record["step_ms"].items():
        lines.append(f"| {name} | {stats['median']:.2f} ({stats['min']:.2f}-{stats['max']:.2f}) | "
                     f"{record['ratio_to_first'][name]:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="27b")
    add_dense_dtype_argument(parser)
    parser.add_argument("--context", type=int, default=32, help="bench's prompt tokens")
    parser.add_argument("--long", type=int, default=2048, help="tokens the long cache holds past the prompt")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--verdict-cache", action="store_true", help="as tools/bench.py's (the same key)")
    parser.add_argument("--out", default=str(REPO / "evidence"))
    parser.set_defaults(pack=None)  # the synthetic target: bench's verdict key without a pack
    args = parser.parse_args()

    model = build_target_model(args.size, seed=0, dense_dtype=args.dense_dtype)
    status, _ = install_runtime(model, args)
    if not status.speculative:
        sys.exit(f"exact verify is off on this machine: {status.reason}")
    lm = model.language_model
    taps = list(SIZES[args.size]["drafter"]["target_layer_ids"])
    timings = dflash2_timing.interleaved_ms(probe_arms(lm, taps, args.context, args.long), args.repeats)
    first = next(iter(timings))
    record = {
        **run_environment("lab/decode_probe.py", f"{args.size} {args.dense_dtype}"),
        "plain_decode_path": status.decode_path.arm, "repeats": args.repeats, "context_tokens": args.context,
        "step_ms": {name: {key: stats[key] for key in ("median", "min", "max")} for name, stats in timings.items()},
        "ratio_to_first": {name: dflash2_timing.paired_ratio(stats, timings[first]) for name, stats in timings.items()},
    }
    name = f"decode-probe-{record['backend']}" + layout_suffix(args.dense_dtype)
    write_record(Path(args.out), name, record, summary(record))
    print(summary(record))


if __name__ == "__main__":
    main()
