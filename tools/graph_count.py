"""Primitives of one decode step and of one verify forward (L = 2..8), counted on CPU.

    python tools/graph_count.py                  # tiny widths, the real 64-layer pattern
    python tools/graph_count.py --pack DIR       # a built pack
    python tools/graph_count.py --out evidence/  # writes graph-counts-cpu.json and .md
    python tools/graph_count.py --dense-dtype float32 --out evidence/   # the real file's layout:
                                                 # fp32 activations (graph-counts-cpu-fp32)

On MLX's CUDA backend a decode step is host-bound, about 15 us a primitive, so a verify
round costs about what it launches (../shared/notes/exact-fast-verify.md, section 3).
Counts are GPU-equivalent primitives, by this rule:
- the graph is every array the step leaves to evaluate: its outputs (greedy tokens,
  captured hidden states) and every array the layer caches and the round's cache
  transaction hold, built on caches evaluated after the prefill;
- view primitives (VIEWS: broadcast, reshape, slice, transpose, ...) launch nothing and
  are not counted; everything else counts once, a compiled (fused) kernel included;
- views are counted apart: those the step builds outside the ONE_LAUNCH calls (what CPU
  builds inside a call is taken out as its ops are). A view launches nothing but still costs
  the host a node to build and evaluate, on a step that is host-bound;
- each call of a ONE_LAUNCH function counts as 1: `mx.fast.rms_norm` (one kernel on
  GPUs, 8 or 9 ops on CPU) and dflash2_kernels' exact matmul (one kernel launch for
  all rows on CUDA and Metal, one stock call per row on CPU). The ops CPU builds such a
  call from are counted by rebuilding the call on evaluated zeros of the same shapes.
  Where CUDA's kernel does not take the call's inputs (fp32 rows where it is fp16's only)
  the call counts as the stock calls CUDA runs instead, as CPU builds them;
- attention counts as CPU builds it, MLX's unfused formula: what CUDA runs at the 27B's
  head dim 256 (on Metal it is one sdpa_vector kernel, so this overcounts there).
The decode step is generate_step's: a forward of one token, then the argmax of
logits - logsumexp. The verify forward is the round's `_dflash_verify_greedy` call
(verify forward and greedy tokens), stock before the runtime is installed, exact after.
"""

import argparse
import functools
import re
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from mlx_vlm.models.cache import KVCache

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import dflash2_kernel_conv32  # noqa: E402
import dflash2_kernel_fused  # noqa: E402
import dflash2_kernel_gdn  # noqa: E402
import dflash2_kernel_rope  # noqa: E402
import dflash2_kernels  # noqa: E402
from records import add_dense_dtype_argument, layout_suffix, run_environment, write_record  # noqa: E402

VIEWS = {
    "AsStrided", "Broadcast", "BroadcastAxes", "ExpandDims", "Flatten", "Reshape", "Slice",
    "Split", "Squeeze", "StopGradient", "Transpose", "Unflatten", "View",
}
# Kernel launches a call makes on CUDA, where CPU builds it from several ops (or, for
# dflash2_kernels' multi-position functions, from one stock call per position); None where
# CUDA's kernel does not take those inputs (a dtype it has no kernel for: fp32 rows where a
# kernel is fp16's only), so CUDA runs the stock calls too, counted as CPU builds them.
ONE_LAUNCH = (
    (mx.fast, "rms_norm", lambda *args, **kwargs: 1),
    (dflash2_kernels, "exact_rows", lambda *args, **kwargs: 1),
    (dflash2_kernels, "exact_rows_fp32", lambda *args, **kwargs: 1),  # fp32 rows (the real file's)
    # A matmul each, and one rotation for all the linears that share x (none at block 0).
    (dflash2_kernels, "exact_linear_group", lambda x, block, signs, matrices: len(matrices) + bool(block)),
    (dflash2_kernels, "rotate", lambda *args, **kwargs: 1),
    (dflash2_kernels, "rotate_group", lambda *args, **kwargs: 1),  # decode's, for MLX's matmuls
    (dflash2_kernels, "gdn_recurrence",
     lambda q, k, v, g, beta, state, *args, **kwargs: reach(dflash2_kernel_gdn.gdn_kernel_supports(
         "cuda", q, k, v, g, beta, state))),
    (dflash2_kernels, "dense_rows",
     lambda x, weight, *args, **kwargs: reach(dflash2_kernel_gdn.dense_kernel_supports(x, weight))),
    (dflash2_kernels, "conv_rows", lambda *args, **kwargs: reach(dflash2_kernel_fused.conv_kernel_supports(*args[:3]))),
    (dflash2_kernels, "rope_rows", lambda *args, **kwargs: reach(dflash2_kernel_rope.rope_kernel_supports(*args[:4]))),
    (dflash2_kernels, "add_rms_norm",
     lambda x, residual, weight, *args, **kwargs: reach(dflash2_kernel_fused.norm_kernel_supports(x, weight, residual))),
    (dflash2_kernels, "gated_rms_norm",
     lambda x, weight, eps, gate, *args, **kwargs: reach(dflash2_kernel_fused.norm_kernel_supports(x, weight, gate))),
    (dflash2_kernels, "gdn_gates",
     lambda *args, **kwargs: reach(dflash2_kernel_fused.gates_kernel_supports(*args[:4]))),
    # Scores, softmax and gather kernels, then decode's own p @ v call per query (fp16 or
    # fp32: the kernels' dtypes; at the 27B's head dim 256, whatever the tiny target's).
    (dflash2_kernels, "decode_attention_rows",
     lambda queries, *args, **kwargs: 3 + queries.shape[2] if queries.dtype in (mx.float16, mx.float32) else None),
)


def reach(taken: bool):
    """One launch where CUDA's kernel takes the call's inputs, else its stock calls (None)."""
    return 1 if taken else None


LENGTHS = range(2, 9)
PROMPT_TOKENS = 2


def graph_kinds(outputs) -> tuple[Counter, Counter]:
    """(non-view primitives, view primitives) of the graph of `outputs`, by kind (evaluated
    arrays are leaves)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "graph.dot"
        mx.export_to_dot(str(path), *outputs)
        labels = Counter(re.findall(r'label ="([^"]*)", shape=rectangle', path.read_text()))
    primitives = Counter({kind: n for kind, n in labels.items() if kind not in VIEWS})
    return primitives, labels - primitives


def signature(value):
    """A hashable stand-in for a call argument: arrays by shape and dtype."""
    if isinstance(value, mx.array):
        return ("array", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(signature(v) for v in value)
    if isinstance(value, dict):
        return ("dict", tuple((k, signature(v)) for k, v in sorted(value.items())))
    return value


def placeholder(sig):
    """Evaluated zeros for an array signature; other arguments as they were."""
    if isinstance(sig, tuple) and sig[:1] == ("array",):
        array = mx.zeros(sig[1], sig[2])
        mx.eval(array)
        return array
    if isinstance(sig, tuple) and sig[:1] == ("dict",):
        return {k: placeholder(v) for k, v in sig[1]}
    if isinstance(sig, tuple):
        return tuple(placeholder(v) for v in sig)
    return sig


def bindings(owner, name) -> list:
    """owner and every kernel module that binds the same function under `name`: the face
    re-exports what a family defines, and a family's own calls look up its own binding."""
    stock = getattr(owner, name)
    return [owner] + [module for module_name, module in sorted(sys.modules.items())
                      if module_name.startswith("dflash2_kernel") and module is not owner
                      and getattr(module, name, None) is stock]


@contextmanager
def one_launch_calls():
    """While active, records each call of a ONE_LAUNCH function: yields a Counter of
    (function, argument signatures). A call made inside another (the norms' rms_norm on
    CPU) is part of the outer call's launch, so it is not recorded again. fp32 convolution
    weights' positions take one nn.Conv1d over the window, as where CUDA's self-test proved
    it (dflash2_kernel_conv32), not CPU's call a position."""
    calls, swapped, inside = Counter(), [], []
    conv32, conv32_verdicts = dflash2_kernel_conv32._conv32_serving, dict(dflash2_kernel_conv32._conv32_serving)
    conv32.update({(dflash2_kernels.backend_name(), rows): True for rows in range(1, dflash2_kernels.MAX_ROWS + 1)})
    for owner, name, launches in ONE_LAUNCH:
        stock = getattr(owner, name)

        def counted(*args, stock=stock, launches=launches, **kwargs):
            count = None if inside else launches(*args, **kwargs)
            if count is None:  # inside another, or stock calls on CUDA: what it builds counts
                return stock(*args, **kwargs)
            calls[stock, signature(args), signature(kwargs), count] += 1
            inside.append(stock)
            try:
                return stock(*args, **kwargs)
            finally:
                inside.pop()

        for binding in bindings(owner, name):
            swapped.append((binding, name, stock))
            setattr(binding, name, counted)
    try:
        yield calls
    finally:
        for owner, name, stock in swapped:
            setattr(owner, name, stock)
        conv32.clear()
        conv32.update(conv32_verdicts)


@functools.cache
def call_kinds(function, args, kwargs) -> tuple[int, int]:
    """(non-view primitives, views) CPU builds one such call from, on evaluated placeholders."""
    output = function(*placeholder(args), **placeholder(kwargs))
    outputs = [out for out in (output if isinstance(output, tuple) else (output,)) if out is not None]
    primitives, views = graph_kinds(outputs)
    return sum(primitives.values()), sum(views.values())


def gpu_primitives(kinds: Counter, calls: Counter) -> int:
    """Non-view primitives, each ONE_LAUNCH call counted as the launches it makes."""
    folded = sum(
        times * (call_kinds(function, args, kwargs)[0] - launches)
        for (function, args, kwargs, launches), times in calls.items()
    )
    return sum(kinds.values()) - folded


def views_outside_calls(views: Counter, calls: Counter) -> int:
    """Views of the graph less those CPU built inside the ONE_LAUNCH calls."""
    inside = sum(times * call_kinds(function, args, kwargs)[1]
                 for (function, args, kwargs, _), times in calls.items())
    return sum(views.values()) - inside


def held_arrays(*objects) -> list:
    """Every mx.array reachable from the objects' attributes, lists, tuples and dicts."""
    found, seen, stack = [], set(), list(objects)
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, mx.array):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif hasattr(value, "__dict__") and not callable(value):
            stack.extend(vars(value).values())
    return found


def prompt_state(lm, prompt) -> list:
    """The caches' evaluated state after the prompt, fed a token at a time (CPU's
    chunked GatedDeltaNet prefill is slow, and the counts do not need it)."""
    cache = lm.make_cache()
    for token in prompt:
        lm(mx.array([[token]]), cache=cache)
    state = [c.state for c in cache]
    mx.eval(state)
    return state


def caches_at(lm, state) -> list:
    """Fresh, evaluated caches holding that state, the KV buffers with the spare room a
    decode step has between growth steps: every count starts from the same point."""
    cache = lm.make_cache()
    for layer_cache, layer_state in zip(cache, state):
        layer_cache.state = list(layer_state)  # a copy: ArraysCache keeps the list it is given
        if isinstance(layer_cache, KVCache):
            layer_cache.prefix_cache_reserve(layer_cache.offset + 1)
    mx.eval(held_arrays(cache))
    return cache


def count_decode_step(lm, cache, token) -> tuple[int, int, Counter]:
    """generate_step's step: one token's logits, the argmax of logits - logsumexp.
    (primitives, views outside the one-launch calls, CPU's primitives by kind)."""
    with one_launch_calls() as calls:
        logits = lm(mx.array([[token]]), cache=cache).logits[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    kinds, views = graph_kinds([mx.argmax(logprobs, axis=-1), *held_arrays(cache)])
    return gpu_primitives(kinds, calls), views_outside_calls(views, calls), kinds


def count_verify(lm, cache, block, taps) -> tuple[int, int, Counter]:
    """The round's verify call (whatever _dflash_verify_greedy is now), then aborted; built
    as one lazy graph (the exact forward's early hand-offs to the device off), so every
    primitive is still there to count."""
    from mlx_vlm.speculative import dflash as rounds
    from mlx_vlm.speculative.cache_state import abort_speculative_round

    import dflash2_verify

    with one_launch_calls() as calls, dflash2_verify.verify_eval_every(0):
        hidden, transaction, tokens = rounds._dflash_verify_greedy(
            lm, mx.array([block]), cache, taps, lambda logits: mx.argmax(logits, axis=-1)
        )
    kinds, views = graph_kinds([tokens, *hidden, *held_arrays(cache, transaction)])
    abort_speculative_round(transaction)
    return gpu_primitives(kinds, calls), views_outside_calls(views, calls), kinds


def count_steps(lm, taps, lengths=LENGTHS) -> dict:
    """Primitives of one decode step and of one verify call per block length, each on
    caches prefilled with the same prompt, and the views each builds outside the one-launch
    calls: {"decode", "verify": {L: n}, "decode_views", "verify_views": {L: n}, "kinds"}."""
    vocab = lm.model.embed_tokens.weight.shape[0]
    prompt = [t % vocab for t in range(1, PROMPT_TOKENS + 1)]
    block = [t % vocab for t in range(7, 7 + max(lengths, default=1))]
    with mx.stream(mx.cpu):  # the graph CPU builds, on any machine
        state = prompt_state(lm, prompt)
        decode, decode_views, decode_kinds = count_decode_step(lm, caches_at(lm, state), block[0])
        verify = {
            length: count_verify(lm, caches_at(lm, state), block[:length], taps)
            for length in lengths
        }
    return {
        "decode": decode,
        "verify": {length: n for length, (n, _, _) in verify.items()},
        "decode_views": decode_views,
        "verify_views": {length: views for length, (_, views, _) in verify.items()},
        "kinds": {"decode": decode_kinds, "verify": verify[max(lengths)][2] if verify else None},
    }


def load_target(pack, dense_dtype="float16"):
    """(model, drafter taps): a built pack, or the tiny4 synthetic target with 64 layers
    (its unpacked tensors in dense_dtype: float32 the real file's layout)."""
    if pack:
        from dflash2_pack import find_pack, load_pack

        model, _, drafter = load_pack(*find_pack(pack))
        return model, list(drafter.config.target_layer_ids) if drafter else []
    from make_synthetic_pack import build_target_model, drafter_config

    taps = drafter_config("tiny4", layers=64)["dflash_config"]["target_layer_ids"]
    return build_target_model("tiny4", seed=0, dense_dtype=dense_dtype, layers=64), list(taps)


def ratios(counts) -> dict:
    return {length: round(n / counts["decode"], 2) for length, n in counts["verify"].items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", help="pack folder (default: tiny4 synthetic target, 64 layers)")
    parser.add_argument("--out", default=str(REPO / "evidence"))
    add_dense_dtype_argument(parser)
    args = parser.parse_args()

    import dflash2_decode_arms
    import dflash2_runtime

    model, taps = load_target(args.pack, args.dense_dtype)
    lm = model.language_model
    stock = count_steps(lm, taps)
    status = dflash2_runtime.install(model)
    exact = count_steps(lm, taps)
    # Plain decode under each replacement arm a machine may choose at install. A compiled arm
    # launches its base arm's kernels, replayed from a trace; on CPU the ops its calls are
    # built from would fuse under mx.compile, so its count here would say nothing of a GPU's.
    decode_by_arm, decode_views_by_arm = {}, {}
    for arm in (arm for arm, parts in dflash2_decode_arms.DECODE_ARMS.items() if "compiled" not in parts):
        dflash2_decode_arms.use_decode_arm(arm)
        arm_counts = count_steps(lm, taps, lengths=())
        decode_by_arm[arm], decode_views_by_arm[arm] = arm_counts["decode"], arm_counts["decode_views"]
    dflash2_decode_arms.use_decode_arm(status.decode_path.arm)
    record = {
        **run_environment(
            "graph_count.py",
            Path(args.pack).name if args.pack else
            f"synthetic tiny widths, 64 layers, seed 0, {args.dense_dtype} unpacked tensors",
        ),
        "dense_dtype": None if args.pack else args.dense_dtype,
        "layers": len(lm.model.layers),
        "rule": "non-view primitives of everything the step leaves to evaluate; each call "
        "of a ONE_LAUNCH function counts as the kernel launches it makes on CUDA; stock "
        "attention as MLX's unfused formula",
        "runtime_status": {"speculative": status.speculative, "reason": status.reason},
        "decode_primitives": stock["decode"],
        "decode_primitives_by_arm": decode_by_arm,
        "verify_primitives_by_block": exact["verify"],
        "verify_ratio_by_block": ratios(exact),
        "stock_verify_primitives_by_block": stock["verify"],
        "stock_verify_ratio_by_block": ratios(stock),
        # Views built outside the one-launch calls (stock decode; exact and stock verify).
        "decode_views": stock["decode_views"],
        "decode_views_by_arm": decode_views_by_arm,
        "verify_views_by_block": exact["verify_views"],
        "stock_verify_views_by_block": stock["verify_views"],
        # As CPU builds them (rms_norm and the exact matmul unfolded), most first.
        "cpu_primitive_kinds": {
            "decode": dict(stock["kinds"]["decode"].most_common()),
            "exact_verify_8": dict(exact["kinds"]["verify"].most_common()),
        },
    }
    name = "graph-counts-cpu" + layout_suffix(None if args.pack else args.dense_dtype)
    write_record(args.out, name, record, summary_markdown(record))
    print(summary_markdown(record))


def summary_markdown(record) -> str:
    lines = [
        f"# Primitives per decode step and per verify forward ({record['pack']})",
        "",
        f"Command: `{record['command']}`  ",
        f"Versions: mlx {record['versions']['mlx']}, mlx-vlm {record['versions']['mlx_vlm']}, "
        f"Python {record['versions']['python']}; counted on CPU, {record['layers']} layers.  ",
        f"Rule: {record['rule']} (tools/graph_count.py).",
        "",
        f"Decode step: {record['decode_primitives']} primitives as stock mlx-vlm runs it; "
        "with the runtime's replacement arms (dflash2_decode_arms.DECODE_ARMS, chosen at install "
        "by measurement): "
        + ", ".join(f"{arm} {n}" for arm, n in record["decode_primitives_by_arm"].items())
        + ". Ratios below are to the stock decode step.",
        "",
        "| block L | exact verify | / decode | stock verify | / decode | views: exact verify | stock verify |",
        "|---|---|---|---|---|---|---|",
    ]
    for length, n in record["verify_primitives_by_block"].items():
        lines.append(
            f"| {length} | {n} | {record['verify_ratio_by_block'][length]} | "
            f"{record['stock_verify_primitives_by_block'][length]} | "
            f"{record['stock_verify_ratio_by_block'][length]} | "
            f"{record['verify_views_by_block'][length]} | {record['stock_verify_views_by_block'][length]} |"
        )
    lines += ["", f"Views (built outside the one-launch calls; they launch nothing but cost the host a "
                  f"node each): stock decode step {record['decode_views']}; "
              + "under the replacement arms: "
              + ", ".join(f"{arm} {n}" for arm, n in record["decode_views_by_arm"].items()) + "."]
    return "\n".join(lines + [""])


if __name__ == "__main__":
    main()
