"""The drafter's attention at a new key length: MLX's fused call against the runtime's route.

    python tools/bench_drafter_attention.py --out evidence/

Each round drafts at a context length the drafter has not seen, so what its attention costs
at a new key length is what serving pays. At the 27B drafter's attention shape (8 queries,
32 heads over 8 KV heads of 128, bf16) this times one call per arm at each of --repeats
new key lengths near each context (arms interleaved, warm-up first), and the same call
again at a length already seen. Arms: MLX's `mx.fast.scaled_dot_product_attention` as
mlx-vlm's DFlashAttention calls it, and `dflash2_runtime.drafter_attention`, which the
runtime installs in its place (on CUDA, bf16 runs in fp32: MLX's fused bf16 call goes to
cuDNN there, which builds a graph for each new key length).
Writes evidence/drafter-attention-<backend>.json and .md.
"""

import argparse
import statistics
import sys
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import dflash2_policy  # noqa: E402
import dflash2_runtime  # noqa: E402
from records import run_environment, write_record  # noqa: E402

QUERIES, HEADS, KV_HEADS, HEAD_DIM = 8, 32, 8, 128  # the 27B drafter (tools/make_synthetic_pack.py)
SCALE = HEAD_DIM**-0.5
ARMS = {
    "mlx fused": lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE),
    "drafter_attention": lambda q, k, v: dflash2_runtime.drafter_attention(q, k, v, scale=SCALE),
}


def timed_call(arm, q, k, v) -> float:
    """ms of one call, inputs evaluated and the device idle before it."""
    mx.eval(q, k, v)
    return dflash2_policy.timed_ms(lambda: mx.eval(ARMS[arm](q, k, v)))()


def measure(context: int, repeats: int, key) -> dict:
    """Per arm: ms at new key lengths (median, min, max) and at a length seen before."""
    q = mx.random.normal((1, HEADS, QUERIES, HEAD_DIM), key=key).astype(mx.bfloat16)
    samples = {arm: [] for arm in ARMS}
    length = context
    for repeat in range(repeats + 1):  # the first pass is the warm-up
        for arm in ARMS:
            length += 1  # never a length any arm has seen
            k = mx.random.normal((1, KV_HEADS, length, HEAD_DIM), key=key).astype(mx.bfloat16)
            ms = timed_call(arm, q, k, k + 1)
            if repeat:
                samples[arm].append(ms)
    for arm in ARMS:  # the last length, now seen by every arm
        timed_call(arm, q, k, k + 1)
    seen = {arm: statistics.median(timed_call(arm, q, k, k + 1) for _ in range(repeats)) for arm in ARMS}
    return {
        arm: {
            "new_length_ms": {"median": statistics.median(s), "min": min(s), "max": max(s)},
            "seen_length_ms": seen[arm],
        }
        for arm, s in samples.items()
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "evidence"))
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 1000, 4000])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    span = (args.repeats + 1) * len(ARMS)  # key lengths one context's calls take
    contexts = sorted(args.contexts)
    if any(b - a < span for a, b in zip(contexts, contexts[1:])):
        parser.error(f"--contexts must be at least {span} apart, or a length would be seen twice")
    key = mx.random.key(0)
    results = {str(context): measure(context, args.repeats, key) for context in args.contexts}
    record = {
        **run_environment("bench_drafter_attention.py", "none (attention inputs only)"),
        "shape": {"queries": QUERIES, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "dtype": "bfloat16"},
        "repeats": args.repeats,
        "by_context": results,
    }
    markdown = summary_markdown(record)
    write_record(args.out, f"drafter-attention-{record['backend']}", record, markdown)
    print(markdown)


def summary_markdown(r) -> str:
    lines = [
        f"# The drafter's attention at a new key length, on {r['backend']} ({r['device']})",
        "",
        f"Command: `{r['command']}`; mlx {r['versions']['mlx']}. One call of "
        f"{r['shape']['queries']} queries, {r['shape']['heads']} heads over {r['shape']['kv_heads']} "
        f"KV heads of {r['shape']['head_dim']}, bf16; each timed call at a key length no call "
        f"had before, arms interleaved after a warm-up pass, median (min-max) of {r['repeats']}; "
        "then the same call at a length already seen.",
        "",
        "| context | arm | ms at a new length | ms at a seen length |",
        "|---|---|---|---|",
    ]
    for context, arms in r["by_context"].items():
        for arm, m in arms.items():
            t = m["new_length_ms"]
            lines.append(f"| {context} | {arm} | {t['median']:.2f} ({t['min']:.2f}-{t['max']:.2f}) | "
                         f"{m['seen_length_ms']:.2f} |")
    return "\n".join(lines + [""])


if __name__ == "__main__":
    main()
