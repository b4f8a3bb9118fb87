"""What one primitive costs the host: MLX's built-in calls against the pack's custom kernels.

    python tools/launch_cost.py --out evidence/

On the H200 a decode step is host-bound (evidence/profile-verify-cuda.md: about 41 ms of wall
time against 17 ms in which the device ran kernels), so a call's host cost (Python building
the primitive, MLX encoding and launching it) sets a step's time more than its kernel's
device time. Each arm builds CALLS (--calls) chained calls on small inputs (each call's output the
next one's input, so the device's work is a few microseconds a call) and evaluates them:
build_us is the Python time to build one call, eval_us the time per call of evaluating them
(MLX encoding and launching, with the device running behind). Arms interleaved, warm-up
first, median of the repeats with min and max. Off CUDA only MLX's own arms run. Writes
evidence/launch-cost-<backend>.json and .md.
"""

import argparse
import statistics
import time

import mlx.core as mx

import kernel_parity  # first: it puts the repository on sys.path
import dflash2_kernel_base  # noqa: E402
import dflash2_kernel_qmv  # noqa: E402
import dflash2_kernel_rotate  # noqa: E402
import dflash2_kernels as dk  # noqa: E402
from dflash2_policy import pass_order  # noqa: E402
from records import run_environment, write_record  # noqa: E402

CALLS = 200
WIDTH = 512  # K = N: a square 2-bit weight, so a matmul's output feeds the next call


def arms(backend: str) -> dict:
    """name -> (primitives a call builds, rows, step(y) -> next y), on fp16 (rows, WIDTH) inputs."""
    weight, scales, biases = dflash2_kernel_qmv.make_weights(WIDTH, WIDTH, mx.random.key(0))
    norm_weight = mx.ones((WIDTH,), dtype=mx.float16)
    signs = dflash2_kernel_rotate.make_signs("pm1", WIDTH, mx.random.key(1))
    mx.eval(weight, scales, biases, norm_weight, signs)
    table = {
        "mlx add": (1, 1, lambda y: y + y),
        "mlx rms_norm": (1, 1, lambda y: mx.fast.rms_norm(y, norm_weight, 1e-6)),
        "mlx quantized_matmul, 1 row": (1, 1, lambda y: dflash2_kernel_qmv.stock_quantized_matmul(y, weight, scales, biases)),
        "mlx hadamard chain (4 primitives)": (4, 1, lambda y: dflash2_kernel_rotate.stock_rotate(y, WIDTH, signs)),
    }
    if backend == "cuda":
        rotate = dflash2_kernel_rotate.cuda_rotate_plan(WIDTH, WIDTH)
        table.update({
            "exact qmv kernel, 1 row": (1, 1, lambda y: dflash2_kernel_qmv.cuda_matmul(y, weight, scales, biases)),
            "exact qmv kernel, 8 rows": (1, 8, lambda y: dflash2_kernel_qmv.cuda_matmul(y, weight, scales, biases)),
            "rotation kernel": (1, 1, lambda y: rotate(y, signs)),
            **qmv_call_arms(weight, scales, biases),
        })
    return table


def qmv_call_arms(weight, scales, biases) -> dict:
    """The exact qmv's 1-row call without dflash2_kernel_qmv.cuda_matmul around it, and the same
    kernel made as mx.fast.cuda_kernel takes it, its template passed at every call (what
    dflash2_kernel_base.BakedCudaKernel saves): where a custom call's host time goes."""
    call = dflash2_kernel_qmv._cuda_launch((1,), WIDTH)
    templated = mx.fast.cuda_kernel(name="dflash2_qmv_2bit_g128_templated", input_names=["x", "w", "scales", "biases"],
                                    output_names=["y"], source=dflash2_kernel_qmv._CUDA_SOURCE, header=dflash2_kernel_base.cuda_header(dflash2_kernel_qmv._CUDA_HEADER))
    return {
        "exact qmv kernel, 1 row, called directly":
            (1, 1, lambda y: dflash2_kernel_qmv._cuda_kernel()(inputs=[y, weight, scales, biases], **call)[0]),
        "exact qmv kernel, 1 row, template passed at each call":
            (1, 1, lambda y: templated(inputs=[y, weight, scales, biases], **call)[0]),
    }


def timed_pass(step, rows: int, calls: int) -> tuple:
    """(build us a call, eval us a call) of `calls` chained calls."""
    y = dflash2_kernel_base.make_inputs("normal", rows, WIDTH, mx.random.key(2))
    mx.eval(y)
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        y = step(y)
    built = time.perf_counter()
    mx.eval(y)
    mx.synchronize()
    done = time.perf_counter()
    return 1e6 * (built - start) / calls, 1e6 * (done - built) / calls


def measure(table: dict, repeats: int, calls: int) -> dict:
    names = list(table)
    samples = {name: [] for name in names}
    for repeat in range(repeats + 1):  # the first pass warms up (and builds the kernels)
        for name in pass_order(names, repeat):
            _, rows, step = table[name]
            result = timed_pass(step, rows, calls)
            if repeat:
                samples[name].append(result)

    def stats(values):
        return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
                "max": round(max(values), 2)}

    return {name: {"primitives": table[name][0], "build_us": stats([b for b, _ in samples[name]]),
                   "eval_us": stats([e for _, e in samples[name]])} for name in names}


def summary_markdown(record: dict) -> str:
    lines = [
        f"# Host cost of one call, on {record['backend']} ({record['device']})", "",
        f"Command: `{record['command']}`; code {record['code']}. {record['calls']} chained calls on ({record['width']}) "
        f"fp16 rows a pass, {record['repeats']} interleaved passes after a warm-up; median (min-max), us per call. "
        "Build: Python building the call; eval: evaluating the built calls (MLX encoding and launching them, the "
        "device running behind).", "",
        "| call | primitives | build us | eval us | build + eval us |", "|---|---|---|---|---|",
    ]
    for name, arm in record["arms"].items():
        build, evaluate = arm["build_us"], arm["eval_us"]
        lines.append(f"| {name} | {arm['primitives']} | {build['median']} ({build['min']}-{build['max']}) "
                     f"| {evaluate['median']} ({evaluate['min']}-{evaluate['max']}) "
                     f"| {build['median'] + evaluate['median']:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--calls", type=int, default=CALLS, help="chained calls a pass")
    parser.add_argument("--out", default=str(kernel_parity.REPO / "evidence"))
    args = parser.parse_args()
    backend = dk.backend_name()
    record = {**run_environment("launch_cost.py", f"{WIDTH}x{WIDTH} 2-bit weight"),
              "calls": args.calls, "width": WIDTH, "repeats": args.repeats,
              "arms": measure(arms(backend), args.repeats, args.calls)}
    markdown = summary_markdown(record)
    write_record(args.out, f"launch-cost-{backend}", record, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
