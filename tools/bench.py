"""Side-by-side speed of plain decoding and exact DFlash2 at the real 27B shape.

    python tools/bench.py --out evidence/

Run on a GPU machine (it builds a random-weight 27B-shape target in memory and a
27B-shape DFlash2 drafter in bf16 and 4-bit on local disk). Everything is measured in
one process, warm-up first, arms interleaved (ABAB), median of --repeats with min and
max: the plain decode step; the exact verify round for blocks 2..8 (forward, greedy
choice, cache commit with rollback) and the drafter, as ratios to the decode step; the
server's own round at block 8 (draft, verify, walk, commit) beside its verify on the same stream;
plain decoding with the runtime installed (each decode arm) against stock; the round
policy's cost table as the server measures it at warm-up; end-to-end tokens per second,
plain against speculative with the oracle drafter (paying the real drafter's cost each
round) at the acceptance profiles below, under the round policy and at each fixed block of
--fixed-blocks; for sampled requests (--sampled-temperatures), plain seeded sampling against
the round policy with the oracle proposing plain seeded sampling's tokens at the same
profiles; token identity. The oracle's acceptance is stochastic by default (--acceptance:
oracle_drafter.DepthAcceptance, each profile's per-depth curve calibrated to its tokens per
round at block 8, the draws seeded by the pass so every arm of a pass sees the same ones),
recorded with the tokens per round it gives at every block under acceptance_model. --tokens
takes a list (40,256): one end-to-end pass per count, each under e2e_by_tokens with tok/s,
the longest's figures on top of the record (tokens_generated says which). It writes
evidence/bench-<backend>-<size>.json and .md. `--size tiny` runs the same on the tiny
pack; `--pack DIR` measures a built pack's own target and drafter. `--part rounds` stops
after the round phase and `--part e2e` runs only the end-to-end phase, in a second process,
adding it to the record the first wrote in --out (each ratio still comes from one process:
the whole run does not fit in one ten-minute GPU call at the 27B shape).
"""

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

# As the runtime does, before MLX starts: a larger CUDA graph cache that evicts
# instead of aborting the process (see dflash2_runtime.py).
os.environ.setdefault("MLX_CUDA_GRAPH_CACHE_SIZE", "4096")
os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")

import mlx.core as mx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]


import dflash2_decode_arms  # noqa: E402
import dflash2_drafter  # noqa: E402
import dflash2_engine  # noqa: E402
import dflash2_kernels  # noqa: E402
import dflash2_policy  # noqa: E402
import dflash2_rounds  # noqa: E402
import dflash2_runtime  # noqa: E402
import dflash2_sampling  # noqa: E402
import dflash2_timing  # noqa: E402
import dflash2_verify  # noqa: E402
from bench_arms import (BLOCK, EARLY_EVAL_BLOCKS, EVAL_EVERY_ARMS, configured, prefill,  # noqa: E402
                        random_drafters, round_arms)
from bench_summary import summary_markdown  # noqa: E402
from dflash2_pack import find_pack, kernel_shapes, load_pack  # noqa: E402
from dflash2_verdicts import VerdictCache, modules_key, pack_key  # noqa: E402
from make_synthetic_pack import build_target_model, synthetic_prompt  # noqa: E402
from oracle_drafter import DEFAULT_DEPTH_DECAY, DepthAcceptance, OracleDrafter  # noqa: E402
from parity import greedy, served_rounds, stock_mlx_vlm  # noqa: E402
from records import add_dense_dtype_argument, layout_suffix, run_environment, write_record  # noqa: E402

# The sampled arms' settings beside their temperature (Qwen3.5's recommended top_p and top_k)
# and seed.
SAMPLED_SETTINGS = {"top_p": 0.95, "top_k": 20, "seed": 0}

# Profiles named by tokens per round at block 8 (seed 003's published figures:
# chat and prose 2.0, median 2.71, code 4.5) and zero acceptance (a random drafter).
PROFILE_TOKENS_PER_ROUND = {"zero": 1.0, "chat": 2.0, "median": 2.71, "code": 4.5}
# What a split run's round phase keeps of its own process when --part e2e adds to its record.
ROUND_PROCESS_KEYS = ("runtime_status", "start_up_verdicts", "plain_decode_path", "round_costs",
                      "drafter_dtype_by_form", "command", "repeats", "code", "git_commit", "git_clean")
# What --part e2e needs of the round phase's record (start_up_verdicts: records since c815b3e).
ROUND_RECORD_KEYS = (*(key for key in ROUND_PROCESS_KEYS if key != "start_up_verdicts"), "round_ms",
                     "decode_step_ms")


def start_up_verdicts(args, model) -> VerdictCache:
    """The start-up checks' verdict cache (--verdict-cache), keyed as a server keys its own: the
    runtime's modules, the model (a built pack's files; or the synthetic one's size, dense
    dtype, kernel shapes and the source of the tools that build it, at seed 0) and, once opened,
    this machine. Without it every check runs."""
    if not args.verdict_cache:
        return VerdictCache()
    if args.pack:
        return VerdictCache(pack_key(Path(args.pack), *find_pack(args.pack), {}))
    builders = {name: hashlib.sha256((REPO / "tools" / name).read_bytes()).hexdigest()
                for name in ("make_synthetic_pack.py", "synthetic_tokenizer.py")}  # its tokenizer picks live rows
    synthetic = {"synthetic": args.size, "seed": 0, "dense_dtype": args.dense_dtype,
                 "kernel_shapes": kernel_shapes(model), **builders}
    return VerdictCache({"modules": modules_key(), "pack": synthetic, "options": {}})


def keep_start_up_verdicts(verdicts: VerdictCache, speculative: bool) -> None:
    """As the server: a start that serves speculation saves what it measured; one that does not
    (a check failed, perhaps on cached verdicts) removes the file, so the next start checks all."""
    if speculative:
        verdicts.save()
    else:
        verdicts.discard()


def install_runtime(model, args) -> tuple:
    """(status, verdicts): dflash2_runtime.install on the model with start_up_verdicts(args,
    model), which keep_start_up_verdicts then keeps or discards."""
    verdicts = start_up_verdicts(args, model)
    verdicts.open()
    status = dflash2_runtime.install(model, verdicts)
    keep_start_up_verdicts(verdicts, status.speculative)
    return status, verdicts


def sampled_sampler(temperature):
    """The sampled arms' position-keyed sampler at `temperature` (None: greedy, no sampler)."""
    return None if temperature is None else dflash2_sampling.PositionSampler(temperature=temperature, **SAMPLED_SETTINGS)


def start_e2e_phase(record: dict, process: dict) -> None:
    """A round-phase record, ready for this process's end-to-end phase: the round phase's
    own process figures kept under round_process (a second e2e run keeps the first's), this
    process's start-up measurements, command, tokens and repeats on top."""
    # (records from before git_commit was recorded: None)
    record.setdefault("round_process", {key: record.get(key) for key in ROUND_PROCESS_KEYS})
    record.update(process)


def add_e2e_section(record: dict, section: dict) -> None:
    """An end-to-end pass's figures (at section["tokens"] tokens a request) into the record:
    kept under e2e_by_tokens by their count, a pass at the same count replacing the earlier
    one, and the longest count's section on top, where the record's end-to-end keys have
    always been (whatever order separate --part e2e calls ran in)."""
    by_tokens = record.setdefault("e2e_by_tokens", {})
    by_tokens[str(section["tokens"])] = section
    record.update(by_tokens[max(by_tokens, key=int)], complete=True)


def acceptance_record(acceptance, accepted_runs: dict, profiles: list, fixed_blocks: list, tokens: int, arm_name) -> dict:
    """The record's acceptance_model for one end-to-end pass: per profile the stochastic
    model's per-depth curve, its expected tokens per round at every block, and the tokens per
    round it gives at every block over the passes' draws (DepthAcceptance.simulate, with
    each pass's seed: what a fixed-block arm accepts; the fixed-block arms that ran are
    checked against it); for the exact-rate pattern, what its fixed-block arms measured."""
    def measured(runs):
        return statistics.mean(full_round_tokens(lens) for lens in runs)

    by_arm = {profile: {str(block): measured([lens for _, lens in accepted_runs[arm_name(profile, block)]])
                        for block in fixed_blocks} for profile in profiles}
    if acceptance is None:
        return {"kind": "exact-rate",
                "accepted_per_round": {profile: PROFILE_TOKENS_PER_ROUND[profile] - 1 for profile in profiles},
                "measured_tokens_per_round_by_fixed_block_arm": by_arm}
    seeds = [seed for seed, _ in accepted_runs[arm_name(profiles[0], BLOCK)]]
    differing = []  # (arm, seed) whose accepted drafts are not what the draws give
    curves = {}
    for profile in profiles:
        model = acceptance[profile]
        for block in fixed_blocks:
            arm = arm_name(profile, block)
            differing += [[arm, seed] for seed, lens in accepted_runs[arm] if lens != model.simulate(block, tokens, seed)]
        curves[profile] = {
            **model.to_json(BLOCK),
            "target_tokens_per_round_at_block_8": PROFILE_TOKENS_PER_ROUND[profile],
            "measured_tokens_per_round_by_block": {
                str(block): measured([model.simulate(block, tokens, seed) for seed in seeds]) for block in range(2, BLOCK + 1)},
            "measured_tokens_per_round_by_fixed_block_arm": by_arm[profile],
        }
    return {"kind": "stochastic",
            "draws": "per continuation index and depth, seeded by the pass: the same in every arm of a pass",
            "seeds": seeds, "tokens": tokens, "profiles": curves,
            "fixed_block_arms_differing_from_draws": differing}


def full_round_tokens(accepted: list) -> float:
    """Tokens per round (accepted drafts + the bonus) over a run's full rounds: the last
    round, cut short by the token budget rather than by acceptance, is left out when there
    are others. What a profile is named by."""
    full = accepted[:-1] or accepted
    return sum(count + 1 for count in full) / max(1, len(full))


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
    add_dense_dtype_argument(parser)
    parser.add_argument("--out", default=str(REPO / "evidence"))
    parser.add_argument("--context", type=int, default=32, help="prompt tokens before timing")
    parser.add_argument("--tokens", default="64",
                        help="tokens per end-to-end run; a list (40,256): one end-to-end pass per count, "
                        "the longest's figures on top of the record, each under e2e_by_tokens")
    parser.add_argument("--acceptance", choices=["stochastic", "exact-rate"], default="stochastic",
                        help="which drafts the oracle gets right: stochastic (oracle_drafter.DepthAcceptance, "
                        "calibrated per profile at block 8) or exact-rate (a fixed count a round, any block)")
    parser.add_argument("--acceptance-depth-decay", type=float, default=DEFAULT_DEPTH_DECAY,
                        help="r of the stochastic model's curve p_k = a r^(k-1)")
    parser.add_argument("--acceptance-seed", type=int, default=0,
                        help="the stochastic model's draws in the warm-up pass; pass n draws at this + n")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lead-in-tokens", type=int, default=8,
                        help="an untimed run this long of the same arm before each timed end-to-end run (0: none)")
    parser.add_argument("--fixed-blocks", default="2,3,4,5,6,7,8",
                        help="fixed blocks measured end to end beside the round policy (must include 8)")
    parser.add_argument("--drafter-forms", default="bf16,4bit", help="random drafters to build: bf16, 4bit or both")
    parser.add_argument("--profiles", default=",".join(PROFILE_TOKENS_PER_ROUND),
                        help="acceptance profiles measured end to end (fewer arms between samples)")
    parser.add_argument("--all-decode-arms", action=argparse.BooleanOptionalAction, default=True,
                        help="end to end, plain under every decode arm (--no-all-decode-arms: stock "
                        "and the arm install chose only)")
    parser.add_argument("--first-request-arms", action=argparse.BooleanOptionalAction, default=True,
                        help="end to end, per profile, the policy as a server's first request too "
                        "(--no-first-request-arms: fewer arms between samples)")
    parser.add_argument("--peer-arms", default="", metavar="PROFILES",
                        help="end to end, for these profiles also mlx-vlm's own speculative decoding (its round "
                        "loop and stock verify, the runtime off: what its --draft-model gives) at block 8, the "
                        "same oracle draws ('': none)")
    parser.add_argument("--compare-prior-depth-decay", type=float, nargs="*", default=[],
                        help="end to end, per profile, the round policy also under these values of "
                        "dflash2_policy.PRIOR_DEPTH_DECAY (a candidate measured beside the default)")
    parser.add_argument("--sampled-temperatures", default="0.6,1.0",
                        help="end to end, per temperature, plain seeded sampling and the round policy per "
                        "profile for sampled requests ('': none)")
    parser.add_argument("--deadline-s", type=float,
                        help="seconds from the start: stop after an end-to-end timed pass, without a "
                        "record, if the passes left would end later (a GPU call's limit)")
    parser.add_argument("--part", choices=["all", "rounds", "e2e"], default="all",
                        help="rounds: stop after the round phase; e2e: only the end-to-end phase, "
                        "added to the record a rounds run wrote in --out")
    parser.add_argument("--verdict-cache", action="store_true",
                        help="keep the start-up checks' verdicts in the user cache, keyed as a server keys "
                        "them (the runtime's modules, the model, this machine): a later process here (the "
                        "e2e part after the rounds part) takes them as a server's second start does")
    args = parser.parse_args()
    fixed_blocks = sorted({int(block) for block in args.fixed_blocks.split(",")})
    if BLOCK not in fixed_blocks or not all(2 <= block <= BLOCK for block in fixed_blocks):
        parser.error(f"--fixed-blocks: blocks 2..{BLOCK}, including {BLOCK} (the profiles are named at it)")
    profiles = args.profiles.split(",")
    token_counts = sorted({int(count) for count in args.tokens.split(",")})
    temperatures = [float(t) for t in args.sampled_temperatures.split(",") if t]
    peer_profiles = [profile for profile in args.peer_arms.split(",") if profile]
    if not profiles or not set(profiles) <= set(PROFILE_TOKENS_PER_ROUND):
        parser.error(f"--profiles: some of {', '.join(PROFILE_TOKENS_PER_ROUND)}")
    if not set(peer_profiles) <= set(profiles):
        parser.error(f"--peer-arms: some of --profiles ({', '.join(profiles)})")
    started = time.time()
    deadline = time.monotonic() + args.deadline_s if args.deadline_s else None
    log = lambda message: print(f"[{time.time() - started:6.1f}s] {message}", flush=True)  # noqa: E731
    size = Path(args.pack).name if args.pack else args.size
    environment = run_environment("bench.py", Path(args.pack).name if args.pack else f"synthetic {args.size}, seed 0")
    name = f"bench-{environment['backend']}-{'pack' if args.pack else args.size}"
    name += "" if args.pack else layout_suffix(args.dense_dtype)
    if args.part == "e2e":
        rounds_record = Path(args.out) / f"{name}.json"
        if not rounds_record.is_file():
            parser.error(f"--part e2e adds to the record a --part rounds run wrote; {rounds_record} is missing")
        record = json.loads(rounds_record.read_text())
        missing = set(ROUND_RECORD_KEYS) - record.keys()
        if missing or record["size"] != size:
            parser.error(f"--part e2e: {rounds_record} is not a round-phase record of {size} "
                         f"({'lacks ' + ', '.join(sorted(missing)) if missing else 'size ' + record['size']})")

    if args.pack:
        # A built pack: its own target and drafter (whatever form it ships).
        model, _, pack_drafter = load_pack(*find_pack(args.pack))
        drafters = configured({"pack": pack_drafter})
    else:
        model = build_target_model(args.size, seed=0, dense_dtype=args.dense_dtype)
        drafters = random_drafters(args.size, args.drafter_forms.split(","))
    lm = model.language_model
    log("target and drafters ready")
    # The end-to-end profiles pay the form a pack should ship: 4-bit when there is one.
    cost_drafter = drafters.get("4bit", next(iter(drafters.values())))
    drafter_names = {id(drafter): form for form, drafter in drafters.items()}
    taps = list(cost_drafter.config.target_layer_ids)
    prompt = synthetic_prompt(args.context)

    status, verdicts = install_runtime(model, args)
    chosen_arm = status.decode_path.arm
    log(f"runtime installed: speculative {status.speculative} {status.reason or ''}; " + "; ".join(status.log_lines()))
    # Every end-to-end arm prefills as the servers do (at mlx-vlm's default prefill step).
    prefill_inverse = dflash2_engine.use_exact_prefill_inverse(lm.args.linear_num_value_heads)
    log(prefill_inverse)
    # Each form in the dtype the server would choose for it (dflash2_drafter.choose_drafter_dtype).
    dtypes = {form: dflash2_drafter.choose_drafter_dtype(model, drafter) for form, drafter in drafters.items()}
    log("drafter dtypes: " + "; ".join(f"{form}: {choice.summary()}" for form, choice in dtypes.items()))
    dflash2_drafter.use_drafter_bf16(dtypes[drafter_names[id(cost_drafter)]].bf16)
    costs = dflash2_timing.measure_round_costs(model, cost_drafter)
    log(f"round policy costs: {costs.summary()}")
    process = {  # what this process installed and measured at start-up, as a server would
        "runtime_status": {"speculative": status.speculative, "reason": status.reason, **status.to_json()},
        "start_up_verdicts": verdicts.to_json(),
        "plain_decode_path": {"arm": chosen_arm, "why": status.decode_path.why,
                              "step_ms_by_arm": status.decode_path.step_ms},
        "round_costs": costs.to_json(),
        "drafter_dtype_by_form": {form: choice.summary() for form, choice in dtypes.items()},
        "prefill_inverse": prefill_inverse,
    }
    if args.part == "e2e":
        start_e2e_phase(record, {**process, "command": environment["command"], "code": environment["code"],
                                 "tokens": token_counts[-1],
                                 "repeats": args.repeats})
    else:
        cache, hidden = prefill(lm, prompt, taps)
        with mx.stream(dflash2_timing.batch_stream):  # as the server's batch generator runs requests
            arms = round_arms(lm, cache, taps, drafters, hidden,
                              (cost_drafter, dtypes[drafter_names[id(cost_drafter)]].bf16))
            rounds = dflash2_timing.interleaved_ms(arms, args.repeats)
        decode_ms = rounds["decode"]["median"]
        verify = {L: dflash2_timing.paired_ratio(rounds[f"verify {L}"], rounds["decode"]) for L in range(2, BLOCK + 1)}
        by_eval_every = {
            L: {**{layers: dflash2_timing.paired_ratio(rounds[f"verify {L}, eval every {layers}"], rounds["decode"])
                   for layers in EVAL_EVERY_ARMS},
                dflash2_verify.VERIFY_EVAL_EVERY: verify[L]}
            for L in EARLY_EVAL_BLOCKS
        }
        served = {form: "bf16" if choice.bf16 else "promoted" for form, choice in dtypes.items()}
        drafter_cost = {form: dflash2_timing.paired_ratio(rounds[f"draft {form}, {served[form]}"], rounds["decode"])
                        for form in drafters}
        cost_form = drafter_names[id(cost_drafter)]
        served_round = {  # the server's round at block 8 and its parts, in decode steps
            "served round": dflash2_timing.paired_ratio(rounds[f"served round {BLOCK}"], rounds["decode"]),
            "verify on the generation stream": dflash2_timing.paired_ratio(
                rounds[f"verify {BLOCK}, generation stream"], rounds["decode"]),
            "verify on the batch stream": verify[BLOCK],
            "verify on the batch stream, commit left lazy": dflash2_timing.paired_ratio(
                rounds[f"verify {BLOCK}, commit left lazy"], rounds["decode"]),
            f"draft {cost_form}": drafter_cost[cost_form],
        }
        pipelined_ms = rounds["decode, pipelined"]["median"]
        # What a user's plain decoding runs at, and the served round in those steps.
        in_pipelined_steps = {
            "served round": dflash2_timing.paired_ratio(rounds[f"served round {BLOCK}"], rounds["decode, pipelined"]),
            f"verify {BLOCK}": dflash2_timing.paired_ratio(rounds[f"verify {BLOCK}"], rounds["decode, pipelined"]),
        }
        log(f"decode step {decode_ms:.2f} ms (pipelined {pipelined_ms:.2f}); verify / decode {verify}; "
            f"drafter {drafter_cost}; served round {served_round}; in pipelined steps {in_pipelined_steps}")
        counts = primitive_counts()
        record = {
            "size": size,
            "dense_dtype": None if args.pack else args.dense_dtype,
            **environment,
            "complete": False,  # the end-to-end part follows; a run cut short keeps this much
            **process,
            "context_tokens": args.context,
            "tokens": token_counts[-1],
            "repeats": args.repeats,
            "decode_step_ms": decode_ms,
            "decode_step_ms_pipelined": pipelined_ms,
            "in_pipelined_decode_steps": in_pipelined_steps,
            "round_ms": rounds,
            "verify_ratio_by_block": verify,
            "served_round_by_part": served_round,
            # verify round / decode step (paired) by the layers its forward is handed to the
            # device after (0: evaluated once at its end), the served value included
            "verify_eval_every": dflash2_verify.VERIFY_EVAL_EVERY,
            "verify_ratio_by_eval_every": by_eval_every,
            "drafter_ratio_by_form": drafter_cost,
            # Counted on CPU for the same layer pattern (tools/graph_count.py): launches per step.
            "decode_primitives": counts["decode"],
            "verify_primitives_by_block": counts["verify"],
            "seconds": round(time.time() - started, 1),
        }
        write_record(args.out, name, record, summary_markdown(record))
        if args.part == "rounds":
            return

    # End to end: plain under each decode arm ("mlx" is stock), and per profile the round
    # policy and each fixed block, interleaved in one loop (each sample after a lead-in run
    # of its own arm) so every arm sees the same machine; one such loop per --tokens count.
    vocab = lm.lm_head.weight.shape[0]
    prompt_ids = mx.array([prompt[:8]])
    dflash2_decode_arms.use_decode_arm("mlx")
    # As a server starts: how a verify block's rows are drawn (self-test at this vocabulary).
    block_sampling = dflash2_sampling.choose_block_sampling(vocab) if temperatures else None
    if block_sampling:
        log(block_sampling.summary())
    # Which drafts the oracle gets right: per profile, the stochastic model's curve (the draws
    # at seed --acceptance-seed + the pass, the warm-up pass 0: the same in every arm of a
    # pass), or the exact-rate pattern (a fixed count a round, whatever the block).
    acceptance = ({profile: DepthAcceptance.calibrated(PROFILE_TOKENS_PER_ROUND[profile], BLOCK,
                                                       args.acceptance_depth_decay) for profile in profiles}
                  if args.acceptance == "stochastic" else None)

    def e2e_pass(count):
        """The end-to-end arms at `count` tokens a request: this count's section of the record."""
        # Each arm's tokens must be its reference's: plain greedy's, or plain seeded sampling's at
        # its temperature (what the oracle proposes for sampled requests).
        references = {temperature: greedy(model, prompt_ids, count, sampler=sampled_sampler(temperature))
                      for temperature in [None, *temperatures]}
        # arm_states: arm -> the DrafterState its last full run was served by (its oracle drafter, round counts)
        identical_by_arm, arm_states, tables_before, seeds_before = {}, {}, {}, {}
        token_gaps = {}  # arm -> each full run's gaps between tokens handed on (the first: from the start)

        def timed_greedy(key, tokens, **kwargs):
            arrivals = [time.perf_counter()]
            output = greedy(model, prompt_ids, tokens, arrivals=arrivals, **kwargs)
            if tokens == count:
                token_gaps.setdefault(key, []).append([1000 * (b - a) for a, b in zip(arrivals, arrivals[1:])])
            return output

        def plain_arm(arm, temperature=None):
            key = plain_name(arm, temperature)

            def run(tokens):
                dflash2_decode_arms.use_decode_arm(arm)
                output = timed_greedy(key, tokens, sampler=sampled_sampler(temperature))
                if tokens == count:
                    identical_by_arm[key] = output == references[temperature]

            return run

        def plain_name(arm, temperature=None):
            return f"plain {arm}" + (f", sampled {temperature:g}" if temperature is not None else "")

        memories = {}  # policy arm -> its AcceptanceMemory, kept across the arm's runs
        accepted_runs = {}  # arm -> each full run's (acceptance seed, accepted drafts per round)
        routes = {}  # policy arm -> its SpeculativeRoute: each run routed as the server would
        routed_plain = {}  # policy arm -> its full runs the route sent plain

        def pass_oracle(key, profile, block, drafter, temperature=None):
            """The oracle for a run of arm `key`, proposing the reference at `temperature` with the
            draws of the pass the run belongs to (each arm runs once a pass, the warm-up pass 0; a
            lead-in run takes the pass of the full run after it): its seed."""
            return OracleDrafter(
                references[temperature], prompt_length=prompt_ids.shape[1], vocab_size=vocab,
                accepted_per_round=None if acceptance else PROFILE_TOKENS_PER_ROUND[profile] - 1,
                acceptance=acceptance[profile] if acceptance else None,
                seed=args.acceptance_seed + len(accepted_runs.get(key, [])),
                block_size=block, target_layer_ids=taps, cost_drafter=drafter,
            )

        def speculative_arm(profile, block=None, drafter=cost_drafter, first_request=False, prior_depth_decay=None,
                            temperature=None):
            """block None: the round policy (ceiling BLOCK), as the server runs it: each run
            starts from the acceptance the arm's earlier runs left (the server's drafter keeps
            an AcceptanceMemory across requests), or, with first_request, from none (a
            server's first request, or a drafter the server did not measure); with
            prior_depth_decay, under that value of the policy's constant instead; with
            temperature, a sampled request (routed and remembered as the server does those)."""
            key = arm_name(profile, block, drafter, first_request, prior_depth_decay, temperature)
            sampler = sampled_sampler(temperature)
            kind = dflash2_policy.GREEDY if temperature is None else dflash2_policy.SAMPLED
            if block is None and not first_request:
                memories[key] = dflash2_policy.AcceptanceMemory(dflash2_kernels.MAX_ROWS)
                routes[key] = dflash2_rounds.SpeculativeRoute()

            def run(tokens):
                dflash2_decode_arms.use_decode_arm(chosen_arm)
                dflash2_drafter.use_drafter_bf16(dtypes[drafter_names[id(drafter)]].bf16)
                oracle = pass_oracle(key, profile, block or BLOCK, drafter, temperature)
                table = costs.to_json()  # the learning table this run's policy starts from
                # The acceptance its first choice reads (what the arm's earlier runs left), and how many
                # requests the memory saw.
                seed = ({"rates": memories[key].estimate.seeded(dflash2_policy.MEMORY_WEIGHT).conditional(),
                         "requests_before": memories[key].requests} if key in memories else None)
                default_decay = dflash2_policy.PRIOR_DEPTH_DECAY
                dflash2_policy.PRIOR_DEPTH_DECAY = prior_depth_decay or default_decay
                try:
                    with served_rounds(oracle, costs, fixed_block=block is not None,
                                       acceptance_memory=memories.get(key)) as state:
                        if key in routes and not routes[key](state, kind):  # the server would route it plain
                            output = timed_greedy(key, tokens, sampler=sampler)
                            state.round_counts = dflash2_policy.RoundCounts(tokens_from_plain_steps=len(output) - 1)
                            routed_plain[key] = routed_plain.get(key, 0) + (tokens == count)
                        else:
                            output = timed_greedy(key, tokens, drafter=oracle, block_size=block or BLOCK,
                                                  sampler=sampler)
                finally:
                    dflash2_policy.PRIOR_DEPTH_DECAY = default_decay
                if tokens == count:
                    accepted_runs.setdefault(key, []).append((oracle.seed, list(oracle.accept_lens)))
                    tables_before[key], arm_states[key] = table, state
                    identical_by_arm[key] = output == references[temperature]
                    seeds_before[key] = seed

            return run

        peer_differing = {}  # peer arm -> tokens of its last full run that differ from plain's

        def peer_arm(profile):
            """mlx-vlm 0.7.2's own speculative decoding (parity.stock_mlx_vlm: its round loop,
            stock verify and drafter calls, plain decode's stock step) at block BLOCK, the
            oracle's draws as the policy arm's. Its verify rounds batched rows as they come,
            so its tokens may leave plain's: counted, not required equal."""
            key = peer_name(profile)

            def run(tokens):
                oracle = pass_oracle(key, profile, BLOCK, cost_drafter)
                with stock_mlx_vlm():
                    output = timed_greedy(key, tokens, drafter=oracle, block_size=BLOCK)
                if tokens == count:
                    accepted_runs.setdefault(key, []).append((oracle.seed, list(oracle.accept_lens)))
                    peer_differing[key] = sum(a != b for a, b in zip(output, references[None]))

            return run

        def peer_name(profile):
            return f"{profile}, mlx-vlm's own speculative decoding, block {BLOCK}"

        def arm_name(profile, block, drafter=cost_drafter, first_request=False, prior_depth_decay=None, temperature=None):
            name = f"{profile}, {'policy' if block is None else f'block {block}'}"
            name += ", first request" if first_request else ""
            name += f", prior depth decay {prior_depth_decay:g}" if prior_depth_decay else ""
            name += f", sampled {temperature:g}" if temperature is not None else ""
            return name if drafter is cost_drafter else f"{name}, {drafter_names[id(drafter)]} drafter"

        def after_lead_in(run):
            """A sample: a short untimed run of the same arm, then the timed one. A server runs
            one configuration request after request; without the lead-in each sample would
            follow another arm's (decode path, block or drafter), which leaves MLX's CUDA graph
            cache and buffer cache in states no server sees. (On the H200 zero acceptance once
            lost about a fifth to plain here, with and without the lead-in; later, routed plain,
            it ran 15-21% faster than the plain arm, which then always came right after stock
            mlx's: dflash2_timing.pass_order now changes what comes before each arm.)"""
            def sample():
                if args.lead_in_tokens:
                    run(args.lead_in_tokens)
                return dflash2_timing.timed_ms(lambda: run(count))()

            return sample

        drafted_profiles = [profile for profile in profiles if profile != "zero"]  # where drafter forms differ
        decode_arms = [arm for arm in dflash2_decode_arms.DECODE_ARMS if args.all_decode_arms or arm in ("mlx", chosen_arm)]
        arms = {f"plain {arm}": after_lead_in(plain_arm(arm)) for arm in decode_arms}
        for profile in profiles:
            arms[arm_name(profile, None)] = after_lead_in(speculative_arm(profile))
            if args.first_request_arms:
                arms[arm_name(profile, None, first_request=True)] = after_lead_in(speculative_arm(profile, first_request=True))
            for block in fixed_blocks:
                arms[arm_name(profile, block)] = after_lead_in(speculative_arm(profile, block))
            for decay in args.compare_prior_depth_decay:
                arms[arm_name(profile, None, prior_depth_decay=decay)] = after_lead_in(
                    speculative_arm(profile, prior_depth_decay=decay))
            if profile in peer_profiles:
                arms[peer_name(profile)] = after_lead_in(peer_arm(profile))
        # Sampled requests: plain seeded sampling on the chosen path, and the round policy per profile.
        for temperature in temperatures:
            arms[plain_name(chosen_arm, temperature)] = after_lead_in(plain_arm(chosen_arm, temperature))
            for profile in profiles:
                arms[arm_name(profile, None, temperature=temperature)] = after_lead_in(
                    speculative_arm(profile, temperature=temperature))
        # The other drafter forms' cost at the same acceptance, block 8 (proposals may differ
        # with real weights; the tokens may not).
        for form, drafter in drafters.items():
            if drafter is not cost_drafter:
                for profile in drafted_profiles:
                    arms[arm_name(profile, BLOCK, drafter)] = after_lead_in(speculative_arm(profile, BLOCK, drafter))
        try:
            e2e_ms = dflash2_timing.interleaved_ms(arms, args.repeats, deadline)
        except TimeoutError as error:
            sys.exit(f"error: --deadline-s {args.deadline_s:g}: {error}")
        dflash2_decode_arms.use_decode_arm(chosen_arm)
        plain = e2e_ms[f"plain {chosen_arm}"]
        speedup = {name: dflash2_timing.paired_ratio(plain, stats) for name, stats in e2e_ms.items()}
        e2e = {profile: speedup[arm_name(profile, None)] for profile in profiles}
        e2e_first = {profile: speedup[arm_name(profile, None, first_request=True)]
                     for profile in profiles if args.first_request_arms}
        e2e_fixed = {
            profile: {str(block): speedup[arm_name(profile, block)] for block in fixed_blocks}
            for profile in profiles
        }
        best_fixed = {profile: max(e2e_fixed[profile].values()) for profile in profiles}
        policy_vs_best_fixed = {profile: e2e[profile] / best_fixed[profile] for profile in profiles}
        # The policy / best fixed block under each candidate value of PRIOR_DEPTH_DECAY (memory arms).
        candidate_decay_vs_best_fixed = {
            f"{decay:g}": {profile: speedup[arm_name(profile, None, prior_depth_decay=decay)] / best_fixed[profile]
                           for profile in profiles}
            for decay in args.compare_prior_depth_decay
        }
        first_vs_best_fixed = {profile: first / best_fixed[profile] for profile, first in e2e_first.items()}
        policy_arms = {f"{profile}{suffix}": arm_name(profile, None, first_request=bool(suffix))
                       for profile in profiles for suffix in ("", ", first request")[: 1 + args.first_request_arms]}
        round_counts = {name: vars(arm_states[arm].round_counts) for name, arm in policy_arms.items()}
        # Each round's drafts (block - 1) in the policy's last run per profile: what it chose.
        policy_drafts = {name: arm_states[arm].drafter.draft_lens for name, arm in policy_arms.items()}
        # Profiles are named by tokens per round at block 8: the mean over the arm's full runs
        # (the passes' draws differ under the stochastic model).
        block_runs = {profile: [lens for _, lens in accepted_runs[arm_name(profile, BLOCK)]] for profile in profiles}
        tokens_per_round = {profile: statistics.mean(map(full_round_tokens, runs)) for profile, runs in block_runs.items()}
        tokens_per_round_whole_run = {
            profile: statistics.mean((count - 1) / max(1, len(lens)) for lens in runs) for profile, runs in block_runs.items()
        }
        acceptance_model = acceptance_record(acceptance, accepted_runs, profiles, fixed_blocks, count, arm_name)
        e2e_by_form = {
            form: {profile: speedup[arm_name(profile, BLOCK, drafter)] for profile in drafted_profiles}
            for form, drafter in drafters.items() if drafter is not cost_drafter
        }
        identical = all(identical_by_arm.values())
        peers = {profile: peer_name(profile) for profile in peer_profiles}
        e2e_peer = {profile: speedup[arm] for profile, arm in peers.items()}
        pack_over_peer = {profile: dflash2_timing.paired_ratio(e2e_ms[arm], e2e_ms[arm_name(profile, None)])
                          for profile, arm in peers.items()}
        sampled_arms = {f"{t:g}": {profile: arm_name(profile, None, temperature=t) for profile in profiles}
                        for t in temperatures}
        e2e_sampled = {t: {profile: dflash2_timing.paired_ratio(e2e_ms[plain_name(chosen_arm, float(t))], e2e_ms[arm])
                           for profile, arm in by_profile.items()}
                       for t, by_profile in sampled_arms.items()}
        # Where the time goes: per token position, the median gap over the timed runs (the
        # warm-up pass left out), for plain on the chosen path and each profile's policy.
        gap_arms = [f"plain {chosen_arm}", *policy_arms.values()]
        token_gap_medians = {arm: [round(statistics.median(gaps), 2) for gaps in zip(*token_gaps[arm][1:])]
                             for arm in gap_arms}
        log(f"e2e (policy) {e2e}; policy / best fixed block {policy_vs_best_fixed}; "
            f"tokens per round at block {BLOCK} {tokens_per_round}; identical {identical}")
        generated = len(references[None])

        return {
            "tokens": count,
            # Tokens each end-to-end request generated (the first from its prefill), which every
            # figure of this section is at.
            "tokens_generated": generated,
            "acceptance_model": acceptance_model,
            "e2e_ms": e2e_ms,
            # Each arm's median run as tokens per second (the request's whole time, prefill included).
            "e2e_tok_s": {arm: generated / (stats["median"] / 1000) for arm, stats in e2e_ms.items()},
            "e2e_lead_in_tokens": args.lead_in_tokens,  # each timed sample after an untimed run this long
            "installed_plain_ratio": dflash2_timing.paired_ratio(e2e_ms["plain mlx"], plain),
            "plain_ratio_by_arm": {arm: dflash2_timing.paired_ratio(e2e_ms["plain mlx"], e2e_ms[f"plain {arm}"])
                                   for arm in decode_arms},
            # The round policy, as the server runs it (acceptance memory across requests, each run
            # routed plain where the server would route its request plain); as
            # it runs a server's first request (none); then each fixed block.
            "e2e_speedup": e2e,
            "e2e_speedup_first_request": e2e_first,
            "e2e_speedup_fixed_block": e2e_fixed,
            "policy_vs_best_fixed_block": policy_vs_best_fixed,
            "first_request_vs_best_fixed_block": first_vs_best_fixed,
            "prior_depth_decay": dflash2_policy.PRIOR_DEPTH_DECAY,
            "policy_vs_best_fixed_block_by_candidate_prior_depth_decay": candidate_decay_vs_best_fixed,
            "policy_round_counts": round_counts,
            "policy_drafts_per_round": policy_drafts,
            "policy_round_costs_at_start": {profile: tables_before[arm_name(profile, None)] for profile in profiles},
            "policy_acceptance_seed_at_start": {profile: seeds_before[arm_name(profile, None)] for profile in profiles},
            # Of the policy's full runs (warm-up included), how many its route sent plain.
            "policy_runs_routed_plain": {profile: routed_plain.get(arm_name(profile, None), 0) for profile in profiles},
            # The measured table after the end-to-end arms taught it (as a server's learns).
            "round_costs_learned": costs.to_json(),
            "cost_drafter_form": drafter_names[id(cost_drafter)],
            "e2e_speedup_by_other_drafter_form": e2e_by_form,
            # mlx-vlm 0.7.2's own speculative decoding at block BLOCK (what its --draft-model gives),
            # over plain as above; the round policy over it; its tokens that differ from plain's.
            "e2e_speedup_peer": e2e_peer,
            "pack_over_peer": pack_over_peer,
            "peer_tokens_differing": {profile: peer_differing[arm] for profile, arm in peers.items()},
            # Sampled requests (seeded, SAMPLED_SETTINGS), by temperature and profile: the round policy
            # over plain seeded sampling, the oracle proposing plain seeded sampling's tokens.
            "e2e_speedup_sampled": e2e_sampled,
            "e2e_sampled_settings": SAMPLED_SETTINGS if temperatures else None,
            "sampled_block_sampling": block_sampling.summary() if block_sampling else None,
            "policy_round_counts_sampled": {t: {profile: vars(arm_states[arm].round_counts) for profile, arm in by_profile.items()}
                                            for t, by_profile in sampled_arms.items()},
            "policy_runs_routed_plain_sampled": {t: {profile: routed_plain.get(arm, 0) for profile, arm in by_profile.items()}
                                                 for t, by_profile in sampled_arms.items()},
            "profile_target_tokens_per_round": PROFILE_TOKENS_PER_ROUND,
            "tokens_per_round": tokens_per_round,
            "tokens_per_round_whole_run": tokens_per_round_whole_run,
            "tokens_identical": identical,
            "e2e_token_gaps_ms": token_gap_medians,
            "seconds": round(time.time() - started, 1),
        }
    for count in token_counts:
        section = {**process, "command": environment["command"], "code": environment["code"],
                   "git_commit": environment["git_commit"], "git_clean": environment["git_clean"],
                   "repeats": args.repeats, **e2e_pass(count)}
        add_e2e_section(record, section)
        write_record(args.out, name, record, summary_markdown(record))
    print(summary_markdown(record))


if __name__ == "__main__":
    main()
