"""Bitwise parity (and optionally speed) of dflash2_kernels on this machine.

For each kernel in --kernels (default qmv) runs its self-test at the chosen
shapes (rows / steps / queries 1..8, every input kind); with --bench it also
times the kernel against the stock calls it replaces (qmv32: the fp32 rows' matmul, against
MLX's single-row calls, its multi-row call and one row). qmv (the exact 2-bit
matmul): --bench times MLX's single-row and multi-row calls against the kernel
on the same shapes; with --tune (CUDA) it first times launch shapes and uses
the fastest per row count for everything after; writes
evidence/kernel-parity-<backend>.json and .md. The other kernels (rotate, gdn,
dense, attention, qmv32, conv32, rotate32) write evidence/kernel-parity-<kernel>-<backend>.json and .md.
Every figure comes from this run.

    python3 tools/lab/kernel_parity.py --shapes 27b --tune --bench
    python3 tools/lab/kernel_parity.py --kernels rotate,gdn,dense,attention,qmv32,conv32,rotate32 --shapes 27b --bench
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import dflash2_kernel_attention  # noqa: E402
import dflash2_kernel_base  # noqa: E402
import dflash2_kernel_conv32  # noqa: E402
import dflash2_kernel_gdn  # noqa: E402
import dflash2_kernel_linear  # noqa: E402
import dflash2_kernel_qmv  # noqa: E402
import dflash2_kernel_qmv32  # noqa: E402
import dflash2_kernel_rotate  # noqa: E402
import dflash2_kernels as dk  # noqa: E402
from make_synthetic_pack import target_config  # noqa: E402
from records import run_environment, write_record  # noqa: E402

BENCH_ROWS = (1, 2, 4, 8)
# CUDA launch shapes (output rows per warp, weight steps per load, prefetch[, warps
# the activation rows split over[, blocks the grid is capped at]]) tried by --tune, by
# activation rows.
# More output rows per warp (R) share each activation load among more outputs (at 8 rows
# and R 2 a lane loads 32 activation bytes per weight word it reads); splitting the
# activation rows over S warps keeps R * M / S accumulators in registers.
# Prefetch bit 1 (2, 3) asks L2 for a warp's whole weight slice first: at 8 rows 247
# registers leave 8 warps an SM, each with one chunk of loads in flight (about 5 KB an SM,
# where covering DRAM latency at full bandwidth takes about 26 KB). (Staging each step's
# activations in shared memory for the block's warps, tried in session 19, took up to twice
# as long at every row count and shape on the H200, and was removed. Session 22 timed three
# more, each bitwise: a lane's slots split over a warp pair (half the registers), L1 cache
# hints, and the weight words through a shared-memory cp.async ring 2 or 6 steps ahead; none
# was faster beyond the noise, whatever its registers, loads in flight or activation
# traffic (evidence/qmv-variants-cuda.md; code in commit c33fc80), and they were removed.
# Session 30 timed a fourth against the kernel as it is, in one process: the final butterfly
# sharing its sums out over the lanes (R * M / 2 shuffles and adds a level while the count
# is even, not R * M: the 8-row tile loop's SASS went from 1780 to 1603 instructions, about
# 5% of those a K = 5120 tile runs). Bitwise, and no faster: 8 rows at 1.30x MLX's single row
# per 27B step against 1.27x (a one-off script's log; no record kept). The time is not in the
# instruction count: ncu had the 8-row kernel issuing about every 3.5 cycles a warp with two
# warps a scheduler (evidence/ncu-qmv-cuda.md).
# Session 31 timed three more with compare_qmv_launch.py on the H200 (one-off variant files
# as --previous-kernels or the current arm; records not kept, each arm bitwise at every
# shape), per 27B step against the kernel as it is: the activation rows copied once per
# block into dynamic shared memory by cp.async where a capped grid gives a block several
# tiles (4, 7 and 8 rows at K 5120 and 6144; one kernel object per shared size, since
# cuda_kernel fixes shared_memory when made): 1.03x at 8 and 4 rows, 0.99 at 7; a register
# cap, __launch_bounds__(128, 3) through a header that redefines __global__, with 396 blocks
# (168 registers, 350 bytes of spills at 8 rows): 1.42x at 8 rows, 1.28 at 7; and at 8 rows
# the launches (1, 2, 1, 1, 396) and (1, 4, 1, 1, 528) (about 128 registers, twice the
# resident warps) 1.42-1.46x, (2, 2, 1, 2, 396) 1.01x. Neither shared activations nor
# occupancy is the limit; an output row's epilogue (16 half-to-float conversions and adds,
# then 5 shuffles and adds, each (output, activation) row pair) costs about half as many
# instructions as its K / 64 = 80 HFMA2s at K 5120. Session 32 tried a launch per 27B shape
# (a tool since removed, evidence/qmv-shapes-cuda.md; at 8 rows the table's launch leaves
# the 5120-row shapes 2.4 tiles a warp): at 8 rows five of the eight shapes kept the table's
# launch, and the fresh pass put the picks' sum at the table's time (1.00x). Session 34 baked
# K into the template (x's rows then a constant apart: immediate load offsets, and a tile's
# rows one base pointer apart; branch experiment/qmv-baked-k, its records
# evidence/qmv-launch-cuda-baked-k*.md there): bitwise at every shape; per 27B step against
# this kernel 0.91-0.95x at 3, 5, 6 and 7 rows, 0.98x at 2, but 1.05x at 4 and 1.02x at 8
# (24 bytes of spills: the 8-row K = 5120 shapes slower, K = 17408 0.93x), for a kernel per
# (rows, K) to build at start-up.)
# A fifth entry caps the grid at B blocks (about one wave of resident warps on the H200's 132
# SMs), each warp then taking several tiles of output rows and loading the next tile's first
# chunk during its last (with prefetch bit 0): in session 24's two interleaved runs
# (evidence/qmv-launch-cuda*.md) it took 0.84-0.94x the launch before at 4 and 7 rows, and at 8
# 0.98-0.99x, inside the runs' noise (identical launches differed by 4%).
TUNE_LAUNCHES = {
    1: [(2, 4, 0), (2, 4, 1), (2, 4, 0, 1, 660), (2, 4, 0, 1, 1320)],
    2: [(2, 2, 3), (2, 2, 1), (2, 2, 3, 1, 660), (2, 2, 1, 1, 660)],
    4: [(2, 2, 3), (2, 2, 1), (2, 2, 3, 1, 396), (2, 2, 1, 1, 396)],
    8: [(4, 2, 1, 2), (3, 2, 1, 2), (2, 2, 1), (4, 2, 1, 2, 264), (3, 2, 1, 2, 264), (4, 2, 1, 2, 528),
        (3, 4, 1, 2, 264), (2, 2, 1, 1, 264), (4, 2, 3, 2, 264)],
}
# R * M / S accumulators of 8 registers each: 16 take about 250 of a thread's 255
# registers at sm_90 (ptxas -v); 20 spill. A capped grid (B) takes a few more: offline
# (nvcc 13) (4, 2, 1, 2, 264) spills 32 bytes at 8 rows, (2, 2, 1, 1, 264) fits in 255.
MAX_ACCUMULATORS = 16
# Rows not timed take the choice of the nearest timed row count with as many
# or more rows, split over as many warps as divide their rows, up to the
# choice's, and with no more output rows per warp than MAX_ACCUMULATORS allows.
TUNE_FALLBACK = {3: 4, 5: 8, 6: 8, 7: 8}
TUNE_SHAPES = ((17408, 5120), (5120, 17408), (1024, 5120))
# Enough weight copies per timing that they do not sit in the 50 MB L2.
ROTATION_BYTES = 256 << 20
MAX_COPIES = 64
REPEATS = 15


def launch_for_rows(launch: tuple, rows: int) -> tuple:
    """A launch chosen for another row count: its split cut to a divisor of `rows` (and, for a
    capped grid, of a block's warps), its output rows per warp to what MAX_ACCUMULATORS allows."""
    rows_per_warp, chunk, prefetch, split, max_blocks = dflash2_kernel_qmv.cuda_launch_fields(launch)
    # a capped grid's split also divides a block's warps (_cuda_launch)
    split = max(s for s in range(1, split + 1)
                if rows % s == 0 and not (max_blocks and dflash2_kernel_qmv.CUDA_WARPS_PER_BLOCK % s))
    rows_per_warp = min(rows_per_warp, max(1, MAX_ACCUMULATORS // (rows // split)))
    if max_blocks:  # the grid's cap on blocks stays
        return rows_per_warp, chunk, prefetch, split, max_blocks
    return (rows_per_warp, chunk, prefetch) if split == 1 else (rows_per_warp, chunk, prefetch, split)


def weight_bytes(n, k):
    return n * k // 4 + 2 * n * (k // dflash2_kernel_qmv.GROUP_SIZE) * 2


def median_seconds(build, warmup=3, runs=REPEATS):
    """Medians after warm-up of: build() + mx.eval of its result, the eval alone
    (the device's work), and build() alone (graph building on the host)."""
    for _ in range(warmup):
        mx.eval(build())  # also compiles the kernels
    total, evals, builds = [], [], []
    for _ in range(runs):
        mx.synchronize()
        start = time.perf_counter()
        outputs = build()
        built = time.perf_counter()
        mx.eval(outputs)
        mx.synchronize()
        end = time.perf_counter()
        total.append(end - start)
        evals.append(end - built)
        builds.append(built - start)
    return statistics.median(total), statistics.median(evals), statistics.median(builds)


def served_cuda_matmul(kernels, launch):
    """A CUDA qmv module's kernel under `launch` as the served verify calls it: (the rows' layout,
    x -> x as handed over, and the call on them). Swizzled rows where the module has that
    layout (dflash2_kernels.exact_linear_rows; every 27B K allows it), else plain ones."""
    swizzled = hasattr(kernels, "swizzle_steps")
    layout = kernels.swizzle_steps if swizzled else (lambda x: x)

    def call(x, w, s, b):
        return kernels.cuda_matmul(x, w, s, b, launch=tuple(launch), **({"swizzled": True} if swizzled else {}))

    return layout, call


class Bench:
    """Weight copies of one shape, rotated past the L2, and 8 activation rows."""

    def __init__(self, n, k, key):
        self.n, self.k = n, k
        count = max(1, min(MAX_COPIES, -(-ROTATION_BYTES // weight_bytes(n, k))))
        keys = mx.random.split(key, count + 1)
        self.copies = [dflash2_kernel_qmv.make_weights(n, k, keys[i]) for i in range(count)]
        self.x = dflash2_kernel_base.make_inputs("normal", dk.MAX_ROWS, k, keys[-1])
        mx.eval(self.copies, self.x)
        self.want = dk.stock_rows(self.x, *self.copies[0])

    def time(self, name, rows, call, launch=None, layout=None):
        """call(x_rows, weight, scales, biases), x's rows in `layout` (x -> x); checked bitwise,
        then timed."""
        x = layout(self.x[:rows]) if layout else self.x[:rows]
        mx.eval(x)
        got = call(x, *self.copies[0])
        mismatches = dflash2_kernel_base._differing(got, self.want[:rows])
        # One pass over all weight copies, per call; the device's time only.
        seconds = median_seconds(lambda: [call(x, *copy) for copy in self.copies], warmup=1)[1]
        seconds /= len(self.copies)
        gb_per_s = weight_bytes(self.n, self.k) / seconds / 1e9
        print(f"  {name:24s} rows={rows} launch={launch} {seconds * 1e6:9.2f} us "
              f"{gb_per_s:7.1f} GB/s  mismatches={mismatches}", flush=True)
        return {
            "shape": [self.n, self.k],
            "name": name,
            "rows": rows,
            "launch": list(launch) if launch else None,
            "us": round(seconds * 1e6, 2),
            "gb_per_s": round(gb_per_s, 2),
            "mismatches_vs_single_rows": mismatches,
        }


def bench_shape(n, k, backend, key):
    bench = Bench(n, k, key)
    kernel = dflash2_kernel_qmv.backend_kernel(backend) or dk.stock_rows  # CPU: the per-row calls serve
    timings = [
        bench.time("mlx single row", 1, dflash2_kernel_qmv.stock_quantized_matmul),
        bench.time("mlx 8 rows (inexact)", 8, dflash2_kernel_qmv.stock_quantized_matmul),
        # Below 8 rows MLX's own multi-row call gave every row its single-row bits on the
        # H200 (the negative control's rows 1-7): its speed there, beside the exact kernel's.
        *(bench.time(f"mlx {rows} rows", rows, dflash2_kernel_qmv.stock_quantized_matmul) for rows in (2, 4)),
        bench.time("mlx 8 single-row calls", 8, dk.stock_rows),
    ]
    for rows in BENCH_ROWS:
        if backend == "cuda":
            layout, call = served_cuda_matmul(dk, dflash2_kernel_qmv.CUDA_LAUNCH[rows])
            timings.append(bench.time("exact kernel", rows, call, dflash2_kernel_qmv.CUDA_LAUNCH[rows], layout))
        else:
            timings.append(bench.time("exact kernel", rows, kernel))
    return timings


def measure_cuda_builds():
    """Seconds of the first call per row count (the NVRTC build: MLX keeps custom
    CUDA kernels in memory only, so every process pays this once per kernel)."""
    weight, scales, biases = dflash2_kernel_qmv.make_weights(16, 512, mx.random.key(0))
    x = dflash2_kernel_base.make_inputs("normal", dk.MAX_ROWS, 512, mx.random.key(1))
    mx.eval(weight, scales, biases, x)
    seconds = {}
    for rows in range(1, dk.MAX_ROWS + 1):
        start = time.perf_counter()
        try:
            mx.eval(dflash2_kernel_qmv.cuda_matmul(x[:rows], weight, scales, biases))
        except Exception as error:  # the self-test reports it
            print(f"build for {rows} rows failed: {error}", flush=True)
            continue
        seconds[rows] = round(time.perf_counter() - start, 2)
    print("kernel build seconds by rows:", seconds, flush=True)
    return seconds


def tune_cuda_launch(key):
    """Time every TUNE_LAUNCHES entry on TUNE_SHAPES; per row count keep the one
    with the least time per decode step (each shape weighted by its calls)."""
    timings, cost = [], {}
    for n, k in TUNE_SHAPES:
        print(f"tune N={n} K={k}", flush=True)
        key, shape_key = mx.random.split(key)
        bench = Bench(n, k, shape_key)
        for rows, launches in TUNE_LAUNCHES.items():
            for launch in launches:
                layout, call = served_cuda_matmul(dk, launch)
                try:
                    row = bench.time("tuning", rows, call, launch, layout)
                except Exception as error:  # a launch that fails to build is never picked
                    print(f"  launch {launch} failed: {error}", flush=True)
                    cost[rows, launch] = float("inf")
                    continue
                timings.append(row)
                if row["mismatches_vs_single_rows"]:
                    cost[rows, launch] = float("inf")  # never pick an inexact launch
                else:
                    cost[rows, launch] = cost.get((rows, launch), 0.0) + row["us"] * dflash2_kernel_qmv.PACKED_SHAPES_27B[n, k][1]
        del bench
    table = {
        rows: min(launches, key=lambda launch: cost[rows, launch])
        for rows, launches in TUNE_LAUNCHES.items()
    }
    table.update({rows: launch_for_rows(table[like], rows) for rows, like in TUNE_FALLBACK.items()})
    return timings, dict(sorted(table.items()))


def decode_step_estimate(timings):
    """Packed matmuls of one 27B decode step (or 8-row verify), summed from the
    per-shape timings above with each shape's calls per step."""
    def total(name, rows):
        seconds = 0.0
        for (n, k), (_, calls) in dflash2_kernel_qmv.PACKED_SHAPES_27B.items():
            match = [t for t in timings if t["shape"] == [n, k] and t["name"] == name and t["rows"] == rows]
            if not match:
                return None
            seconds += match[0]["us"] * calls
        return round(seconds / 1000, 3)

    return {
        "mlx single row (ms)": total("mlx single row", 1),
        "exact kernel, 1 row (ms)": total("exact kernel", 1),
        "mlx 8 rows, inexact (ms)": total("mlx 8 rows (inexact)", 8),
        "mlx 4 rows (ms)": total("mlx 4 rows", 4),
        "exact kernel, 4 rows (ms)": total("exact kernel", 4),
        "mlx 8 single-row calls (ms)": total("mlx 8 single-row calls", 8),
        "exact kernel, 8 rows (ms)": total("exact kernel", 8),
    }


def summary_markdown(record):
    lines = [
        f"# Exact 2-bit matmul parity on {record['backend']} ({record['device']})",
        "",
        f"Command: `{record['command']}`  ",
        f"Versions: mlx {record['versions']['mlx']}, mlx-vlm {record['versions']['mlx_vlm']}, "
        f"Python {record['versions']['python']}  ",
        (f"Self-test: none, {dflash2_kernel_base.NO_KERNEL} (no kernel to prove; each row is MLX's own single-row call)"
         if record["self_test"]["reason"] == dflash2_kernel_base.NO_KERNEL else
         f"Self-test: {'passed' if record['self_test']['ok'] else 'FAILED: ' + str(record['self_test']['reason'])}"
         f" in {record['self_test']['seconds']} s")
        + (f" (including building the kernels not built{' while tuning' if record.get('tuned') else ''})"
           if record["backend"] == "cuda" else ""),
        "",
    ]
    if record.get("kernel_build_seconds"):
        builds = record["kernel_build_seconds"]
        lines += [
            "First-call (NVRTC build) seconds by rows, default launch table: "
            + ", ".join(f"{rows}: {value}" for rows, value in builds.items())
            + f" (total {round(sum(builds.values()), 1)} s per process)",
            "",
        ]
    if "cuda_launch" in record:
        how = "chosen by this run's tuning (rows 'tuning' below)" if record["tuned"] else "as set in the code"
        lines += [
            f"CUDA launch per rows (R, C, prefetch[, S[, B]]), {how}, used for everything else here: "
            + ", ".join(f"{rows}: {tuple(launch)}" for rows, launch in record["cuda_launch"].items()),
            "",
        ]
    lines += [
        "Differing elements against one MLX single-row call per row, compared as bits,",
        f"rows 1..8, inputs {', '.join(dflash2_kernel_base.INPUT_KINDS)}; on CUDA both the kernel's layouts (plain rows, and",
        "the swizzled rows the rotation hands it) where K is a multiple of 512.",
        "",
        "| shape (N, K) | cases | exact kernel | MLX multi-row call (negative control) |",
        "|---|---|---|---|",
    ]
    shapes = sorted({tuple(c["shape"]) for c in record["cases"]})
    for shape in shapes:
        cases = [c for c in record["cases"] if tuple(c["shape"]) == shape]
        lines.append(
            f"| {shape} | {len(cases)} | {sum(c['mismatches'] for c in cases)} | "
            f"{sum(c['stock_mismatches'] or 0 for c in cases)} |"
        )
    lines.append(
        f"| all | {len(record['cases'])} | {record['exact_mismatches']} | {record['stock_mismatches']} |"
    )
    stock_by_rows = {}
    for case in record["cases"]:
        stock_by_rows[case["rows"]] = stock_by_rows.get(case["rows"], 0) + (case["stock_mismatches"] or 0)
    lines += ["", "MLX multi-row call, differing elements by rows: "
              + ", ".join(f"{rows}: {count}" for rows, count in sorted(stock_by_rows.items()))]
    if record.get("timings"):
        lines += [
            "",
            "## Timings",
            "",
            "Median per call over weight copies rotated past the L2 (weights from memory);",
            "GB/s counts the packed weights, scales and biases once.",
            "",
            "| shape (N, K) | what | rows | launch (R, C, prefetch[, S[, B]]) | us | GB/s | differing vs single rows |",
            "|---|---|---|---|---|---|---|",
        ]
        for t in record["timings"]:
            launch = tuple(t["launch"]) if t["launch"] else ""
            lines.append(
                f"| {tuple(t['shape'])} | {t['name']} | {t['rows']} | {launch} | {t['us']} | "
                f"{t['gb_per_s']} | {t['mismatches_vs_single_rows']} |"
            )
    if record.get("decode_step_estimate"):
        lines += ["", "## Packed matmuls of one 27B decode step (sum of the rows above x calls per step)", ""]
        for name, value in record["decode_step_estimate"].items():
            lines.append(f"- {name}: {value}")
    return "\n".join(lines) + "\n"


def timed_self_test(name, shapes, seed):
    """dflash2_kernels' self-test of one kernel, printed: (result, seconds)."""
    started = time.perf_counter()
    result = dk.SELF_TESTS[name][1](shapes=shapes, seed=seed)
    seconds = round(time.perf_counter() - started, 1)
    print(f"{name} self-test ok={result.ok} variant={result.variant} mismatches={result.mismatches} "
          f"stock_mismatches={result.stock_mismatches} cases={len(result.cases)} ({seconds} s)")
    if result.reason:
        print("reason:", result.reason)
    return result, seconds


def write_and_print(out, stem, record, markdown):
    write_record(out, stem, record, markdown)
    print(markdown)


# ---------------------------------------------------------------------------
# rotate, gdn, dense, attention


def conv_shape_27b() -> tuple:
    """(B, C, K) of the 27B's GatedDeltaNet convolution: its q, k and v channels, its taps."""
    text = target_config("27b")["text_config"]
    channels = 2 * text["linear_num_key_heads"] * text["linear_key_head_dim"] + \
        text["linear_num_value_heads"] * text["linear_value_head_dim"]
    return 1, channels, text["linear_conv_kernel_dim"]


CONV_SHAPE_27B = conv_shape_27b()
# Kernel -> (27B shapes, small shapes) of its self-test.
KERNEL_SHAPES = {
    "rotate": (dflash2_kernel_rotate.ROTATE_SHAPES_27B, dflash2_kernel_rotate.ROTATE_SHAPES_SMALL),
    "rotate_group": (dflash2_kernel_linear.ROTATE_GROUP_SHAPES_27B, ((1024, 512, 2), (2048, 2048, 3))),
    "rotate_group32": (dflash2_kernel_linear.ROTATE_GROUP_SHAPES_27B, ((1024, 512, 2), (2048, 2048, 3))),
    "gdn": (dflash2_kernel_gdn.GDN_SHAPES_27B, dflash2_kernel_gdn.GDN_SHAPES_SMALL),
    "dense": (dflash2_kernel_gdn.DENSE_SHAPES_27B, dflash2_kernel_gdn.DENSE_SHAPES_SMALL),
    "qmv32": (tuple(dflash2_kernel_qmv.PACKED_SHAPES_27B), dflash2_kernel_qmv32.FP32_SHAPES_SMALL),
    "conv32": ((CONV_SHAPE_27B,), dflash2_kernel_conv32.CONV32_SHAPES_SMALL),
    "rotate32": (dflash2_kernel_rotate.ROTATE_SHAPES_27B, dflash2_kernel_rotate.ROTATE_SHAPES_SMALL),
    "attention": ((dflash2_kernel_attention.ATTENTION_PACK_SHAPE,), dflash2_kernel_attention.ATTENTION_TINY_SHAPES),
}


def timing_row(what, shape, rows, kernel, stock, **more):
    """Median ms of kernel and stock (one call + mx.eval), and each one's build us."""
    ours, _, ours_build = median_seconds(kernel)
    theirs, _, theirs_build = median_seconds(stock)
    row = {
        "what": what, "shape": list(shape), "rows": rows, "kernel_ms": round(1e3 * ours, 4),
        "stock_ms": round(1e3 * theirs, 4), "ratio": round(theirs / ours, 2),
        "kernel_build_us": round(1e6 * ours_build, 1), "stock_build_us": round(1e6 * theirs_build, 1),
    }
    row.update({name: round(1e3 * median_seconds(call)[0], 4) for name, call in more.items()})
    print("  " + ", ".join(f"{key} {value}" for key, value in row.items()), flush=True)
    return row


def bench_kernel(name):
    """Timings of the drafts' report tables: the 27B shapes at a few row counts."""
    key = mx.random.key(1)
    rows_out = []
    if name in ("rotate", "rotate32"):
        inputs, rows_of = ((dflash2_kernel_rotate.make_rotate_inputs, "") if name == "rotate" else
                           (dflash2_kernel_base.make_inputs_fp32, ", fp32 rows"))
        for k, block in ((5120, 512), (17408, 1024)):
            signs = dflash2_kernel_rotate.make_signs("pm1", k, key)
            for rows in (1, 8):
                x = inputs("normal", rows, k, key)
                rows_out.append(timing_row(
                    "rotate vs the stock chain" + rows_of, (k, block), rows,
                    lambda: dk.rotate(x, block, signs), lambda: dflash2_kernel_rotate.stock_rotate(x, block, signs)))
    elif name == "gdn":
        shape = dflash2_kernel_gdn.GDN_SHAPES_27B[0]
        B, Hk, Hv, Dk, Dv = shape
        for steps in (1, 2, 4, 8):
            inputs = dflash2_kernel_gdn.make_gdn_inputs("normal", B, steps, Hk, Hv, Dk, Dv, key)
            mx.eval(inputs)
            rows_out.append(timing_row(
                "gdn_recurrence vs stock per-step", shape, steps,
                lambda: dk.gdn_recurrence(*inputs), lambda: dflash2_kernel_gdn.stock_recurrence(*inputs)))
    elif name == "dense":
        n, k = dflash2_kernel_gdn.DENSE_SHAPES_27B[0]
        for dtype, inputs in ((mx.float16, dflash2_kernel_base.make_inputs),
                              (mx.float32, dflash2_kernel_base.make_inputs_fp32)):
            weight = dflash2_kernel_gdn.make_dense_weight(n, k, mx.random.key(2), dtype)
            for rows in (1, 2, 4, 8):
                x = inputs("normal", rows, k, mx.random.key(3))
                mx.eval(weight, x)
                rows_out.append(timing_row(
                    f"dense_rows vs one-row calls, {str(dtype).removeprefix('mlx.core.')}", (n, k), rows,
                    lambda: dk.dense_rows(x, weight), lambda: dflash2_kernel_gdn.stock_dense_rows(x, weight),
                    mlx_multi_row_ms=lambda: x @ weight.T))
    elif name == "conv32":
        conv1d, window = dflash2_kernel_conv32.make_conv32_case("normal", *CONV_SHAPE_27B, key)
        for rows in (2, 4, 8):
            part = window[:, : CONV_SHAPE_27B[2] - 1 + rows]
            mx.eval(conv1d.parameters(), part)
            rows_out.append(timing_row(
                "one conv1d call over the block vs a call a position", CONV_SHAPE_27B, rows,
                lambda: dflash2_kernel_conv32.block_conv1d_rows(conv1d, part, rows),
                lambda: dflash2_kernel_conv32.stock_conv1d_rows(conv1d, part, rows)))
    elif name == "qmv32":
        for n, k in ((17408, 5120), (5120, 17408), (12288, 5120), (1024, 5120)):
            packed = dflash2_kernel_qmv.make_weights(n, k, mx.random.key(2))
            for rows in (1, 2, 4, 8):
                x = dflash2_kernel_base.make_inputs_fp32("normal", rows, k, mx.random.key(3))
                mx.eval(packed, x)
                rows_out.append(timing_row(
                    "exact_rows_fp32 vs single-row calls", (n, k), rows,
                    lambda: dk.exact_rows_fp32(x, *packed), lambda: dflash2_kernel_qmv.stock_rows(x, *packed),
                    mlx_multi_row_ms=lambda: dflash2_kernel_qmv.stock_quantized_matmul(x, *packed),
                    mlx_one_row_ms=lambda: dflash2_kernel_qmv.stock_quantized_matmul(x[:1], *packed)))
    elif name == "attention":
        shape = dflash2_kernel_attention.ATTENTION_PACK_SHAPE
        scale = shape[3] ** -0.5
        for first_length in (1030, 4000):
            for rows in range(1, dflash2_kernel_attention.MAX_QUERIES + 1):
                queries, keys, values, _, _ = dflash2_kernel_attention._make_case(shape, first_length, rows, "normal", key)
                mx.eval(queries, keys, values)
                args = (queries, keys, values, scale, first_length)
                rows_out.append(timing_row(
                    f"decode_attention_rows vs per-query calls, {first_length} keys", shape, rows,
                    lambda: dk.decode_attention_rows(*args), lambda: dflash2_kernel_attention.stock_attention_rows(*args)))
    return rows_out


def kernel_markdown(name, record):
    test = record["self_test"]
    lines = [
        f"# {name} parity on {record['backend']} ({record['device']})",
        "",
        f"Command: `{record['command']}`  ",
        f"Versions: mlx {record['versions']['mlx']}, mlx-vlm {record['versions']['mlx_vlm']}, "
        f"Python {record['versions']['python']}  ",
        f"Self-test: {'passed' if test['ok'] else 'FAILED'} in {test['seconds']} s"
        + (f"; serving variant {test['variant']}" if test["variant"] else "")
        + (f"; reason: {test['reason']}" if test["reason"] else ""),
        "",
        "Differing elements against decode's one-row / one-step / one-query calls, as bits.",
        "",
        "| shape | cases | differing |",
        "|---|---|---|",
    ]
    for shape in sorted({tuple(c["shape"]) for c in record["cases"]}):
        cases = [c for c in record["cases"] if tuple(c["shape"]) == shape]
        lines.append(f"| {shape} | {len(cases)} | {sum(c['mismatches'] for c in cases)} |")
    if test["variants"]:
        lines += ["", "Variants, differing elements: "
                  + ", ".join(f"{v}: {n}" for v, n in test["variants"].items())]
    controls = test["controls"] or {"stock multi-row path": test["stock_mismatches"]}
    lines += ["", "Negative controls, differing elements (-1: raised): "
              + ", ".join(f"{c}: {n}" for c, n in controls.items())]
    if record.get("timings"):
        columns = list(record["timings"][0])
        lines += ["", "## Timings", "", "Median of one call + mx.eval after warm-up; build = the call alone.", "",
                  "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for row in record["timings"]:
            lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def run_kernel(name, args, backend):
    """Self-test (and with --bench time) one of KERNEL_SHAPES' kernels; True if it passed."""
    large, small = KERNEL_SHAPES[name]
    shapes = list(large) + list(small) if args.shapes == "27b" else list(small)
    result, seconds = timed_self_test(name, shapes, args.seed)
    record = {
        "kernel": name,
        "backend": backend,
        **run_environment("lab/kernel_parity.py", f"{args.shapes} kernel shapes"),
        "command": f"python3 tools/lab/kernel_parity.py --kernels {name} --shapes {args.shapes} "
                   f"--seed {args.seed}" + " --bench" * args.bench,
        "self_test": {
            "ok": result.ok, "reason": result.reason, "seconds": seconds, "variant": result.variant,
            "mismatches": result.mismatches, "stock_mismatches": result.stock_mismatches,
            "variants": result.variants, "controls": result.controls,
        },
        "cases": result.cases,
    }
    if args.bench:
        record["timings"] = bench_kernel(name)
    write_and_print(args.out, f"kernel-parity-{name}-{backend}", record, kernel_markdown(name, record))
    return result.ok


# ---------------------------------------------------------------------------
# qmv


def run_qmv(args, backend):
    """The exact 2-bit matmul's parity (and --tune, --bench); True if it passed."""
    # The 27B run also takes the small default shapes: they cover K % 512 != 0
    # and a partial last warp, which no 27B matrix has.
    bench_shapes = list(dflash2_kernel_qmv.PACKED_SHAPES_27B) if args.shapes == "27b" else list(dflash2_kernel_qmv.DEFAULT_SHAPES)
    shapes = bench_shapes + list(dflash2_kernel_qmv.DEFAULT_SHAPES) * (args.shapes == "27b")
    command = f"python3 tools/lab/kernel_parity.py --shapes {args.shapes} --seed {args.seed}"
    command += " --bench" * args.bench + " --tune" * args.tune

    builds = measure_cuda_builds() if backend == "cuda" else None
    tuning = []
    tuned = args.tune and backend == "cuda"
    if tuned:
        tuning, table = tune_cuda_launch(mx.random.key(args.seed + 2))
        dflash2_kernel_qmv.CUDA_LAUNCH.update(table)
        dflash2_kernel_qmv._cuda_launch.cache_clear()  # measure_cuda_builds cached the table before tuning's
        print("tuned CUDA_LAUNCH =", table)

    result, seconds = timed_self_test("qmv", shapes, args.seed)

    record = {
        "backend": backend,
        **run_environment("lab/kernel_parity.py", f"{args.shapes} kernel shapes"),
        "command": command,
        "cuda_kernel_source": dflash2_kernel_qmv.cuda_qmv_source_digest(),
        "exact_mismatches": result.mismatches,
        "stock_mismatches": result.stock_mismatches,
        "self_test": {"ok": result.ok, "reason": result.reason, "seconds": seconds},
        "cases": result.cases,
    }
    if backend == "cuda":
        record["cuda_launch"] = {rows: list(launch) for rows, launch in dflash2_kernel_qmv.CUDA_LAUNCH.items()}
        record["tuned"] = tuned
        record["kernel_build_seconds"] = builds
    if args.bench or tuning:
        timings = list(tuning)
        key = mx.random.key(args.seed + 1)
        for n, k in bench_shapes if args.bench else []:
            print(f"bench N={n} K={k}", flush=True)
            key, shape_key = mx.random.split(key)
            timings += bench_shape(n, k, backend, shape_key)
        record["timings"] = timings
        if args.bench and args.shapes == "27b":
            record["decode_step_estimate"] = decode_step_estimate(timings)

    write_and_print(args.out, f"kernel-parity-{backend}", record, summary_markdown(record))
    return result.ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="qmv",
                        help=f"comma-separated, of: qmv, {', '.join(KERNEL_SHAPES)} (default qmv)")
    parser.add_argument("--shapes", choices=["tiny", "27b"], default="tiny")
    parser.add_argument("--bench", action="store_true", help="time the calls too")
    parser.add_argument("--tune", action="store_true",
                        help="qmv on CUDA: time launch shapes first, use the fastest for the rest")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "evidence"))
    args = parser.parse_args()
    kernels = [name.strip() for name in args.kernels.split(",") if name.strip()]
    unknown = [name for name in kernels if name != "qmv" and name not in KERNEL_SHAPES]
    if unknown or not kernels:
        parser.error(f"--kernels: unknown {unknown}; choose from qmv, {', '.join(KERNEL_SHAPES)}")

    backend = dk.backend_name()
    passed = [run_qmv(args, backend) if name == "qmv" else run_kernel(name, args, backend)
              for name in kernels]
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
