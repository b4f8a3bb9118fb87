"""Regenerate a pack's evidence/ in one command: parity, fixture checks and the benchmark.

    python tools/make_evidence.py --pack DIR

runs tools/parity.py and tools/bench.py on the pack's own target and drafter and
writes their JSON and Markdown records to DIR/evidence (or --out). Run it on the
machine the figures are for; the bitwise negative control only shows on GPUs.
"""

import argparse
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", required=True)
    parser.add_argument("--out", help="default: PACK/evidence")
    args = parser.parse_args()
    out = args.out or str(Path(args.pack) / "evidence")
    failed = False
    for tool in ("parity.py", "bench.py"):
        command = [sys.executable, str(TOOLS / tool), "--pack", args.pack, "--out", out]
        print("$", " ".join(command), flush=True)
        failed |= subprocess.run(command).returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
