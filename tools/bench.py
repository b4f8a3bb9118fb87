"""Side-by-side speed of plain decoding and exact DFlash2 at the real 27B shape.

    python tools/bench.py --out evidence/

Run on a GPU machine (it builds a random-weight 27B-shape target in memory and a
27B-shape DFlash2 drafter in bf16 and 4-bit on local disk). Everything is measured in
one process, warm-up first, arms interleaved (ABAB), median of --repeats with min and
max: the plain decode step; the exact verify round for blocks 2..8 (forward, greedy
choice, cache commit with rollback) and the drafter, as ratios to the decode step;
plain decoding with the runtime installed against stock; end-to-end tokens per second,
plain against speculative with the oracle drafter (paying the real drafter's cost each
round) at the acceptance profiles below; token identity. It writes
evidence/bench-<backend>-<size>.json and .md. `--size tiny` runs the same on the tiny
pack; `--pack DIR` measures a built pack's own target and drafter.
"""

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

# As the runtime does, before MLX starts: a larger CUDA graph cache that evicts
# instead of aborting the process (see dflash2_runtime.py).
os.environ.setdefault("MLX_CUDA_GRAPH_CACHE_SIZE", "4096")
os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")

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
from records import write_record  # noqa: E402

BLOCK = 8
# Profiles named by tokens per round at block 8 (seed 003's published figures:
# chat and prose 2.0, median 2.71, code 4.5) and zero acceptance (a random drafter).
PROFILE_TOKENS_PER_ROUND = {"zero": 1.0, "chat": 2.0, "median": 2.71, "code": 4.5}
GB = 1e9


def timed_ms(fn):
    def sample():
        mx.synchronize()
        start = time.perf_counter()
        fn()
        mx.synchronize()
        return 1000 * (time.perf_counter() - start)

    return sample


def prefill_one_by_one(lm, tokens, taps):
    """Token-by-token prefill (decode arithmetic), capturing the drafter's taps."""
    cache = lm.make_cache()
    hidden = []
    for token in tokens:
        out = lm(mx.array([[token]]), cache=cache, capture_layer_ids=taps)
        hidden.append(mx.concatenate(out.hidden_states, axis=-1))
        mx.eval(hidden[-1])
    return cache, mx.concatenate(hidden, axis=1)


def round_arms(lm, cache, taps, drafters, hidden):
    """One sample each of: a decode step, an exact verify round per block (forward,
    greedy choice, commit of half the block), a draft of 8 per drafter form."""
    token = mx.array([[7]])
    arms = {"decode": timed_ms(lambda: mx.eval(lm(token, cache=cache).logits))}

    def verify_round(length):
        block = mx.array([[11 + i for i in range(length)]])

        def run():
            hidden_out, states, tokens = dflash_rounds._dflash_verify_greedy(
                lm, block, cache, taps, lambda logits: mx.argmax(logits, axis=-1)
            )
            mx.eval(tokens, hidden_out)
            commit_speculative_round(lm, cache, states, length // 2, length)

        return run

    for length in range(2, BLOCK + 1):
        arms[f"verify {length}"] = timed_ms(verify_round(length))
    step_hidden = hidden[:, -4:]
    for form, drafter in drafters.items():
        draft_cache = drafter.reset(lm)
        mx.eval(drafter.draft_block_greedy(1, hidden, draft_cache, BLOCK, None))
        arms[f"draft {form}"] = timed_ms(
            lambda d=drafter, c=draft_cache: mx.eval(d.draft_block_greedy(1, step_hidden, c, BLOCK, None))
        )
    return arms


def primitive_counts() -> dict:
    """Primitives of plain decode (the arm chosen at install) and of exact verify for
    L = 2..8, counted on CPU on a tiny-width target with the real 64-layer pattern
    (tools/graph_count.py: the counts depend on the layer pattern, not the widths)."""
    from graph_count import count_steps, load_target

    model, taps = load_target(None)
    return count_steps(model.language_model, taps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["27b", "tiny"], default="27b")
    parser.add_argument("--pack", help="measure a built pack instead of random weights")
    parser.add_argument("--out", default=str(REPO / "evidence"))
    parser.add_argument("--context", type=int, default=32, help="prompt tokens before timing")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per end-to-end run")
    parser.add_argument("--repeats", type=int, default=5)
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
    cost_drafter = next(iter(drafters.values()))  # the end-to-end profiles pay this one's cost
    drafter_names = {id(drafter): form for form, drafter in drafters.items()}
    taps = list(cost_drafter.config.target_layer_ids)
    prompt = [(17 * i + 3) % 200 + 1 for i in range(args.context)]

    status = dflash2_runtime.install(model)
    chosen_arm = status.decode_path.arm
    log(f"runtime installed: speculative {status.speculative} {status.reason or ''}; "
        f"plain decode path {chosen_arm} ({status.decode_path.why})")
    cache, hidden = prefill_one_by_one(lm, prompt, taps)
    rounds = dflash2_runtime.interleaved_ms(round_arms(lm, cache, taps, drafters, hidden), args.repeats)
    decode_ms = rounds["decode"]["median"]
    verify = {L: rounds[f"verify {L}"]["median"] / decode_ms for L in range(2, BLOCK + 1)}
    drafter_cost = {form: rounds[f"draft {form}"]["median"] / decode_ms for form in drafters}
    log(f"decode step {decode_ms:.2f} ms; verify / decode {verify}; drafter {drafter_cost}")

    # End to end: stock plain, installed plain and one speculative arm per profile,
    # interleaved in one loop so every arm sees the same machine state.
    vocab = lm.lm_head.weight.shape[0]
    prompt_ids = mx.array([prompt[:8]])
    dflash2_runtime.use_decode_arm("mlx")
    reference = greedy(model, prompt_ids, args.tokens)
    outputs, oracles = {}, {}

    def plain_arm(arm):
        def run():
            dflash2_runtime.use_decode_arm(arm)
            outputs[arm] = greedy(model, prompt_ids, args.tokens)

        return run

    def speculative_arm(profile, drafter=cost_drafter):
        accepted = PROFILE_TOKENS_PER_ROUND[profile] - 1

        def run():
            dflash2_runtime.use_decode_arm(chosen_arm)
            oracle = OracleDrafter(
                reference, vocab_size=vocab, accepted_per_round=accepted, block_size=BLOCK,
                target_layer_ids=taps, cost_drafter=drafter,
            )
            key = profile if drafter is cost_drafter else f"{profile}, {drafter_names[id(drafter)]}"
            outputs[key] = greedy(model, prompt_ids, args.tokens, drafter=oracle, block_size=BLOCK)
            oracles[key] = oracle

        return run

    arms = {"stock plain": timed_ms(plain_arm("mlx")), "plain": timed_ms(plain_arm(chosen_arm))}
    arms.update({profile: timed_ms(speculative_arm(profile)) for profile in PROFILE_TOKENS_PER_ROUND})
    # The other drafter forms' cost at the same acceptance (proposals may differ with real
    # weights; the tokens may not).
    for form, drafter in drafters.items():
        if drafter is not cost_drafter:
            for profile in ("chat", "median", "code"):
                arms[f"{profile}, {form} drafter"] = timed_ms(speculative_arm(profile, drafter))
    e2e_ms = dflash2_runtime.interleaved_ms(arms, args.repeats)
    dflash2_runtime.use_decode_arm(chosen_arm)
    plain_ms = e2e_ms["plain"]["median"]
    e2e = {profile: plain_ms / e2e_ms[profile]["median"] for profile in PROFILE_TOKENS_PER_ROUND}
    tokens_per_round = {
        profile: (args.tokens - 1) / max(1, len(oracles[profile].accept_lens))
        for profile in PROFILE_TOKENS_PER_ROUND
    }
    e2e_by_form = {
        form: {profile: plain_ms / e2e_ms[f"{profile}, {form} drafter"]["median"]
               for profile in ("chat", "median", "code")}
        for form, drafter in drafters.items() if drafter is not cost_drafter
    }
    identical = all(output == reference for output in outputs.values())
    counts = primitive_counts()
    log(f"e2e {e2e}; tokens per round {tokens_per_round}; identical {identical}")

    record = {
        "size": Path(args.pack).name if args.pack else args.size,
        "backend": dflash2_kernels.backend_name(),
        "device": mx.device_info().get("device_name", platform.machine()),
        "versions": {"mlx": mx.__version__, "mlx_vlm": mlx_vlm.__version__},
        "command": "python " + shlex.join(["tools/bench.py", *sys.argv[1:]]),
        "runtime_status": {"speculative": status.speculative, "reason": status.reason, **status.to_json()},
        "plain_decode_path": {"arm": chosen_arm, "why": status.decode_path.why,
                              "step_ms_by_arm": status.decode_path.step_ms},
        "context_tokens": args.context,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "decode_step_ms": decode_ms,
        "round_ms": rounds,
        "verify_ratio_by_block": verify,
        "drafter_ratio_by_form": drafter_cost,
        "e2e_ms": e2e_ms,
        "installed_plain_ratio": e2e_ms["stock plain"]["median"] / plain_ms,
        "e2e_speedup": e2e,
        "cost_drafter_form": next(iter(drafters)),
        "e2e_speedup_by_other_drafter_form": e2e_by_form,
        # Counted on CPU for the same layer pattern (tools/graph_count.py): launches per step.
        "decode_primitives": counts["decode"],
        "verify_primitives_by_block": counts["verify"],
        "profile_target_tokens_per_round": PROFILE_TOKENS_PER_ROUND,
        "tokens_per_round": tokens_per_round,
        "tokens_identical": identical,
        "seconds": round(time.time() - started, 1),
    }
    name = f"bench-{record['backend']}-{'pack' if args.pack else args.size}"
    write_record(args.out, name, record, summary_markdown(record))
    print(summary_markdown(record))


def summary_markdown(r) -> str:
    def spread(stats):
        return f"{stats['median']:.2f} ({stats['min']:.2f}-{stats['max']:.2f})"

    lines = [
        f"# Speed at the {r['size']} shape on {r['backend']} ({r['device']})",
        "",
        f"Command: `{r['command']}`; mlx {r['versions']['mlx']}, mlx-vlm {r['versions']['mlx_vlm']}. "
        f"One process, warm-up first, arms interleaved, median (min-max) of {r['repeats']} repeats.",
        "",
        f"Plain decode path chosen at install: `{r['plain_decode_path']['arm']}` "
        f"({r['plain_decode_path']['why']}); decode step {r['decode_step_ms']:.2f} ms; "
        f"installed plain / stock plain end to end: {r['installed_plain_ratio']:.2f}x, same tokens.",
        "",
        "| arm | ms per round | ratio to a decode step |",
        "|---|---|---|",
    ]
    for arm, stats in r["round_ms"].items():
        lines.append(f"| {arm} | {spread(stats)} | {stats['median'] / r['decode_step_ms']:.2f} |")
    lines += [
        "",
        f"End to end, {r['tokens']} tokens, block 8, oracle drafter paying the real drafter's cost:",
        "",
        "| arm | ms per run | target tokens per round | measured tokens per round | speculative / plain |",
        "|---|---|---|---|---|",
    ]
    for arm, stats in r["e2e_ms"].items():
        if arm in r["e2e_speedup"]:
            lines.append(
                f"| {arm} | {spread(stats)} | {r['profile_target_tokens_per_round'][arm]:.2f} | "
                f"{r['tokens_per_round'][arm]:.2f} | {r['e2e_speedup'][arm]:.2f}x |"
            )
        else:
            lines.append(f"| {arm} | {spread(stats)} | | | |")
    for form, speedups in r["e2e_speedup_by_other_drafter_form"].items():
        lines.append("")
        lines.append(f"Same profiles paying the {form} drafter's cost: "
                     + ", ".join(f"{profile} {s:.2f}x" for profile, s in speedups.items()) + ".")
    lines += [
        "",
        f"Primitives (tools/graph_count.py, counted on CPU for the same 64-layer pattern): decode step "
        f"{r['decode_primitives']}; exact verify by block "
        + ", ".join(f"{L}: {n}" for L, n in r["verify_primitives_by_block"].items()) + ".",
        "",
        f"Tokens identical across every arm: {r['tokens_identical']}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
