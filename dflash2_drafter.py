"""The drafter's set-up: its block options, the dtype it drafts in, and its attention off cuDNN.

Only the drafter's proposals depend on anything here, never the tokens: block_limits checks
the block options once, configure_drafter applies the experiment options (RuntimeOptions) to
a loaded drafter, choose_drafter_dtype
times bf16 against promoted activations as serving drafts, and dflash2_runtime installs
this module's drafter calls in mlx-vlm.
"""

import types
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
from mlx_vlm.speculative.common import _dflash_block_total
from mlx_vlm.speculative.drafters.dflash2.dflash2 import DFlash2DraftModel
from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashAttention, DFlashDraftModel

import dflash2_kernels
import dflash2_timing
from dflash2_audit import _with_globals
from dflash2_rounds import greedy_drafting


@dataclass(frozen=True)
class BlockLimits:
    """The verify block's bounds, checked once (block_limits) before any weights load."""

    ceiling: int  # the largest block a round verifies: 2..min(trained block, MAX_ROWS)
    fixed: bool  # every round verifies the ceiling (--dflash2-block-size)


def block_limits(trained: int, block_size: Optional[int] = None, block_cap: Optional[int] = None) -> BlockLimits:
    """--dflash2-block-size and --dflash2-block-cap against the drafter's trained block and
    the exact kernels' rows; a ValueError names the option. No option: the adaptive block
    up to both."""
    top = min(trained, dflash2_kernels.MAX_ROWS)
    for option, value in (("--dflash2-block-size", block_size), ("--dflash2-block-cap", block_cap)):
        if value is not None and not 2 <= value <= top:
            raise ValueError(f"{option} {value} is outside 2..{top} (the drafter was trained on blocks of "
                             f"{trained}; the exact kernels take up to {dflash2_kernels.MAX_ROWS} rows)")
    ceiling = top if block_size is None else block_size
    return BlockLimits(ceiling if block_cap is None else min(ceiling, block_cap), block_size is not None)


@dataclass(frozen=True)
class RuntimeOptions:
    """Experiment knobs; the defaults are what the pack serves."""

    blocks: Optional[BlockLimits] = None  # block_limits' value; None: block_limits(trained block)
    candidate_selector: bool = False  # use the trained selector when drafting greedily
    sliding_window: bool = False  # drafter attends to its last `sliding_window` context positions


def configure_drafter(drafter, options: RuntimeOptions) -> BlockLimits:
    """Apply the experiment options to a loaded drafter's config and layers; returns the
    block limits it applied.

    The round policy chooses each block up to the limits' ceiling, already checked against
    the drafter's trained block and the kernels' rows. Whether the block is fixed and how
    the drafter drafts are the pack's, not the drafter's: dflash2_rounds.DrafterState
    carries them.
    """
    blocks = options.blocks or block_limits(int(drafter.config.block_size))
    # _dflash_block_total reads min(block_size, runtime_block_size) each request.
    drafter.config.runtime_block_size = blocks.ceiling
    if options.sliding_window:
        # z-lab's window mask: mlx-vlm's sliding drafter layers keep only the last
        # `sliding_window - 1` context positions and a rotating cache of that size,
        # so the drafter's memory stays flat in the context length.
        window = drafter.config.sliding_window
        if not window:
            raise ValueError("the drafter's config has no sliding_window")
        drafter.config.layer_types = ["sliding_attention"] * len(drafter.layers)
        for layer in drafter.layers:
            layer.self_attn.is_sliding = True
            layer.self_attn.sliding_window = window
    return blocks


# Drafter precision: the target hands over fp16 activations; meeting bf16 drafter
# weights they promote the drafter to fp32. Running it in bf16 instead (fp16 handed
# back to the head) is faster for some drafters and slower for others, and on CUDA its
# attention then goes to cuDNN, which builds a graph for every new key length (MLX's
# sdpa_cudnn caches them by shape): serving drafts each round at a new context length.
# On CPU bf16 is emulated. So the server times both at start-up, as serving drafts
# (choose_drafter_dtype). Only the proposals can differ, never the tokens.

# mlx-vlm's own, taken at import: dflash2_runtime imports this module before it installs
# the replacements in their place.
_stock_draft_hidden = DFlashDraftModel._hidden
_stock_embed_input_tokens = DFlash2DraftModel._embed_input_tokens


_drafter_bf16: Optional[bool] = None  # None: bf16 off CPU; choose_drafter_dtype sets it by measurement


def use_drafter_bf16(flag: Optional[bool]) -> None:
    global _drafter_bf16
    _drafter_bf16 = flag


def _drafter_in_bf16() -> bool:
    return dflash2_kernels.backend_name() != "cpu" if _drafter_bf16 is None else _drafter_bf16


@dataclass(frozen=True)
class DrafterDtypeChoice:
    bf16: bool
    why: str
    pass_ms: dict = field(default_factory=dict)  # "bf16" / "promoted" -> interleaved_ms stats

    @classmethod
    def from_json(cls, data: dict) -> "DrafterDtypeChoice":
        """A cached choice (dataclasses.asdict's)."""
        choice = cls(**data)
        if not isinstance(choice.bf16, bool):
            raise ValueError(f"bf16 is {choice.bf16!r}")
        return choice

    def summary(self) -> str:
        timed = ", ".join(f"{name} {stats['median']:.2f} ms" for name, stats in self.pass_ms.items())
        return (f"drafter activations: {'bf16' if self.bf16 else 'promoted'} ({self.why}"
                + (f"; median pass of {timed}" if timed else "") + ")")


def choose_drafter_dtype(model, drafter, repeats: int = 5, passes: int = 3,
                         candidate_selector: bool = False) -> DrafterDtypeChoice:
    """Run the drafter in bf16 or in the dtype its inputs promote to, whichever drafts a
    block faster here as serving drafts: after a 15- or 16-row context, each pass of the
    drafter's largest block reads one new context row, so no pass sees a key length any
    pass saw before (a request's rounds never do either), and a cache of work per shape
    (as cuDNN's attention graphs, which drafter_attention now avoids) cannot flatter an
    arm. Arms interleaved after warm-up. On CPU bf16 is emulated: promoted, untimed."""
    if dflash2_kernels.backend_name() == "cpu":
        use_drafter_bf16(False)
        return DrafterDtypeChoice(False, "bf16 is emulated on CPU")
    lm = getattr(model, "language_model", model)
    width = len(drafter.config.target_layer_ids) * int(lm.args.hidden_size)
    context = mx.random.normal((1, 16, width), key=mx.random.key(0)).astype(mx.float16)
    block = _dflash_block_total(drafter, None)

    def sample(bf16):
        # The arms start one row apart: no key length of one is ever the other's.
        run = drafter_passes(model, drafter, context[:, int(bf16):], bf16, block, candidate_selector)
        return dflash2_timing.timed_ms(lambda: run(passes))

    pass_ms = dflash2_timing.interleaved_ms({"bf16": sample(True), "promoted": sample(False)}, repeats)
    bf16 = dflash2_timing.paired_ratio(pass_ms["bf16"], pass_ms["promoted"]) < 1.0  # by pass
    use_drafter_bf16(bf16)
    drafter.reset(model)
    return DrafterDtypeChoice(
        bf16, f"faster of both, {passes} passes of block {block}, each at a new context length", pass_ms
    )


def drafter_pass(model, drafter, context, bf16: bool, block: int, candidate_selector: bool = False):
    """A function that builds one drafter pass of `block` as serving drafts it, in bf16 or
    promoted, and returns its tokens unevaluated: after this reads `context`, each pass reads
    its last row once more, so no pass sees a key length any pass before it saw (a request's
    rounds never do either)."""
    draft = greedy_drafting(drafter, candidate_selector)
    use_drafter_bf16(bf16)
    cache = drafter.reset(model)  # its own, growing across every pass
    mx.eval(draft(1, context, cache, block, None))

    def one_pass():
        use_drafter_bf16(bf16)
        return draft(1, context[:, -1:], cache, block, None)

    return one_pass


def drafter_passes(model, drafter, context, bf16: bool, block: int, candidate_selector: bool = False):
    """A function that runs `count` drafter_pass passes, each evaluated."""
    one_pass = drafter_pass(model, drafter, context, bf16, block, candidate_selector)
    return lambda count: [mx.eval(one_pass()) for _ in range(count)]


# The drafter's grouped dynamic causal convolution in fewer launches. mlx-vlm's builds a zero
# fill, a shifted copy and four element-wise ops per tap (its kernel as a gather), about 13
# launches a call and four calls a layer: at the 27B shape about half of the drafter's 490
# launches a pass, each costing the host about 10 us (evidence/profile-verify-cuda.md, draft
# 8). Here the input is zero-padded once and every tap's ops run as one compiled element-wise
# kernel: the same ops in the same order (+0 start, shifted-in zeros), mlx-vlm's bits on CPU.
# Only proposals depend on it: on CUDA NVRTC may fuse an fp32 multiply and add into one FMA
# (fp16 and bf16 arithmetic are intrinsics it does not contract), so a promoted drafter's
# proposals can differ in a last bit, never the tokens.


@mx.compile
def _convolve_taps(padded, dynamic, base):
    """sum over taps of (base[tap] + dynamic[:, :, tap]) * the input shifted by tap, added in
    mlx-vlm's order onto a zero."""
    taps, length = base.shape[0], dynamic.shape[1]
    groups, group_size = padded.shape[2:]
    output = mx.array(0, dtype=padded.dtype)
    for tap in range(taps):
        kernel = base[tap:tap + 1].reshape(1, 1, groups, group_size).astype(padded.dtype)
        output = output + (kernel + dynamic[:, :, tap]) * padded[:, taps - 1 - tap: taps - 1 - tap + length]
    return output


def grouped_dynamic_convolve(hidden, dynamic, base, group_size):
    """mlx-vlm's _grouped_dynamic_convolve through _convolve_taps."""
    batch, length, hidden_size = hidden.shape
    groups = hidden_size // group_size
    blocks = hidden.reshape(batch, length, groups, group_size)
    taps = base.shape[0]
    if taps > 1:
        blocks = mx.concatenate([mx.zeros((batch, taps - 1, groups, group_size), blocks.dtype), blocks], axis=1)
    dynamic = dynamic.reshape(batch, length, taps, groups, 1)
    return _convolve_taps(blocks, dynamic, base).reshape(hidden.shape)


def _draft_hidden_bf16(self, inputs, target_hidden, cache):
    if not _drafter_in_bf16():
        return _stock_draft_hidden(self, inputs, target_hidden, cache)
    hidden = _stock_draft_hidden(self, inputs, target_hidden.astype(mx.bfloat16), cache)
    return hidden.astype(target_hidden.dtype)


def _embed_input_tokens_bf16(self, inputs):
    embedded = _stock_embed_input_tokens(self, inputs)
    return embedded.astype(mx.bfloat16) if _drafter_in_bf16() else embedded


# The drafter's attention off cuDNN. On CUDA, MLX sends fp16/bf16 attention with a head
# dim up to 128 to cuDNN, which builds a graph for each new key length (tens of ms on an
# H200: evidence/drafter-attention-cuda.md, docs/lab.md), and every round drafts at a
# new context length. In fp32 MLX runs its own kernels at any length. Stock
# DFlashAttention.__call__ runs unchanged, its `mx` being _DrafterMlx.


def drafter_attention(queries, keys, values, *, scale, mask=None, sinks=None):
    """mx.fast.scaled_dot_product_attention for the drafter: fp16/bf16 on CUDA in fp32."""
    if dflash2_kernels.backend_name() != "cuda" or queries.dtype == mx.float32:
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )
    wide = [array.astype(mx.float32) for array in (queries, keys, values)]
    out = mx.fast.scaled_dot_product_attention(
        *wide, scale=scale, mask=mask, sinks=None if sinks is None else sinks.astype(mx.float32)
    )
    return out.astype(queries.dtype)


class _DrafterMlx:
    """mlx.core as the drafter's attention sees it: its fused attention is drafter_attention."""

    fast = types.SimpleNamespace(scaled_dot_product_attention=drafter_attention)

    def __getattr__(self, name):
        return getattr(mx, name)


_drafter_attention_call = _with_globals(DFlashAttention.__call__, mx=_DrafterMlx())
