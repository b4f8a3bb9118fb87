"""Where an exact verify round's GPU time goes, kernel by kernel, against a decode step.

    python tools/lab/profile_verify.py --out evidence/

CUDA only (the GPU machine): builds the random-weight 27B-shape target as tools/bench.py
does, installs the runtime, prefills a short prompt, then records with PyTorch's profiler
(CUPTI, which sees every kernel the process launches, MLX's included) a few decode steps
and exact verify rounds of each --blocks length (the longest also evaluated once at its end,
without the runtime's early hand-offs to the device). Per arm it gives the wall time of a step
(timed apart, unprofiled), the summed kernel time and kernel count per step, and each
kernel's time and launches per step; the kernels whose time grows most from a decode step
to the longest verify round come first, then those whose launches grow most (on CUDA the
host's cost follows the launches). Writes evidence/profile-verify-<backend>.json and .md.
A diagnostic: which kernels to make faster, not a speed record (see tools/bench.py).
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: bench_arms, records

import bench_arms  # noqa: E402  (first: the runtime it imports sets MLX's CUDA graph cache before MLX starts; it puts the pack on sys.path)

import mlx.core as mx  # noqa: E402

import dflash2_drafter  # noqa: E402
import dflash2_kernels  # noqa: E402
import dflash2_rounds  # noqa: E402
import dflash2_timing  # noqa: E402
import dflash2_verify  # noqa: E402
from records import run_environment, write_record  # noqa: E402

NAME_CHARS = 120  # kernel names are long template instantiations: their head says enough


def busy_us(intervals) -> float:
    """Microseconds in which at least one kernel ran: the union of (start, end) intervals.
    Kernels of two streams can overlap (on the H200 a verify's small kernels sat for hundreds
    of microseconds beside others), so their summed durations overstate the device's time."""
    busy, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy


def kernel_ms_per_step(steps, count: int, settle) -> dict:
    """Per step, over `count` steps under the profiler: ms and launches by kernel name, busy ms,
    and the host's CUDA API calls (runtime and driver: graph instantiation, updates,
    launches, captures) by name, ms and calls."""
    from torch.profiler import ProfilerActivity, profile

    steps(1)  # lead-in: the switch from the previous arm stays out of the record
    settle()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as recorded:
        steps(count)
        settle()
    by_name, launches, intervals = defaultdict(float), defaultdict(float), []
    api_ms, api_calls = defaultdict(float), defaultdict(float)
    for event in recorded.events():
        if str(event.device_type).endswith("CUDA"):
            by_name[event.name[:NAME_CHARS]] += event.time_range.elapsed_us() / 1000 / count
            launches[event.name[:NAME_CHARS]] += 1 / count
            intervals.append((event.time_range.start, event.time_range.end))
        elif event.name.startswith("cu"):  # CUPTI's record of a CUDA API call, on the host
            api_ms[event.name] += event.time_range.elapsed_us() / 1000 / count
            api_calls[event.name] += 1 / count
    return {"by_kernel": dict(sorted(by_name.items(), key=lambda item: -item[1])),
            "launches_by_kernel": dict(sorted(launches.items(), key=lambda item: -item[1])),
            "kernel_ms": sum(by_name.values()), "kernels": sum(launches.values()),
            "busy_ms": busy_us(intervals) / 1000 / count,
            "api_ms": dict(sorted(api_ms.items(), key=lambda item: -item[1])), "api_calls": dict(api_calls)}


def host_ms_by_layer(steps, count: int) -> list:
    """Median ms the host spends building each layer of the served verify forward (its hand-off
    to the device included), over `count` rounds: a layer far above its neighbours is where
    the host waits (a sync, a graph build) instead of queueing work."""
    served_layer = dflash2_verify.ExactVerifier._layer
    marks = []
    steps(1)  # lead-in: the switch from the previous arm stays out of the record

    def timed_layer(self, *args):
        if self._layers_built == 0:
            marks.append([time.perf_counter()])
        hidden = served_layer(self, *args)
        marks[-1].append(time.perf_counter())
        return hidden

    dflash2_verify.ExactVerifier._layer = timed_layer
    try:
        steps(count)
    finally:
        dflash2_verify.ExactVerifier._layer = served_layer
    per_round = [[1000 * (b - a) for a, b in zip(times, times[1:])] for times in marks]
    if not per_round or len({len(layers) for layers in per_round}) != 1:
        raise RuntimeError(f"the served verify built {sorted({len(layers) for layers in per_round})} layers a round")
    return [round(statistics.median(layer), 3) for layer in zip(*per_round)]


def host_split_ms(step, settle, count: int, before=None) -> dict:
    """Median ms of a step's parts, unprofiled, over `count` steps (after one untimed): Python
    building its graph (the served verify's hand-offs to the device included), MLX's async_eval
    of the rest (encoding and launching it), then waiting for the device to finish.
    step() -> (outputs to evaluate, what to run after them: a round's commit, or nothing);
    before(): run untimed between the settled state and the step (a round the step follows)."""
    parts = {"build": [], "launch": [], "wait": []}
    for index in range(count + 1):
        settle()
        if before is not None:
            before()
        start = time.perf_counter()
        outputs, after = step()
        built = time.perf_counter()
        mx.async_eval(outputs)
        launched = time.perf_counter()
        mx.eval(outputs)
        done = time.perf_counter()
        after()
        if index:
            for part, ms in zip(parts, (built - start, launched - built, done - launched)):
                parts[part].append(1000 * ms)
    return {part: round(statistics.median(samples), 3) for part, samples in parts.items()} | {
        f"{part}_min_max": [round(min(samples), 3), round(max(samples), 3)] for part, samples in parts.items()}


def split_steps(lm, cache, taps, blocks, drafting=None) -> dict:
    """name -> (step(), before()) for host_split_ms: a decode step; per block a verify round as
    served (handed off every dflash2_verify.VERIFY_EVAL_EVERY layers) and built whole (one
    eval); a decode step right after a verify round of the shortest and the longest block,
    its commit queued (as the request loop leaves it) or finished: where the first plain step
    after a round's extra time goes (issue 49: +0.5 to +1.8 decode steps on the H100); and with
    drafting (drafter, the prompt's tap hidden states) a drafter pass of the longest block."""
    token = mx.array([[7]])
    decode = lambda: ([lm(token, cache=cache).logits], lambda: None)  # noqa: E731
    steps = {"decode": (decode, None)}

    def round_before(length, settled):
        rounds = bench_arms.verify_round_steps(lm, cache, taps, length)
        settle = bench_arms.cache_settler(cache)
        return lambda: (rounds(1), settled and settle())

    def verify(length, every):
        block = mx.array([[11 + i for i in range(length)]])

        def step():
            with dflash2_verify.verify_eval_every(every):
                hidden_out, states, tokens = bench_arms.dflash_rounds._dflash_verify_greedy(
                    lm, block, cache, taps, lambda logits: mx.argmax(logits, axis=-1))
            return [tokens, hidden_out], lambda: dflash2_rounds.commit_round(lm, cache, states, length // 2, length)

        return step

    for length in blocks:
        steps[f"verify {length}"] = (verify(length, dflash2_verify.VERIFY_EVAL_EVERY), None)
        steps[f"verify {length}, one eval"] = (verify(length, 0), None)
    for length in sorted({blocks[0], blocks[-1]}):
        steps[f"decode after verify {length}, its commit queued"] = (decode, round_before(length, False))
        steps[f"decode after verify {length}, its commit done"] = (decode, round_before(length, True))
    if drafting is not None:
        one_pass = dflash2_drafter.drafter_pass(lm, *drafting, True, blocks[-1])
        steps[f"draft {blocks[-1]}"] = (lambda: ([one_pass()], lambda: None), None)
    return steps


def growth_order(arms: dict, longest: str, key: str) -> list:
    """Kernel names by how much arms[longest][key] exceeds the decode step's, most first
    (ties by name, so a table's cut is the same from run to run)."""
    decode, verify = arms["decode"][key], arms[longest][key]
    return sorted(set(decode) | set(verify),
                  key=lambda kernel: (decode.get(kernel, 0.0) - verify.get(kernel, 0.0), kernel))


def summary_markdown(record: dict) -> str:
    arms = record["arms"]
    longest = f"verify {max(record['blocks'])}"
    lines = [
        f"# Where a verify round's GPU time goes on {record['backend']} ({record['device']})", "",
        f"Command: `{record['command']}`; mlx {record['versions']['mlx']}, mlx-vlm {record['versions']['mlx_vlm']}, "
        f"code {record['code']}. Context {record['context_tokens']} tokens; decode path "
        f"`{record['plain_decode_path']}`"
        + "".join(f"; {name}={value}" for name, value in record.get("mlx_environment", {}).items()) + ".", "",
        "Wall: ms per step, timed unprofiled (median of the samples); kernel ms: summed kernel time "
        "per step under PyTorch's profiler (CUPTI). Wall well above kernel time means the host "
        "(building and launching) bounds the step.", "",
    ]
    busy = all("busy_ms" in arm for arm in arms.values())  # records before it was measured lack it
    if busy:
        lines[-1:-1] = ["Busy ms: the time in which at least one kernel ran (kernels of two streams can "
                        "overlap, and then their summed time overstates the device's)."]
    lines += ["| arm | wall ms | kernel ms |" + (" busy ms |" if busy else "") + " kernels per step |",
              "|---|---|---|" + ("---|" if busy else "") + "---|"]
    for name, arm in arms.items():
        lines.append(f"| {name} | {arm['wall_ms']:.2f} | {arm['kernel_ms']:.2f} |"
                     + (f" {arm['busy_ms']:.2f} |" if busy else "") + f" {arm['kernels']:.0f} |")
    if "host_ms_by_layer" in record:
        layers = record["host_ms_by_layer"]
        slowest = sorted(range(len(layers)), key=lambda i: (-layers[i], i))[:5]
        lines += ["", f"Host ms building each layer of a served {longest} forward (median over the "
                  f"rounds, timed unprofiled): {sum(layers):.2f} in all, median layer "
                  f"{statistics.median(layers):.3f}; slowest: "
                  + ", ".join(f"layer {i} {layers[i]:.2f}" for i in slowest) + "."]
    if "host_split_ms" in record:  # records before it was measured lack it
        lines += ["", "One step's parts, ms (median (min-max), unprofiled, before the profiler; steps not "
                  "pipelined): Python building the graph (a served verify's hand-offs included), MLX's async_eval "
                  "of the rest (encoding, launching), waiting for the device.", "",
                  "| step | build | launch | wait |", "|---|---|---|---|"]
        lines += [f"| {name} | " + " | ".join(f"{split[part]:.2f} ({split[part + '_min_max'][0]:.2f}-"
                                             f"{split[part + '_min_max'][1]:.2f})" for part in ("build", "launch", "wait"))
                  + " |" for name, split in record["host_split_ms"].items()]
    if all("api_ms" in arm for arm in arms.values()):  # records before API calls were read lack it
        calls = sorted(set().union(*(arm["api_ms"] for arm in arms.values())),
                       key=lambda call: (-arms[longest]["api_ms"].get(call, 0.0), call))[:12]
        lines += ["", "Host CUDA API calls per step, ms (calls), under the profiler (its own cost per call "
                  "included): where the host's time goes beside building the graph.", "",
                  "| call | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
        lines += [f"| `{call}` | " + " | ".join(f"{arm['api_ms'].get(call, 0.0):.2f} ({arm['api_calls'].get(call, 0):.1f})"
                                              for arm in arms.values()) + " |" for call in calls]

    def growth_table(what, unit, order, key, rows, digits):
        table = ["", f"Kernels by {what} added from a decode step to a {longest} round ({unit} per step):", "",
                 "| kernel | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
        return table + [f"| `{kernel}` | " + " | ".join(f"{arm[key].get(kernel, 0.0):.{digits}f}" for arm in arms.values())
                        + " |" for kernel in record[order][:rows]]

    lines += growth_table("time", "ms", "kernels_by_growth", "by_kernel", 25, 3)
    if "launches_by_growth" in record:  # records before launches were counted per kernel lack it
        lines += growth_table("launches", "launches", "launches_by_growth", "launches_by_kernel", 15, 0)
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(bench_arms.REPO / "evidence"))
    parser.add_argument("--size", choices=["27b", "tiny"], default="27b")
    parser.add_argument("--context", type=int, default=32, help="prompt tokens before profiling")
    parser.add_argument("--blocks", default="2,4,8", help="verify lengths to profile")
    parser.add_argument("--steps", type=int, default=4, help="steps per arm under the profiler")
    args = parser.parse_args()
    if dflash2_kernels.backend_name() != "cuda":
        parser.error("CUDA only: PyTorch's profiler reads the kernels through CUPTI")
    import torch

    torch.zeros(1, device="cuda")  # CUDA up in torch before its profiler starts
    blocks = sorted({int(block) for block in args.blocks.split(",")})
    started = time.time()
    lm, cache, taps, status, hidden = bench_arms.prefilled_target(args.size, args.context)
    print(f"[{time.time() - started:6.1f}s] runtime installed: {'; '.join(status.log_lines())}", flush=True)
    drafter = bench_arms.random_drafters(args.size, ["4bit"])["4bit"]

    settle = bench_arms.cache_settler(cache)
    arm_steps = {"decode": bench_arms.decode_steps(lm, cache)}
    arm_steps.update({f"verify {length}": bench_arms.verify_round_steps(lm, cache, taps, length) for length in blocks})
    arm_steps[f"verify {blocks[-1]}, one eval"] = bench_arms.handed_off_every(
        0, bench_arms.verify_round_steps(lm, cache, taps, blocks[-1]))
    # The drafter's pass of the longest block as serving drafts it (4-bit, bf16 activations), each
    # at a new key length: issue 49 asks for at most 0.15 decode steps (0.30 on the H100).
    arm_steps[f"draft {blocks[-1]}"] = dflash2_drafter.drafter_passes(lm, drafter, hidden, True, blocks[-1])
    arms = {}
    with mx.stream(dflash2_timing.batch_stream):  # as the server's batch generator runs requests
        wall = dflash2_timing.interleaved_ms(
            {name: dflash2_timing.steady_ms(steps, 3, settle) for name, steps in arm_steps.items()}, 5)
        # before the profiler: CUPTI, once attached, may slow the host's CUDA calls after it
        host_split = {name: host_split_ms(step, settle, 2 * args.steps, before)
                      for name, (step, before) in split_steps(lm, cache, taps, blocks, (drafter, hidden)).items()}
        for name, steps in arm_steps.items():
            arms[name] = {"wall_ms": wall[name]["median"], "wall_ms_samples": wall[name]["samples"],
                          **kernel_ms_per_step(steps, args.steps, settle)}
            print(f"[{time.time() - started:6.1f}s] {name}: wall {arms[name]['wall_ms']:.2f} ms, "
                  f"kernels {arms[name]['kernel_ms']:.2f} ms in {arms[name]['kernels']:.0f}, "
                  f"busy {arms[name]['busy_ms']:.2f} ms", flush=True)
        host_layers = host_ms_by_layer(arm_steps[f"verify {blocks[-1]}"], args.steps)
    longest = f"verify {blocks[-1]}"
    record = {
        **run_environment("lab/profile_verify.py", f"synthetic {args.size}, seed 0"),
        "context_tokens": args.context, "blocks": blocks, "profiled_steps": args.steps,
        "plain_decode_path": status.decode_path.arm,
        "arms": arms, "host_ms_by_layer": host_layers, "host_split_ms": host_split,
        "kernels_by_growth": growth_order(arms, longest, "by_kernel"),
        "launches_by_growth": growth_order(arms, longest, "launches_by_kernel"),
    }
    markdown = summary_markdown(record)
    write_record(args.out, f"profile-verify-{record['backend']}", record, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
