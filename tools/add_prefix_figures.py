"""Copies the prefix-cache records' time to first token and speculation's extra memory into a bench record.

    python tools/add_prefix_figures.py evidence/bench-cuda-27b.json \
        evidence/prefix-cache-cuda-27b.json evidence/prefix-cache-cuda-27b-steps.json

Issue 11 keeps `ttft_ms` and `spec_extra_memory_gb` in the bench record; tools/bench_prefix.py
measures them in its own runs. Every measured row is copied, by context, with the route, the
prefill step and the record it came from (whose command says how it ran); nothing is chosen
or typed. Run it again after tools/bench.py rewrites the record (`--part e2e` keeps them).
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]


def prefix_figures(prefix_records: dict) -> dict:
    """{'ttft_ms': context -> rows, 'spec_extra_memory_gb': context -> figures} from
    prefix-cache records (name -> record)."""
    ttft, memory = {}, {}
    for name, record in sorted(prefix_records.items()):
        for route, steps in record["by_route_step_context"].items():
            for step, contexts in steps.items():
                for context, row in contexts.items():
                    ttft.setdefault(context, []).append({
                        "route": route, "step": int(step), "cold": row["ttft_ms"]["cold"],
                        "cached": row["ttft_ms"]["cached"], "cached_over_cold": row["cached_over_cold"],
                        "exact": row["exact"], "record": name,
                    })
        # Records that kept each figure's spread took the median over passes; earlier ones one pass.
        passes = record["repeats"] if "spec_peak_over_plain_min_max_gb" in record else 1
        for context, figures in record.get("spec_extra_memory_gb", {}).items():
            memory.setdefault(context, []).append({**figures, "passes": passes, "record": name})
    by_length = lambda table: dict(sorted(table.items(), key=lambda item: int(item[0])))  # noqa: E731
    return {"ttft_ms": by_length(ttft), "spec_extra_memory_gb": by_length(memory)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", type=Path, help="the bench record (JSON) to add to")
    parser.add_argument("prefix", type=Path, nargs="+", help="prefix-cache records (JSON)")
    args = parser.parse_args()
    for path in (args.bench, *args.prefix):
        if not path.is_file():
            parser.error(f"{path} is not a file")
    record = json.loads(args.bench.read_text())
    if len({path.stem for path in args.prefix}) < len(args.prefix):
        parser.error("two prefix-cache records share a name: rows name their record by it")
    sources = {path.stem: json.loads(path.read_text()) for path in args.prefix}
    for name, source in sources.items():
        if "by_route_step_context" not in source:
            parser.error(f"{name} is not a prefix-cache record (tools/bench_prefix.py)")
        if (source["backend"], source["size"]) != (record["backend"], record["size"]):
            parser.error(f"{name} is of {source['backend']} {source['size']}, "
                         f"the bench record of {record['backend']} {record['size']}")
    record.update(prefix_figures(sources))
    record["prefix_figure_commands"] = {name: source["command"] for name, source in sorted(sources.items())}

    from bench import summary_markdown
    from records import write_record

    write_record(args.bench.parent, args.bench.stem, record, summary_markdown(record))
    print(f"{args.bench}: ttft_ms at {', '.join(record['ttft_ms'])} tokens, spec_extra_memory_gb at "
          f"{', '.join(record['spec_extra_memory_gb']) or 'no'} tokens, from {len(sources)} records")


if __name__ == "__main__":
    main()
