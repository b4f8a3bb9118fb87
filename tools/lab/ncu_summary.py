"""Where the exact 2-bit matmul stalls: a record from Nsight Compute's output of the ncu part.

    python tools/lab/ncu_summary.py DETAILS.txt [SASS.csv] --out evidence/

`bash tools/device_27b.sh ncu` profiles MLX's single-row qmv and the exact kernel at 1 and 8
rows (one launch each at (17408, 5120)) and prints the report's details page (ncu-qmv.txt)
and its SASS with per-instruction counts (ncu-sass.csv). This reads them back: per kernel,
the metrics that say whether it is bound by memory, by issue or by latency (duration,
registers and occupancy, issue and stall statistics, throughputs), and from the SASS the
instruction mix and the stall samples by opcode. Writes evidence/ncu-qmv-cuda.json and .md.
A diagnostic for the next kernel change (issue 13 item 3), not a speed record: ncu replays
each kernel with cold caches and unlocked clocks.
"""

import argparse
import csv
import re
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from records import code_digest, git_state, write_record  # noqa: E402

METRICS = (
    "Duration", "Registers Per Thread", "Theoretical Occupancy", "Achieved Occupancy",
    "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "No Eligible",
    "Warp Cycles Per Issued Instruction", "Instructions Executed", "Compute (SM) Throughput",
    "Memory Throughput", "L1/TEX Cache Throughput", "L2 Cache Throughput", "DRAM Throughput",
    "L1/TEX Hit Rate", "Stall Long Scoreboard", "Stall Wait", "Stall Not Selected",
    "Stall Dispatch Stall", "Stall Math Pipe Throttle", "Stall Short Scoreboard",
)
# A kernel's header line: two spaces, its signature, its grid x block, then the context.
KERNEL = re.compile(r"^  (\S.*?\)) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context")
METRIC = re.compile(r"^    (\S.*?\S)\s{2,}(\S*)\s+([\d,.]+)$")
OPCODES_SHOWN = 10


def short_name(signature: str) -> str:
    """The kernel's name with its template arguments, without the parameter list: what
    precedes the parenthesis that the signature's last one closes (template arguments can
    hold parentheses of their own, as SASS's `qmv_kernel<(int)8, ...>`)."""
    if signature.endswith(")"):
        depth = 0
        for at in range(len(signature) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(signature[at], 0)
            if depth == 0:
                signature = signature[:at]
                break
    return signature.removeprefix("void ").strip()


def read_details(text: str) -> dict:
    """name -> {"grid", "block", metric -> (value, unit)}: the first value of each METRICS
    entry within each kernel's section of `ncu --page details` output."""
    kernels, current = {}, None
    for line in text.splitlines():
        header = KERNEL.match(line)
        if header:
            current = kernels.setdefault(short_name(header[1]), {
                "grid": [int(v) for v in header.group(2, 3, 4)], "block": [int(v) for v in header.group(5, 6, 7)]})
            continue
        found = METRIC.match(line)
        if current is not None and found and found[1] in METRICS and found[1] not in current:
            current[found[1]] = (float(found[3].replace(",", "")), found[2])
    return kernels


def read_sass(rows) -> dict:
    """name -> {"instructions": n, "opcodes": [(opcode, share of executed, stall samples)]}
    from `ncu --page source --csv --print-source sass` rows."""
    kernels, current, header = {}, None, None
    for row in rows:
        if row and row[0] == "Kernel Name":
            current = kernels.setdefault(short_name(row[1]), {"executed": Counter(), "stalls": Counter()})
        elif row and row[0] == "Address":
            header = row
        elif current is not None and header and len(row) == len(header):
            source = dict(zip(header, row))
            words = source["Source"].split()
            opcode = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
            current["executed"][opcode] += int(source["Instructions Executed"] or 0)
            current["stalls"][opcode] += int(source["Warp Stall Sampling (All Samples)"] or 0)
    summary = {}
    for name, counts in kernels.items():
        total = sum(counts["executed"].values())
        summary[name] = {"instructions": total, "opcodes": [
            (opcode, round(executed / total, 4), counts["stalls"][opcode])
            for opcode, executed in counts["executed"].most_common(OPCODES_SHOWN)]}
    return summary


def summary_markdown(record: dict) -> str:
    names = list(record["kernels"])
    lines = [
        "# Nsight Compute on the 2-bit matmuls (cuda)", "",
        f"Command: `{record['command']}` on the output of `bash tools/device_27b.sh ncu` (one launch "
        "each at (17408, 5120): MLX's single-row call, the exact kernel at 1 and at 8 rows; caches "
        "flushed per replay, clocks not locked). The details page names kernels as ncu prints "
        "them, the SASS page with their namespaces.", "",
        "| metric | " + " | ".join(f"`{name}`" for name in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for metric in ("grid", "block", *METRICS):
        cells = []
        for name in names:
            value = record["kernels"][name].get(metric)
            cells.append("" if value is None else str(value) if metric in ("grid", "block")
                         else f"{value[0]:g} {value[1]}".strip())
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    for name, sass in record.get("sass", {}).items():
        lines += ["", f"`{name}`: {sass['instructions']:,} warp instructions; by opcode (share of executed, "
                  "stall samples): " + ", ".join(f"{op} {share:.1%} ({stalls})" for op, share, stalls in sass["opcodes"])]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("details", type=Path, help="ncu --page details --print-details all output")
    parser.add_argument("sass", type=Path, nargs="?", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--out", default=str(REPO / "evidence"))
    args = parser.parse_args()
    kernels = read_details(args.details.read_text())
    if not kernels:
        parser.error(f"{args.details}: no kernel sections of ncu's details page")
    record = {"command": f"python tools/lab/ncu_summary.py {args.details.name}" + (f" {args.sass.name}" if args.sass else ""),
              "backend": "cuda", "code": code_digest(), **git_state(), "kernels": kernels}
    if args.sass:
        with args.sass.open(newline="") as rows:
            record["sass"] = read_sass(csv.reader(rows))
    write_record(args.out, "ncu-qmv-cuda", record, summary_markdown(record))
    print(summary_markdown(record))


if __name__ == "__main__":
    main()
