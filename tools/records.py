"""Writes a tool's evidence record (the JSON and its Markdown summary, side by side), and
README's results table from the records.

    python tools/records.py            # print the results table
    python tools/records.py --readme   # write it into README.md, between its markers
    python tools/records.py --check    # the commits README's records name that HEAD does not descend from
"""

import argparse
import hashlib
import json
import os
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_START = "<!-- results: written from evidence/*.json by python tools/records.py --readme -->"
RESULTS_END = "<!-- end of results -->"


def write_record(out, stem: str, record: dict, markdown: str) -> Path:
    """OUT/STEM.json and OUT/STEM.md; returns the JSON path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    return out / f"{stem}.json"


def run_environment(tool: str, pack: str, argv=None) -> dict:
    """A record's header: where and with what it ran, the command that wrote it."""
    import mlx.core as mx
    import mlx_vlm

    import dflash2_kernels

    return {
        "backend": dflash2_kernels.backend_name(),
        "device": mx.device_info().get("device_name", platform.machine()),
        "versions": {
            "mlx": mx.__version__,
            "mlx_vlm": mlx_vlm.__version__,
            "python": platform.python_version(),
        },
        "command": "python " + shlex.join([f"tools/{tool}", *(sys.argv[1:] if argv is None else argv)]),
        "pack": pack,
        "code": code_digest(),
        **git_state(),
        # MLX reads these from the environment (on CUDA: graph sizes, the graph cache): what
        # the process ran with, the runtime's own defaults included.
        "mlx_environment": {name: value for name, value in sorted(os.environ.items()) if name.startswith("MLX_")},
    }


def add_dense_dtype_argument(parser) -> None:
    """--dense-dtype, for tools that build the synthetic target (parity, bench)."""
    parser.add_argument("--dense-dtype", choices=["float16", "float32"], default="float16",
                        help="without --pack, the synthetic target's unpacked tensors (norms, convolution, "
                        "gates), which set the activations' dtype; float32 is the real 27B file's layout "
                        "(the record's name gains -fp32)")


def layout_suffix(dense_dtype) -> str:
    """A record name's suffix for the synthetic target's layout: the fp32 one's records sit
    beside the fp16 ones README quotes (None: a pack's own layout)."""
    return "-fp32" if dense_dtype == "float32" else ""


def git_state() -> dict:
    """git_commit and git_clean (no uncommitted change to tracked files). The device's copy of
    the tree has no git history: there the command that sent it names them in RECORD_GIT_COMMIT
    and RECORD_GIT_CLEAN (1 or 0); with neither, both are None."""
    import subprocess

    if os.environ.get("RECORD_GIT_COMMIT"):
        return {"git_commit": os.environ["RECORD_GIT_COMMIT"], "git_clean": os.environ.get("RECORD_GIT_CLEAN") == "1"}

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"git_commit": git("rev-parse", "HEAD"),
                "git_clean": git("status", "--porcelain", "--untracked-files=no") == ""}
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": None, "git_clean": None}


def code_digest() -> str:
    """sha256 (first 12 hex digits) of the pack's top-level Python files and the tools: which
    code a record measured, also where the device's copy of the tree has no git history."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("tools/lab/*.py")]):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


# ---------------------------------------------------------------------------------------
# README's results table


def times(ratio) -> str:
    return f"{ratio:.2f}x"


def verify_rounds(r):
    return ", ".join(f"block {block}: {r['verify_ratio_by_block'][block]:.2f}" for block in ("2", "4", "8"))


def served_rounds(r):
    """The server's cost table at start-up: a round's verify + draft at blocks 2, 4 and 8, in
    the plain decode steps it timed beside them (pipelined, as generation runs them)."""
    costs = r["round_costs"]
    return ", ".join(f"block {block}: {costs['verify_steps_by_block'][block]:.2f} + "
                     f"{costs['draft_steps_by_block'][block]:.2f}" for block in ("2", "4", "8"))


def profile_cells(r, speedups: dict, counts: dict) -> str:
    """Each measured profile's tokens per round and policy-over-plain ratio, marked where the
    arm's last run took no token from rounds (routed plain: plain against plain)."""
    def cell(profile, ratio):
        plain = (counts.get(profile) or {}).get("tokens_from_rounds") == 0
        return f"{r['tokens_per_round'][profile]:.1f}: {times(ratio)}" + (" (routed plain)" if plain else "")

    return ", ".join(cell(profile, ratio) for profile, ratio in speedups.items())


def end_to_end(r):
    return profile_cells(r, r["e2e_speedup"], r.get("policy_round_counts") or {})


def sampled_end_to_end(r):
    """The sampling settings, then per temperature speculative over plain seeded sampling."""
    settings = ", ".join(f"{name} {value}" for name, value in r["e2e_sampled_settings"].items() if name != "seed")
    counts = r.get("policy_round_counts_sampled") or {}
    return settings + "; " + "; ".join(f"temperature {t}: " + profile_cells(r, by_profile, counts.get(t) or {})
                                      for t, by_profile in r["e2e_speedup_sampled"].items())


def next_turn(r):
    row = r["by_route_step_context"]["plain"]["256"]["4096"]
    return f"{row['ttft_ms']['cached']:,.0f} / {row['ttft_ms']['cold']:,.0f} ms ({row['cached_over_cold']:.2f})"


def starts(r):
    first, second = r["starts"]["first"], r["starts"]["second"]
    return (f"first {first['ready_s']:.0f} s ({first['after_load_s']:.0f} s of checks), second "
            f"{second['ready_s']:.0f} s ({second['after_load_s']:.1f} s after its weights loaded)")


def battery(r):
    servers = r["servers"].values()
    worst = [max(len(s["client_5xx"]) for s in servers), max(s["crashes"] for s in servers),
             max(len(s["path_leaks"]) for s in servers), max(s["answers_changed"] for s in servers)]
    return f"{max(s['sent'] for s in servers):,} each: " + " / ".join(map(str, worst))


# (what, the record's stem in evidence/, its figure)
RESULTS = [
    ("Exact verify, rollback, greedy and seeded sampled tokens against plain decoding: differing elements", "parity-cuda",
     lambda r: f"{r['exact_mismatches']:,} (negative controls: {r['stock_mismatches']:,})"),
    ("Exact verify round timed alone, in the round phase's decode steps (each evaluated alone)", "bench-cuda-27b",
     verify_rounds),
    ("The same with the real file's fp32 activations", "bench-cuda-27b-fp32", verify_rounds),
    ("A round as the server times it at start-up, verify + draft, in its plain decode steps (queued as "
     "generation queues them): what the round policy decides by", "bench-cuda-27b", served_rounds),
    ("The same with the real file's fp32 activations", "bench-cuda-27b-fp32", served_rounds),
    ("4-bit drafter pass, in decode steps", "bench-cuda-27b", lambda r: f"{r['drafter_ratio_by_form']['4bit']:.2f}"),
    ("Plain decoding, the pack's kernels over stock mlx-vlm", "bench-cuda-27b",
     lambda r: times(r["installed_plain_ratio"])),
    ("Speculative over plain end to end, by tokens per round (oracle drafter at the 4-bit drafter's cost)",
     "bench-cuda-27b", end_to_end),
    ("Sampled requests, speculative over plain seeded sampling end to end, by tokens per round",
     "bench-cuda-27b", sampled_end_to_end),
    ("A next turn's first token at 4k tokens of history: prefix cache / cold", "prefix-cache-cuda-27b-4k", next_turn),
    ("Speculation's extra memory at 16k tokens: whole context / the drafter's sliding window",
     "prefix-cache-cuda-27b-4k", lambda r: "{full:.2f} / {sliding_window:.2f} GB".format(**r["spec_extra_memory_gb"]["16384"])),
    ("Server start, launch to ready at the 27B shape: first, then with its checks cached", "starts-cuda", starts),
    ("Hostile requests per server: client errors answered 5xx / crashes / paths leaked / answers changed",
     "battery-cpu", battery),
]


def measured_code(record: dict) -> str:
    """What code a record measured, for the table: its git commit (short; marked where the
    tree had uncommitted changes), else, for records from before commits were recorded, its
    code digest and that it names no commit."""
    if record.get("git_commit"):
        return record["git_commit"][:12] + (", uncommitted changes" if record.get("git_clean") is False else "")
    return f"no commit recorded, code {record.get('code', 'not recorded')}"


def results_table(evidence: Path = ROOT / "evidence") -> str:
    """README's results: one row per figure, with the record it comes from and the commit
    that record measured (or, for records older than commits, their code digest)."""
    lines = ["| measure | result | device | record (commit) |", "|---|---|---|---|"]
    for what, stem, figure in RESULTS:
        record = json.loads((Path(evidence) / f"{stem}.json").read_text())
        device = record.get("device", record["backend"])
        lines.append(f"| {what} | {figure(record)} | {device} | [{stem}](evidence/{stem}.md) ({measured_code(record)}) |")
    return "\n".join(lines) + "\n"


def quoted_stems() -> list:
    """The records README's results table quotes."""
    return list(dict.fromkeys(stem for _, stem, _ in RESULTS))


def named_commits(record: dict) -> list:
    """Every git commit a record names: its own, a split run's round phase's (round_process)
    and each end-to-end section's (e2e_by_tokens)."""
    parts = [record, record.get("round_process") or {}, *(record.get("e2e_by_tokens") or {}).values()]
    return list(dict.fromkeys(part["git_commit"] for part in parts if part.get("git_commit")))


def commits_outside_history(evidence: Path = ROOT / "evidence", root: Path = ROOT, env=None) -> list:
    """(record stem, commit) for each commit a quoted record names that is not an ancestor of
    HEAD (`git merge-base --is-ancestor`: unknown commits, and commits off HEAD's line, such
    as one of a branch never merged or rewritten away). Records naming no commit are left to
    the table, which says so."""
    import subprocess

    outside = []
    for stem in quoted_stems():
        record = json.loads((Path(evidence) / f"{stem}.json").read_text())
        for commit in named_commits(record):
            ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=root, env=env,
                                      capture_output=True, text=True)
            if ancestor.returncode != 0:
                outside.append((stem, commit))
    return outside


def readme_with_results(text: str, evidence: Path = ROOT / "evidence") -> str:
    """text with the table between its results markers written from the records."""
    start, end = text.index(RESULTS_START) + len(RESULTS_START), text.index(RESULTS_END)
    return text[:start] + "\n" + results_table(evidence) + text[end:]


def main():
    parser = argparse.ArgumentParser(description="README's results table, from evidence/*.json")
    parser.add_argument("--readme", action="store_true", help="write the table into README.md between its markers")
    parser.add_argument("--check", action="store_true",
                        help="list the commits quoted records name that are not ancestors of HEAD (exit 1 if any)")
    args = parser.parse_args()
    if args.check:
        outside = commits_outside_history()
        for stem, commit in outside:
            print(f"{stem}: {commit} is not an ancestor of HEAD")
        sys.exit(1 if outside else 0)
    if args.readme:
        readme = ROOT / "README.md"
        readme.write_text(readme_with_results(readme.read_text()))
    else:
        print(results_table(), end="")


if __name__ == "__main__":
    main()
