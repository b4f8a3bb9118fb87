"""Bitwise parity (and optionally speed) of dflash2_kernels on this machine.

Runs dflash2_kernels.self_test at the chosen shapes (rows 1..8, every input
kind), and with --bench times MLX's single-row and multi-row calls against the
exact kernel on the same shapes. Writes evidence/kernel-parity-<backend>.json
and .md; every figure in them comes from this run.

    python3 tools/kernel_parity.py --shapes 27b --bench --sweep
"""

import argparse
import importlib.metadata
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import dflash2_kernels as dk  # noqa: E402

# (N, K) of every packed matrix of the 27B target, with the calls per decode step.
SHAPES_27B = {
    (12288, 5120): ("attention q_proj", 16),
    (1024, 5120): ("attention k_proj, v_proj", 32),
    (5120, 6144): ("attention o_proj, GDN out_proj", 64),
    (10240, 5120): ("GDN in_proj_qkv", 48),
    (6144, 5120): ("GDN in_proj_z", 48),
    (17408, 5120): ("MLP gate_proj, up_proj", 128),
    (5120, 17408): ("MLP down_proj", 64),
    (248320, 5120): ("lm_head", 1),
}
BENCH_ROWS = (1, 2, 4, 8)
# Launch shapes (output rows per warp, weight steps per load) tried by --sweep.
SWEEP = {
    1: [(1, 4), (2, 4), (4, 2), (4, 4), (8, 2)],
    2: [(2, 2), (2, 4), (4, 2), (8, 1)],
    4: [(1, 4), (2, 2), (2, 4), (4, 1)],
    8: [(1, 2), (1, 4), (2, 1), (2, 2)],
}
SWEEP_SHAPES = ((17408, 5120), (5120, 17408), (1024, 5120))
# Enough weight copies per timing that they do not sit in the 50 MB L2.
ROTATION_BYTES = 256 << 20
MAX_COPIES = 64
REPEATS = 15


def weight_bytes(n, k):
    return n * k // 4 + 2 * n * (k // dk.GROUP_SIZE) * 2


def median_seconds_per_call(call, copies):
    """Median over REPEATS of one pass over all weight copies, per call."""
    mx.eval([call(*copy) for copy in copies])  # warm-up, compiles kernels
    times = []
    for _ in range(REPEATS):
        outputs = [call(*copy) for copy in copies]
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(outputs)
        mx.synchronize()
        times.append((time.perf_counter() - start) / len(copies))
    return statistics.median(times)


def bench_shape(n, k, backend, sweep, key):
    copies_needed = max(1, min(MAX_COPIES, -(-ROTATION_BYTES // weight_bytes(n, k))))
    keys = mx.random.split(key, copies_needed + 1)
    copies = [dk.make_weights(n, k, keys[i]) for i in range(copies_needed)]
    x = dk.make_inputs("normal", dk.MAX_ROWS, k, keys[-1])
    mx.eval(copies, x)
    want = dk.stock_rows(x, *copies[0])
    rows_out = []

    def record(name, rows, call, launch=None):
        got = call(*copies[0])
        mismatches = (got.view(mx.uint16) != want[:rows].view(mx.uint16)).sum().item()
        seconds = median_seconds_per_call(call, copies)
        rows_out.append(
            {
                "shape": [n, k],
                "name": name,
                "rows": rows,
                "launch": list(launch) if launch else None,
                "us": round(seconds * 1e6, 2),
                "gb_per_s": round(weight_bytes(n, k) / seconds / 1e9, 2),
                "mismatches_vs_single_rows": mismatches,
            }
        )
        print(f"  {name:28s} rows={rows} launch={launch} {seconds * 1e6:9.2f} us  "
              f"{weight_bytes(n, k) / seconds / 1e9:7.1f} GB/s  mismatches={mismatches}", flush=True)

    record("mlx single row", 1, lambda w, s, b: dk.stock_quantized_matmul(x[:1], w, s, b))
    record("mlx 8 rows (inexact)", 8, lambda w, s, b: dk.stock_quantized_matmul(x, w, s, b))
    record("mlx 8 single-row calls", 8, lambda w, s, b: dk.stock_rows(x, w, s, b))
    kernel = dk.backend_kernel(backend)
    for rows in BENCH_ROWS:
        record("exact kernel", rows, lambda w, s, b, rows=rows: kernel(x[:rows], w, s, b))
    if sweep and backend == "cuda" and (n, k) in SWEEP_SHAPES:
        for rows, launches in SWEEP.items():
            for launch in launches:
                record("sweep", rows, lambda w, s, b, rows=rows, launch=launch:
                       dk.cuda_matmul(x[:rows], w, s, b, launch=launch), launch)
    del copies
    return rows_out


def decode_step_estimate(timings):
    """Packed matmuls of one 27B decode step (or 8-row verify), summed from the
    per-shape timings above with each shape's calls per step."""
    def total(name, rows):
        seconds = 0.0
        for (n, k), (_, calls) in SHAPES_27B.items():
            match = [t for t in timings if t["shape"] == [n, k] and t["name"] == name and t["rows"] == rows]
            if not match:
                return None
            seconds += match[0]["us"] * calls
        return round(seconds / 1000, 3)

    return {
        "mlx single row (ms)": total("mlx single row", 1),
        "exact kernel, 1 row (ms)": total("exact kernel", 1),
        "mlx 8 rows, inexact (ms)": total("mlx 8 rows (inexact)", 8),
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
        f"Self-test: {'passed' if record['self_test']['ok'] else 'FAILED: ' + str(record['self_test']['reason'])}"
        f" in {record['self_test']['seconds']} s (kernel builds included)",
        "",
        "Differing elements against one MLX single-row call per row, compared as bits,",
        f"rows 1..8, inputs {', '.join(dk.INPUT_KINDS)}.",
        "",
        "| shape (N, K) | cases | exact kernel | MLX multi-row call (negative control) |",
        "|---|---|---|---|",
    ]
    shapes = sorted({tuple(c["shape"]) for c in record["cases"]})
    for shape in shapes:
        cases = [c for c in record["cases"] if tuple(c["shape"]) == shape]
        lines.append(
            f"| {shape} | {len(cases)} | {sum(c['mismatches'] for c in cases)} | "
            f"{sum(c['stock_mismatches'] for c in cases)} |"
        )
    lines.append(
        f"| all | {len(record['cases'])} | {record['exact_mismatches']} | {record['stock_mismatches']} |"
    )
    stock_by_rows = {}
    for case in record["cases"]:
        stock_by_rows[case["rows"]] = stock_by_rows.get(case["rows"], 0) + case["stock_mismatches"]
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
            "| shape (N, K) | what | rows | launch (R, C) | us | GB/s | differing vs single rows |",
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=["tiny", "27b"], default="tiny")
    parser.add_argument("--bench", action="store_true", help="time the calls too")
    parser.add_argument("--sweep", action="store_true", help="with --bench: time CUDA launch shapes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "evidence"))
    args = parser.parse_args()

    backend = dk.backend_name()
    # The 27B run also takes the small default shapes: they cover K % 512 != 0
    # and a partial last warp, which no 27B matrix has.
    bench_shapes = list(SHAPES_27B) if args.shapes == "27b" else list(dk.DEFAULT_SHAPES)
    shapes = bench_shapes + list(dk.DEFAULT_SHAPES) * (args.shapes == "27b")
    command = f"python3 tools/kernel_parity.py --shapes {args.shapes} --seed {args.seed}"
    command += " --bench" * args.bench + " --sweep" * args.sweep

    started = time.perf_counter()
    result = dk.self_test(shapes=shapes, seed=args.seed)
    seconds = round(time.perf_counter() - started, 1)
    print(f"self-test ok={result.ok} mismatches={result.mismatches} "
          f"stock_mismatches={result.stock_mismatches} cases={len(result.cases)} ({seconds} s)")
    if result.reason:
        print("reason:", result.reason)

    record = {
        "backend": backend,
        "device": mx.device_info().get("device_name", platform.processor()),
        "versions": {
            "mlx": mx.__version__,
            "mlx_vlm": importlib.metadata.version("mlx-vlm"),
            "python": platform.python_version(),
        },
        "command": command,
        "exact_mismatches": result.mismatches,
        "stock_mismatches": result.stock_mismatches,
        "self_test": {"ok": result.ok, "reason": result.reason, "seconds": seconds},
        "cases": result.cases,
    }
    if backend == "cuda":
        record["cuda_launch"] = {rows: list(launch) for rows, launch in dk.CUDA_LAUNCH.items()}
    if args.bench:
        timings = []
        key = mx.random.key(args.seed + 1)
        for n, k in bench_shapes:
            print(f"bench N={n} K={k}", flush=True)
            key, shape_key = mx.random.split(key)
            timings += bench_shape(n, k, backend, args.sweep, shape_key)
        record["timings"] = timings
        if args.shapes == "27b":
            record["decode_step_estimate"] = decode_step_estimate(timings)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kernel-parity-{backend}.json").write_text(json.dumps(record, indent=1) + "\n")
    markdown = summary_markdown(record)
    (out / f"kernel-parity-{backend}.md").write_text(markdown)
    print(markdown)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
