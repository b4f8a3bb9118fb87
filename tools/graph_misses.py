"""Which CUDA graphs of a decode step or verify round MLX builds anew, and what changed.

    python tools/graph_misses.py --out /tmp/out

CUDA only (the GPU machine). MLX 0.32.2 records a step's kernels into CUDA graphs of about
100 nodes and keeps the executable graphs keyed by topology (node kinds and dependency
edges, the edges found by buffer address); a graph whose key is new pays cudaGraphInstantiate.
On the H200 a verify round paid one of 6-10 ms per round while decode steps paid none
(evidence/profile-verify-cuda.md). This tool has MLX write every graph it commits as a DOT
file (MLX_SAVE_CUDA_GRAPHS_DOT_FILE), builds the 27B-shape target as tools/bench.py does,
runs decode steps and verify rounds, and reports per step the committed graphs whose
topology no earlier graph had, each against the graph at the same place in the step
before: which nodes and dependency edges differ, named by kernel. Writes
graph-misses-<backend>.json and .md, and the DOT files of the last two steps of each arm
as graphs.tar.gz. A diagnostic: why a round re-instantiates, not a speed record.
"""

import argparse
import os
import re
import tarfile
import tempfile
import time
from pathlib import Path

GRAPH_FILES = "MLX_SAVE_CUDA_GRAPHS_DOT_FILE"  # MLX writes graph N to <this>_N.dot
if __name__ == "__main__":  # MLX reads it once, at its first graph commit: before any eval
    os.environ[GRAPH_FILES] = os.path.join(tempfile.mkdtemp(prefix="dflash2-graphs-"), "g")

import bench  # noqa: E402  (MLX's CUDA graph cache, as served; the pack on sys.path)

import dflash2_kernels  # noqa: E402
import dflash2_policy  # noqa: E402
from profile_verify import prefilled_target  # noqa: E402
from records import run_environment, write_record  # noqa: E402

NODE = re.compile(r'"(graph_(\d+)_node_(\d+))"\s*\[((?:[^\]"]|"(?:[^"\\]|\\.)*")*)\]', re.S)
EDGE = re.compile(r'"(graph_\d+_node_\d+)"\s*->\s*"(graph_\d+_node_\d+)"')
LABEL = re.compile(r'label="((?:[^"\\]|\\.)*)"', re.S)
KINDS = ("KERNEL", "MEMSET", "MEMCPY", "GRAPH", "EMPTY", "HOST", "EVENT_RECORD", "WAIT_EVENT",
         "MEM_ALLOC", "MEM_FREE", "CONDITIONAL")


def kernel_name(label: str) -> str:
    """The function a KERNEL node's label names on the line after its kind, without its
    parameter list (labels break lines as newlines or as escaped \\n)."""
    lines = [line.strip() for line in label.replace("\\n", "\n").splitlines()]
    after = [line for line in lines[next(i for i, line in enumerate(lines) if "KERNEL" in line.upper()) + 1:] if line]
    if not after:
        return ""
    name, depth = after[0], 0
    for end in range(len(name) - 1, -1, -1) if name.endswith(")") else ():
        depth += {")": 1, "(": -1}.get(name[end], 0)
        if depth == 0:
            name = name[:end]  # the parameter list: the bracket that closes the line, matched
            break
    return name.removeprefix("void ").strip()


def parse_graph(text: str) -> dict:
    """A DOT file of cudaGraphDebugDotPrint as {"nodes": [(name, kind, kernel)], "edges":
    {(from, to)}}, nodes named (graph ordinal in the file, node index) in creation order:
    graph ids count up across files, the ordinals and indices are what two commits share."""
    graphs, by_id, nodes = {}, {}, []
    for match in NODE.finditer(text):
        if match.group(1) in by_id or "->" in text[max(0, match.start() - 4):match.start()]:
            continue  # an edge's far end, or a node declared again
        label = LABEL.search(match.group(4))
        label = label.group(1) if label else ""
        kind = next((kind for kind in KINDS if kind in label.upper()), "?")
        kernel = kernel_name(label) if kind == "KERNEL" else ""
        name = (graphs.setdefault(match.group(2), len(graphs)), int(match.group(3)))
        by_id[match.group(1)] = name
        nodes.append((name, kind, kernel))
    edges = {(by_id[a], by_id[b]) for a, b in EDGE.findall(text) if a in by_id and b in by_id}
    return {"nodes": sorted(nodes), "edges": edges}


def topology(graph: dict) -> tuple:
    """What MLX's graph key holds: node kinds in order and the dependency edges."""
    return tuple((name, kind) for name, kind, _ in graph["nodes"]), frozenset(graph["edges"])


def describe_change(before: dict, after: dict, limit: int = 12) -> list:
    """Lines naming how `after` differs from `before`: nodes whose kind or kernel differ,
    nodes only in one, edges only in one (each end named by its kernel)."""
    old = {name: (kind, kernel) for name, kind, kernel in before["nodes"]}
    new = {name: (kind, kernel) for name, kind, kernel in after["nodes"]}

    def named(name, nodes):
        kind, kernel = nodes.get(name, ("?", ""))
        return f"{name[0]}.{name[1]} {kernel[:60] or kind}"

    lines = [f"node {named(name, old)} -> {new[name][1][:60] or new[name][0]}"
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


def record_steps(arms: dict, warm: int, count: int) -> dict:
    """Per arm: `warm` steps, then `count` steps each timed and read back as the graphs it
    committed. Arms take turns step by step, as served requests would alternate."""
    paths = committed_since(-1)
    last = max([-1] + [file_number(path) for path in paths])
    for path in paths:
        path.unlink()  # the build's and the self-tests' graphs (thousands): not a step's
    for _ in range(warm):
        for steps in arms.values():
            steps(1)
    graphs, paths, last = take_graphs(last)
    seen = {topology(graph) for graph in graphs}  # in MLX's cache by now
    for path in paths:
        path.unlink()
    result = {name: [] for name in arms}
    for step in range(count):
        for name, steps in arms.items():
            started = time.perf_counter()
            steps(1)
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
            unparsed = sum(1 for graph, path in zip(graphs, paths) if not graph["nodes"] and path.stat().st_size)
            result[name].append({"step": step, "wall_ms": round(wall_ms, 2), "graphs": graphs, "unparsed": unparsed,
                                 "files": [path.name for path in paths], "misses": misses})
    return result


def summary_markdown(record: dict) -> str:
    lines = [f"# CUDA graphs built anew per step on {record['backend']} ({record['device']})", "",
             f"Command: `{record['command']}`; mlx {record['versions']['mlx']}, code {record['code']}. "
             f"After {record['warm_steps']} warm-up steps per arm, arms taking turns; a miss is a committed "
             "graph whose topology (node kinds, dependency edges) no earlier graph of the run had: MLX "
             "instantiates it instead of updating a cached one.", "",
             "| arm | step | wall ms | graphs | misses (place: nodes/edges) |", "|---|---|---|---|---|"]
    for name, steps in record["arms"].items():
        for step in steps:
            misses = ", ".join(f"{m['place']}: {m['nodes']}/{m['edges']}" for m in step["misses"]) or "none"
            unparsed = f" ({step['unparsed']} unparsed)" if step["unparsed"] else ""
            lines.append(f"| {name} | {step['step']} | {step['wall_ms']:.2f} | {step['graphs']}{unparsed} | {misses} |")
    lines += ["", "Each miss against the graph at the same place in the arm's step before:"]
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
    started = time.time()
    lm, cache, taps, _ = prefilled_target(args.size, 32)
    print(f"[{time.time() - started:6.1f}s] runtime installed", flush=True)
    arms = {"decode": bench.decode_steps(lm, cache),
            f"verify {args.block}": bench.verify_round_steps(lm, cache, taps, args.block)}
    with bench.mx.stream(dflash2_policy.batch_stream):  # as the server's batch generator runs requests
        steps = record_steps(arms, args.warm, args.steps)
    print(f"[{time.time() - started:6.1f}s] recorded {args.steps} steps per arm", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "graphs.tar.gz", "w:gz") as archive:
        for name, arm in steps.items():
            for step in arm[-2:]:
                for file in step["files"]:
                    archive.add(graph_folder() / file, arcname=f"{name.replace(' ', '-')}/step{step['step']}/{file}")
    record = {**run_environment("graph_misses.py", f"synthetic {args.size}, seed 0"),
              "warm_steps": args.warm,
              "arms": {name: [{**step, "graphs": len(step["graphs"])} for step in arm] for name, arm in steps.items()}}
    markdown = summary_markdown(record)
    write_record(out, f"graph-misses-{record['backend']}", record, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
