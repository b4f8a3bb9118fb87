"""A first and a second start of serve_dflash2.py on one pack, and one after a reboot: how long
each takes, and how much of it comes after the weights load (issue 45 item 2: a second start
within 30 s of that).

    python tools/bench_starts.py --pack PACK [--out evidence/] [--scratch DIR --starts first,...]

The starts share one HOME, so a later one finds the start-up verdicts and the compiled kernels
the first kept in the user's cache folder (dflash2_verdicts.py, dflash2_kernel_cache.py), and
one temp folder, which "after a reboot" finds emptied. Each start is timed from the process's
launch to /health's first 200; "weights loaded" is the log's first "start-up checks:" line, which
the engine writes right after mlx-vlm loaded the target. After each start one greedy request; the
answers must be the same. With --scratch the HOME, the temp folder and the starts' results stay
in DIR, so the starts can run in separate invocations (a GPU call's time limit). Writes
evidence/starts-<backend>.json and .md, with the git commit and whether the tree was clean, once
the first and the second start have run.
"""

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from records import run_environment, write_record  # noqa: E402
from server_process import ServerProcess  # noqa: E402

LOADED = "start-up checks: "  # dflash2_verdicts.VerdictCache.open's line, right after the target loads
# Where the time before the checks goes: the server's log lines that end each phase (imports
# and the pack's launch checks; the drafter's set-up and the engine's start; the target's load).
MILESTONES = {"launch checks": "launch checks against ", "engine started": "prefill inverse: ",
              "target loaded": LOADED}
RUNTIME_LOG = " DFlash2 "  # dflash2_speculation's start-up lines: the paths chosen, and how fast
AFTER_LOAD_TARGET_S = 30
PROMPT = "Write a Python function that reverses a list."


def log_time(line: str) -> float:
    """A log line's time (the gateway's format: local time, milliseconds)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def milestones_s(log: list, launched: float) -> dict:
    """Seconds from launch to each MILESTONES line's first appearance in the log (those found)."""
    found = {}
    for name, text in MILESTONES.items():
        line = next((line for line in log if text in line), None)
        if line is not None:
            found[name] = log_time(line) - launched
    return found


def greedy_answer(server: ServerProcess) -> str:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    connection.request("POST", "/v1/chat/completions", headers={"content-type": "application/json"}, body=json.dumps(
        {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 32}))
    reply = connection.getresponse()
    body = json.loads(reply.read())
    connection.close()
    if reply.status != 200:
        raise RuntimeError(f"{server.name}: HTTP {reply.status}: {body}")
    return body["choices"][0]["message"]["content"]


STARTS = ("first", "second", "after a reboot")


def start(name: str, pack: Path, workdir: Path, timeout: int) -> dict:
    temp = workdir / "tmp"
    if name == "after a reboot":
        shutil.rmtree(temp, ignore_errors=True)  # the same folder, emptied: the servers' paths in it stay
    launched = time.time()
    server = ServerProcess(name.replace(" ", "-"), ["serve_dflash2.py"], workdir, cwd=pack, tmpdir=temp)
    try:
        health = server.wait_ready(timeout)
        ready = time.time()
        log = server.log().splitlines()
        phases = milestones_s(log, launched)
        loaded = phases["target loaded"]
        return {"ready_s": round(ready - launched, 1), "weights_loaded_s": round(loaded, 1),
                "after_load_s": round(ready - launched - loaded, 1),
                "milestones_s": {name: round(seconds, 1) for name, seconds in phases.items()},
                "start_up_checks": health["start_up_checks"],
                "runtime_log": [line for line in log if RUNTIME_LOG in line], "answer": greedy_answer(server)}
    finally:
        server.stop()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", type=Path, required=True, help="a pack folder built by tools/build_pack.py")
    parser.add_argument("--start-timeout", type=int, default=1800, help="seconds for a server to start")
    parser.add_argument("--out", type=Path, default=REPO / "evidence")
    parser.add_argument("--scratch", type=Path, help="keep the HOME, temp folder and results here between runs")
    parser.add_argument("--starts", default=",".join(STARTS),
                        help=f"which starts to run now, in order, of {', '.join(STARTS)} (later ones need a first)")
    args = parser.parse_args(argv)
    pack = args.pack.resolve()
    if not (pack / "serve_dflash2.py").is_file():
        parser.error(f"{pack} has no serve_dflash2.py: build it with tools/build_pack.py")
    wanted = [name.strip() for name in args.starts.split(",")]
    if set(wanted) - set(STARTS):
        parser.error(f"--starts takes {', '.join(STARTS)}")
    with contextlib.ExitStack() as stack:
        scratch = args.scratch or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-starts-")))
        scratch.mkdir(parents=True, exist_ok=True)
        results = scratch / "starts.json"
        if "first" in wanted:  # a first start finds nothing cached, and later ones only its
            for kept in ("home", "tmp"):
                shutil.rmtree(scratch / kept, ignore_errors=True)
            results.unlink(missing_ok=True)
        starts = json.loads(results.read_text()) if results.exists() else {}
        if "first" not in starts and wanted[0] != "first":
            parser.error(f"no first start in {results}: run --starts first before the others")
        for name in wanted:
            starts[name] = start(name, pack, scratch, args.start_timeout)
            results.write_text(json.dumps(starts))
    if "second" not in starts:
        print(f"kept in {results}: {', '.join(starts)}; run the second start to write the record")
        return
    starts = {name: starts[name] for name in STARTS if name in starts}
    second = starts["second"]
    record = {
        **run_environment("bench_starts.py", pack.name, argv),
        "method": "starts of serve_dflash2.py from the pack, one HOME (a later start finds the first's "
                  "cached verdicts and kept kernels) and one temp folder, emptied before the start 'after a "
                  "reboot'; each timed from launch to /health's first 200, weights loaded at the log's first "
                  f"{LOADED.strip()!r} line; then one greedy request each",
        "starts": starts,
        "answers_equal": len({start["answer"] for start in starts.values()}) == 1,
        "second_after_load_within_target": second["after_load_s"] <= AFTER_LOAD_TARGET_S,
    }
    write_record(args.out, f"starts-{record['backend']}", record, summary_markdown(record))
    print(summary_markdown(record))
    if not record["answers_equal"] or any((start["start_up_checks"]["full_check_because"] is None) == (name == "first")
                                          for name, start in starts.items()):
        sys.exit("error: the first start found verdicts cached, a later one checked everything again, or the "
                 "answers differ (see the record)")


def summary_markdown(r) -> str:
    lines = [
        f"# Starts on {r['backend']} ({r['device']}): {', '.join(r['starts'])}, {r['pack']} pack",
        "",
        f"Command: `{r['command']}`; commit {r['git_commit'] or 'unknown'}"
        + ("" if r["git_clean"] is None else " (clean tree)" if r["git_clean"] else " (uncommitted changes)")
        + f", code {r['code']}; mlx {r['versions']['mlx']}, mlx-vlm {r['versions']['mlx_vlm']}",
        "",
        f"Method: {r['method']}.",
        "",
        "| start | ready s | weights loaded s | after the load s | verdicts from the cache | checks run (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, start in r["starts"].items():
        checks = start["start_up_checks"]
        measured = ", ".join(f"{check} {seconds:.1f}" for check, seconds in checks["measured_s"].items())
        lines.append(f"| {name} | {start['ready_s']:.1f} | {start['weights_loaded_s']:.1f} | "
                     f"{start['after_load_s']:.1f} | {', '.join(checks['from_cache']) or '-'} | {measured} |")
    timed = {name: start["milestones_s"] for name, start in r["starts"].items() if start.get("milestones_s")}
    if timed:  # records before the milestones were kept lack them
        lines += ["", "Seconds from launch to each phase's end (imports and the pack's launch checks; the drafter's "
                  "set-up and the engine's start; the target's load): " + "; ".join(
                      f"{name}: " + ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in phases.items())
                      for name, phases in timed.items()) + "."]
    lines += ["", f"Second start within {AFTER_LOAD_TARGET_S} s of its weights load: "
                  f"{r['second_after_load_within_target']}; the same greedy answer from every start: "
                  f"{r['answers_equal']}."]
    for name, start in r["starts"].items():
        if start.get("runtime_log"):
            lines += ["", f"The {name} start's runtime log:", "", "```", *start["runtime_log"], "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
