"""Which CUDA graphs of a decode step or verify round MLX builds anew, and what changed.

    python tools/graph_misses.py --out /tmp/out

CUDA only (the GPU machine). MLX 0.32.2 records a step's kernels into CUDA graphs and keeps
the executable graphs keyed by topology (node kinds and dependency edges, the edges found by
buffer address, mlx/backend/cuda/device.cpp); a graph whose key is new, or that cannot be
updated in place, pays cudaGraphInstantiate. Verify rounds paid such instantiations where
decode steps paid none (evidence/profile-verify-cuda.md). This tool has MLX write every
graph it commits as a DOT file (MLX_SAVE_CUDA_GRAPHS_DOT_FILE), builds the 27B-shape target
as tools/bench.py does, and runs decode steps and verify rounds, arms taking turns. Per
step it counts the instantiations (PyTorch's profiler, as tools/profile_verify.py) and
finds the committed graphs whose topology no earlier graph had, each against the graph at
the same place in the arm's step before: which nodes and dependency edges differ, named by
kernel. More instantiations than new topologies: graphs MLX cannot update (its
subgraph_to_key) or whose update failed. Writes graph-misses-<backend>.json and .md, and the
DOT files of each arm's last two steps as graphs.tar.gz. A diagnostic: why a round
re-instantiates, not a speed record (writing the files slows every step).
"""

import argparse
import functools
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

GRAPH_FILES = "MLX_SAVE_CUDA_GRAPHS_DOT_FILE"  # MLX writes graph N to <this>_N.dot
if __name__ == "__main__":  # MLX reads it once, at its first graph commit: before any eval
    os.environ[GRAPH_FILES] = os.path.join(tempfile.mkdtemp(prefix="dflash2-graphs-"), "g")

import bench  # noqa: E402  (MLX's CUDA graph cache, as served; the pack on sys.path)

import mlx.core as mx  # noqa: E402
from mlx_vlm.speculative.cache_state import commit_speculative_round  # noqa: E402

import dflash2_kernels  # noqa: E402
import dflash2_policy  # noqa: E402
from ncu_summary import short_name  # noqa: E402
from records import run_environment, write_record  # noqa: E402

# MLX's dump (cudaGraphDebugDotPrint, no flags): a cluster per graph, the committed graph's
# first, then each child graph (a captured cuBLAS call) it holds. A node's label is its index
# and, on the next line, its payload: a kernel's mangled symbol (shape octagon) or the name
# of the child graph it runs (graph_N); other kinds of node carry words of their own.
EDGE = re.compile(r'"graph_(\d+)_node_(\d+)"\s*->\s*"graph_(\d+)_node_(\d+)"(?:\s*\[[^\]]*\])?')
NODE = re.compile(r'"graph_(\d+)_node_(\d+)"\s*\[([^\]]*)\]')
ATTRIBUTE = re.compile(r'(\w+)="([^"]*)"')
CHILD = re.compile(r"graph_(\d+)$")


def parse_graph(text: str) -> dict:
    """One DOT file as {"nodes": [(name, kind, symbol)], "edges": {(from, to)}, "unparsed": n}.
    Nodes are named (graph ordinal in the file, node index): graph ids count up across files,
    ordinals and indices are what two commits of one graph share. kind: "kernel", "graph G"
    (runs child graph G) or the payload's first word; symbol: a kernel's (mangled) name."""
    graphs, nodes, unparsed = {}, {}, 0

    def ordinal(graph_id: str) -> int:
        return graphs.setdefault(graph_id, len(graphs))

    edges = EDGE.findall(text)
    for graph_id, index, attributes in NODE.findall(EDGE.sub("", text)):  # an edge can carry attributes
        name = (ordinal(graph_id), int(index))
        if name in nodes:
            continue
        fields = dict(ATTRIBUTE.findall(attributes))
        lines = [line.strip() for line in fields.get("label", "").replace("\\n", "\n").splitlines() if line.strip()]
        payload = lines[1] if len(lines) > 1 else ""
        child = CHILD.match(payload)
        if child:
            nodes[name] = (f"graph {ordinal(child.group(1))}", "")
        elif fields.get("shape") == "octagon":
            nodes[name] = ("kernel", payload)
        else:
            unparsed += not payload
            nodes[name] = (payload.split()[0] if payload else "?", "")
    pairs = {((ordinal(a), int(i)), (ordinal(b), int(j))) for a, i, b, j in edges if a == b}
    return {"nodes": sorted((name, *node) for name, node in nodes.items()),
            "edges": {pair for pair in pairs if pair[0] in nodes and pair[1] in nodes}, "unparsed": unparsed}


def topology(graph: dict) -> tuple:
    """What MLX's graph key holds, near enough: node kinds in creation order and the
    dependency edges (MLX keeps them as a string in insertion order). A committed graph's
    kernel is "K" there whichever kernel it is; a child graph's kernel also carries its
    cluster shape, which the dump leaves out: the kernel's symbol stands in for it (a captured
    cuBLAS call may pick a clustered kernel at one shape and not at another)."""
    return (tuple((name, kind, symbol if name[0] else "") for name, kind, symbol in graph["nodes"]),
            frozenset(graph["edges"]))


@functools.cache
def readable(symbol: str) -> str:
    """A kernel's symbol demangled where c++filt is at hand, without its parameter list."""
    if symbol.startswith("_Z") and shutil.which("c++filt"):
        symbol = subprocess.run(["c++filt", symbol], capture_output=True, text=True).stdout.strip() or symbol
    return short_name(symbol)[:80]


def describe_change(before: dict, after: dict, limit: int = 12) -> list:
    """Lines naming how `after` differs from `before`: nodes whose kind or kernel differ,
    nodes only in one, edges only in one (each end named by its kernel)."""
    old = {name: (kind, symbol) for name, kind, symbol in before["nodes"]}
    new = {name: (kind, symbol) for name, kind, symbol in after["nodes"]}

    def named(name, nodes):
        kind, symbol = nodes.get(name, ("?", ""))
        return f"{name[0]}.{name[1]} {readable(symbol) if symbol else kind}"

    lines = [f"node {named(name, old)} -> {readable(new[name][1]) if new[name][1] else new[name][0]}"
             for name in sorted(old.keys() & new.keys()) if old[name] != new[name]]
    lines += [f"node only before: {named(name, old)}" for name in sorted(old.keys() - new.keys())]
    lines += [f"node only after: {named(name, new)}" for name in sorted(new.keys() - old.keys())]
    lines += [f"edge only before: {named(a, old)} -> {named(b, old)}" for a, b in sorted(before["edges"] - after["edges"])]
    lines += [f"edge only after: {named(a, new)} -> {named(b, new)}" for a, b in sorted(after["edges"] - before["edges"])]
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


def file_number(path: Path) -> int:
    return int(path.stem.rsplit("_", 1)[1])


def graph_folder() -> Path:
    return Path(os.environ[GRAPH_FILES]).parent


def committed_since(last: int) -> list:
    """The DOT files MLX wrote after file number `last`, in commit order."""
    return sorted((path for path in graph_folder().glob("g_*.dot") if file_number(path) > last), key=file_number)


def take_graphs(last: int) -> tuple:
    """(graphs committed after file `last`, their files, the newest file's number)."""
    paths = committed_since(last)
    return [parse_graph(path.read_text()) for path in paths], paths, max([last] + [file_number(p) for p in paths])


def instantiations(run) -> int:
    """cudaGraphInstantiate calls while run() runs, as PyTorch's profiler (CUPTI) sees them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as recorded:
        run()
    return sum(event.name.startswith("cudaGraphInstantiate") for event in recorded.events())


def record_steps(arms: dict, warm: int, count: int, count_instantiations=instantiations,
                 context=lambda: None) -> dict:
    """Per arm (name -> (steps, settle)): `warm` steps, then `count` steps, each settled
    (what it left lazy evaluated, so no step commits another's work), timed, its
    instantiations counted and its graphs read back, beside context(): the positions the
    cache held before it. Arms take turns step by step."""
    paths = committed_since(-1)
    last = max([-1] + [file_number(path) for path in paths])
    for path in paths:
        path.unlink()  # the build's and the self-tests' graphs (thousands): not a step's
    for _ in range(warm):
        for steps, settle in arms.values():
            steps(1)
            settle()
    graphs, paths, last = take_graphs(last)
    # The warm-up's topologies are in MLX's graph cache (the bench's 4096 entries, one cache
    # per stream: every arm runs on one); the build's are left out, and a step graph only a
    # build graph shared would count as a miss here.
    seen = {topology(graph) for graph in graphs}
    for path in paths:
        path.unlink()
    result = {name: [] for name in arms}
    for step in range(count):
        for name, (steps, settle) in arms.items():
            positions = context()
            started = time.perf_counter()
            instantiated = count_instantiations(lambda: (steps(1), settle()))
            wall_ms = 1000 * (time.perf_counter() - started)
            graphs, paths, last = take_graphs(last)
            before = result[name][-1]["graphs"] if result[name] else []
            misses = []
            for place, graph in enumerate(graphs):
                if topology(graph) not in seen:
                    misses.append({"place": place, "nodes": len(graph["nodes"]), "edges": len(graph["edges"]),
                                   "change": describe_change(before[place], graph) if place < len(before)
                                   else ["no graph at this place in the step before"]})
                    seen.add(topology(graph))
            result[name].append({"step": step, "context": positions, "wall_ms": round(wall_ms, 2),
                                 "instantiations": instantiated,
                                 "graphs": graphs, "unparsed": sum(graph["unparsed"] for graph in graphs),
                                 "files": [path.name for path in paths], "misses": misses})
    return result


def summary_markdown(record: dict) -> str:
    lines = [f"# CUDA graphs built anew per step on {record['backend']} ({record['device']})", "",
             f"Command: `{record['command']}`; mlx {record['versions']['mlx']}, code {record['code']}. "
             f"After {record['warm_steps']} warm-up steps per arm, decode and the verify arms advancing 5 and 4 "
             "taking turns, each step settled; then each arm that leaves its commit lazy (or queues it) alone. "
             "Instantiations: cudaGraphInstantiate calls in the step. A miss is a committed graph whose "
             "topology (node kinds, dependency edges) no earlier graph of the run had; instantiations "
             "beyond the misses are graphs MLX cannot update in place, or whose update failed. Wall "
             "times include writing every graph to disk.", "",
             "| arm | step | context | wall ms | graphs | instantiations | misses (place: nodes/edges) |",
             "|---|---|---|---|---|---|---|"]
    for name, steps in record["arms"].items():
        for step in steps:
            misses = ", ".join(f"{m['place']}: {m['nodes']}/{m['edges']}" for m in step["misses"]) or "none"
            unparsed = f" ({step['unparsed']} nodes unparsed)" if step["unparsed"] else ""
            lines.append(f"| {name} | {step['step']} | {step['context']} | {step['wall_ms']:.2f} | {step['graphs']}{unparsed} | "
                         f"{step['instantiations']} | {misses} |")
    lines += ["", "The first three misses of each step, against the graph at the same place in the arm's "
              "step before:"]
    for name, steps in record["arms"].items():
        for step in steps:
            for miss in step["misses"][:3]:
                lines += ["", f"- {name}, step {step['step']}, graph {miss['place']}:"]
                lines += [f"  - {line}" for line in miss["change"]]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", choices=["27b", "tiny"], default="27b")
    parser.add_argument("--block", type=int, default=8, help="verify length")
    parser.add_argument("--warm", type=int, default=4, help="warm-up steps per arm")
    parser.add_argument("--steps", type=int, default=12, help="recorded steps per arm (do misses die out?)")
    args = parser.parse_args()
    if dflash2_kernels.backend_name() != "cuda":
        parser.error("CUDA only: MLX builds CUDA graphs on no other backend")
    import torch

    torch.zeros(1, device="cuda")  # CUDA up in torch before its profiler starts
    started = time.time()
    lm, cache, taps, _ = bench.prefilled_target(args.size, 32)
    print(f"[{time.time() - started:6.1f}s] runtime installed", flush=True)
    settle = bench.cache_settler(cache)
    # Rounds that advance the cache by half the block plus one meet every key length modulo 8
    # in turn; a control that advances by 4 meets two. If misses follow the key lengths
    # (a cuBLAS call of the attention picking another kernel at some), the control's stop.
    half = args.block // 2
    arms = {"decode": (bench.decode_steps(lm, cache), settle),
            f"verify {args.block}, advancing {half + 1}": (bench.verify_round_steps(lm, cache, taps, args.block), settle),
            f"verify {args.block}, advancing 4": (bench.verify_round_steps(lm, cache, taps, args.block, 3), settle)}
    # Rounds unsettled, as the server runs them: the commit queued as an evaluation of its own
    # (dflash2_policy.commit_round), and mlx-vlm's commit left lazy for the next round's first
    # evaluation to take. Each arm runs alone, so that what it leaves stays its own.
    unsettled = {f"verify {args.block}, commit left lazy": (
                     bench.verify_round_steps(lm, cache, taps, args.block, commit=commit_speculative_round), lambda: None),
                 f"verify {args.block}, commit queued": (
                     bench.verify_round_steps(lm, cache, taps, args.block), lambda: None)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = {}
    with tarfile.open(out / "graphs.tar.gz", "w:gz") as archive:
        for phase in [arms] + [{name: arm} for name, arm in unsettled.items()]:
            with mx.stream(dflash2_policy.batch_stream):  # as the server's batch generator runs requests
                recorded = record_steps(phase, args.warm, args.steps,
                                        context=lambda: dflash2_policy.processed_tokens(cache))
            settle()
            print(f"[{time.time() - started:6.1f}s] recorded {args.steps} steps of {', '.join(phase)}", flush=True)
            for name, arm in recorded.items():
                for step in arm[-2:]:
                    for file in step["files"]:
                        archive.add(graph_folder() / file, arcname=f"{name.replace(' ', '-')}/step{step['step']}/{file}")
            steps.update(recorded)
    shutil.rmtree(graph_folder())
    record = {**run_environment("graph_misses.py", f"synthetic {args.size}, seed 0"),
              "warm_steps": args.warm,
              "arms": {name: [{**step, "graphs": len(step["graphs"])} for step in arm] for name, arm in steps.items()}}
    markdown = summary_markdown(record)
    write_record(out, f"graph-misses-{record['backend']}", record, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
