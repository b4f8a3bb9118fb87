"""tools/bench.py's record as Markdown: the round phase, the end-to-end arms by profile and
block, acceptance, tokens per request, the peer and sampled requests."""

import statistics

import dflash2_timing
from dflash2_runtime import VerifyPathChoice
from bench_arms import BLOCK


def acceptance_lines(model) -> list:
    """The acceptance model the end-to-end arms ran under, per profile."""
    if model is None:
        return []
    if model["kind"] == "exact-rate":
        return ["", "Acceptance: exact rate, a fixed count of drafts right a round whatever the block ("
                + ", ".join(f"{p} {n:g}" for p, n in model["accepted_per_round"].items()) + "); fixed-block arms measured "
                + "; ".join(f"{p}: " + ", ".join(f"block {b} {t:.2f}" for b, t in by_block.items())
                            for p, by_block in model["measured_tokens_per_round_by_fixed_block_arm"].items()) + "."]
    profiles = model["profiles"]
    first = next(iter(profiles.values()))
    blocks = list(first["expected_tokens_per_round_by_block"])
    differing = model["fixed_block_arms_differing_from_draws"]
    lines = ["", f"Acceptance: stochastic (tools/oracle_drafter.py DepthAcceptance), the draft at depth k of a block "
             f"right with p_k = a r^(k-1), r = {first['r']:g}, a solved per profile for its tokens per round at "
             f"block 8; draws {model['draws']} (seeds {', '.join(map(str, model['seeds']))}). Tokens per round "
             f"by block at {model['tokens']} tokens, expected / measured over the passes' draws; fixed-block arms "
             + ("all accepting what the draws give:" if not differing
                else f"accepting other than the draws: {', '.join(f'{arm} (seed {seed})' for arm, seed in differing)}:"),
             "", "| profile | a | p_1..p_" + str(len(first["p_by_depth"])) + " | "
             + " | ".join(f"block {b}" for b in blocks) + " |", "|---|---|---|" + "---|" * len(blocks)]
    for profile, curve in profiles.items():
        measured = curve["measured_tokens_per_round_by_block"]
        lines.append(f"| {profile} | {curve['a']:.3f} | " + " ".join(f"{p:.2f}" for p in curve["p_by_depth"]) + " | "
                     + " | ".join(f"{e:.2f} / {measured[b]:.2f}" for b, e in curve["expected_tokens_per_round_by_block"].items())
                     + " |")
    return lines


def tokens_lines(r) -> list:
    """Each end-to-end pass by its tokens a request: plain's and each profile's policy's
    tokens per second, the policy over plain (the record's top-level figures are the longest's)."""
    by_tokens = r.get("e2e_by_tokens")
    if not by_tokens:
        return []
    profiles = list(r["e2e_speedup"])
    lines = ["", "End to end by tokens a request (tok/s: tokens generated over the request's whole time, prefill "
             "included; policy over plain in brackets; the tables above are at "
             f"{r['tokens_generated']} tokens):", "",
             "| tokens | stock plain tok/s | plain tok/s | " + " | ".join(f"{p} policy" for p in profiles)
             + " | tokens identical in every arm |", "|---|---|---|" + "---|" * (len(profiles) + 1)]
    for count, section in sorted(by_tokens.items(), key=lambda kv: int(kv[0])):
        tok_s, arm = section["e2e_tok_s"], section["plain_decode_path"]["arm"]
        lines.append(f"| {section['tokens_generated']} | {tok_s['plain mlx']:.1f} | {tok_s[f'plain {arm}']:.1f} | "
                     + " | ".join(f"{tok_s[f'{p}, policy']:.1f} ({section['e2e_speedup'][p]:.2f}x)"
                                  if p in section["e2e_speedup"] else "-" for p in profiles)
                     + f" | {section['tokens_identical']} |")
    return lines


def ratio_method(r) -> str:
    """How the record's ratios were taken: paired by pass where its samples were kept."""
    paired_rounds = "samples" in r["round_ms"]["decode"]
    paired_e2e = "samples" in next(iter(r.get("e2e_ms", {}).values()), {})
    if not (paired_rounds or paired_e2e):
        return "."
    return ("; a ratio of two arms is the median over passes of their ratio within a pass"
            + ("." if paired_rounds or "e2e_ms" not in r else
               " (the round phase's, from a record without samples: a ratio of medians)."))


def cached_checks_text(record: dict) -> str:
    """' Start-up checks from the verdict cache (...)' where a process took any (--verdict-cache)."""
    cached = (record.get("start_up_verdicts") or {}).get("from_cache")
    return f" Start-up checks from the verdict cache (measured {sorted(set(cached.values()))[0]}): " \
        f"{', '.join(cached)}." if cached else ""


def verify_path_text(process) -> str:
    """' At install, verify path: ...' from a process's runtime status; '' for records from
    before the choice."""
    path = (process.get("runtime_status") or {}).get("verify_path")
    return f" At install, {VerifyPathChoice.from_json(path).summary()}." if path else ""


def summary_markdown(r) -> str:
    def spread(stats):
        return f"{stats['median']:.2f} ({stats['min']:.2f}-{stats['max']:.2f})"

    # A split run: the round phase's own process (tools/bench.py --part rounds, then --part e2e).
    rounds = r.get("round_process", r)
    lines = [
        f"# Speed at the {r['size']} shape on {r['backend']} ({r['device']})",
        "",
        f"mlx {r['versions']['mlx']}, mlx-vlm {r['versions']['mlx_vlm']}. In each process, warm-up first, "
        "arms interleaved, median (min-max) of the repeats" + ratio_method(r),
        "",
        f"Round phase: `{rounds['command']}`, {rounds['repeats']} repeats, code {rounds.get('code', 'not recorded')}. "
        "Plain decode path chosen at install: "
        f"`{rounds['plain_decode_path']['arm']}` ({rounds['plain_decode_path']['why']}); "
        f"decode step {r['decode_step_ms']:.2f} ms." + verify_path_text(rounds),
        "",
    ]
    if rounds is not r:
        lines += [
            f"End-to-end phase, in a second process: `{r['command']}`, {r['repeats']} repeats, "
            f"code {r.get('code', 'not recorded')}. Plain decode "
            f"path chosen at install: `{r['plain_decode_path']['arm']}` ({r['plain_decode_path']['why']})."
            + verify_path_text(r) + cached_checks_text(r),
            "",
        ]
    def ratio(stats, reference):  # records before samples were kept: a ratio of medians
        if "samples" in stats:
            return dflash2_timing.paired_ratio(stats, reference)
        return stats["median"] / reference["median"]

    lines += ["| arm | ms per round | ratio to a decode step |", "|---|---|---|"]
    for arm, stats in r["round_ms"].items():
        lines.append(f"| {arm} | {spread(stats)} | {ratio(stats, r['round_ms']['decode']):.2f} |")
    def cost_table(costs):
        refill = f"; the first plain step after a round +{costs['refill_steps']:.2f}" if "refill_steps" in costs else ""
        return (f"(decode step {costs['decode_step_ms']:.2f} ms), in decode steps, block: verify+draft: "
                + ", ".join(f"{b}: {v:.2f}+{costs['draft_steps_by_block'][b]:.2f}"
                            for b, v in costs["verify_steps_by_block"].items()) + refill + ".")

    by_eval_every = r.get("verify_ratio_by_eval_every")  # absent from records before the hand-offs
    if by_eval_every:
        lines += ["", f"Verify round / decode step by the layers its forward is handed to the device "
                  f"after (0: evaluated once at its end; served: {r['verify_eval_every']}): "
                  + "; ".join(f"block {L}: " + ", ".join(f"{layers}: {ratio:.2f}"
                                                          for layers, ratio in sorted(ratios.items(), key=lambda kv: int(kv[0])))
                              for L, ratios in by_eval_every.items()) + "."]
    if "decode_step_ms_pipelined" in r:  # absent from records before it was timed
        lines += ["", f"Plain decode as generation runs it (each step queued before the token before it is "
                  f"read): {r['decode_step_ms_pipelined']:.2f} ms a step, what a user's plain decoding "
                  "runs at; in those steps: "
                  + "; ".join(f"{arm} {ratio:.2f}" for arm, ratio in r["in_pipelined_decode_steps"].items()) + "."]
    served_round = r.get("served_round_by_part")  # absent from records before it was timed
    if served_round:
        lines += ["", f"The server's round at block {BLOCK} (dflash2_rounds.RequestDecoder.round: draft, verify, "
                  "walk, commit, on mlx-vlm's generation stream) and its parts timed alone, in decode steps: "
                  + "; ".join(f"{part} {ratio:.2f}" for part, ratio in served_round.items())
                  + ". The cost table's verify is a round less the drafter's pass."]
    lines += ["", "Drafter dtype as the server chooses it at start-up: "
              + "; ".join(f"{form}: {summary}" for form, summary in r.get("drafter_dtype_by_form", {}).items())]
    lines += [
        "",
        "Round policy's cost table, measured as the server does at warm-up " + cost_table(r["round_costs"])
        + (" (the end-to-end phase's process)" if rounds is not r else ""),
        "",
        f"Primitives (tools/graph_count.py, counted on CPU for the same 64-layer pattern): decode step "
        f"{r['decode_primitives']}; exact verify by block "
        + ", ".join(f"{L}: {n}" for L, n in r["verify_primitives_by_block"].items()) + ".",
        "",
    ]
    if not r["complete"]:
        return "\n".join(lines + ["The end-to-end part did not finish in this run.", ""])
    whole_run = r.get("tokens_per_round_whole_run")  # absent from records before full-round naming
    first = r.get("e2e_speedup_first_request")  # absent from records before acceptance memory
    if "prefill_inverse" in r:  # records before it: mlx-vlm's inverse in every arm's prefill
        lines += [f"Every end-to-end arm's prefill, as the servers': {r['prefill_inverse']}.", ""]
    lines += [
        f"Installed plain / stock plain end to end: {r['installed_plain_ratio']:.2f}x; under each "
        f"decode arm, stock / arm: "
        + ", ".join(f"{arm} {ratio:.2f}x" for arm, ratio in r["plain_ratio_by_arm"].items()) + ".",
        "",
        f"End to end, {r['tokens']} tokens, oracle drafter paying the {r['cost_drafter_form']} drafter's cost, "
        + (f"each timed run after an untimed {r['e2e_lead_in_tokens']}-token run of the same arm, "
           if r.get("e2e_lead_in_tokens") else "")
        + f"speculative / plain (`{r['plain_decode_path']['arm']}`)"
        + (". Policy: as the server runs it, each run from the acceptance the arm's earlier runs left "
           "(the server's drafter keeps it across requests); first request: from none:"
           if first else ":"),
        "",
        "| profile | "
        + ("tokens per round at block 8, full rounds (whole run; target)" if whole_run
           else "tokens per round at block 8, whole run (target)")
        + " | policy | " + ("first request | " if first else "")
        + " | ".join(f"block {b}" for b in next(iter(r["e2e_speedup_fixed_block"].values())))
        + " | policy / best fixed | " + ("first request / best fixed | " if first else "")
        + "policy tokens from rounds / plain steps |",
        "|---|---|---|" + ("---|" if first else "") + "---|" * len(next(iter(r["e2e_speedup_fixed_block"].values())))
        + "---|---|" + ("---|" if first else ""),
    ]
    for profile, speedup in r["e2e_speedup"].items():
        counts = r["policy_round_counts"][profile]
        lines.append(
            f"| {profile} | {r['tokens_per_round'][profile]:.2f} ("
            + (f"{whole_run[profile]:.2f}; " if whole_run else "")
            + f"{r['profile_target_tokens_per_round'][profile]:.2f}) "
            f"| {speedup:.2f}x | " + (f"{first[profile]:.2f}x | " if first else "")
            + " | ".join(f"{v:.2f}x" for v in r["e2e_speedup_fixed_block"][profile].values())
            + f" | {r['policy_vs_best_fixed_block'][profile]:.3f} | "
            + (f"{r['first_request_vs_best_fixed_block'][profile]:.3f} | " if first else "")
            + f"{counts['tokens_from_rounds']} / {counts['tokens_from_plain_steps']} |"
        )
    for decay, ratios in r.get("policy_vs_best_fixed_block_by_candidate_prior_depth_decay", {}).items():
        lines += ["", f"The policy under a candidate prior depth decay {decay} (the policy's is "
                  f"{r['prior_depth_decay']:g}), policy / best fixed: "
                  + ", ".join(f"{profile} {ratio:.3f}" for profile, ratio in ratios.items()) + "."]
    if "policy_runs_routed_plain" in r:
        lines += ["", f"The policy's full runs routed plain, as the server routes a request whose rounds would not "
                  f"pay (of {r['repeats'] + 1} with the warm-up): "
                  + ", ".join(f"{profile} {runs}" for profile, runs in r["policy_runs_routed_plain"].items()) + "."]
    if "policy_drafts_per_round" in r:
        lines += ["", "The policy's drafts per round (block - 1) in its last run: "
                  + "; ".join(f"{profile} {drafts}" for profile, drafts in r["policy_drafts_per_round"].items()) + "."]
    lines += acceptance_lines(r.get("acceptance_model"))  # absent from records before it
    lines += tokens_lines(r)
    tok_s = r.get("e2e_tok_s")  # absent from records before tok/s
    lines += ["", "| arm | ms per run |" + (" tok/s |" if tok_s else ""), "|---|---|" + ("---|" if tok_s else "")]
    lines += [f"| {arm} | {spread(stats)} |" + (f" {tok_s[arm]:.1f} |" if tok_s else "") for arm, stats in r["e2e_ms"].items()]
    if "e2e_token_gaps_ms" in r:
        plain_gaps = next(iter(r["e2e_token_gaps_ms"].values()))
        lines += ["", "Where the time goes (`e2e_token_gaps_ms`: per token, the median gap since the one "
                  "before, the first from the request's start), against plain on the chosen path:", "",
                  "| arm | first token ms | later tokens, median ms | ms over plain, summed | slowest tokens (position: ms) |",
                  "|---|---|---|---|---|"]
        for arm, gaps in r["e2e_token_gaps_ms"].items():
            slowest = sorted(range(1, len(gaps)), key=lambda i: -gaps[i])[:3]
            lines.append(f"| {arm} | {gaps[0]:.1f} | {statistics.median(gaps[1:]):.1f} | "
                         f"{sum(gaps) - sum(plain_gaps):+.1f} | "
                         + ", ".join(f"{i}: {gaps[i]:.1f}" for i in slowest) + " |")
    if r.get("e2e_speedup_peer"):  # absent from records before the peer arm
        lines += ["", "The peer, mlx-vlm 0.7.2's own speculative decoding (its round loop and stock verify, "
                  "the runtime off, the same oracle draws) at block 8: over plain, the pack's policy over it, "
                  "and its tokens that differ from plain decoding's: "
                  + "; ".join(f"{profile} {speedup:.2f}x, pack {r['pack_over_peer'][profile]:.2f}x, "
                              f"{r['peer_tokens_differing'][profile]} differing"
                              for profile, speedup in r["e2e_speedup_peer"].items()) + "."]
    for form, speedups in r["e2e_speedup_by_other_drafter_form"].items():
        lines.append("")
        lines.append(f"Same profiles at block 8 paying the {form} drafter's cost: "
                     + ", ".join(f"{profile} {s:.2f}x" for profile, s in speedups.items()) + ".")
    sampled = r.get("e2e_speedup_sampled")  # absent from records before sampled speculation
    if sampled:
        settings, profiles = r["e2e_sampled_settings"], list(next(iter(sampled.values())))
        lines += ["", f"Sampled requests (top_p {settings['top_p']:g}, top_k {settings['top_k']}, seed "
                  f"{settings['seed']}; {r['sampled_block_sampling']}): the round policy over plain seeded "
                  "sampling, the oracle proposing plain seeded sampling's tokens at each profile's acceptance "
                  "(policy tokens from rounds / plain steps in its last run; its full runs routed plain):", "",
                  "| temperature | " + " | ".join(profiles) + " |", "|---|" + "---|" * len(profiles)]
        for t, by_profile in sampled.items():
            counts, plain = r["policy_round_counts_sampled"][t], r["policy_runs_routed_plain_sampled"][t]
            lines.append(f"| {t} | " + " | ".join(
                f"{speedup:.2f}x ({counts[p]['tokens_from_rounds']} / {counts[p]['tokens_from_plain_steps']}; "
                f"{plain[p]})" for p, speedup in by_profile.items()) + " |")
    lines += [
        "",
        "The same table after the end-to-end arms taught it (as a server's learns from its requests) "
        + cost_table(r["round_costs_learned"]),
        "",
        f"Tokens identical across every arm: {r['tokens_identical']}.",
        "",
    ]
    return "\n".join(lines)
