"""The exact packed matmul's GPU time per 27B decode step under two CUDA launch tables, side by side.

    python tools/lab/compare_qmv_launch.py --previous '{"8": [4, 2, 1, 2]}' --out evidence/
    git show REV:dflash2_kernel_qmv.py > /tmp/before.py    # another revision's kernel as well
    python tools/lab/compare_qmv_launch.py --previous '{}' --previous-kernels /tmp/before.py --out /tmp/

CUDA only. For every packed shape of the 27B target (weights rotated past the L2, as
tools/lab/kernel_parity.py times them) and every row count 2..8, times MLX's single-row call,
the kernel under the previous launch and under dflash2_kernel_qmv.CUDA_LAUNCH (each on rows in
the layout the served verify hands it: swizzled, where the kernel has that layout), interleaved
(ABAB, warm-up first, median of the repeats with min and max); each is checked bitwise
against MLX's single-row calls first. With --previous-kernels the previous arm runs that
file's CUDA kernel (its own launch table for rows --previous leaves out): a kernel change
timed against the kernel before it in one process. Per row count it sums each arm over the shapes,
weighted by their calls in a decode step: the figure issue 13 holds the 8-row kernel to
(at most 1.2x MLX's single row). Writes evidence/qmv-launch-<backend>.json and .md.
"""

import argparse
import importlib.util
import json
import math
import statistics
import time
from pathlib import Path

import mlx.core as mx

import kernel_parity  # first: it puts the repository on sys.path
import dflash2_kernel_qmv as qmv  # noqa: E402
import dflash2_timing  # noqa: E402
from records import run_environment, write_record  # noqa: E402

ROWS = tuple(range(2, qmv.MAX_ROWS + 1))


def pass_ms(call, x, copies):
    """ms of one call per weight copy (one pass past the L2), the device's time per call."""
    def run():
        mx.synchronize()
        start = time.perf_counter()
        one_pass(call, x, copies)()
        mx.synchronize()
        return 1000 * (time.perf_counter() - start) / len(copies)

    return run


def one_pass(call, x, copies):
    """One call per weight copy, evaluated."""
    return lambda: mx.eval([call(x, *copy) for copy in copies])


def kernel_us(passes: dict, calls: int, repeats: int) -> dict:
    """Each arm's GPU time per call in us (median, min and max over its kernels' launches),
    as CUPTI reads it through PyTorch's profiler over `repeats` interleaved passes: the device's
    time alone, none of the host's (the wall-clock figures carry the host's launch cost where a
    kernel is shorter than it). Kernels are told apart by name, learnt from one profiled pass of
    each arm; an arm whose pass launched other than one kernel a call, or a kernel another
    arm launches too, gets None. MLX's graph runs a pass's independent calls side by side,
    which lengthens each launch: busy_per_call (the time in which any of the arm's kernels ran,
    over its calls) is the device's time per call with that overlap counted once."""
    from torch.profiler import ProfilerActivity, profile

    from profile_verify import busy_us

    def launched(passes_in_order):
        with profile(activities=[ProfilerActivity.CUDA]) as recorded:
            for run in passes_in_order:
                run()
            mx.synchronize()
        return [(event.name, event.time_range.start, event.time_range.end) for event in recorded.events()
                if str(event.device_type).endswith("CUDA")]

    names = {}
    for arm, run in passes.items():
        kernels = launched([run])
        names[arm] = {name for name, *_ in kernels} if len(kernels) == calls else set()
    order = [passes[arm] for repeat in range(repeats) for arm in dflash2_timing.pass_order(list(passes), repeat)]
    intervals = {}
    for name, start, end in launched(order):
        intervals.setdefault(name, []).append((start, end))
    result = {}
    for arm, own in names.items():
        shared = any(own & other for other_arm, other in names.items() if other_arm != arm)
        spans = [span for name in own for span in intervals.get(name, [])]
        samples = [end - start for start, end in spans]
        result[arm] = None if shared or not samples else {
            "median": round(statistics.median(samples), 2), "min": round(min(samples), 2), "max": round(max(samples), 2),
            "busy_per_call": round(busy_us(spans) / (repeats * calls), 2)}
    return result


def load_kernels(path: Path):
    """Another revision's dflash2_kernel_qmv.py (dflash2_kernels.py before the split) as a
    module of its own (MLX names a custom kernel's module by a hash of its source, so both
    kernels build side by side)."""
    spec = importlib.util.spec_from_file_location("previous_dflash2_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_shape(n, k, previous: dict, repeats: int, key, previous_kernels=qmv, cupti_repeats=0) -> dict:
    bench = kernel_parity.Bench(n, k, key)
    one = bench.x[:1]
    arms, mismatches = {"mlx single row": pass_ms(qmv.stock_quantized_matmul, one, bench.copies)}, {}
    passes = {"mlx single row": one_pass(qmv.stock_quantized_matmul, one, bench.copies)}
    for rows in ROWS:
        for name, kernels, launch in (("previous", previous_kernels, previous[rows]),
                                      ("current", qmv, qmv.CUDA_LAUNCH[rows])):
            # Each kernel reads its rows as the served verify hands them.
            layout, call = kernel_parity.served_cuda_matmul(kernels, launch)
            x = layout(bench.x[:rows])
            mx.eval(x)
            got = call(x, *bench.copies[0])
            mismatches[f"{name} {rows}"] = qmv._differing(got, bench.want[:rows])
            arms[f"{name} {rows}"] = pass_ms(call, x, bench.copies)
            passes[f"{name} {rows}"] = one_pass(call, x, bench.copies)
    timings = dflash2_timing.interleaved_ms(arms, repeats)
    print(f"N={n} K={k}: " + ", ".join(f"{name} {t['median'] * 1000:.1f} us" for name, t in timings.items()), flush=True)
    shape = {"timings_us": timings_us(timings), "mismatches_vs_single_rows": mismatches}
    if cupti_repeats:
        shape["kernel_us"] = kernel_us(passes, len(bench.copies), cupti_repeats)
    return shape


def timings_us(timings: dict) -> dict:
    """interleaved_ms's ms per arm as us, median, min and max, for a record."""
    return {name: {stat: round(t[stat] * 1000, 2) for stat in ("median", "min", "max")}
            for name, t in timings.items()}


def per_step_ms(shapes: dict, timings: str, arm_of, stat: str = "median") -> float:
    """ms per decode step: each shape's `stat` of shapes[shape][timings][arm_of(n, k)] x the
    shape's calls per step, summed with fsum (exact, so the figure does not depend on the
    Python: 3.12's sum compensates, 3.11's does not, and a total on a rounding boundary came
    out 0.001 apart)."""
    return round(math.fsum(shapes[f"{n}x{k}"][timings][arm_of(n, k)][stat] * calls
                           for (n, k), (_, calls) in qmv.PACKED_SHAPES_27B.items()) / 1000, 3)


def step_sums(shapes: dict, timings: str = "timings_us", stat: str = "median") -> dict:
    """ms per decode step of each arm: its per-shape `stat` x the shape's calls per step (arms
    without that figure at some shape left out)."""
    names = next(iter(shapes.values()))[timings]
    return {name: per_step_ms(shapes, timings, lambda n, k, name=name: name, stat) for name in names
            if all((entry[timings][name] or {}).get(stat) is not None for entry in shapes.values())}


def summary_markdown(record: dict) -> str:
    sums = record["step_ms"]
    single = sums["mlx single row"]
    lines = [
        f"# Exact packed matmul per 27B decode step, two launch tables, on {record['backend']} ({record['device']})", "",
        f"Command: `{record['command']}`; code {record['code']}. Weights rotated past the L2; arms interleaved, "
        f"{record['repeats']} repeats after a warm-up, median per shape, summed over the 27B shapes by their "
        f"calls per step. Differing elements against MLX's single-row calls: {record['mismatches']}.", "",
        f"MLX single row: {single:.3f} ms per step.", "",
        "| rows | previous launch | ms | / MLX single row | current launch | ms | / MLX single row | current / previous |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rows in record["rows"]:
        before, after = sums[f"previous {rows}"], sums[f"current {rows}"]
        lines.append(f"| {rows} | {tuple(record['previous'][str(rows)])} | {before:.3f} | {before / single:.2f} "
                     f"| {tuple(record['current'][str(rows)])} | {after:.3f} | {after / single:.2f} | {after / before:.2f} |")
    same = [str(rows) for rows in record["rows"] if record["previous"][str(rows)] == record["current"][str(rows)]]
    previous_source = record.get("previous_kernel_source", record["cuda_kernel_source"])
    if previous_source != record["cuda_kernel_source"]:
        lines += ["", f"The previous arm ran another kernel: source {previous_source} ({record['previous_kernels']}), the "
                  f"current arm {record['cuda_kernel_source']}. Rows with the same launch in both arms compare "
                  "the two kernels alone."]
    elif same:
        lines += ["", f"Rows {', '.join(same)}: the same launch in both arms, a control: their current / previous "
                  "is the comparison's own noise."]
    for key, what in (("kernel_step_ms", "the median launch per shape; MLX's graph runs a pass's independent "
                       "calls side by side, which lengthens each launch, the more the shorter the kernel"),
                      ("busy_step_ms", "per shape, the time in which any of the arm's kernels ran, over its calls: "
                       "overlapping launches counted once")):
        sums = record.get(key)
        if not sums or "mlx single row" not in sums:
            continue
        single = sums["mlx single row"]
        lines += ["", f"GPU time alone (CUPTI through PyTorch's profiler, {record['cupti_repeats']} interleaved passes "
                  f"after the wall-clock ones), {what}; summed likewise. MLX single row {single:.3f} ms per step.", "",
                  "| rows | previous ms | / MLX single row | current ms | / MLX single row | current / previous |",
                  "|---|---|---|---|---|---|"]
        for rows in record["rows"]:
            before, after = sums.get(f"previous {rows}"), sums.get(f"current {rows}")
            cells = [f"{t:.3f} | {t / single:.2f}" if t else "- | -" for t in (before, after)]
            lines.append(f"| {rows} | {cells[0]} | {cells[1]} | " + (f"{after / before:.2f} |" if before and after else "- |"))
    lines += ["", "Per shape, us (median, min-max):", "", "| shape | arm | median | min | max |", "|---|---|---|---|---|"]
    for shape, entry in record["shapes"].items():
        for name, t in entry["timings_us"].items():
            if name == "mlx single row" or name.endswith(" 8"):
                lines.append(f"| {shape} | {name} | {t['median']} | {t['min']} | {t['max']} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--previous", required=True,
                        help="JSON: rows -> launch (R, C, prefetch[, S[, B]]); rows not named take the previous "
                             "kernel's CUDA_LAUNCH")
    parser.add_argument("--previous-kernels", type=Path,
                        help="another revision's dflash2_kernel_qmv.py: the previous arm runs its CUDA kernel")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cupti-repeats", type=int, default=0,
                        help="then this many interleaved passes under PyTorch's profiler: each arm's GPU time alone")
    parser.add_argument("--out", default=str(kernel_parity.REPO / "evidence"))
    args = parser.parse_args()
    if qmv.backend_name() != "cuda":
        parser.error("CUDA only: the launch tables are the CUDA kernel's")
    previous_kernels = load_kernels(args.previous_kernels) if args.previous_kernels else qmv
    previous = {rows: tuple(previous_kernels.CUDA_LAUNCH[rows]) for rows in ROWS}
    previous.update({int(rows): tuple(launch) for rows, launch in json.loads(args.previous).items()})
    key = mx.random.key(0)
    shapes = {}
    for n, k in qmv.PACKED_SHAPES_27B:
        key, shape_key = mx.random.split(key)
        shapes[f"{n}x{k}"] = time_shape(n, k, previous, args.repeats, shape_key, previous_kernels, args.cupti_repeats)
    record = {
        **run_environment("lab/compare_qmv_launch.py", "27b kernel shapes"),
        "cuda_kernel_source": qmv.cuda_qmv_source_digest(), "repeats": args.repeats, "rows": list(ROWS),
        "previous_kernel_source": previous_kernels.cuda_qmv_source_digest(),
        "previous_kernels": args.previous_kernels.name if args.previous_kernels else None,
        "previous": {str(rows): list(launch) for rows, launch in previous.items()},
        "current": {str(rows): list(qmv.CUDA_LAUNCH[rows]) for rows in ROWS},
        "mismatches": sum(sum(entry["mismatches_vs_single_rows"].values()) for entry in shapes.values()),
        "shapes": shapes,
    }
    record["step_ms"] = step_sums(shapes)
    if args.cupti_repeats:
        record["cupti_repeats"] = args.cupti_repeats
        record["kernel_step_ms"] = step_sums(shapes, "kernel_us")
        record["busy_step_ms"] = step_sums(shapes, "kernel_us", "busy_per_call")
    markdown = summary_markdown(record)
    write_record(args.out, f"qmv-launch-{record['backend']}", record, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
