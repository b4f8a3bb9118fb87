"""Side-by-side speed of plain decoding and exact DFlash2 at the real 27B shape.

    python tools/bench.py --out evidence/

Run on a GPU machine (it builds a random-weight 27B-shape target in memory and a
27B-shape DFlash2 drafter in bf16 and 4-bit on local disk). In one process it
measures: the plain decode step; the stock (inexact) and exact verify round for
blocks 2..8 (forward, greedy choice, cache commit with rollback) as ratios to the
decode step; the drafter's cost; end-to-end tokens per second, plain against
speculative with the oracle drafter at chat-like and code-like acceptance while
paying the real drafter's cost each round; peak memory; token identity. It writes
evidence/bench-<backend>-<size>.json and .md. `--size tiny` runs the same on the tiny
pack; `--pack DIR` measures a built pack's own target and drafter.
"""

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

# Verify rounds of every block size add many distinct CUDA graphs; MLX's default
# cache of 400 thrashes (and raises) at the 27B layer count.
os.environ.setdefault("MLX_CUDA_GRAPH_CACHE_SIZE", "4096")

import mlx.core as mx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import mlx_vlm  # noqa: E402
from mlx_vlm.speculative import dflash as dflash_rounds  # noqa: E402
from mlx_vlm.speculative.cache_state import commit_speculative_round  # noqa: E402
from mlx_vlm.speculative.drafters import load_drafter  # noqa: E402

import dflash2_kernels  # noqa: E402
import dflash2_runtime  # noqa: E402
from dflash2_pack import find_pack, load_pack  # noqa: E402
from make_synthetic_pack import build_target_model, write_drafter  # noqa: E402
from oracle_drafter import OracleDrafter  # noqa: E402
from parity import greedy  # noqa: E402

# Per-position acceptance that gives the published tokens per round at block 8:
# chat about 2.7, code about 4.5 (1 + sum of q^k for k = 1..7).
PROFILES = {"chat": 0.36, "code": 0.16}
GB = 1e9


def mean_ms(fn, repeats):
    fn()  # warm-up: compilation and allocation
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    mx.synchronize()
    return 1000 * (time.perf_counter() - start) / repeats


def prefill_one_by_one(lm, tokens, taps):
    """Token-by-token prefill (decode arithmetic), capturing the drafter's taps."""
    cache = lm.make_cache()
    hidden = []
    for token in tokens:
        out = lm(mx.array([[token]]), cache=cache, capture_layer_ids=taps)
        hidden.append(mx.concatenate(out.hidden_states, axis=-1))
        mx.eval(hidden[-1])
    return cache, mx.concatenate(hidden, axis=1)


def decode_step_ms(lm, cache, repeats):
    token = mx.array([[7]])
    return mean_ms(lambda: mx.eval(lm(token, cache=cache).logits), repeats)


def verify_round_ms(lm, cache, taps, length, repeats):
    """One verify round as the round loop runs it: forward, greedy choice, commit."""
    block = mx.array([[11 + i for i in range(length)]])

    def round_():
        hidden, states, tokens = dflash_rounds._dflash_verify_greedy(
            lm, block, cache, taps, lambda logits: mx.argmax(logits, axis=-1)
        )
        mx.eval(tokens, hidden)
        commit_speculative_round(lm, cache, states, length // 2, length)

    return mean_ms(round_, repeats)


def drafter_ms(drafter, model, hidden, repeats):
    cache = drafter.reset(model)
    mx.eval(drafter.draft_block_greedy(1, hidden, cache, 8, None))
    step_hidden = hidden[:, -4:]
    return mean_ms(lambda: mx.eval(drafter.draft_block_greedy(1, step_hidden, cache, 8, None)), repeats)


def generate(model, tokens, drafter=None):
    """Greedy tokens from a one-token prompt, with tok/s and peak memory in GB."""
    mx.reset_peak_memory()
    start = time.perf_counter()
    block_size = 8 if drafter is not None else None
    out = greedy(model, mx.array([[1]]), tokens, drafter=drafter, block_size=block_size)
    return out, tokens / (time.perf_counter() - start), mx.get_peak_memory() / GB


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["27b", "tiny"], default="27b")
    parser.add_argument("--pack", help="measure a built pack instead of random weights")
    parser.add_argument("--out", default=str(REPO / "evidence"))
    parser.add_argument("--context", type=int, default=32, help="prompt tokens before timing")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per end-to-end run")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    started = time.time()
    log = lambda message: print(f"[{time.time() - started:6.1f}s] {message}", flush=True)  # noqa: E731

    if args.pack:
        # A built pack: its own target and drafter (whatever form it ships).
        model, _, pack_drafter = load_pack(*find_pack(args.pack))
        drafters = {"pack": pack_drafter}
    else:
        model = build_target_model(args.size, seed=0)
        drafters = {}
        with tempfile.TemporaryDirectory() as folder:
            for form in ("bf16", "4bit"):
                write_drafter(Path(folder) / form, args.size, seed=0, form=form)
                drafters[form], _ = load_drafter(Path(folder) / form)
    mx.eval([drafter.parameters() for drafter in drafters.values()])
    lm = model.language_model
    log("target and drafters ready")
    cost_drafter = next(iter(drafters.values()))
    taps = list(cost_drafter.config.target_layer_ids)
    prompt = [(17 * i + 3) % 200 + 1 for i in range(args.context)]

    cache, _ = prefill_one_by_one(lm, prompt, taps)
    decode_ms = decode_step_ms(lm, cache, args.repeats)
    log(f"decode step {decode_ms:.2f} ms")
    stock_plain, stock_plain_tps, _ = generate(model, args.tokens)
    blocks = range(2, 9)
    stock = {L: verify_round_ms(lm, cache, taps, L, args.repeats) / decode_ms for L in blocks}
    log(f"stock verify {stock}")

    status = dflash2_runtime.install(model)
    log(f"runtime installed: {status.speculative} {status.reason}")
    cache, hidden = prefill_one_by_one(lm, prompt, taps)
    installed_decode_ms = decode_step_ms(lm, cache, args.repeats)
    log(f"decode step after install {installed_decode_ms:.2f} ms")
    exact = {L: verify_round_ms(lm, cache, taps, L, args.repeats) / decode_ms for L in blocks}
    log(f"exact verify {exact}")
    drafter_cost = {
        form: drafter_ms(drafter, model, hidden, args.repeats) / decode_ms
        for form, drafter in drafters.items()
    }
    log(f"drafter {drafter_cost}")

    plain, plain_tps, plain_peak = generate(model, args.tokens)
    vocab = lm.lm_head.weight.shape[0]
    e2e, rounds, identical, extra_memory = {}, {}, plain == stock_plain, {}
    for profile, error_rate in PROFILES.items():
        oracle = OracleDrafter(
            plain,
            vocab_size=vocab,
            error_rate=error_rate,
            block_size=8,
            target_layer_ids=taps,
            cost_drafter=cost_drafter,
        )
        spec, spec_tps, spec_peak = generate(model, args.tokens, oracle)
        identical &= spec == plain
        e2e[profile] = spec_tps / stock_plain_tps
        rounds[profile] = (args.tokens - 1) / max(1, len(oracle.accept_lens))
        extra_memory[profile] = spec_peak - plain_peak
        log(f"{profile}: {spec_tps:.1f} tok/s vs {stock_plain_tps:.1f}, {rounds[profile]:.2f} tokens/round")

    record = {
        "size": Path(args.pack).name if args.pack else args.size,
        "backend": dflash2_kernels.backend_name(),
        "device": mx.device_info().get("device_name", platform.machine()),
        "versions": {"mlx": mx.__version__, "mlx_vlm": mlx_vlm.__version__},
        "command": "python " + shlex.join(["tools/bench.py", *sys.argv[1:]]),
        "runtime_status": {"speculative": status.speculative, "reason": status.reason},
        "context_tokens": args.context,
        "decode_step_ms": decode_ms,
        "plain_tok_s": stock_plain_tps,
        # The same plain decode with the runtime installed (one-row exact kernel).
        "installed_decode_step_ms": installed_decode_ms,
        "installed_plain_tok_s": plain_tps,
        "verify_ratio_by_block": exact,
        "stock_verify_ratio_by_block": stock,
        "drafter_ratio_by_form": drafter_cost,
        "e2e_speedup": e2e,
        "tokens_per_round": rounds,
        "tokens_identical": identical,
        "peak_memory_gb": {"plain": plain_peak},
        # Measured at the end-to-end context (prompt of one token plus generated tokens).
        "spec_extra_memory_gb": {str(args.tokens): max(extra_memory.values())},
        "seconds": round(time.time() - started, 1),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"bench-{record['backend']}-{'pack' if args.pack else args.size}"
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / f"{name}.md").write_text(summary_markdown(record))
    print(summary_markdown(record))


def summary_markdown(r) -> str:
    lines = [
        f"# Speed at the {r['size']} shape on {r['backend']} ({r['device']})",
        "",
        f"Command: `{r['command']}`; mlx {r['versions']['mlx']}, mlx-vlm {r['versions']['mlx_vlm']}",
        "",
        f"Plain decode step, stock: {r['decode_step_ms']:.2f} ms ({r['plain_tok_s']:.1f} tok/s end "
        f"to end); with the runtime installed: {r['installed_decode_step_ms']:.2f} ms "
        f"({r['installed_plain_tok_s']:.1f} tok/s), same tokens",
        "",
        "Verify rounds are given in stock decode steps.",
        "",
        "| block | exact verify round / decode step | stock (inexact) round / decode step |",
        "|---|---|---|",
    ]
    for block, ratio in r["verify_ratio_by_block"].items():
        lines.append(f"| {block} | {ratio:.2f} | {r['stock_verify_ratio_by_block'][block]:.2f} |")
    lines += ["", "| drafter form | draft of 8 / decode step |", "|---|---|"]
    lines += [f"| {f} | {v:.2f} |" for f, v in r["drafter_ratio_by_form"].items()]
    lines += ["", "| profile | tokens per round | speculative / plain tok/s |", "|---|---|---|"]
    for profile, speedup in r["e2e_speedup"].items():
        lines.append(f"| {profile} | {r['tokens_per_round'][profile]:.2f} | {speedup:.2f}x |")
    lines += [
        "",
        f"Tokens identical to stock plain decoding (plain after install and speculative): "
        f"{r['tokens_identical']}. "
        f"Peak memory plain {r['peak_memory_gb']['plain']:.2f} GB; "
        f"speculation adds {list(r['spec_extra_memory_gb'].values())[0]:.2f} GB.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
