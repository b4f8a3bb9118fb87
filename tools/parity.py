"""Bitwise parity of the exact speculative path against plain decoding.

The checks here are shared by the test suite (CPU, tiny pack) and by the
evidence run on a GPU machine:

    python tools/parity.py --out evidence/              # the tiny synthetic pack
    python tools/parity.py --pack DIR --out DIR/evidence  # a built pack

loads the pack (by default it builds the tiny synthetic one), measures the stock verify path first (the
negative control: on CUDA and Metal it differs from decode), installs the
runtime, and counts every differing element of verify logits, captured hidden
states, rollback logits, greedy tokens and seeded sampled tokens (with the start-up
self-test of how a verify block's rows are drawn), plus the kernel self-test at the
real 27B packed shapes. It writes evidence/parity-<backend>.json and .md, and the
fixture checks (text, thinking, tool-call and image prompts, plain against
speculative with the pack's own drafter) to evidence/fixture-checks-<backend>.*.
"""

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

# As the runtime does, before MLX starts: a larger CUDA graph cache that evicts
# instead of aborting the process (see dflash2_runtime.py).
os.environ.setdefault("MLX_CUDA_GRAPH_CACHE_SIZE", "4096")
os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_vlm.generate.ar import generate_step  # noqa: E402
from mlx_vlm.generate.common import generation_stream  # noqa: E402
from mlx_vlm.speculative.cache_state import commit_speculative_round  # noqa: E402
from mlx_vlm.utils import prepare_inputs  # noqa: E402
from PIL import Image  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import dflash2_audit  # noqa: E402
import dflash2_rounds  # noqa: E402
import dflash2_sampling  # noqa: E402
from dflash2_policy import RoundCosts  # noqa: E402
from dflash2_sampling import PositionSampler  # noqa: E402
from oracle_drafter import OracleDrafter  # noqa: E402
from records import add_dense_dtype_argument, layout_suffix, run_environment, write_record  # noqa: E402

# The parts one record can be run in, one process each, in this order (all: one process).
PARTS = ("all", "verify", "contexts", "tokens")
PROMPTS = [
    "Write a short poem about the sea.",
    "List three prime numbers and explain why.",
    "def reverse(s):",
]
# Sampled cases (issue 47), one seed each: Qwen3.5's thinking settings, plain temperature 1,
# and min_p; at a partial acceptance, so rounds both accept and reject drafts.
SAMPLED_SETTINGS = (
    dict(temperature=0.6, top_p=0.95, top_k=20),
    dict(temperature=1.0, top_p=1.0),
    dict(temperature=0.8, top_p=1.0, min_p=0.05),
)
SAMPLED_ERROR_RATE = 0.35
# Sampled requests speculate in the server's round loop (dflash2_rounds.RequestDecoder), which
# runs for drafters with a cost table; at a fixed block the table's figures go unused.
FIXED_BLOCK_COSTS = RoundCosts(1.0, {b: 1.0 for b in range(2, 9)}, {b: 0.0 for b in range(2, 9)})


def differing(actual: mx.array, expected: mx.array) -> int:
    """Differing elements, compared as raw bits (so -0, +0 and NaNs count)."""
    if actual.shape != expected.shape:
        return int(max(actual.size, expected.size))
    a, e = np.array(actual), np.array(expected)
    view = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return int((a.view(view) != e.view(view)).sum())


def chat_ids(tokenizer, text, *, thinking):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=thinking,
    )
    return mx.array([tokenizer.encode(prompt, add_special_tokens=False)])


def image_inputs(processor, text="Describe it."):
    """A fixed 64x64 image prompt through the pack's processor."""
    pixels = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    inputs = prepare_inputs(processor, images=[Image.fromarray(pixels)], prompts=prompt)
    extra = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
    return inputs["input_ids"], extra


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def fixture_prompts(processor):
    """name -> (input ids, extra generate kwargs) for the pack's fixture checks."""
    tokenizer = processor.tokenizer
    tool_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    return {
        "text": (chat_ids(tokenizer, PROMPTS[0], thinking=False), {}),
        "thinking": (chat_ids(tokenizer, PROMPTS[1], thinking=True), {}),
        "tool-call": (mx.array([tokenizer.encode(tool_prompt, add_special_tokens=False)]), {}),
        "image": image_inputs(processor),
    }


def fixture_cases(model, processor, drafter, max_tokens):
    """Each fixture decoded plain and speculative with the pack's own drafter."""
    cases = []
    for name, (ids, extra) in fixture_prompts(processor).items():
        plain = greedy(model, ids, max_tokens, **extra)
        spec = greedy(model, ids, max_tokens, drafter=drafter, **extra)
        cases.append(
            {
                "fixture": name,
                "tokens": len(plain),
                "rounds": len(drafter.accept_lens),
                "accepted": int(sum(drafter.accept_lens)),
                "identical": spec == plain,
            }
        )
    return cases


def greedy(model, input_ids, max_tokens, *, drafter=None, block_size=None, arrivals=None, sampler=None, **kwargs):
    """Greedy tokens through generate_step, or with `sampler` (a PositionSampler) its seeded
    draws; `arrivals` (a list) gets each token's time.perf_counter() as it is handed on.

    It runs on generate_step's own stream, as mlx-vlm's server runs plain generation on
    one stream: generate_step builds each step's input (`y[None]`) on the caller's
    stream, and on CUDA an op on another stream that feeds a step in the same evaluation
    makes MLX wait on the host until the step before has finished, so plain decoding
    would lose its overlap of building a step with running the one before (the timed
    benches' plain arms with it)."""
    tokens = []
    with mx.stream(generation_stream):
        steps = generate_step(
            input_ids,
            model,
            kwargs.pop("pixel_values", None),
            None,
            max_tokens=max_tokens,
            temperature=0.0,
            sampler=sampler,
            draft_model=drafter,
            draft_kind="dflash",
            draft_block_size=block_size,
            **kwargs,
        )
        for token, _ in steps:
            tokens.append(int(token))
            if arrivals is not None:
                arrivals.append(time.perf_counter())
    return tokens


def _evaluated(cache):
    mx.eval([layer.state for layer in cache])
    return cache


def _prefilled(lm, ids, taps):
    """The cache after prefilling ids, evaluated: each case starts from a deep copy of
    it, the cache its own prefill would give (buffer capacity included)."""
    cache = lm.make_cache()
    lm(ids, cache=cache, capture_layer_ids=taps)
    return _evaluated(cache)


def snapshot_cases(lm, taps, snapshot, block, lengths=range(2, 9), rollback_lengths=()):
    """From one cache: verify of L tokens of block against L single-token decode steps
    for each L in lengths; for each L in rollback_lengths, the next token's logits after
    committing each accepted count of an L-token verify against a cache that decoded
    only the accepted tokens and the bonus."""
    cases = []
    for length in lengths:
        sequential = copy.deepcopy(snapshot)
        steps = [lm(mx.array([[t]]), cache=sequential, capture_layer_ids=taps) for t in block[:length]]
        cache = copy.deepcopy(snapshot)
        out = lm(mx.array([block[:length]]), cache=cache, capture_layer_ids=taps, speculative_verify=True)
        out.gdn_states.abort()
        logits = differing(out.logits, mx.concatenate([s.logits for s in steps], axis=1))
        hidden = sum(
            differing(h, mx.concatenate([s.hidden_states[i] for s in steps], axis=1))
            for i, h in enumerate(out.hidden_states)
        )
        cases.append({"check": "verify", "length": length, "logits": logits, "hidden": hidden})
    probe = mx.array([[block[0]]])
    for length in rollback_lengths:
        fresh = copy.deepcopy(snapshot)  # never speculated: one decode step per accepted token
        for accepted in range(length):
            lm(mx.array([[block[accepted]]]), cache=fresh)
            _evaluated(fresh)
            cache = copy.deepcopy(snapshot)
            out = lm(mx.array([block[:length]]), cache=cache, capture_layer_ids=taps, speculative_verify=True)
            commit_speculative_round(lm, cache, out.gdn_states, accepted, length)
            mismatch = differing(lm(probe, cache=cache).logits, lm(probe, cache=copy.deepcopy(fresh)).logits)
            cases.append({"check": "rollback", "length": length, "accepted": accepted, "logits": mismatch})
    return cases


def verify_cases(lm, ids, taps, continuation, lengths=range(2, 9)):
    """One verify forward of L tokens against L single-token decode steps, after ids."""
    return snapshot_cases(lm, taps, _prefilled(lm, ids, taps), continuation, lengths)


def rollback_cases(lm, ids, taps, continuation, lengths=(2, 5, 8)):
    """Next-token logits after committing `accepted` drafts vs a cache that never saw the rest."""
    return snapshot_cases(lm, taps, _prefilled(lm, ids, taps), continuation, (), lengths)


def decode_logits(lm, ids, tokens):
    """Logits of plain single-token decode steps after a prefill."""
    cache = lm.make_cache()
    lm(ids, cache=cache)
    return mx.concatenate([lm(mx.array([[t]]), cache=cache).logits for t in tokens], axis=1)


def prefill_snapshots(lm, taps, contexts):
    """Caches after token-by-token prefills (decode arithmetic) of each context length.

    One growing prefill; a deep copy at each length, so every case starts from
    the same cache a plain run would have, buffer capacity included."""
    from make_synthetic_pack import synthetic_prompt

    cache, snapshots = lm.make_cache(), {}
    for position, token in enumerate(synthetic_prompt(max(contexts)), start=1):
        mx.eval(lm(mx.array([[token]]), cache=cache, capture_layer_ids=taps).logits)
        if position in contexts:
            snapshots[position] = copy.deepcopy(cache)
    return snapshots


def context_cases(lm, taps, snapshots, block, lengths=range(2, 9), rollback_contexts=()):
    """snapshot_cases from each snapshot (rollback at every accepted count from the
    snapshots in rollback_contexts), each case labelled with its context length."""
    return [
        {"context": context, **case}
        for context, snapshot in snapshots.items()
        for case in snapshot_cases(lm, taps, snapshot, block, lengths,
                                   lengths if context in rollback_contexts else ())
    ]


def served_prefill_logits(model, ids, step, **route):
    """First-token logits of a server's prompt batch prefilling ids on a fresh one-row batch
    cache (mlx-vlm's _make_cache), in chunks of step with the last token alone, as
    PromptProcessingBatch runs it; route: capture_layer_ids on the speculative route."""
    from mlx_vlm.generate.ar import _make_cache

    lm = model.language_model
    lm._position_ids = lm._rope_deltas = None  # the model keeps a prompt's rotary positions
    cache = _make_cache(lm, [0])
    embedded = model.get_input_embeddings(ids, None).to_dict()
    embeds, positions, deltas = (embedded[k] for k in ("inputs_embeds", "position_ids", "rope_deltas"))

    def forward(start, end, **kwargs):
        return model(ids[:, start:end], cache=cache, inputs_embeds=embeds[:, start:end],
                     position_ids=positions[..., start:end], rope_deltas=deltas, **kwargs, **route)

    done = 0
    while done < ids.shape[1] - 1:
        end = min(done + step, ids.shape[1] - 1)
        forward(done, end)
        mx.eval([layer.state for layer in cache])
        done = end
    return forward(done, ids.shape[1], logits_to_keep=1).logits[:, -1]


def prefill_route_cases(model, taps, contexts, step):
    """The speculative route's prefill (capture_layer_ids: mlx-vlm's batch path, a
    BatchKVCache and an array mask) against the plain route's (its one-row shortcut onto
    row caches): every token the request gets reads what its prefill left, so their
    first-token logits must be the same bits."""
    from make_synthetic_pack import synthetic_prompt

    cases = []
    for context in contexts:
        ids = mx.array([synthetic_prompt(context)])
        plain = served_prefill_logits(model, ids, step)
        speculative = served_prefill_logits(model, ids, step, capture_layer_ids=taps)
        cases.append({"check": "prefill routes", "context": context, "step": step,
                      "logits": differing(speculative, plain)})
    return cases


def all_token_combos(blocks=range(2, 9), errors=(0.0, 0.35, 1.0)):
    """Every (prompt, thinking, block, error rate): the full matrix of the GPU run."""
    return [
        (prompt, thinking, block, error_rate)
        for thinking in (False, True)
        for prompt in PROMPTS
        for block in blocks
        for error_rate in errors
    ]


@contextmanager
def served_rounds(drafter, costs, fixed_block=False, acceptance_memory=None):
    """The drafter as the server serves it (dflash2_speculation.load_speculation): the round
    policy decides each round from the cost table; with a fixed block the requested block
    runs every round. Yields its dflash2_rounds.DrafterState (round_counts: the last run's);
    afterwards the state served before is served again."""
    state = dflash2_rounds.DrafterState(drafter, costs, fixed_block=fixed_block, acceptance_memory=acceptance_memory)
    previous = dflash2_rounds.serve_rounds_with(state)
    try:
        yield state
    finally:
        dflash2_rounds.serve_rounds_with(previous)


@contextmanager
def stock_mlx_vlm():
    """mlx-vlm 0.7.2 as shipped inside the block: every replaced target (dflash2_audit.REPLACED)
    back to the object its replacement stands in for, the replacements again afterwards. What
    a user of mlx-vlm's own --draft-model runs: the negative controls, and bench's peer arm."""
    swapped = []
    for row in dflash2_audit.REPLACED:
        owner, name = dflash2_audit.resolve(row.target)
        current = getattr(owner, name)
        if hasattr(current, "__dflash2_stock__"):
            setattr(owner, name, current.__dflash2_stock__)
            swapped.append((owner, name, current))
    try:
        yield
    finally:
        for owner, name, current in swapped:
            setattr(owner, name, current)


def oracle_token_case(model, ids, plain, block, error_rate, max_tokens, sampler=None, **labels):
    """Speculative tokens (oracle drafter proposing `plain`, at one block and error rate)
    against plain's: greedy, or drawn by `sampler` with `plain` its plain seeded run."""
    vocab = model.language_model.lm_head.weight.shape[0]
    drafter = OracleDrafter(plain, prompt_length=ids.shape[-1], vocab_size=vocab, error_rate=error_rate, block_size=block)
    with served_rounds(drafter, FIXED_BLOCK_COSTS, fixed_block=True) if sampler is not None else nullcontext():
        spec = greedy(model, ids, max_tokens, drafter=drafter, block_size=block, sampler=sampler)
    return {
        "check": "tokens" if sampler is None else "sampled tokens",
        **labels,
        "block": block,
        "error_rate": error_rate,
        "accepted": int(sum(drafter.accept_lens)),
        "rounds": len(drafter.accept_lens),
        "identical": spec == plain,
    }


def token_cases(model, tokenizer, max_tokens, combos):
    """Greedy speculative tokens (oracle drafter) against plain decoding, chat prompts."""
    plain_by_prompt = {}
    cases = []
    for prompt, thinking, block, error_rate in combos:
        ids = chat_ids(tokenizer, prompt, thinking=thinking)
        if (prompt, thinking) not in plain_by_prompt:
            plain_by_prompt[prompt, thinking] = greedy(model, ids, max_tokens)
        plain = plain_by_prompt[prompt, thinking]
        cases.append(
            oracle_token_case(model, ids, plain, block, error_rate, max_tokens, prompt=prompt, thinking=thinking)
        )
    return cases


def raw_token_cases(model, ids, max_tokens, blocks=range(2, 9), errors=(0.0, 0.35, 1.0)):
    """The same for a raw-id prompt (targets without tokenizer files)."""
    plain = greedy(model, ids, max_tokens)
    return [
        oracle_token_case(model, ids, plain, block, error_rate, max_tokens, prompt="raw ids")
        for block in blocks
        for error_rate in errors
    ]


def sampled_token_cases(model, ids, max_tokens, blocks=range(2, 9)):
    """Seeded sampled speculative tokens (the oracle proposing plain seeded sampling's, so
    drafts are accepted at its rate) against plain seeded sampling's, per setting and block."""
    cases = []
    for seed, settings in enumerate(SAMPLED_SETTINGS):
        sampler = PositionSampler(**settings, seed=seed)
        plain = greedy(model, ids, max_tokens, sampler=sampler)
        cases += [oracle_token_case(model, ids, plain, block, SAMPLED_ERROR_RATE, max_tokens, sampler,
                                    settings=settings, seed=seed)
                  for block in blocks]
    return cases


def case_mismatches(case) -> int:
    if case["check"] in ("tokens", "sampled tokens"):
        return 0 if case["identical"] else 1
    return case["logits"] + case.get("hidden", 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", help="pack folder (default: build the tiny synthetic pack)")
    parser.add_argument(
        "--size",
        choices=["tiny", "27b"],
        default="tiny",
        help="synthetic target without --pack; 27b: random weights in memory, raw-id prompts, "
        "contexts across the KV cache's 256-token growth steps",
    )
    add_dense_dtype_argument(parser)
    parser.add_argument("--out", default=str(REPO / "evidence"))
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--kernel-shapes", choices=["tiny", "27b"], default="27b")
    parser.add_argument(
        "--part", choices=PARTS, default="all",
        help="verify: verify and rollback with their negative controls, and the kernel self-tests; "
        "contexts: verify and rollback at the prefilled contexts (their controls too) and the prefill "
        "routes; tokens: the greedy and sampled token runs (and the fixture checks). Each later part "
        "adds to the record the parts before it left in --out (same commit and code); all: every part "
        "in one process",
    )
    args = parser.parse_args()

    import dflash2_kernel_qmv
    import dflash2_kernels
    import dflash2_runtime
    from dflash2_pack import find_pack, load_pack
    from make_synthetic_pack import SIZES, build_target_model, make_pack

    environment = run_environment(
        "parity.py", Path(args.pack).name if args.pack else f"synthetic {args.size} target, seed 0"
    )
    environment["dense_dtype"] = None if args.pack else args.dense_dtype
    stem = f"parity-{environment['backend']}{layout_suffix(environment['dense_dtype'])}"
    parts = PARTS[1:] if args.part == "all" else (args.part,)
    # Before minutes of loading: a later part needs the earlier parts' record, from this run.
    earlier = earlier_part(Path(args.out), stem, args.part) if args.part not in ("all", "verify") else None
    if earlier is not None:
        same_run(earlier, environment, args.part)

    started = time.time()
    log = lambda message: print(f"[{time.time() - started:6.1f}s] {message}", flush=True)  # noqa: E731
    processor = drafter = None
    if args.pack:
        model, processor, drafter = load_pack(*find_pack(args.pack))
    elif args.size == "27b":
        model = build_target_model("27b", seed=0, dense_dtype=args.dense_dtype)
    else:
        with tempfile.TemporaryDirectory() as folder:
            paths = make_pack(folder, size="tiny", seed=0, dense_dtype=args.dense_dtype)
            model, processor, drafter = load_pack(paths["target"], paths["drafter"])
    lm = model.language_model
    if processor is None:
        # Raw token ids: the in-memory 27B target has no tokenizer files.
        taps = SIZES["27b"]["drafter"]["target_layer_ids"]
        ids = mx.array([[(31 * i + 5) % 300 + 1 for i in range(16)]])
    else:
        taps = list(drafter.config.target_layer_ids)
        ids = chat_ids(processor.tokenizer, PROMPTS[0], thinking=False)
    continuation = greedy(model, ids, 8)
    contexts = (250, 252, 254, 256, 258, 262, 1030) if args.size == "27b" and not args.pack else (5, 12)
    log(f"model ready; prefilling contexts {contexts}")
    record = {**environment, "parts": list(parts),
              # the residual stream's dtype (the final norm's weight sets it): the activations'
              "activation_dtype": str(lm.model.norm.weight.dtype).removeprefix("mlx.core.")}
    exact, stock = [], []
    # Before install: the stock verifier (the negative controls).
    if "verify" in parts:
        log("stock verify (negative control)")
        stock += verify_cases(lm, ids, taps, continuation)
        stock_decode = decode_logits(lm, ids, continuation)
    if "contexts" in parts:
        snapshots = prefill_snapshots(lm, taps, contexts)
        log("stock verify at the contexts (negative control)")
        stock += context_cases(lm, taps, snapshots, continuation)
    status = dflash2_runtime.install(model)
    log(f"runtime installed: speculative {status.speculative} {status.reason or ''}")
    if "verify" in parts:
        # Plain decode after install (one-row matmuls on the exact kernel) against stock.
        exact.append({"check": "plain decode", "logits": differing(decode_logits(lm, ids, continuation), stock_decode)})
        exact += verify_cases(lm, ids, taps, continuation) + rollback_cases(lm, ids, taps, continuation)
        log("exact verify and rollback")
    if "contexts" in parts:
        exact += context_cases(lm, taps, snapshots, continuation, rollback_contexts=(contexts[1], contexts[-1]))
        log("exact verify and rollback at the contexts; prefill routes")
        exact += prefill_route_cases(model, taps, contexts, step=256 if contexts[-1] > 256 else 4)
    if "verify" in parts:
        # Last: at the 27B shapes the self-tests set what serves (the pack's own shapes did at install).
        log("kernel self-tests")
        shapes = list(dflash2_kernel_qmv.PACKED_SHAPES_27B) if args.kernel_shapes == "27b" else None
        record.update({
            "runtime_status": {"speculative": status.speculative, "reason": status.reason, **status.to_json()},
            "kernel_self_test": kernel_test_json(dflash2_kernels.self_test(shapes=shapes), shapes),
        })
        if record["activation_dtype"] == "float32":  # fp32 rows take their own kernel
            record["kernel_self_test_fp32"] = kernel_test_json(dflash2_kernels.self_test_qmv32(shapes=shapes), shapes)
    record["stock_cases"] = stock
    fixtures = []
    if "tokens" in parts:
        log("greedy token runs")
        if processor is None:
            exact += raw_token_cases(model, ids, args.max_tokens)
        else:
            exact += token_cases(model, processor.tokenizer, args.max_tokens, all_token_combos())
            fixtures = fixture_cases(model, processor, drafter, args.max_tokens)
        # As a server starts: the self-test picks one call over a block's rows or decode's call
        # per row, and the sampled runs then draw as it chose.
        vocab = lm.lm_head.weight.shape[0]
        block_sampling = dflash2_sampling.choose_block_sampling(vocab)
        log(f"{block_sampling.summary()}; sampled token runs")
        exact += sampled_token_cases(model, ids, args.max_tokens)
        # Rows whose one-call draw differed from decode's per-row call: not a mismatch, as
        # the sampled runs then draw row by row (batched false).
        record["block_sampling"] = {"vocab": vocab, "differing_rows": block_sampling.differing,
                                    "batched": block_sampling.batched, "seconds": block_sampling.seconds,
                                    "summary": block_sampling.summary()}
    record.update(cases=exact, seconds=round(time.time() - started, 1))
    if earlier is not None:
        record = {**earlier, **record, "command": earlier["command"], f"{args.part}_command": record["command"],
                  "parts": earlier["parts"] + [args.part], "cases": earlier["cases"] + exact,
                  "stock_cases": earlier["stock_cases"] + stock,
                  "seconds": round(earlier["seconds"] + record["seconds"], 1)}
    kernels = [record[key] for key in ("kernel_self_test", "kernel_self_test_fp32") if key in record]
    record["exact_mismatches"] = (sum(case_mismatches(c) for c in record["cases"])
                                  + sum(kernel["mismatches"] for kernel in kernels))
    record["stock_mismatches"] = (sum(case_mismatches(c) for c in record["stock_cases"])
                                  + sum(kernel["stock_mismatches"] for kernel in kernels))
    backend = environment["backend"]
    write_record(args.out, stem, record, summary_markdown(record))
    fixture_record = {**environment, "all_identical": all(c["identical"] for c in fixtures), "cases": fixtures}
    if fixtures:
        write_record(args.out, f"fixture-checks-{backend}", fixture_record, fixture_markdown(fixture_record))
        print(fixture_markdown(fixture_record))
    print(summary_markdown(record))
    exact = record["exact_mismatches"] == 0 and fixture_record["all_identical"]
    return 0 if exact and status.speculative else 1


def fixture_markdown(record) -> str:
    lines = [
        f"# Fixture checks on {record['backend']} ({record['device']}): {record['pack']}",
        "",
        f"Command: `{record['command']}`; mlx {record['versions']['mlx']}, "
        f"mlx-vlm {record['versions']['mlx_vlm']}",
        "",
        "| fixture | tokens | rounds | accepted drafts | speculative == plain |",
        "|---|---|---|---|---|",
    ]
    for c in record["cases"]:
        lines.append(
            f"| {c['fixture']} | {c['tokens']} | {c['rounds']} | {c['accepted']} | {c['identical']} |"
        )
    return "\n".join(lines + [""])


def kernel_test_json(result, shapes) -> dict:
    """A kernel self-test's counts, for the record."""
    return {"ok": result.ok, "shapes": [list(s) for s in (shapes or [])], "mismatches": result.mismatches,
            "stock_mismatches": result.stock_mismatches, "cases": len(result.cases)}


def earlier_part(out: Path, stem: str, part: str = "tokens") -> dict:
    """The record in out of the parts before `part` (PARTS' order), which `part` adds to."""
    path = out / f"{stem}.json"
    before = list(PARTS[1:PARTS.index(part)])
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"--part {part} adds to the {' and '.join(before)} parts' record: {path} unreadable ({error})")
    if record.get("parts") != before:
        raise SystemExit(f"--part {part} adds to the {' and '.join(before)} parts' record: "
                         f"{path} has parts {record.get('parts')}")
    return record


def same_run(earlier: dict, environment: dict, part: str = "tokens"):
    """The parts of one record measure the same code on the same machine."""
    for key in ("git_commit", "git_clean", "code", "device", "versions", "dense_dtype"):
        if key == "dense_dtype" and key not in earlier:
            continue  # a record from before --dense-dtype: fp16, or a pack's own layout
        if earlier.get(key) != environment.get(key):
            raise SystemExit(f"--part {part}: the earlier parts' record has another {key} "
                             f"({earlier.get(key)!r}, here {environment.get(key)!r}): run every part again")


def summary_markdown(record) -> str:
    tokens = [c for c in record["cases"] if c["check"] == "tokens"]
    contexts = ", ".join(sorted({str(c["context"]) for c in record["cases"] if "context" in c}, key=int))
    lines = [
        f"# Parity on {record['backend']} ({record['device']})",
        "",
        f"Command: `{record['command']}`  ",
        f"Versions: mlx {record['versions']['mlx']}, mlx-vlm {record['versions']['mlx_vlm']}, "
        f"Python {record['versions']['python']}",
        "",
        "| check | cases | differing elements |",
        "|---|---|---|",
    ]
    for check, label in (
        ("plain decode", "plain decode after install vs stock"),
        ("prefill routes", "first-token logits, speculative route's prefill vs plain route's"),
        ("verify", "exact verify vs decode (L=2..8; contexts " + contexts + ")"),
        ("rollback", "rollback at every accepted count vs never-speculated cache"),
    ):
        cases = [c for c in record["cases"] if c["check"] == check]
        if not cases and check == "prefill routes":
            continue  # records from before the check
        lines.append(f"| {label} | {len(cases)} | {sum(map(case_mismatches, cases))} |")
    lines.append(
        f"| greedy tokens, oracle drafter | {len(tokens)} | "
        f"{sum(not c['identical'] for c in tokens)} runs differ |"
    )
    sampled = [c for c in record["cases"] if c["check"] == "sampled tokens"]
    if sampled:  # records from before sampled speculation have none
        lines.append(
            f"| seeded sampled tokens, oracle drafter proposing plain seeded sampling's (blocks "
            f"{min(c['block'] for c in sampled)}..{max(c['block'] for c in sampled)}, "
            f"{len({str(c['settings']) for c in sampled})} settings) | {len(sampled)} | "
            f"{sum(not c['identical'] for c in sampled)} runs differ |"
        )
    kernel, fp32 = record["kernel_self_test"], record.get("kernel_self_test_fp32")
    lines.append(f"| exact kernel self-test | {kernel['cases']} | {kernel['mismatches']} |")
    if fp32:
        lines.append(f"| exact kernel self-test, fp32 rows | {fp32['cases']} | {fp32['mismatches']} |")
    stock = record["stock_cases"]
    lines.append(
        f"| stock verify (negative control) | {len(stock)} | {sum(map(case_mismatches, stock))} |"
    )
    lines.append(
        f"| MLX multi-row matmul (negative control) | {kernel['cases']} | {kernel['stock_mismatches']} |"
    )
    if fp32:
        lines.append(f"| MLX 8-row fp32 matmul (negative control) | {fp32['cases']} | {fp32['stock_mismatches']} |")
    check = record["runtime_status"].get("verify_self_check")
    if check:
        lines += ["", f"Start-up {check['summary']}."]
    block_sampling = record.get("block_sampling")
    if block_sampling:
        lines += ["", f"Block sampling self-test at vocabulary {block_sampling['vocab']}: {block_sampling['summary']}."]
    # Records whose verify part held the contexts (before the contexts part) end at tokens too.
    missing = [] if "tokens" in record.get("parts", ["tokens"]) else [p for p in PARTS[1:] if p not in record["parts"]]
    if missing:
        lines += ["", f"Not in this record yet: the {' and '.join(missing)} part{'s' if len(missing) > 1 else ''} "
                      f"(`--part {missing[0]}` adds the next)."]
    for part in PARTS[2:]:
        if record.get(f"{part}_command"):
            lines += ["", f"The {part} part in another process on the same machine: `{record[f'{part}_command']}`."]
    lines += [
        "",
        f"exact_mismatches = {record['exact_mismatches']}, "
        f"stock_mismatches = {record['stock_mismatches']}",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
