"""Speculation's extra memory over HTTP, by context: serve_dflash2.py in rounds against serve.py.

    python tools/bench_memory.py --pack PACK [--contexts 100 4096 16384] [--repeats 5] [--out evidence/]
    python tools/bench_memory.py --tiny --contexts 64 256 --out evidence/   # builds the tiny pack

Starts serve_dflash2.py with a fixed verify block (--block, default 4: every greedy request
runs rounds, whether or not they pay, as a user's would once the drafter accepts) and serve.py
from one built pack, both without the prefix cache at its prefill step (256: the same prompt
again would restore from the cache, and the cache's stored states would sit under every later
peak), then sends both the same greedy chat request per context, its prompt cut
to about that many tokens of the pack's tokenizer: one warm-up request per context and server,
then --repeats passes, the server order alternating. Each request's peak is MLX's peak memory
from its admission to its end, as the server logs it on the request's finish line; x-dflash2
says each request's route, and every speculative request must have run rounds and none may
have restored cached tokens. It writes
evidence/memory-http-<backend>.json and .md: per context the prompt's tokens, each server's
memory at rest and request peak (median, min, max) and speculation's extra peak over plain,
the per-pass difference (median, min, max). tools/bench_prefix.py measures the same in
process (--memory-contexts), also one request's own peak.
"""

import argparse
import http.client
import json
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from bench_server import (  # noqa: E402
    REQUEST_PEAK, add_bench_options, bench_pack, parse_bench_args, server_memory, spread)
from dflash2_options import PREFIX_CACHE_PREFILL_STEP  # noqa: E402
from records import run_environment, write_record  # noqa: E402
from server_process import ServerProcess, own_kernels  # noqa: E402

# The prompt: this module's own source, repeated and cut to the context's tokens.
TEXT = Path(__file__).read_text()
INSTRUCTION = "\n\nSummarise the text above in one sentence."
SPECULATIVE, PLAIN = "serve_dflash2.py", "serve.py"
# No prefix cache, at the step the servers prefill with when it is on.
NO_CACHE = ["--no-prefix-cache", "--prefill-step-size", str(PREFIX_CACHE_PREFILL_STEP)]
CACHED_TOKENS = re.compile(r"cached_tokens=([0-9]+)")


def prompts(pack: Path, contexts) -> dict:
    """context -> a prompt of about that many tokens (the instruction included)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(pack))
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    tail = len(tokenizer.encode(INSTRUCTION, add_special_tokens=False))
    built = {}
    for context in contexts:
        body = (tokens * (context // len(tokens) + 1))[:max(1, context - tail)]
        built[context] = tokenizer.decode(body) + INSTRUCTION
    return built


def chat(server: ServerProcess, prompt: str, max_tokens: int) -> dict:
    """One greedy request: its route, its prompt's tokens, its tokens from rounds and its peak
    memory (GB, the finish line the server logs just after the response's last byte)."""
    since = len(server.log())
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                       "max_tokens": max_tokens})
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=3600)
    connection.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    reply = connection.getresponse()
    payload = json.loads(reply.read())
    connection.close()
    if reply.status != 200:
        raise RuntimeError(f"{server.name}: HTTP {reply.status}: {json.dumps(payload)[:500]}")
    return {"mode": reply.getheader("x-dflash2") or "plain",
            "prompt_tokens": payload["usage"]["prompt_tokens"],
            "tokens_from_rounds": (payload.get("timings") or {}).get("tokens_from_rounds"),
            "peak_gb": finish_peak(server.wait_for_log(since, "finished in"))}


def finish_peak(line: str) -> float:
    """A finish line's peak memory (GB); ValueError where the request restored cached tokens
    (its peak is not a prefill's at its context)."""
    if int(CACHED_TOKENS.search(line)[1]):
        raise ValueError(f"a request restored cached tokens: {line}")
    return float(REQUEST_PEAK.search(line)[1])


def run(pack: Path, contexts, max_tokens: int, repeats: int, block: int, logs: Path, start_timeout: int):
    texts = prompts(pack, contexts)
    servers = {
        SPECULATIVE: ServerProcess(SPECULATIVE, [SPECULATIVE, *NO_CACHE, "--dflash2-block-size", str(block)],
                                   logs / "spec", cwd=pack, **own_kernels(SPECULATIVE)),
        PLAIN: ServerProcess(PLAIN, [PLAIN, *NO_CACHE], logs / "plain", cwd=pack, **own_kernels(PLAIN)),
    }
    try:
        for server in servers.values():
            server.wait_ready(start_timeout)
        rest = {name: server_memory(server.log())["at_rest_gb"] for name, server in servers.items()}
        samples = {context: {name: [] for name in servers} for context in contexts}
        for context in contexts:
            for server in servers.values():  # warm-up: a length's first request compiles
                chat(server, texts[context], max_tokens)
            for repeat in range(repeats):
                order = list(servers) if repeat % 2 == 0 else list(servers)[::-1]
                for name in order:
                    sample = chat(servers[name], texts[context], max_tokens)
                    samples[context][name].append(sample)
                    print(f"{context} tokens, pass {repeat + 1}/{repeats}, {name}: {sample['mode']}, "
                          f"peak {sample['peak_gb']:.3f} GB", file=sys.stderr, flush=True)
        return rest, samples, {name: server.command for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()


def summarise(samples) -> dict:
    results = {}
    for context, arms in samples.items():
        speculative, plain = arms[SPECULATIVE], arms[PLAIN]
        results[str(context)] = {
            "prompt_tokens": plain[0]["prompt_tokens"],
            "speculative_modes": sorted({s["mode"] for s in speculative}),
            "tokens_from_rounds": spread([s["tokens_from_rounds"] for s in speculative]),
            "peak_gb": {name: spread([s["peak_gb"] for s in arm]) for name, arm in arms.items()},
            "extra_peak_gb": spread([s["peak_gb"] - p["peak_gb"] for s, p in zip(speculative, plain)]),
        }
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_options(parser, max_tokens=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 4096, 16384])
    parser.add_argument("--block", type=int, default=4, help="serve_dflash2.py's fixed verify block")
    args = parse_bench_args(parser, argv)

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as scratch:
        scratch = Path(scratch)
        pack = bench_pack(parser, args, scratch)
        rest, samples, commands = run(pack, args.contexts, args.max_tokens, args.repeats, args.block, scratch,
                                      args.start_timeout)
    record = {
        **run_environment("bench_memory.py", "tiny synthetic" if args.tiny else pack.name, argv),
        "servers": commands,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "method": "greedy chat requests, one at a time, after one warm-up request per context and server, "
                  "server order alternating by pass; a request's peak is MLX's peak memory from its admission "
                  "to its end (the server's finish line); extra = speculative peak - serve.py's peak, paired "
                  "by pass",
        "memory_at_rest_gb": rest,
        "results": summarise(samples),
        "seconds": round(time.time() - started, 1),
    }
    off_rounds = [context for context, result in record["results"].items()
                  if result["speculative_modes"] != ["speculative"] or not result["tokens_from_rounds"]["min"]]
    if off_rounds:  # nothing to compare: no record
        sys.exit(f"error: serve_dflash2.py ran no rounds at {', '.join(off_rounds)} tokens: "
                 f"{json.dumps(record['results'])}")
    write_record(args.out, f"memory-http-{record['backend']}", record, summary_markdown(record))
    print(summary_markdown(record))


def summary_markdown(r) -> str:
    def cell(stats, sign=""):
        return f"{stats['median']:{sign}.3f} ({stats['min']:{sign}.3f} to {stats['max']:{sign}.3f})"

    rest = r["memory_at_rest_gb"]
    lines = [
        f"# Speculation's extra memory over HTTP on {r['backend']} ({r['device']}): {r['pack']} pack",
        "",
        f"Command: `{r['command']}`; mlx {r['versions']['mlx']}, mlx-vlm {r['versions']['mlx_vlm']}; "
        f"code {r.get('git_commit') or '-'} (clean: {r.get('git_clean')})",
        "",
        f"Method: {r['method']}. {r['repeats']} passes, max_tokens {r['max_tokens']}; median (min to max), GB.",
        "",
        f"At rest (after the warm-ups): {SPECULATIVE} {rest[SPECULATIVE]:.3f}, {PLAIN} {rest[PLAIN]:.3f}, "
        f"difference {rest[SPECULATIVE] - rest[PLAIN]:+.3f}.",
        "",
        f"| context | prompt tokens | {SPECULATIVE} route | tokens from rounds | {SPECULATIVE} peak | "
        f"{PLAIN} peak | extra peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for context, result in r["results"].items():
        lines.append(
            f"| {context} | {result['prompt_tokens']} | {', '.join(result['speculative_modes'])} | "
            f"{result['tokens_from_rounds']['median']:g} | {cell(result['peak_gb'][SPECULATIVE])} | "
            f"{cell(result['peak_gb'][PLAIN])} | {cell(result['extra_peak_gb'], '+')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
