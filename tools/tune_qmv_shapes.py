"""Per 27B shape, the fastest exact launch of the packed matmul at each row count: a sweep,
then a fresh side-by-side check of the picks against the row count's one launch.

    python tools/tune_qmv_shapes.py --rows 4,5,6,7,8 --out evidence/

CUDA only. A launch's grid is a whole number of waves for some shapes and not for others
(at 8 rows the table's launch gives the 5120-row shapes 2.4 tiles a warp, so their last tile
runs on under half the warps), so the fastest launch can differ by shape. For every packed
shape of the 27B target and row count, times MLX's single-row call and each CANDIDATES
launch (CUDA_LAUNCH's own first), interleaved, weights rotated past the L2, each launch
checked bitwise against MLX's single-row calls first (one that differs or fails is never
picked), and picks the fastest median. A pick's sweep median is the least of several noisy
medians, so biased low: a second interleaved pass, with fresh samples, times the table's
launch against the pick per shape, and the record's per-step sums come from that pass.
Writes evidence/qmv-shapes-<backend>.json and .md, with the picks that differ from the table
listed by (rows, N, K).
"""

import argparse

import mlx.core as mx

import kernel_parity  # first: it puts the repository on sys.path
import dflash2_kernel_qmv as qmv  # noqa: E402
import dflash2_policy  # noqa: E402
from compare_qmv_launch import pass_ms, per_step_ms, timings_us  # noqa: E402
from records import run_environment, write_record  # noqa: E402

# Launches (R, C, prefetch[, S[, B]]) tried beside the table's, by rows. Accumulators
# R * M / S at most 16 (kernel_parity.MAX_ACCUMULATORS); a capped grid of B blocks holds
# about one wave: 264 blocks at 12-16 accumulators (two 4-warp blocks an SM at 255
# registers), 396 or 528 at 8 or fewer.
CANDIDATES = {
    4: [(2, 2, 1, 1, 396), (2, 2, 3), (4, 2, 1), (2, 2, 1, 2, 528), (1, 2, 1, 1, 528), (4, 2, 1, 1, 264)],
    5: [(3, 2, 1), (2, 2, 1), (2, 2, 1, 1, 396), (1, 2, 1, 1, 528), (3, 2, 1, 1, 264)],
    6: [(4, 2, 1, 2), (2, 2, 1), (2, 2, 1, 2, 396), (2, 2, 1, 1, 264), (1, 2, 1, 1, 528), (4, 2, 1, 2, 264)],
    7: [(2, 2, 1, 1, 264), (2, 2, 1), (1, 2, 1, 1, 396), (1, 2, 1, 1, 528), (1, 2, 1)],
    8: [(2, 2, 1, 1, 264), (2, 2, 1), (2, 2, 1, 2, 396), (2, 2, 1, 2), (4, 2, 1, 2, 264), (1, 2, 1, 1, 396),
        (1, 2, 1, 1, 528), (1, 2, 1, 2), (2, 2, 1, 4, 528)],
}


def candidates(rows: int) -> list:
    """The table's launch for `rows` first, then CANDIDATES' others."""
    table = tuple(qmv.CUDA_LAUNCH[rows])
    return [table] + [launch for launch in CANDIDATES.get(rows, []) if launch != table]


def launch_arm(bench, rows: int, launch: tuple):
    """(ms of one call per weight copy, differing elements), or None where it fails to build or run."""
    layout, call = kernel_parity.served_cuda_matmul(qmv, launch)
    x = layout(bench.x[:rows])
    mx.eval(x)
    try:
        differing = qmv._differing(call(x, *bench.copies[0]), bench.want[:rows])
    except Exception as error:
        print(f"  rows {rows} launch {launch} failed: {error}", flush=True)
        return None
    return pass_ms(call, x, bench.copies), differing


def tune_shape(n: int, k: int, rows_list, repeats: int, key) -> dict:
    bench = kernel_parity.Bench(n, k, key)
    arms, differing = {"mlx single row": pass_ms(qmv.stock_quantized_matmul, bench.x[:1], bench.copies)}, {}
    for rows in rows_list:
        for launch in candidates(rows):
            arm = launch_arm(bench, rows, launch)
            if arm:
                arms[f"{rows} {list(launch)}"], differing[f"{rows} {list(launch)}"] = arm
    sweep = dflash2_policy.interleaved_ms(arms, repeats)
    picks = {}
    for rows in rows_list:
        exact = [launch for launch in candidates(rows) if differing.get(f"{rows} {list(launch)}") == 0]
        picks[rows] = min(exact, key=lambda launch: sweep[f"{rows} {list(launch)}"]["median"])
    # The check: fresh samples of the table's launch against each pick (one arm where they agree).
    check_arms = {"mlx single row": arms["mlx single row"]}
    for rows in rows_list:
        for launch in {tuple(qmv.CUDA_LAUNCH[rows]), picks[rows]}:
            check_arms[f"{rows} {list(launch)}"] = arms[f"{rows} {list(launch)}"]
    check = dflash2_policy.interleaved_ms(check_arms, repeats)

    print(f"N={n} K={k}: picks " + ", ".join(
        f"{rows}: {list(picks[rows])} {check[f'{rows} {list(picks[rows])}']['median'] * 1000:.1f} us "
        f"(table {check[f'{rows} {list(qmv.CUDA_LAUNCH[rows])}']['median'] * 1000:.1f})" for rows in rows_list),
        flush=True)
    return {"sweep_us": timings_us(sweep), "check_us": timings_us(check), "differing": differing,
            "picks": {str(rows): list(launch) for rows, launch in picks.items()}}


def step_sums(shapes: dict, table: dict) -> dict:
    """ms per decode step from the check pass: MLX's single row, and per row count (table:
    str(rows) -> the launch the table had) that launch everywhere against each shape's pick."""
    sums = {"mlx single row": per_step_ms(shapes, "check_us", lambda n, k: "mlx single row")}
    for rows in map(int, table):
        sums[f"{rows} table"] = per_step_ms(shapes, "check_us", lambda n, k: f"{rows} {table[str(rows)]}")
        sums[f"{rows} picks"] = per_step_ms(shapes, "check_us",
                                            lambda n, k: f"{rows} {shapes[f'{n}x{k}']['picks'][str(rows)]}")
    return sums


def summary_markdown(record: dict) -> str:
    sums = record["step_ms"]
    single = sums["mlx single row"]
    lines = [
        f"# Exact packed matmul: the fastest launch per 27B shape, on {record['backend']} ({record['device']})", "",
        f"Command: `{record['command']}`; code {record['code']}, kernel source {record['cuda_kernel_source']}. "
        f"Per shape, a sweep of the candidate launches ({record['repeats']} interleaved repeats after a warm-up, "
        "weights rotated past the L2) picks the fastest median among the bitwise ones; a second interleaved pass, "
        "fresh samples, times each pick against the table's launch. Sums: the check pass's medians x each shape's "
        f"calls per decode step. Differing elements of the picks against MLX's single-row calls: {record['pick_differing']}.",
        "", f"MLX single row: {single:.3f} ms per step.", "",
        "| rows | table launch | ms | / MLX single row | per-shape picks ms | / MLX single row | picks / table |",
        "|---|---|---|---|---|---|---|",
    ]
    for rows in record["rows"]:
        table, picks = sums[f"{rows} table"], sums[f"{rows} picks"]
        lines.append(f"| {rows} | {tuple(record['table'][str(rows)])} | {table:.3f} | {table / single:.2f} "
                     f"| {picks:.3f} | {picks / single:.2f} | {picks / table:.2f} |")
    lines += ["", "Picks by shape (check pass, us: pick / table launch):", "",
              "| shape | " + " | ".join(f"{rows} rows" for rows in record["rows"]) + " |",
              "|---|" + "---|" * len(record["rows"])]
    for shape, entry in record["shapes"].items():
        cells = []
        for rows in record["rows"]:
            pick, table = entry["picks"][str(rows)], record["table"][str(rows)]
            check = entry["check_us"]
            cells.append(f"{tuple(pick)}: {check[f'{rows} {pick}']['median']} / {check[f'{rows} {table}']['median']}")
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    lines += ["", "Picks that are not the table's launch, by (rows, N, K):", "",
              "```", *(f"{tuple(key)}: {tuple(launch)}," for key, launch in record["by_shape"]), "```"]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4,5,6,7,8", help="row counts to tune")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(kernel_parity.REPO / "evidence"))
    args = parser.parse_args()
    if qmv.backend_name() != "cuda":
        parser.error("CUDA only: the launches are the CUDA kernel's")
    rows_list = sorted({int(rows) for rows in args.rows.split(",")})
    key = mx.random.key(0)
    shapes = {}
    for n, k in qmv.PACKED_SHAPES_27B:
        key, shape_key = mx.random.split(key)
        shapes[f"{n}x{k}"] = tune_shape(n, k, rows_list, args.repeats, shape_key)
    table = {str(rows): list(qmv.CUDA_LAUNCH[rows]) for rows in rows_list}
    by_shape = [((rows, n, k), shapes[f"{n}x{k}"]["picks"][str(rows)])
                for rows in rows_list for n, k in qmv.PACKED_SHAPES_27B
                if shapes[f"{n}x{k}"]["picks"][str(rows)] != table[str(rows)]]
    record = {
        **run_environment("tune_qmv_shapes.py", "27b kernel shapes"),
        "cuda_kernel_source": qmv.cuda_qmv_source_digest(), "repeats": args.repeats, "rows": rows_list,
        "table": table,
        "pick_differing": sum(entry["differing"][f"{rows} {entry['picks'][str(rows)]}"]
                              for entry in shapes.values() for rows in rows_list),
        "shapes": shapes, "by_shape": by_shape,
    }
    record["step_ms"] = step_sums(shapes, table)
    markdown = summary_markdown(record)
    write_record(args.out, f"qmv-shapes-{record['backend']}", record, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
