#!/usr/bin/env python3
"""Train the tiny target + DFlash2 drafter pair in fixtures/tiny-pair (a test and demo fixture).

    python tools/train_tiny_pair.py --out fixtures/tiny-pair        # ~40 min on 2 CPU cores
    OPENBLAS_NUM_THREADS=1 python tools/train_tiny_pair.py ...      # on a CPU other work shares

The target has make_synthetic_pack's tiny geometry (1 GatedDeltaNet layer + 1 attention
layer, hidden 512, vocab 512) and is trained aware of its 2-bit packing: every packed
matrix is a parameter in the rotated (Hadamard-signed) basis, quantized to 2-bit group-128
affine codes in the forward pass with a straight-through gradient, so the packed file
computes what training saw. The drafter (2 DFlash2 layers) learns DFlash's block objective
on the target's tap hidden states: from the context features of positions < p, the anchor
token at p and mask tokens after it, predict the target's greedy tokens p+1 .. p+7 in
parallel, through the target's own embedding and head (which it shares at run time).

Data: the running Python's standard library (Lib/*.py, sorted): the raw source, plus chat
samples made from it: code turns (a documented function asked for, in one of several
phrasings; the answer is its source), prose turns (a module, class or function asked about;
the answer is its docstring, naming it) and tool-call turns built from function signatures,
mixed in the proportions of Corpus.MIX. The byte-level BPE of the
pack's tokenizer is retrained on that source; the chat template and special tokens are
make_synthetic_pack's. Files are written with make_synthetic_pack's writers, so the
formats are exactly the synthetic pack's.

Deterministic from --seed on one software stack (Python's stdlib version, MLX, the BLAS):
the same stack regenerates the same bytes. MLX's CPU wheel links the reference BLAS; where
numpy's OpenBLAS and a C compiler are present the script routes MLX's sgemm to it (about
10x faster training) by re-running itself with a small preloaded shim, with two OpenBLAS
threads unless OPENBLAS_NUM_THREADS says otherwise (on a 2-core CPU other processes
shared, one thread ran a target step 3x faster: spinning threads wait on each other).

This pair is a fixture: a few million parameters trained for minutes. It is not a
substitute for Ternary-Bonsai-2-27B and its drafter.
"""

import argparse
import ast
import hashlib
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from dflash2_pack import PINS_FILE, SUMS_FILE, build_skeleton, sha256_file  # noqa: E402
from make_synthetic_pack import (  # noqa: E402
    SIZES,
    drafter_config,
    target_config,
    write_drafter,
    write_target,
)
from synthetic_tokenizer import CHAT_TEMPLATE, build_tokenizer, special_token_ids  # noqa: E402

SIZE = "tiny"
SEQ_LEN = 128  # target training window
BLOCK = 8  # the drafter's trained block (anchor + 7 drafts): drafter_config's block_size
GROUP, BITS = 128, 2  # the pack's affine quantization
DRAFT_LOSS_DECAY = 4.0  # DFlash's position weights exp(-(k-1)/decay): early drafts matter most

OPENBLAS_SHIM = r"""
#include <stdint.h>
extern void scipy_cblas_sgemm64_(int, int, int, int64_t, int64_t, int64_t, float,
                                 const float *, int64_t, const float *, int64_t, float,
                                 float *, int64_t);
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    scipy_cblas_sgemm64_(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rerun_with_openblas():
    """Re-run this script with MLX's cblas_sgemm served by numpy's OpenBLAS, if possible."""
    if os.environ.get("TINY_PAIR_BLAS"):
        return
    libs = sorted((Path(np.__file__).parent.parent / "numpy.libs").glob("libscipy_openblas64_*.so"))
    if not libs:
        log("numpy's OpenBLAS not found: training on MLX's reference BLAS (slow)")
        return
    folder = Path(tempfile.mkdtemp(prefix="tiny-pair-blas-"))
    (folder / "shim.c").write_text(OPENBLAS_SHIM)
    built = subprocess.run(
        ["cc", "-O2", "-shared", "-fPIC", str(folder / "shim.c"), "-o", str(folder / "libshim.so"),
         str(libs[0]), f"-Wl,-rpath,{libs[0].parent}"],
        capture_output=True, text=True,
    )
    if built.returncode:
        log("no C compiler for the OpenBLAS shim: training on MLX's reference BLAS (slow)")
        return
    env = {**os.environ, "TINY_PAIR_BLAS": "openblas", "LD_PRELOAD": str(folder / "libshim.so"),
           "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "2")}
    sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)


# ---------------------------------------------------------------------------------------
# Data


def stdlib_sources():
    """(name, text) of the standard library's top-level modules, sorted by name."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [(path.name, path.read_text(encoding="utf-8", errors="replace")) for path in sorted(lib.glob("*.py"))]


CODE_ASKS = (
    "Write a Python function `{name}`: {summary}",
    "Implement `{name}` in Python. {summary}",
    "{summary} Write it as a Python function.",
    "Show me the code of `{module}.{name}`.",
    "def {name}({params}):",
)
FUNCTION_ASKS = (
    "What does `{module}.{name}` do?",
    "Explain the function `{name}`.",
    "How do I use {module}.{name}?",
    "What is `{name}` for?",
)
CLASS_ASKS = (
    "What is the `{name}` class?",
    "Describe the class {module}.{name}.",
    "Explain what {name} objects are for.",
)
MODULE_ASKS = (
    "What is the `{module}` module for?",
    "Describe the {module} module.",
    "Summarize what {module} does.",
    "Tell me about the Python module {module}.",
)


def prose_answer(doc, limit=700):
    """A docstring as a prose answer: its first paragraphs, up to about `limit` characters."""
    paragraphs, total = [], 0
    for paragraph in doc.strip().split("\n\n"):
        if paragraphs and total + len(paragraph) > limit:
            break
        paragraphs.append(paragraph.strip())
        total += len(paragraph)
    return "\n\n".join(paragraphs)[: limit * 2]


def chat_samples(sources, renderer, seed):
    """Chat-formatted samples from the sources, by kind: "code" (a documented function asked
    for in one of several phrasings, the answer its source), "prose" (a module's, class's or
    function's docstring as the answer to a question about it, the answer naming it) and
    "tools" (a call with its arguments, the function offered as a tool). The phrasing of
    each question is drawn from the seeded generator."""
    rng = np.random.default_rng(seed)
    samples = {"code": [], "prose": [], "tools": []}

    def turn(kind, asks, answer, tools=None, **names):
        ask = asks[rng.integers(len(asks))].format(**names)
        message = {"role": "assistant", "content": answer}
        if tools:
            message = {"role": "assistant", "content": "", "tool_calls": [{"function": answer}]}
        samples[kind].append(renderer([{"role": "user", "content": ask}, message], tools=tools))

    for name, text in sources:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        module = name[:-3]
        doc = ast.get_docstring(tree)
        if doc and len(doc) > 40:
            turn("prose", MODULE_ASKS, f"The `{module}` module: {prose_answer(doc)}", module=module)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 20:
                    turn("prose", CLASS_ASKS, f"`{module}.{node.name}`: {prose_answer(doc)}",
                         module=module, name=node.name)
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            source = ast.get_source_segment(text, node)
            if not doc or not source or len(source) > 1500:
                continue
            summary = doc.strip().splitlines()[0]
            params = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            names = {"module": module, "name": node.name, "summary": summary, "params": ", ".join(params)}
            turn("code", CODE_ASKS, source, **names)
            turn("prose", FUNCTION_ASKS, f"`{module}.{node.name}({', '.join(params)})`: {prose_answer(doc)}",
                 **names)
            if params:
                tool = {"type": "function", "function": {
                    "name": node.name, "description": summary,
                    "parameters": {"type": "object", "properties": {p: {"type": "string"} for p in params},
                                   "required": params}}}
                call = {"name": node.name, "arguments": {p: p.upper() for p in params}}
                turn("tools", ("{summary} Use {module}.",), call, tools=[tool], **names)
    return samples


def make_renderer(tokenizer):
    """Renders [user, assistant] as a request without thinking and its answer: the prompt
    exactly as the server builds it (generation prompt with an empty think block), then the
    assistant turn as the template writes it."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=CHAT_TEMPLATE)

    def render(messages, tools=None, generation_prompt=False):
        return fast.apply_chat_template(messages, tools=tools, tokenize=False, enable_thinking=False,
                                        add_generation_prompt=generation_prompt)

    def render_turn(messages, tools=None):
        request = render(messages[:1], tools)
        answer = render(messages, tools)[len(request) + len("<|im_start|>assistant\n"):]
        return render(messages[:1], tools, generation_prompt=True) + answer

    return render_turn


class Corpus:
    """Token windows: raw source at any offset, chat samples from their start, tool-call
    samples ending at their end (the call, not the long tools preamble). A batch draws its
    rows' kinds in the proportions of MIX: the tool-call turns, one fixed shape, stay a
    small share so that other requests are not answered with a call."""

    MIX = {"raw": 0.1, "code": 0.3, "prose": 0.45, "tools": 0.15}

    def __init__(self, tokenizer, sources, seed):
        eot = special_token_ids(SIZES[SIZE]["special_base"])["<|endoftext|>"]
        samples = chat_samples(sources, make_renderer(tokenizer), seed)
        self.raw = np.concatenate(
            [np.array(e.ids + [eot], np.int32) for e in tokenizer.encode_batch([t for _, t in sources])]
        )
        pad = lambda ids: np.array((ids + [eot] * (SEQ_LEN + 1))[: max(len(ids), SEQ_LEN + 1)], np.int32)  # noqa: E731
        self.chats = {kind: [pad(e.ids) for e in tokenizer.encode_batch(texts)] for kind, texts in samples.items()}
        self.rng = np.random.default_rng(seed)
        log(f"data: {len(self.raw)} source tokens; chat turns "
            + ", ".join(f"{len(turns)} {kind}" for kind, turns in self.chats.items()))

    def batch(self, size):
        rows = []
        for kind in self.rng.choice(list(self.MIX), size, p=list(self.MIX.values())):
            if kind == "raw":
                start = self.rng.integers(0, len(self.raw) - SEQ_LEN - 1)
                rows.append(self.raw[start : start + SEQ_LEN + 1])
            elif kind == "tools":
                rows.append(self.chats[kind][self.rng.integers(len(self.chats[kind]))][-SEQ_LEN - 1 :])
            else:
                rows.append(self.chats[kind][self.rng.integers(len(self.chats[kind]))][: SEQ_LEN + 1])
        return mx.array(np.stack(rows))


# ---------------------------------------------------------------------------------------
# Quantization-aware target


def fake_quant(rotated):
    """The packed values: 2-bit affine codes with fp16 scales and biases, as mx.quantize
    writes them; the gradient passes straight through."""
    codes = mx.quantize(rotated.astype(mx.float16), group_size=GROUP, bits=BITS)
    packed = mx.dequantize(*codes, group_size=GROUP, bits=BITS).astype(mx.float32)
    return rotated + mx.stop_gradient(packed - rotated)


def hadamard_rows(x, block):
    return mx.hadamard_transform(x.reshape(-1, block), scale=1 / math.sqrt(block)).reshape(x.shape)


class PackedLinear(nn.Module):
    """A packed module while training: the weight lives in the pack's rotated basis
    (W diag(signs) H per block), and the effective dense weight is the packed one rotated back."""

    def __init__(self, dense_weight, block, signs):
        super().__init__()
        self.block = block
        self._signs = signs
        self.weight = hadamard_rows(dense_weight * signs, block) if block else dense_weight

    def dense(self):
        packed = fake_quant(self.weight)
        return hadamard_rows(packed, self.block) * self._signs if self.block else packed

    def __call__(self, x):
        return x @ self.dense().T


class PackedEmbedding(PackedLinear):
    def __call__(self, indices):
        return self.dense()[indices]

    def as_linear(self, x):
        return PackedLinear.__call__(self, x)


def packed_signs(seed, path, width):
    key = mx.random.key((seed << 32) | (int(hashlib.sha256(path.encode()).hexdigest()[:7], 16)))
    return (mx.random.randint(0, 2, (width,), key=key) * 2 - 1).astype(mx.float32)


def training_target(config, seed):
    """mlx-vlm's dense Qwen3.5 language model with every packed module made a PackedLinear."""
    mx.random.seed(seed)
    lm = build_skeleton({**config, "model_type": config["base_model_type"]}, "config.json").language_model
    modules = dict(lm.named_modules())
    replacements = []
    for record in config["modules"]:
        dense = modules[record["path"]].weight
        block = record["block"]
        signs = packed_signs(seed, record["path"], dense.shape[1]) if block else None
        cls = PackedEmbedding if record["embedding"] else PackedLinear
        replacements.append((record["path"], cls(dense, block, signs)))
    lm.update_modules(tree_unflatten(replacements))
    return lm


def next_token_loss(lm, batch):
    logits = lm(batch[:, :-1]).logits
    return nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")


def cosine_lr(peak, steps, warmup):
    return optim.join_schedules(
        [optim.linear_schedule(peak / warmup, peak, warmup), optim.cosine_decay(peak, steps - warmup, peak / 10)],
        [warmup],
    )


def train(model, loss_fn, batches, steps, lr, label):
    optimizer = optim.AdamW(cosine_lr(lr, steps, max(1, steps // 10)), weight_decay=0.0)
    step = nn.value_and_grad(model, loss_fn)
    started, history = time.time(), []
    for index in range(steps):
        loss, grads = step(model, *batches())
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        history.append(loss.item())
        if index % 10 == 0 or index == steps - 1:
            log(f"{label} step {index}/{steps}: loss {np.mean(history[-10:]):.3f} ({time.time() - started:.0f} s)")
    return history


def target_tensors(lm, config):
    """The trained language model in the pack's tensor names: packed modules as 2-bit codes,
    fp16 scales and biases and their signs; the rest fp32, as the real 27B's file holds them
    (make_synthetic_pack: its size is matched by fp32 dense tensors), so activations run in
    fp32 as training's did (and, on a CPU, many times faster than fp16's)."""
    packed = {record["path"] for record in config["modules"]}
    tensors = {}
    for path, module in lm.named_modules():
        if path in packed:
            codes, scales, biases = mx.quantize(module.weight.astype(mx.float16), group_size=GROUP, bits=BITS)
            name = f"language_model.{path}"
            tensors.update({f"{name}.weight": codes, f"{name}.scales": scales, f"{name}.biases": biases})
            if module.block:
                tensors[f"{name}.signs"] = module._signs
    for name, value in tree_flatten(lm.parameters()):
        module_path = name.rpartition(".")[0]
        if module_path not in packed:
            tensors[f"language_model.{name}"] = value.astype(mx.float32)
    return tensors


# ---------------------------------------------------------------------------------------
# The drafter's block objective


def context_features(lm, batch, taps):
    """The target's tap hidden states (concatenated, as the runtime feeds them) and its
    greedy next token at every position."""
    out = lm(batch, capture_layer_ids=taps)
    return mx.stop_gradient(mx.concatenate(out.hidden_states, axis=-1)), mx.argmax(out.logits, axis=-1)


def block_attention(attn, x, h_ctx, anchors, rope):
    """DFlashAttention over many blocks at once: block j (anchor at position p_j) sees the
    context positions < p_j and its own block, with the runtime's rope offsets."""
    rows, length, _ = x.shape
    batch, context, _ = h_ctx.shape
    per_row = rows // batch

    def heads(t, count):
        return t.reshape(t.shape[0], t.shape[1], count, -1).transpose(0, 2, 1, 3)

    q = rope(attn.q_norm(heads(attn.q_proj(x), attn.n_heads)), offset=anchors)
    k = rope(attn.k_norm(heads(attn.k_proj(x), attn.n_kv_heads)), offset=anchors)
    v = heads(attn.v_proj(x), attn.n_kv_heads)
    ctx_k = mx.repeat(rope(attn.k_norm(heads(attn.k_proj(h_ctx), attn.n_kv_heads)), offset=0), per_row, axis=0)
    ctx_v = mx.repeat(heads(attn.v_proj(h_ctx), attn.n_kv_heads), per_row, axis=0)
    keys = mx.concatenate([ctx_k, k], axis=2)
    values = mx.concatenate([ctx_v, v], axis=2)
    groups = attn.n_heads // attn.n_kv_heads
    keys, values = mx.repeat(keys, groups, axis=1), mx.repeat(values, groups, axis=1)
    scores = (q * attn.scale) @ keys.swapaxes(-1, -2)
    visible = mx.arange(context)[None] < anchors[:, None]  # (rows, context)
    visible = mx.concatenate([visible, mx.ones((rows, length), dtype=mx.bool_)], axis=1)
    scores = mx.where(visible[:, None, None, :], scores, -1e9)
    out = mx.softmax(scores, axis=-1) @ values
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(rows, length, -1))


def draft_logits(drafter, embed, head, h_taps, tokens, anchors, mask_id):
    """The drafter's logits for every block: anchor token + BLOCK - 1 mask tokens."""
    batch, per_row = anchors.shape
    h_ctx = drafter.hidden_norm(drafter.fc(h_taps))
    anchor_tokens = mx.take_along_axis(tokens, anchors, axis=1).reshape(-1, 1)
    inputs = mx.concatenate([anchor_tokens, mx.full((anchor_tokens.shape[0], BLOCK - 1), mask_id)], axis=1)
    x = embed[inputs]
    flat_anchors = anchors.reshape(-1)
    for layer in drafter.layers:
        residual = x
        y, kernel = layer.attention_conv.prepare(layer.input_layernorm(x))
        x = residual + layer.attention_conv.finish(
            block_attention(layer.self_attn, y, h_ctx, flat_anchors, drafter.rope), kernel
        )
        residual = x
        y, kernel = layer.mlp_conv.prepare(layer.post_attention_layernorm(x))
        x = residual + layer.mlp_conv.finish(layer.mlp(y), kernel)
    return drafter.norm(x)[:, 1:] @ head.T


def block_loss(drafter, embed, head, h_taps, greedy, tokens, anchors, mask_id):
    """Cross-entropy of drafts k = 1..BLOCK-1 against the target's greedy tokens, weighted
    exp(-(k-1)/decay). The greedy token after position p + k - 1 is greedy[p + k - 1]."""
    logits = draft_logits(drafter, embed, head, h_taps, tokens, anchors, mask_id)
    positions = anchors.reshape(-1, 1) + mx.arange(BLOCK - 1)[None]
    rows = mx.repeat(mx.arange(anchors.shape[0]), anchors.shape[1])[:, None]
    labels = greedy[rows, positions]
    weights = mx.exp(-mx.arange(BLOCK - 1) / DRAFT_LOSS_DECAY)
    losses = nn.losses.cross_entropy(logits, labels, reduction="none")
    return (losses * weights).sum() / (weights.sum() * losses.shape[0])


def training_drafter(config, seed):
    mx.random.seed(seed + 1)
    drafter = build_skeleton(config, "config.json")
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            # Start as the identity: the current position passes, the dynamic part is small.
            conv.base_kernel = mx.zeros_like(conv.base_kernel).at[:, 0, :].add(1.0)
            conv.kernel_projection.weight = conv.kernel_projection.weight * 0.1
    # The runtime drafts greedily without the candidate selector; with it (an option),
    # zero pair scores make it pick the head's argmax too.
    drafter.candidate_selector.hidden_projection.weight = mx.zeros_like(
        drafter.candidate_selector.hidden_projection.weight
    )
    drafter.candidate_selector.freeze()
    return drafter


def drafter_tensors(drafter):
    return {name: value for name, value in tree_flatten(drafter.parameters())}


# ---------------------------------------------------------------------------------------


def seal(root):
    """The launch checks' files, as a built pack has them: dflash2-pack.json (the runtime's
    pins and every pack file's), then SHA256SUMS of the pack files and the pins (the README
    and the timed training record are not pinned)."""
    from build_pack import file_pin, runtime_pins, write_text

    unpinned = (SUMS_FILE, PINS_FILE, "README.md", "training.json")
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name not in unpinned)
    digests = {name: sha256_file(root / name) for name in names}
    pins = {"runtime": runtime_pins(), "files": {name: file_pin(root / name, digests[name]) for name in names}}
    digests[PINS_FILE] = write_text(root / PINS_FILE, json.dumps(pins, indent=2, sort_keys=True) + "\n")
    write_text(root / SUMS_FILE, "".join(f"{digests[name]}  {name}\n" for name in sorted(digests)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "fixtures" / "tiny-pair")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=6000)
    parser.add_argument("--drafter-steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=12)
    args = parser.parse_args()
    rerun_with_openblas()
    mx.random.seed(args.seed)
    started = time.time()

    sources = stdlib_sources()
    special_base = SIZES[SIZE]["special_base"]
    tokenizer = build_tokenizer(special_base, corpus="\n".join(text for _, text in sources))
    corpus = Corpus(tokenizer, sources, args.seed)

    config = target_config(SIZE)
    lm = training_target(config, args.seed)
    lm.train()
    target_loss = train(lm, next_token_loss, lambda: (corpus.batch(args.batch),), args.target_steps, 3e-3, "target")
    lm.eval()
    write_target(args.out / "target", SIZE, args.seed, tokenizer=tokenizer, trained=target_tensors(lm, config))

    draft_config = drafter_config(SIZE)
    drafter = training_drafter(draft_config, args.seed)
    taps = draft_config["dflash_config"]["target_layer_ids"]
    mask_id = draft_config["dflash_config"]["mask_token_id"]
    embed = mx.stop_gradient(lm.model.embed_tokens.dense())
    head = mx.stop_gradient(lm.lm_head.dense())
    anchors_per_row = 16

    def drafter_batch():
        tokens = corpus.batch(args.batch)[:, :-1]
        h_taps, greedy = context_features(lm, tokens, taps)
        # Anchors leave a whole block inside the window and at least one context position.
        anchors = mx.array(corpus.rng.integers(1, SEQ_LEN - BLOCK + 1, (args.batch, anchors_per_row)))
        return embed, head, h_taps, greedy, tokens, anchors, mask_id

    draft_loss = train(drafter, block_loss, drafter_batch, args.drafter_steps, 3e-3, "drafter")
    write_drafter(args.out / "drafter", SIZE, args.seed, trained=drafter_tensors(drafter))
    record = {
        "seed": args.seed,
        "target_steps": args.target_steps,
        "drafter_steps": args.drafter_steps,
        "batch": args.batch,
        "seq_len": SEQ_LEN,
        "target_loss_last10": round(float(np.mean(target_loss[-10:])), 3),
        "drafter_block_loss_last10": round(float(np.mean(draft_loss[-10:])), 3),
        "blas": os.environ.get("TINY_PAIR_BLAS", "mlx reference"),
        "blas_threads": int(os.environ.get("OPENBLAS_NUM_THREADS", "0")) or None,
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "seconds": round(time.time() - started),
        "note": "a test and demo fixture, not a substitute for Ternary-Bonsai-2-27B",
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    seal(args.out)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
