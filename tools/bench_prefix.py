"""Time to first token of a conversation's next turn, cold and from the exact prefix cache.

    python tools/bench_prefix.py --out evidence/ [--contexts 1024 4096 16384] [--step-sizes 2048 512]

Run on a GPU machine at the real 27B shape (random weights built in memory, as tools/bench.py;
`--pack DIR` measures a built pack). For each prefill step size and context N: a first turn of
N random tokens, then a second turn that keeps all but the first turn's last 6 tokens (the
generation prompt a chat template does not repeat) and appends --follow-up tokens (the answer
and the next question). Each request runs through mlx-vlm's BatchGenerator as the server's
worker runs it; the time runs from the prompt's embedding to its first token. The second
turn is timed cold (mlx-vlm's own prompt batch), cached (after the first turn stored its
boundaries) and repeated (the same prompt again: all but its last token restored); the
record says whether the cached first-token logits are bitwise the cold ones, how many tokens
were reused and how large the store grew. `--speculative` runs the speculative route (the
drafter's taps are stored too) beside the plain one, with the round policy's cost table
measured as the speculative server measures it at start-up, then measures speculation's extra
memory at --memory-contexts with and without the drafter's sliding window, each request
prefilled by the servers' prompt batch without a store. Median of --repeats.
Writes evidence/prefix-cache-<backend>-<size>.json and .md.
"""

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from mlx_vlm.generate.ar import BatchGenerator  # noqa: E402

import dflash2_drafter  # noqa: E402
import dflash2_engine  # noqa: E402
import dflash2_runtime  # noqa: E402
import dflash2_rounds  # noqa: E402
import dflash2_timing  # noqa: E402
from dflash2_prefix_cache import PrefixPromptBatch, PrefixStore  # noqa: E402
from parity import differing  # noqa: E402
from records import run_environment, write_record  # noqa: E402

GENERATION_PROMPT = 6  # tokens a first turn's prompt has after the history the next turn repeats


def request_kwargs(model, inputs):
    """Input ids and prompt arguments as the server's worker makes them (_gpu_embed)."""
    data = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    features = model.get_input_embeddings(inputs["input_ids"], inputs.get("pixel_values"),
                                          mask=inputs.get("attention_mask"), **data)
    return inputs["input_ids"], {**data, **{k: v for k, v in features.to_dict().items() if v is not None}}


@contextlib.contextmanager
def first_token_logits(model):
    """Collects the logits of each request's first token, as its prefill's final forward
    (the call with logits_to_keep) gives them."""
    language_model = type(model.language_model)
    stock = language_model.__call__
    seen = []

    def call(self, *args, **kwargs):
        out = stock(self, *args, **kwargs)
        if "logits_to_keep" in kwargs:
            seen.append(out.logits[:, -1])
        return out

    language_model.__call__ = call
    try:
        yield seen
    finally:
        language_model.__call__ = stock


def request(model, processor, inputs, *, step, store=None, drafter=None, max_tokens=3, served_prefill=False):
    """One greedy request through BatchGenerator: (tokens, cached tokens, seconds to the first
    token). store None: cold, mlx-vlm's own prompt batch, or with served_prefill the servers'
    without a store (which keeps only the taps a sliding drafter reads); otherwise the prefix
    cache's."""
    generate_module = sys.modules["mlx_vlm.generate"]
    stock = generate_module.PromptProcessingBatch
    if store is not None or served_prefill:
        generate_module.PromptProcessingBatch = type("StoredPromptBatch", (PrefixPromptBatch,), {"store": store})
    try:
        generator = BatchGenerator(model.language_model, processor, prefill_step_size=step, draft_model=drafter,
                                   draft_kind="dflash" if drafter else None, greedy_sampling=True)
        started = time.perf_counter()
        input_ids, kwargs = request_kwargs(model, inputs)
        generator.insert([input_ids[0].tolist()], max_tokens=max_tokens, prompt_kwargs=[kwargs])
        tokens, cached, first, finished = [], None, None, False
        while not finished:
            prompt_responses, responses = generator.next()
            cached = next((p.cached_tokens for p in prompt_responses), cached)
            for response in responses:
                tokens.append(int(response.token))
                first = first or time.perf_counter() - started
                finished = finished or response.finish_reason is not None
        generator.close()
        return tokens, cached, first
    finally:
        generate_module.PromptProcessingBatch = stock


def turns(context: int, follow_up: int, vocab: int, seed: int):
    """Token ids of a first turn and of the next turn that extends its history."""
    key = mx.random.key(seed)
    first = mx.random.randint(0, vocab, (context,), key=key).tolist()
    extra = mx.random.randint(0, vocab, (follow_up,), key=mx.random.split(key)[1]).tolist()
    return first, first[: context - GENERATION_PROMPT] + extra


def measure(model, processor, context, step, args, drafter=None):
    vocab = min(model.language_model.args.vocab_size, 150000)  # clear of the special tokens
    samples = {"cold": [], "first_turn": [], "cached": [], "repeat": []}
    exact, cached_tokens, store_gb = True, None, None
    with first_token_logits(model) as seen:
        for repeat in range(args.repeats):
            first, second = ({"input_ids": mx.array([ids])} for ids in
                             turns(context, args.follow_up, vocab, seed=repeat))
            cold_tokens, _, ttft = request(model, processor, second, step=step, drafter=drafter)
            samples["cold"].append(ttft)
            store = PrefixStore(args.budget_gb)
            samples["first_turn"].append(request(model, processor, first, step=step, store=store, drafter=drafter)[2])
            store_gb = store.nbytes() / 1e9
            tokens, cached_tokens, ttft = request(model, processor, second, step=step, store=store, drafter=drafter)
            samples["cached"].append(ttft)
            samples["repeat"].append(request(model, processor, second, step=step, store=store, drafter=drafter)[2])
            cold, _, cached, repeated = seen[-4:]
            exact = exact and differing(cached, cold) == differing(repeated, cold) == 0 and tokens == cold_tokens
            seen.clear()
            mx.clear_cache()
    ttft_ms = {name: round(1000 * statistics.median(values), 1) for name, values in samples.items()}
    return {"ttft_ms": ttft_ms, "cached_over_cold": round(ttft_ms["cached"] / ttft_ms["cold"], 3),
            "cached_tokens": cached_tokens, "second_turn_tokens": context - GENERATION_PROMPT + args.follow_up,
            "store_gb_after_first_turn": round(store_gb, 3), "exact": exact,
            "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 2)}


def drafter_own_bytes(drafter, model) -> int:
    """The drafter's weights in bytes, less the target's embedding and head it binds (its
    parameters() include them)."""
    from mlx.utils import tree_flatten

    shared = {id(value) for _, value in tree_flatten(model.parameters())}
    return sum(value.nbytes for _, value in tree_flatten(drafter.parameters()) if id(value) not in shared)


def spec_extra_memory(model, processor, drafter, contexts, step, repeats):
    """Speculation's extra memory by context, in GB: the drafter's weights plus how far a
    speculative request's peak goes past a plain one's (drafter cache, taps, verify work;
    nothing where it stays below), with the drafter's whole context and then with its
    sliding window. Per context, `repeats` passes of plain, whole and windowed requests in
    turn (after one untimed pass: a layout's first request allocates once), each peak
    against its own pass's plain one, median over passes. Returns that, the median
    difference itself (negative: below plain), the differences' min and max, and the
    drafter's cache after a request (its context: what the window bounds; no allocator
    noise), in GB."""
    drafter.reset(model)  # bound to the target, as a request binds it
    weights = drafter_own_bytes(drafter, model)
    vocab = min(model.language_model.args.vocab_size, 150000)
    layouts = ("full", "sliding_window")

    def peak(context, layout=None):
        """One request's peak memory: plain (layout None) or speculative with that layout."""
        if layout == "sliding_window":
            dflash2_drafter.configure_drafter(drafter, dflash2_drafter.RuntimeOptions(sliding_window=True))
        elif layout == "full":
            loaded_layout()  # configure_drafter never switches the window back off
        inputs = {"input_ids": mx.array([turns(context, 1, vocab, seed=0)[0]])}
        gc.collect()  # the earlier requests' caches go now, not when the collector next runs
        mx.clear_cache()
        mx.reset_peak_memory()
        request(model, processor, inputs, step=step, drafter=drafter if layout else None, max_tokens=16,
                served_prefill=True)
        if layout:
            cache_gb.setdefault(str(context), {})[layout] = round(sum(map(cache_bytes, made)) / 1e9, 6)
            made.clear()  # kept, this request's cache would sit under the next one's peak
        return mx.get_peak_memory()

    extra, over_plain, spread, cache_gb = {}, {}, {}, {}
    # The timings after this serve the drafter as loaded.
    with attention_layout_kept(drafter) as loaded_layout, drafter_caches(drafter) as made:
        for context in contexts:
            grown = {name: [] for name in layouts}
            for sample in range(repeats + 1):
                plain = peak(context)
                for name in layouts:
                    spec = peak(context, name)
                    if sample:
                        grown[name].append(spec - plain)
            median = {name: statistics.median(values) for name, values in grown.items()}
            extra[str(context)] = {name: round((weights + max(0, m)) / 1e9, 3) for name, m in median.items()}
            over_plain[str(context)] = {name: round(m / 1e9, 3) for name, m in median.items()}
            spread[str(context)] = {name: [round(min(v) / 1e9, 3), round(max(v) / 1e9, 3)] for name, v in grown.items()}
            print(f"speculation's extra memory at {context} tokens: {extra[str(context)]}; "
                  f"peak over plain {over_plain[str(context)]} (min-max {spread[str(context)]})", flush=True)
    return extra, over_plain, spread, cache_gb


@contextlib.contextmanager
def drafter_caches(drafter):
    """Collects the cache each request's drafter.reset makes (the drafter's context)."""
    made = []
    stock = drafter.reset

    def reset(*args, **kwargs):
        made.append(stock(*args, **kwargs))
        return made[-1]

    drafter.reset = reset
    try:
        yield made
    finally:
        del drafter.reset


def cache_bytes(cache) -> int:
    """Bytes a drafter cache holds: each layer's key and value buffers as allocated."""
    return sum(array.nbytes for layer in cache for array in (getattr(layer, "keys", None),
                                                              getattr(layer, "values", None))
               if array is not None)


@contextlib.contextmanager
def attention_layout_kept(drafter):
    """Puts back the drafter's attention layout, which configure_drafter's window option
    switches to sliding (and nothing switches back), and its block ceiling, on leaving and
    whenever the function it yields is called."""
    layout = (list(drafter.config.layer_types),
              [(layer.self_attn.is_sliding, layer.self_attn.sliding_window) for layer in drafter.layers])
    ceiling = getattr(drafter.config, "runtime_block_size", None)  # None: mlx-vlm's default

    def restore():
        drafter.config.runtime_block_size = ceiling
        drafter.config.layer_types = list(layout[0])
        for layer, (sliding, size) in zip(drafter.layers, layout[1]):
            layer.self_attn.is_sliding, layer.self_attn.sliding_window = sliding, size

    try:
        yield restore
    finally:
        restore()


def load(args):
    """(model, processor, drafter or None). A random-weight model gets the tiny pack's
    processor: BatchGenerator reads only its stop criteria."""
    from dflash2_pack import find_pack, load_pack
    from make_synthetic_pack import build_target_model, make_pack, write_drafter
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_processor

    if args.pack:
        target, drafter_dir = find_pack(Path(args.pack))
        return load_pack(target, drafter_dir if args.speculative else None)
    folder = Path(tempfile.mkdtemp())
    processor = load_processor(make_pack(folder / "tiny", size="tiny", seed=0)["target"])
    drafter = None
    if args.speculative:
        write_drafter(folder / "drafter", args.size, seed=0, form=args.drafter_form)
        drafter, _ = load_drafter(folder / "drafter")
    return build_target_model(args.size, seed=0), processor, drafter


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["27b", "tiny"], default="27b")
    parser.add_argument("--pack", help="measure a built pack instead of random weights")
    parser.add_argument("--out", default=str(REPO / "evidence"))
    parser.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 16384],
                        help="contexts of the timed turns (none: speculation's memory only)")
    parser.add_argument("--step-sizes", type=int, nargs="+", default=[2048, 512])
    parser.add_argument("--follow-up", type=int, default=150, help="tokens the second turn adds")
    parser.add_argument("--speculative", action="store_true", help="also the speculative route")
    parser.add_argument("--memory-contexts", type=int, nargs="*", default=[1024, 4096],
                        help="contexts at which to measure speculation's extra memory (needs --speculative)")
    parser.add_argument("--drafter-form", choices=["bf16", "4bit"], default="4bit",
                        help="the random drafter's form (the one a pack should ship: 4bit)")
    parser.add_argument("--budget-gb", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (and memory passes), at least 5")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (each first repeat at a new length compiles)")
    started = time.time()
    model, processor, drafter = load(args)
    status = dflash2_runtime.install(model)
    prefill_inverse = dflash2_engine.use_exact_prefill_inverse(  # as both servers prefill
        model.language_model.args.linear_num_value_heads, max(args.step_sizes))
    dflash2_engine.use_first_tokens_first()  # as both servers hand out a first token
    print(prefill_inverse, flush=True)
    if drafter is not None:  # the policy's table, as the speculative server measures it at start-up
        costs = dflash2_timing.measure_round_costs(model, drafter)
        dflash2_rounds.serve_rounds_with(dflash2_rounds.DrafterState(drafter, costs))
        print("round costs:", costs.summary(), flush=True)
    routes = {"plain": None, **({"speculative": drafter} if args.speculative else {})}
    request(model, processor, {"input_ids": mx.array([list(range(1, 40))])}, step=16)  # compile and warm up
    results, memory, peak_over_plain, peak_spread, drafter_cache = {}, {}, {}, {}, {}

    def write(complete):
        """The record so far: a run cut short keeps what it measured (complete: false)."""
        record = {
            "size": Path(args.pack).name if args.pack else args.size,
            **run_environment("bench_prefix.py", Path(args.pack).name if args.pack else f"synthetic {args.size}, seed 0"),
            "complete": complete,
            "runtime_speculative": status.speculative,
            "drafter_form": None if args.pack else args.drafter_form,
            "prefill_inverse": prefill_inverse,
            "follow_up_tokens": args.follow_up,
            "repeats": args.repeats,
            "by_route_step_context": results,
            "spec_extra_memory_gb": memory,
            "spec_peak_over_plain_gb": peak_over_plain,
            "spec_peak_over_plain_min_max_gb": peak_spread,
            "drafter_cache_gb": drafter_cache,
            "exact": all(r["exact"] for steps in results.values() for c in steps.values() for r in c.values())
                     if results else None,  # None: no cached turn was timed
            "seconds": round(time.time() - started, 1),
        }
        write_record(args.out, f"prefix-cache-{record['backend']}-{record['size']}", record, summary_markdown(record))
        return record

    # Memory first (it is quick), so that a run cut short in the timings still has it.
    if drafter is not None and args.memory_contexts:
        extra, over_plain, spread, cache_gb = spec_extra_memory(model, processor, drafter, args.memory_contexts,
                                                                args.step_sizes[0], args.repeats)
        memory.update(extra)
        peak_over_plain.update(over_plain)
        peak_spread.update(spread)
        drafter_cache.update(cache_gb)
        write(complete=False)
    for route, route_drafter in routes.items():
        for step in args.step_sizes:
            for context in args.contexts:
                result = measure(model, processor, context, step, args, route_drafter)
                print(f"{route} step {step} context {context}: {result}", flush=True)
                results.setdefault(route, {}).setdefault(str(step), {})[str(context)] = result
                write(complete=False)
    record = write(complete=True)
    print(summary_markdown(record))


def bracket(over, context, name) -> str:
    value = over.get(context, {}).get(name)
    return "" if value is None else f" ({value:+})"


def summary_markdown(r) -> str:
    lines = [
        f"# Time to first token with the exact prefix cache, {r['size']} shape on {r['backend']} ({r['device']})",
        "",
        f"Command: `{r['command']}`; mlx {r['versions']['mlx']}, mlx-vlm {r['versions']['mlx_vlm']}. "
        f"Second turn = first turn less its last {GENERATION_PROMPT} tokens + {r['follow_up_tokens']} tokens; "
        f"median of {r['repeats']}. {r.get('prefill_inverse', '')}.",
    ]
    if r["by_route_step_context"]:
        lines += ["", "| route | step | context | cold ms | cached ms | cached / cold | repeat ms | reused tokens | "
                  "store GB | logits bitwise |", "|---|---|---|---|---|---|---|---|---|---|"]
        for route, steps in r["by_route_step_context"].items():
            for step, contexts in steps.items():
                for context, m in contexts.items():
                    t = m["ttft_ms"]
                    lines.append(f"| {route} | {step} | {context} | {t['cold']} | {t['cached']} | "
                                 f"{m['cached_over_cold']:.2f} | {t['repeat']} | {m['cached_tokens']} / "
                                 f"{m['second_turn_tokens']} | {m['store_gb_after_first_turn']} | {m['exact']} |")
        lines += ["", f"Every cached first token bitwise the cold one: {r['exact']}."]
    lines.append("")
    if r["spec_extra_memory_gb"]:
        form = f"the {r['drafter_form']} drafter's" if r.get("drafter_form") else "the drafter's"
        lines += [f"Speculation's extra memory ({form} own weights, not the target's embedding and head it "
                  "shares, + how far a speculative request's peak goes past a plain one's, nothing where "
                  "it stays below; that difference itself in brackets; median over passes of plain, whole "
                  "and windowed requests, each against its own pass's plain one), GB:", "",
                  "| context | drafter's whole context | sliding window |", "|---|---|---|"]
        over = r.get("spec_peak_over_plain_gb", {})
        lines += [f"| {context} | {m['full']}{bracket(over, context, 'full')} | "
                  f"{m['sliding_window']}{bracket(over, context, 'sliding_window')} |"
                  for context, m in r["spec_extra_memory_gb"].items()]
        lines.append("")
    if r.get("drafter_cache_gb"):
        lines += ["The drafter's cache after a request (its context), GB, whole / window: "
                  + "; ".join(f"{context} tokens {m['full']} / {m['sliding_window']}"
                              for context, m in r["drafter_cache_gb"].items()) + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
