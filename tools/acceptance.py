"""Acceptance of the trained tiny pair's drafter, and the speed of speculative against plain.

    python tools/acceptance.py --out evidence/                # fixtures/tiny-pair
    python tools/acceptance.py --pack DIR --out DIR/evidence  # another target + drafter pair

For code-like, prose-like and tool-call chat prompts: greedy decoding plain and
speculative at fixed blocks 2..5 (the drafter's runtime ceiling), the tokens checked equal,
with tokens per round (1 + accepted drafts) and the share of drafts accepted. Then the
speed of speculative decoding against plain on this machine, the drafter configured as the
server configures it (the demo's fixed block, and the adaptive round policy by the round
costs a start-up measures): one warm-up pass, then the arms interleaved, median, min and max of
5. And sixteen varied chat requests (code, prose, questions, a tool call) answered greedily
as the demo answers them: how many distinct answers they get, and the drafts accepted when
the same requests run speculatively at the demo's block. Writes
evidence/acceptance-<backend>.json and .md.

fixtures/tiny-pair is a test and demo fixture (a few million parameters trained for
minutes), not Ternary-Bonsai-2-27B: its figures say the drafter path works, not what the
27B pair accepts.
"""

import argparse
import sys
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from parity import WEATHER_TOOL, chat_ids, greedy, served_rounds  # noqa: E402
from records import run_environment, write_record  # noqa: E402

PAIR = REPO / "fixtures" / "tiny-pair"
PROMPTS = {
    "code": [
        "Write a Python function `split_path`: Split a path into its head and tail.",
        "Write a Python function `read_config`: Read and parse a configuration file.",
        "Write a Python function `is_valid`: Return True if the name is valid.",
    ],
    "prose": [
        "Explain what a context manager does in Python.",
        "Describe how the module handles errors.",
        "What does this class return when the file is empty?",
    ],
    "tool-call": [
        "What is the weather in Paris?",
        "Get the weather for the city of Berlin.",
    ],
}
BLOCKS = (2, 3, 4, 5)
SPEED_BLOCK = 4  # the demo's fixed block (serve_dflash2.DEMO_BLOCK_SIZE)
# Sixteen varied chat requests: the demo should answer different prompts differently.
# (kind, text); the tool-call request offers parity's weather tool.
VARIED_PROMPTS = [
    ("code", "Write a Python function `split_path`: Split a path into its head and tail."),
    ("code", "Write a Python function that reverses a list."),
    ("code", "def fibonacci(n):"),
    ("code", "Write a class for a stack with push and pop."),
    ("prose", "Explain what a context manager does in Python."),
    ("prose", "Describe the json module."),
    ("prose", "Write a short paragraph about the sea."),
    ("prose", "Summarize what the logging module does."),
    ("question", "What does os.path.join return?"),
    ("question", "How do I read a file line by line?"),
    ("question", "Why is my loop so slow?"),
    ("question", "What is the difference between a list and a tuple?"),
    ("question", "What is `shutil.copy` for?"),
    ("chat", "Hi"),
    ("chat", "Tell me a joke."),
    ("tool-call", "What is the weather in Paris?"),
]
VARIED_TOKENS = 16


def prompt_ids(tokenizer, kind, text):
    """A chat prompt without thinking; tool-call prompts offer parity's weather tool."""
    if kind != "tool-call":
        return chat_ids(tokenizer, text, thinking=False)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tools=[WEATHER_TOOL], tokenize=False,
        add_generation_prompt=True, enable_thinking=False,
    )
    return mx.array([tokenizer.encode(prompt, add_special_tokens=False)])


def all_prompt_ids(tokenizer, per_kind=None):
    """(kind, text, ids) of every prompt, or of the first `per_kind` of each kind."""
    return [(kind, text, prompt_ids(tokenizer, kind, text))
            for kind, texts in PROMPTS.items() for text in texts[:per_kind]]


def acceptance_cases(model, tokenizer, drafter, costs, prompts, max_tokens, blocks=BLOCKS):
    """Each (kind, text, ids) prompt plain and speculative at each fixed block: rounds,
    drafts, accepted."""
    cases = []
    for kind, text, ids in prompts:
        plain = greedy(model, ids, max_tokens)
        for block in blocks:
            with served_rounds(drafter, costs, fixed_block=True):
                spec = greedy(model, ids, max_tokens, drafter=drafter, block_size=block)
            rounds, accepted = len(drafter.accept_lens), int(sum(drafter.accept_lens))
            cases.append({
                "kind": kind, "prompt": text, "block": block, "tokens": len(plain),
                "rounds": rounds, "drafted": int(sum(drafter.draft_lens)), "accepted": accepted,
                "identical": spec == plain, "text": tokenizer.decode(plain),
            })
    return cases


def varied_answers(model, tokenizer, max_tokens=VARIED_TOKENS, drafter=None, costs=None,
                   block=SPEED_BLOCK):
    """Each of VARIED_PROMPTS answered by plain greedy decoding through the chat template
    without thinking (as the demo serves a temperature-0 request), and the number of distinct
    answers. With a drafter, each also runs speculatively at the demo's fixed block: its
    tokens must equal plain's, and the drafts it accepted are counted."""
    answers = []
    for kind, text in VARIED_PROMPTS:
        ids = prompt_ids(tokenizer, kind, text)
        plain = greedy(model, ids, max_tokens)
        answer = {"kind": kind, "prompt": text, "text": tokenizer.decode(plain)}
        if drafter is not None:
            with served_rounds(drafter, costs, fixed_block=True):
                spec = greedy(model, ids, max_tokens, drafter=drafter, block_size=block)
            answer.update(identical=spec == plain, drafted=int(sum(drafter.draft_lens)),
                          accepted=int(sum(drafter.accept_lens)))
        answers.append(answer)
    record = {"prompts": len(answers), "max_tokens": max_tokens,
              "distinct_answers": len({a["text"] for a in answers}), "answers": answers}
    if drafter is not None:
        record.update(block=block, identical=all(a["identical"] for a in answers),
                      drafted=sum(a["drafted"] for a in answers), accepted=sum(a["accepted"] for a in answers))
    return record


def summarize(cases):
    """Per kind and block: tokens per round and the share of drafts accepted."""
    rows = []
    for kind in PROMPTS:
        for block in sorted({c["block"] for c in cases}):
            group = [c for c in cases if c["kind"] == kind and c["block"] == block]
            rounds = sum(c["rounds"] for c in group)
            accepted = sum(c["accepted"] for c in group)
            drafted = sum(c["drafted"] for c in group)
            rows.append({
                "kind": kind, "block": block, "rounds": rounds,
                "tokens_per_round": round((rounds + accepted) / rounds, 3) if rounds else None,
                "acceptance": round(accepted / drafted, 3) if drafted else None,
            })
    return rows


def speed_ratio(model, tokenizer, drafter, costs, max_tokens, repeats=5):
    """Plain, speculative at the demo's fixed block and speculative with the round policy,
    on a code prompt, interleaved (dflash2_timing.interleaved_ms: one warm-up pass)."""
    import dflash2_timing

    ids = prompt_ids(tokenizer, "code", PROMPTS["code"][0])

    sources = {}  # the last run's tokens from rounds and from plain steps, per arm

    def speculative(fixed_block):
        with served_rounds(drafter, costs, fixed_block=fixed_block) as state:
            greedy(model, ids, max_tokens, drafter=drafter, block_size=SPEED_BLOCK if fixed_block else None)
        counts = state.round_counts
        sources[fixed_block] = {"tokens_from_rounds": counts.tokens_from_rounds,
                                "tokens_from_plain_steps": counts.tokens_from_plain_steps}

    ms = dflash2_timing.interleaved_ms({
        "plain": dflash2_timing.timed_ms(lambda: greedy(model, ids, max_tokens)),
        "speculative, fixed block": dflash2_timing.timed_ms(lambda: speculative(True)),
        "speculative, round policy": dflash2_timing.timed_ms(lambda: speculative(False)),
    }, repeats)
    return {
        "block": SPEED_BLOCK, "max_tokens": max_tokens, "repeats": repeats, "ms": ms,
        "speed_over_plain": {name: round(ms["plain"]["median"] / arm["median"], 3)
                             for name, arm in ms.items() if name != "plain"},
        "token_sources": {"speculative, fixed block": sources[True], "speculative, round policy": sources[False]},
        "round_costs": costs.to_json(), "round_costs_summary": costs.summary(),
    }


def markdown(record):
    lines = [
        f"# Drafter acceptance on {record['backend']} ({record['device']}): {record['pack']}",
        "",
        "A test and demo fixture (a few million parameters trained for minutes), **not** "
        "Ternary-Bonsai-2-27B: these figures show the drafter path working, not the 27B pair's acceptance.",
        "",
        f"Command: `{record['command']}`; mlx {record['versions']['mlx']}, "
        f"mlx-vlm {record['versions']['mlx_vlm']}. Greedy, {record['max_tokens']} tokens a prompt, "
        "fixed blocks; speculative tokens equal plain in every run: "
        f"{record['all_identical']}.",
        "",
        "| prompts | block | rounds | tokens per round | drafts accepted |",
        "|---|---|---|---|---|",
    ]
    for row in record["summary"]:
        lines.append(f"| {row['kind']} | {row['block']} | {row['rounds']} | {row['tokens_per_round']} "
                     f"| {row['acceptance']:.0%} |")
    speed = record["speed"]
    lines += [
        "",
        f"Speed on this machine: a code prompt, {speed['max_tokens']} tokens, one warm-up pass, then "
        f"the arms interleaved {speed['repeats']} times (median, min, max). The drafter is configured "
        f"as the server configures it; the round costs it measured: {speed['round_costs_summary']}.",
        "",
        "| arm | median ms | min ms | max ms | speed over plain | tokens from rounds / plain steps |",
        "|---|---|---|---|---|---|",
    ]
    for name, ms in speed["ms"].items():
        ratio = speed["speed_over_plain"].get(name, 1.0)
        source = speed["token_sources"].get(name)
        split = f"{source['tokens_from_rounds']} / {source['tokens_from_plain_steps']}" if source else "-"
        label = f"{name} {speed['block']}" if name.endswith("fixed block") else name
        lines.append(f"| {label} | {ms['median']:.0f} | {ms['min']:.0f} | {ms['max']:.0f} | {ratio:.2f}x | {split} |")
    lines += [
        "",
        "Sample (code prompt, plain greedy):",
        "",
        "```",
        record["sample"],
        "```",
        "",
    ]
    varied = record["varied"]
    lines += [
        f"Sixteen varied requests, greedy, {varied['max_tokens']} tokens each, through the chat template "
        f"without thinking: **{varied['distinct_answers']} distinct answers of {varied['prompts']}**. "
        f"Speculative at block {varied['block']}: {varied['accepted']} of {varied['drafted']} drafts "
        f"accepted, tokens equal plain in every request: {varied['identical']}.",
        "",
        "| kind | prompt | answer (plain greedy) | drafts accepted |",
        "|---|---|---|---|",
    ]
    for answer in varied["answers"]:
        cell = lambda text: "`" + text.replace("\n", "\u21b5").replace("|", "\\|").replace("`", "'") + "`"  # noqa: E731
        lines.append(f"| {answer['kind']} | {answer['prompt'].replace('`', '')} | {cell(answer['text'])} "
                     f"| {answer['accepted']} / {answer['drafted']} |")
    lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", type=Path, default=PAIR, help="folder with target/ and drafter/")
    parser.add_argument("--out", type=Path, default=REPO / "evidence")
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()

    import dflash2_drafter
    import dflash2_runtime
    from dflash2_pack import find_pack, load_pack
    from dflash2_timing import measure_round_costs

    model, processor, drafter = load_pack(*find_pack(args.pack))
    status = dflash2_runtime.install(model)
    if not status.speculative:
        sys.exit(f"speculation is off: {status.reason}")
    # As the server starts: its default options, then the round costs measured on this machine.
    dflash2_drafter.configure_drafter(drafter, dflash2_drafter.RuntimeOptions())
    costs = measure_round_costs(model, drafter)
    tokenizer = processor.tokenizer
    cases = acceptance_cases(model, tokenizer, drafter, costs, all_prompt_ids(tokenizer), args.max_tokens)
    pack = "trained tiny pair (fixtures/tiny-pair), a fixture, not the 27B" if args.pack == PAIR else args.pack.name
    record = {
        **run_environment("acceptance.py", pack),
        "max_tokens": args.max_tokens,
        "all_identical": all(c["identical"] for c in cases),
        "summary": summarize(cases),
        "speed": speed_ratio(model, tokenizer, drafter, costs, args.max_tokens),
        "sample": next(c["text"] for c in cases if c["kind"] == "code"),
        "cases": cases,
        "varied": varied_answers(model, tokenizer, drafter=drafter, costs=costs),
    }
    write_record(args.out, f"acceptance-{record['backend']}", record, markdown(record))
    print(markdown(record))
    return 0 if record["all_identical"] and record["varied"]["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
