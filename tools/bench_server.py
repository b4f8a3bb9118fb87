"""End-to-end server speed: serve_dflash2.py, its --no-dflash2 baseline and serve.py on one pack.

    python tools/bench_server.py --pack PACK [--max-tokens 64] [--repeats 5] [--out evidence/]
    python tools/bench_server.py --tiny --max-tokens 12 --out evidence/   # builds the tiny pack

Starts the three servers from the built pack folder (each on its own free 127.0.0.1 port),
then sends the same greedy (temperature 0) streaming chat requests to them one at a time:
one warm-up request per prompt and server, then `--repeats` passes in which the order of
the servers rotates. Per request it measures the decode speed as (tokens - 1) / (time of
the last token chunk - time of the first) and the time to the first token, from the client
side. Every server must return the same text for a prompt. It writes
evidence/bench-server-<backend>.json and .md: versions, the command, per prompt and server
the median, min and max of both figures, and the ratios to serve.py; and from each server's
log, MLX's active memory once it was ready and its requests' peaks.
"""

import argparse
import http.client
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from records import run_environment, write_record  # noqa: E402
from server_process import ServerProcess, own_kernels  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

PROMPTS = {
    "chat": "Write a short, friendly note inviting a neighbour to dinner on Friday.",
    "code": "Write a Python function that returns the n-th Fibonacci number iteratively.",
}
ARMS = {  # name -> (script, options)
    "dflash2": ("serve_dflash2.py", []),
    "no-dflash2": ("serve_dflash2.py", ["--no-dflash2"]),
    "serve.py": ("serve.py", []),
}
REFERENCE = "serve.py"
# A server's log: its memory once ready (the last warm-up's line) and each request's peak.
MEMORY_AT_REST = re.compile(r"warm-up plain: .*memory in use ([0-9.]+) GB")
REQUEST_PEAK = re.compile(r"finished in .*peak_memory=([0-9.]+)GB")


def stream_chat(server: ServerProcess, prompt: str, max_tokens: int) -> dict:
    """One streaming greedy request, timed at the client as each event arrives."""
    body = json.dumps({
        "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": max_tokens,
        "stream": True, "stream_options": {"include_usage": True},
    })
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=3600)
    sent = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    reply = connection.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"{server.name}: HTTP {reply.status}: {reply.read()[:500]!r}")
    mode = reply.getheader("x-dflash2")
    token_times, text, usage, timings = [], [], None, {}
    while line := reply.readline():
        if not line.startswith(b"data: {"):
            continue
        arrived = time.perf_counter()
        event = json.loads(line[len(b"data: "):])
        if "error" in event:
            raise RuntimeError(f"{server.name}: {event['error']}")
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            pieces = [delta.get("content"), delta.get("reasoning"), json.dumps(delta.get("tool_calls"))
                      if delta.get("tool_calls") else None]
            if any(pieces):
                token_times.append(arrived)
                text.extend(piece for piece in pieces if piece)
        if event.get("usage"):
            usage, timings = event["usage"], event.get("timings") or {}
    connection.close()
    tokens = usage["completion_tokens"]
    span = token_times[-1] - token_times[0] if len(token_times) > 1 else 0.0
    return {
        "mode": mode,
        "text": "".join(text),
        "tokens": tokens,
        "ttft_s": token_times[0] - sent,
        "decode_tok_s": (tokens - 1) / span if span > 0 else None,
        "tokens_from_rounds": timings.get("tokens_from_rounds"),
        "tokens_from_plain_steps": timings.get("tokens_from_plain_steps"),
    }


def spread(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def server_memory(log: str) -> dict:
    """MLX's active memory (GB) a server held once ready (after its warm-ups), and its requests'
    peaks (the finish lines': the benchmark's warm-up requests and the measured ones), from its log."""
    rest = MEMORY_AT_REST.search(log)
    return {"at_rest_gb": float(rest[1]) if rest else None,
            "request_peak_gb": spread([float(peak) for peak in REQUEST_PEAK.findall(log)])}


def run(pack: Path, max_tokens: int, repeats: int, logs: Path, start_timeout: int):
    servers = {}
    try:
        for name, (script, options) in ARMS.items():
            servers[name] = ServerProcess(name, [script, *options], logs / name, cwd=pack, **own_kernels(name))
        health = {name: server.wait_ready(start_timeout) for name, server in servers.items()}
        samples = {prompt: {name: [] for name in ARMS} for prompt in PROMPTS}
        for prompt, text in PROMPTS.items():  # warm-up, not recorded
            for server in servers.values():
                stream_chat(server, text, max_tokens)
        names = list(ARMS)
        for repeat in range(repeats):
            for index, (prompt, text) in enumerate(PROMPTS.items()):
                shift = (repeat + index) % len(names)
                for name in names[shift:] + names[:shift]:
                    samples[prompt][name].append(stream_chat(servers[name], text, max_tokens))
                    print(f"repeat {repeat + 1}/{repeats} {prompt} {name}: "
                          f"{samples[prompt][name][-1]['decode_tok_s'] or 0:.2f} tok/s", file=sys.stderr)
        memory = {name: server_memory(server.log()) for name, server in servers.items()}
        return health, samples, memory, {name: server.command for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()


def summarise(samples) -> dict:
    results = {}
    for prompt, arms in samples.items():
        results[prompt] = {}
        for name, runs in arms.items():
            results[prompt][name] = {
                "mode": runs[0]["mode"],
                "tokens": spread(r["tokens"] for r in runs),
                "decode_tok_s": spread(r["decode_tok_s"] for r in runs),
                "ttft_s": spread(r["ttft_s"] for r in runs),
                "tokens_from_rounds": spread(r["tokens_from_rounds"] for r in runs),
                "tokens_from_plain_steps": spread(r["tokens_from_plain_steps"] for r in runs),
            }
        for name, runs in arms.items():  # per pass against serve.py's request of the same pass
            results[prompt][name]["ratio_to_serve_py"] = {
                key: spread(r[key] / ref[key] if r[key] and ref[key] else None
                            for r, ref in zip(runs, arms[REFERENCE]))["median"]
                for key in ("decode_tok_s", "ttft_s")
            }
    return results


def outputs_identical(samples) -> bool:
    return all(len({r["text"] for runs in arms.values() for r in runs}) == 1 for arms in samples.values())


def tiny_pack(folder: Path) -> Path:
    """The tiny synthetic target and drafter, built into a pack folder."""
    from build_pack import build_pack
    from make_synthetic_pack import make_pack

    sources = make_pack(folder / "sources", size="tiny", seed=0)
    build_pack(str(sources["target"]), str(sources["drafter"]), folder / "pack")
    return folder / "pack"


def add_bench_options(parser, max_tokens: int):
    """The options bench_server and bench_memory share: the pack (or --tiny), tokens, passes,
    start timeout, output folder."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--pack", type=Path, help="a pack folder built by tools/build_pack.py")
    where.add_argument("--tiny", action="store_true", help="build and bench the tiny synthetic pack")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--repeats", type=int, default=5, help="measured passes after the warm-up (>= 5)")
    parser.add_argument("--start-timeout", type=int, default=1800, help="seconds for a server to start")
    parser.add_argument("--out", type=Path, default=REPO / "evidence")


def parse_bench_args(parser, argv):
    args = parser.parse_args(argv)
    if args.repeats < 5 or args.max_tokens < 2:
        parser.error("--repeats must be at least 5 and --max-tokens at least 2")
    return args


def bench_pack(parser, args, scratch: Path) -> Path:
    """The pack to bench: --pack's, or the tiny one built into scratch."""
    pack = (tiny_pack(scratch) if args.tiny else args.pack).resolve()
    if not (pack / "serve_dflash2.py").is_file():
        parser.error(f"{pack} has no serve_dflash2.py: build it with tools/build_pack.py")
    return pack


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_options(parser, max_tokens=64)
    args = parse_bench_args(parser, argv)

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-server-") as scratch:
        scratch = Path(scratch)
        pack = bench_pack(parser, args, scratch)
        health, samples, memory, commands = run(pack, args.max_tokens, args.repeats, scratch, args.start_timeout)

    record = {
        **run_environment("bench_server.py", "tiny synthetic" if args.tiny else pack.name, argv),
        "servers": commands,
        "round_costs": health["dflash2"].get("round_costs"),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "prompts": PROMPTS,
        "method": "greedy streaming chat requests, one at a time, server order rotated each pass "
                  "after one warm-up request per prompt and server; decode tok/s = (tokens - 1) / "
                  "(last token chunk - first token chunk), TTFT = first token chunk - request sent, "
                  "both at the client; a ratio to serve.py is the median over passes of the ratio "
                  "to serve.py's request of the same pass",
        "results": summarise(samples),
        "outputs_identical": outputs_identical(samples),
        "memory": memory,
        "seconds": round(time.time() - started, 1),
    }
    write_record(args.out, f"bench-server-{record['backend']}", record, summary_markdown(record))
    print(summary_markdown(record))
    if not record["outputs_identical"]:
        sys.exit("error: the servers' outputs differ (see the record)")


def summary_markdown(r) -> str:
    def cell(stats, scale=1.0, digits=2):
        if stats["median"] is None:
            return "-"
        return (f"{stats['median'] * scale:.{digits}f} "
                f"({stats['min'] * scale:.{digits}f}-{stats['max'] * scale:.{digits}f})")

    lines = [
        f"# Server speed on {r['backend']} ({r['device']}): {r['pack']} pack",
        "",
        f"Command: `{r['command']}`; mlx {r['versions']['mlx']}, mlx-vlm {r['versions']['mlx_vlm']}, "
        f"Python {r['versions']['python']}",
        "",
        f"Method: {r['method']}. {r['repeats']} measured passes, max_tokens {r['max_tokens']}; "
        "median (min-max).",
        "",
        f"Outputs identical across servers and repeats: {r['outputs_identical']}.",
        "",
        "| prompt | server | mode | decode tok/s | / serve.py | TTFT ms | / serve.py "
        "| tokens from rounds / plain steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for prompt, arms in r["results"].items():
        for name, result in arms.items():
            ratio = result["ratio_to_serve_py"]
            sources = (f"{result['tokens_from_rounds']['median']:g} / {result['tokens_from_plain_steps']['median']:g}"
                       if result["tokens_from_rounds"]["median"] is not None else "-")
            lines.append(
                f"| {prompt} | {name} | {result['mode'] or 'plain'} | {cell(result['decode_tok_s'])} | "
                f"{ratio['decode_tok_s'] or 0:.2f}x | {cell(result['ttft_s'], 1000, 0)} | "
                f"{ratio['ttft_s'] or 0:.2f}x | {sources} |")
    if r.get("memory"):
        lines += ["", "MLX's active memory, GB: each server once ready (after its start's warm-ups), and "
                      "its requests' peaks (median (min-max)), from its log:", "",
                  "| server | at rest | over serve.py at rest | request peak |", "|---|---|---|---|"]
        reference = r["memory"][REFERENCE]["at_rest_gb"]
        for name, held in r["memory"].items():
            rest = held["at_rest_gb"]
            over = f"{rest - reference:+.3f}" if rest is not None and reference is not None else "-"
            lines.append(f"| {name} | {'-' if rest is None else f'{rest:.3f}'} | {over} | "
                         f"{cell(held['request_peak_gb'], 1, 3)} |")
    if r["round_costs"]:
        costs = r["round_costs"]
        lines += ["", f"serve_dflash2.py's round costs (decode step {costs['decode_step_ms']:.2f} ms), "
                      "in decode steps:", "", "| block | verify | draft |", "|---|---|---|"]
        lines += [f"| {block} | {verify:.2f} | {costs['draft_steps_by_block'][block]:.2f} |"
                  for block, verify in costs["verify_steps_by_block"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
