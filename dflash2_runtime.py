"""Adds exact DFlash 2 speculative decoding to pinned mlx-vlm 0.7.2 at run time.

Greedy speculative output must equal plain decoding token for token. Stock 0.7.2
verifies a draft block with batched kernels whose rounding differs from the
single-token decode step (on CUDA and Metal; CPU happens to agree). The patches
below make every verify position use the decode step's own arithmetic: packed
2-bit linears go through dflash2_kernels' exact matmul (all rows in one pass, each
row bitwise equal to MLX's single-row kernel); the rotation, the dense gate
projections, the GatedDeltaNet recurrence and attention through its multi-position
kernels, each self-tested against decode's single-position call (per-position stock
calls where one failed); row-wise work runs once over all positions; and the greedy
token is picked the way plain decode picks it. Every replaced or mirrored mlx-vlm function is in dflash2_audit's
table: if its source differs from the audited one, `install` refuses and names it.
"""

import contextlib
import copy
import functools
import logging
import os
import time
import types
from dataclasses import dataclass, field
from typing import Optional

# MLX's CUDA backend caches executable graphs by topology (400 by default) and,
# past 2x capacity lifetime misses, throws and kills the process: a fuse, not a
# rate check, that a long-lived server crosses sooner or later (verify blocks of
# several sizes add topologies). Keep a larger cache and let it evict instead.
# Read when MLX first uses the GPU.
os.environ.setdefault("MLX_CUDA_GRAPH_CACHE_SIZE", "4096")
os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35 import HadamardQuantizedLinear
from mlx_vlm.models.qwen3_5 import language as qwen3_5_language
from mlx_vlm.models.qwen3_5 import gated_delta as gated_delta_module
from mlx_vlm.models.qwen3_5.speculative_verifier import Qwen3_5BatchInvariantForward
from mlx_vlm.speculative import dflash as dflash_rounds
from mlx_vlm.speculative.cache_state import abort_speculative_round
from mlx_vlm.speculative.common import _dflash_block_total
from mlx_vlm.speculative.drafters.dflash2.dflash2 import DFlash2DraftModel
from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashAttention, DFlashDraftModel

import dflash2_audit
import dflash2_kernels
import dflash2_pack
import dflash2_rounds
import dflash2_timing
from dflash2_verdicts import VerdictCache

logger = logging.getLogger("dflash2.runtime")


class ExactnessError(RuntimeError):
    """A verify call reached a case the exact path does not cover."""


@dataclass
class RuntimeOptions:
    """Experiment knobs; the defaults are what the pack serves."""

    block_size: Optional[int] = None  # fixed verify block (2..8); None adapts
    block_cap: Optional[int] = None  # upper bound for the adaptive block
    candidate_selector: bool = False  # use the trained selector when drafting greedily
    sliding_window: bool = False  # drafter attends to its last `sliding_window` context positions


@dataclass
class DecodePathChoice:
    """Which replacements plain decode uses (a DECODE_ARMS key), and why."""

    arm: str
    why: str
    step_ms: dict = field(default_factory=dict)  # arm -> {"median", "min", "max"}

    @classmethod
    def from_json(cls, data: dict) -> "DecodePathChoice":
        """A cached choice (dataclasses.asdict's); ValueError for an arm this runtime lacks."""
        choice = cls(**data)
        if choice.arm not in DECODE_ARMS:
            raise ValueError(f"no decode arm {choice.arm!r}")
        return choice


@dataclass
class RuntimeStatus:
    speculative: bool
    reason: Optional[str]
    backend: str
    self_test: dict = field(default_factory=dict)  # kernel name -> SelfTestResult
    decode_path: Optional[DecodePathChoice] = None
    verify_check: Optional["VerifySelfCheck"] = None
    seconds: dict = field(default_factory=dict)  # start-up check -> wall seconds it took

    def log_lines(self) -> list[str]:
        """What start-up logs: kernels, the verify self-check, plain decode's path."""
        lines = [
            "kernel self-tests: "
            + ", ".join(f"{name} {'ok' if r.ok else 'FAILED'}" + (f" ({r.reason})" if r.reason else "")
                        + (f" {r.seconds:.1f} s" if r.seconds else "") for name, r in self.self_test.items())
        ]
        if self.verify_check is not None:
            lines.append(self.verify_check.summary())
        if self.decode_path is not None:
            timings = ", ".join(f"{arm} {t['min']:.2f} ms (median {t['median']:.2f})"
                                for arm, t in self.decode_path.step_ms.items())
            lines.append(f"plain decode path: {self.decode_path.arm} ({self.decode_path.why}"
                         + (f"; fastest step: {timings}" if timings else "") + ")")
        if self.seconds:
            lines.append("start-up checks took: " + ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items()))
        return lines

    def to_json(self) -> dict:
        """For /health."""
        check = self.verify_check
        return {
            "backend": self.backend,
            "kernels": {name: {"ok": r.ok, "reason": r.reason} for name, r in self.self_test.items()},
            "verify_self_check": None if check is None else {
                "blocks": check.blocks, "differing": check.differing,
                "stock_differing": check.stock_differing, "stock_block": check.stock_block,
                "seconds": round(check.seconds, 2),
                "seconds_by_part": {name: round(s, 2) for name, s in check.seconds_by_part.items()},
                "summary": check.summary(),
            },
            "plain_decode_path": None if self.decode_path is None else {
                "arm": self.decode_path.arm, "why": self.decode_path.why,
                "step_ms": self.decode_path.step_ms,
            },
            "seconds": {name: round(s, 2) for name, s in self.seconds.items()},
        }


# ---------------------------------------------------------------------------
# Exact verify forward


def _packed_linear(linear: HadamardQuantizedLinear, x: mx.array) -> mx.array:
    """The packed linear of decode, for many rows, bit for bit per row.

    Its arrays are read as the module's items (linear["weight"]): attribute access on an
    nn.Module goes through a Python __getattr__, about half a microsecond each, four
    times for each of ~400 calls a forward."""
    # The kernels reproduce MLX's fp16 single-row arithmetic. Packs whose dense
    # tensors are fp32 carry fp32 activations: those rows take MLX's own
    # single-row call one by one, exact by construction, only slower.
    k = x.shape[-1]
    if x.dtype == mx.float16 and x.size <= dflash2_kernels.MAX_ROWS * k:
        # A verify block or a decode row: one call each for the rotation and the matmul
        # (about 400 a forward, so no more host work around them than they need: install
        # checked the weights, and the kernels take (..., K) rows, so no reshape goes around).
        return dflash2_kernels.exact_linear_rows(
            x, linear.block, linear["signs"] if linear.block else None,
            linear["weight"], linear["scales"], linear["biases"],
        )
    if linear.block:
        x = dflash2_kernels.rotate(x, linear.block, linear["signs"])
    rows = x.reshape(-1, k)
    matmul = (
        dflash2_kernels.exact_quantized_matmul
        if rows.dtype == mx.float16
        else dflash2_kernels.stock_rows
    )
    outputs = [
        matmul(
            rows[start : start + dflash2_kernels.MAX_ROWS],
            linear.weight,
            linear.scales,
            linear.biases,
        )
        for start in range(0, rows.shape[0], dflash2_kernels.MAX_ROWS)
    ]
    out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)
    return out.reshape(*x.shape[:-1], out.shape[-1])


_stock_hadamard_linear_call = HadamardQuantizedLinear.__call__
_stock_gated_delta_ops = gated_delta_module.gated_delta_ops
_stock_gated_delta_net_call = qwen3_5_language.Qwen3_5GatedDeltaNet.__call__
_stock_rotary_call = qwen3_5_language.apply_multimodal_rotary_pos_emb
_stock_decoder_layer_call = qwen3_5_language.Qwen3_5DecoderLayer.__call__

# Plain decode's replacements in use, chosen by choose_decode_path from an
# end-to-end measurement on this machine. Each is bitwise decode's own result
# (their self-tests prove it), so the choice changes speed, never tokens.
DECODE_ARMS = {
    "mlx": frozenset(),
    "rotation": frozenset({"rotation"}),
    "rotation+recurrence": frozenset({"rotation", "recurrence"}),
    "rotation+recurrence+convolution": frozenset({"rotation", "recurrence", "convolution"}),
    "rotation+recurrence+convolution+rope": frozenset({"rotation", "recurrence", "convolution", "rope"}),
    "rotation+recurrence+convolution+rope+residual":
        frozenset({"rotation", "recurrence", "convolution", "rope", "residual"}),
    "rotation+recurrence+matmul": frozenset({"rotation", "recurrence", "matmul"}),
}
_decode_path: frozenset = frozenset()


def _hadamard_linear_call(self, x):
    """HadamardQuantizedLinear.__call__ with the rotation as one kernel and, for
    one fp16 row, optionally the exact matmul kernel (both bitwise stock's)."""
    if "rotation" not in _decode_path or x.dtype != mx.float16:
        return _stock_hadamard_linear_call(self, x)
    if "matmul" in _decode_path and x.size == x.shape[-1]:
        return _packed_linear(self, x)
    if self.block:
        x = dflash2_kernels.rotate(x, self.block, self["signs"])
    return _mlx_packed_matmul(self, x)


def _mlx_packed_matmul(linear, rotated):
    """The module's own MLX matmul on its rotated input (decode's, at any row count)."""
    return mx.quantized_matmul(  # items, not attributes: see _packed_linear
        rotated, linear["weight"], linear["scales"], linear["biases"], transpose=True,
        group_size=linear.group_size, bits=linear.bits,
    )


def _shared_rotation_block(linears, x) -> int:
    """The rotation block packed linears that share fp16 x can rotate it with in one launch:
    all HadamardQuantizedLinear (not a subclass, which may call otherwise) with one nonzero
    block; else 0."""
    blocks = {getattr(linear, "block", None) for linear in linears}
    if (x.dtype != mx.float16 or len(blocks) != 1
            or not all(type(linear) is HadamardQuantizedLinear for linear in linears)):
        return 0
    return linears[0].block


def _decode_linears(linears, x):
    """Linears that share x (an MLP's gate and up; a GatedDeltaNet's in_proj_qkv and
    in_proj_z) as decode's own calls compute them; with the rotation, x rotated for all of
    them in one launch (dflash2_kernels.rotate_group, the same bits), then each one's matmul
    as _hadamard_linear_call runs it."""
    block = _shared_rotation_block(linears, x) if "rotation" in _decode_path else 0
    if not block:
        return tuple(linear(x) for linear in linears)
    if "matmul" in _decode_path and x.size == x.shape[-1]:
        return _exact_linear_group(linears, x, block)
    signs = [linear["signs"] for linear in linears]
    return tuple(_mlx_packed_matmul(linear, rotated)
                 for linear, rotated in zip(linears, dflash2_kernels.rotate_group(x, block, signs)))


def _exact_linear_group(linears, x, block):
    """dflash2_kernels.exact_linear_group of packed linears that share x (items, not
    attributes: see _packed_linear)."""
    return dflash2_kernels.exact_linear_group(
        x, block, [linear["signs"] for linear in linears],
        [(linear["weight"], linear["scales"], linear["biases"]) for linear in linears])


def _mlp_call(self, x):
    """Qwen3_5MLP.__call__, its gate and up through _decode_linears."""
    return self.down_proj(qwen3_5_language.swiglu(*_decode_linears((self.gate_proj, self.up_proj), x)))


def _gated_delta_ops_call(q, k, v, g, beta, state=None, mask=None):
    """gated_delta_ops with decode's single step on the recurrence kernel."""
    if "recurrence" not in _decode_path or mask is not None or q.shape[1] != 1 or state is None:
        return _stock_gated_delta_ops(q, k, v, g, beta, state, mask)
    y, states = dflash2_kernels.gdn_recurrence(q, k, v, g, beta, state)
    return y, states[:, -1]


def _gated_delta_net_call(self, inputs, mask=None, cache=None):
    """Qwen3_5GatedDeltaNet.__call__; with the convolution, decode's one unpadded fp16 row
    runs the layer as verify does at one position (gated_delta_positions): the window,
    convolution and silu in one launch instead of six (dflash2_kernels.conv_rows), both
    gates in one (dense_rows). Each kernel is bitwise decode's (its self-test), and
    choose_decode_path compares a step of the arm with stock's before it can serve."""
    if ("convolution" not in _decode_path or type(self) is not qwen3_5_language.Qwen3_5GatedDeltaNet
            or self.training or mask is not None or cache is None
            or inputs.shape[:2] != (1, 1) or inputs.dtype != mx.float16):
        return _stock_gated_delta_net_call(self, inputs, mask, cache)
    return gated_delta_positions(self, inputs, cache, _module_call, _decode_linears)


def _rotary_call(q, k, cos, sin, unqueeze_dim=1):
    """language.apply_multimodal_rotary_pos_emb; with the rope, decode's queries and keys
    rotated in one launch instead of twelve (dflash2_kernels.rope_rows, bitwise mlx-vlm's
    compiled rotary: its self-test)."""
    if "rope" not in _decode_path or unqueeze_dim != 1 or q.shape[2] != 1:
        return _stock_rotary_call(q, k, cos, sin, unqueeze_dim)
    return dflash2_kernels.rope_rows(q, k, cos, sin)


def _decoder_layer_call(self, x, mask=None, cache=None, position_ids=None, position_embeddings=None):
    """Qwen3_5DecoderLayer.__call__; with the residual, decode's residual add and the norm
    after it in one launch instead of two (_add_and_norm, the same bits). During a plain
    step the drafter's tap layers keep their outputs (dflash2_rounds.keep_tap_output)."""
    if "residual" not in _decode_path or type(self) is not qwen3_5_language.Qwen3_5DecoderLayer or x.shape[1] != 1:
        output = _stock_decoder_layer_call(self, x, mask, cache, position_ids, position_embeddings)
    else:
        if self.is_linear:
            def mixer(normed):
                return self.linear_attn(normed, mask, cache)
        else:
            def mixer(normed):
                return self.self_attn(normed, mask=mask, cache=cache, position_ids=position_ids,
                                      position_embeddings=position_embeddings)
        output = _fused_residual_layer(self, x, mixer, _module_call)
    dflash2_rounds.keep_tap_output(self, output)
    return output


def _fused_residual_layer(layer, x, mixer, feed_forward):
    """A Qwen3.5 decoder layer's body (input norm, mixer(normed): its attention or
    GatedDeltaNet, residual add, post-attention norm, feed_forward(layer.mlp, normed), the
    second residual add) with the first add and the norm after it in one launch."""
    hidden, normed = _add_and_norm(x, mixer(layer.input_layernorm(x)), layer.post_attention_layernorm)
    return hidden + feed_forward(layer.mlp, normed)


def _add_and_norm(x, residual, norm):
    """(x + residual, norm(x + residual)); an nn.RMSNorm's in one launch
    (dflash2_kernels.add_rms_norm: bitwise the Add and the mx.fast.rms_norm it calls)."""
    if type(norm) is not nn.RMSNorm:
        hidden = x + residual
        return hidden, norm(hidden)
    return dflash2_kernels.add_rms_norm(x, residual, norm.weight, norm.eps)


def _module_call(module, x):
    return module(x)


def _single_unpadded_row(cache, batch: int) -> bool:
    left_padding = getattr(cache, "left_padding", None)
    return batch == 1 and (left_padding is None or max(left_padding.tolist()) <= 0)


# The verify forward hands its hidden state to the device (mx.async_eval) after every
# VERIFY_EVAL_EVERY layers, so the GPU runs the first layers while Python builds the rest:
# a round cannot queue behind the one before (its block comes from that round's tokens), and
# with one eval at the end the GPU idles through the whole graph build
# (evidence/profile-verify-cuda.md: a round's wall time beside the GPU's busy time, handed
# off and evaluated once). Same ops in the same order, so the same bits. 0: one eval at the end.
VERIFY_EVAL_EVERY = 8


@contextlib.contextmanager
def verify_eval_every(layers: int):
    """Within it the verify forward hands off every `layers` layers instead (0: none, one
    lazy graph evaluated at its end): for side-by-side timings, and for counting the whole
    graph's primitives."""
    global VERIFY_EVAL_EVERY
    served, VERIFY_EVAL_EVERY = VERIFY_EVAL_EVERY, layers
    try:
        yield
    finally:
        VERIFY_EVAL_EVERY = served


class ExactVerifier(Qwen3_5BatchInvariantForward):
    """Qwen3.5 verify forward whose every position equals a decode step.

    Row-wise work (norms, rotations, rotary tables, gates, silu, the
    convolution over strided windows, one KV update per layer) runs once for
    all positions: those kernels take their launch shape from the row, never
    from the row count. What decode runs through kernels that are not
    row-invariant (packed and dense matmuls, the GatedDeltaNet recurrence,
    attention) goes through dflash2_kernels' multi-position equivalents.
    """

    _layers_built = 0  # of the forward being built; verify starts each at 0

    def verify(self, language_model, inputs, *, cache=None, **kwargs):
        # The server's one-row batch cache brings an explicit causal mask; an
        # unpadded single row decodes without one. Checked once per round.
        attention_cache = (cache or [None])[language_model.model.fa_idx]
        self._unpadded_row = _single_unpadded_row(attention_cache, inputs.shape[0])
        self._layers_built = 0
        return super().verify(language_model, inputs, cache=cache, **kwargs)

    def _layer(self, layer, hidden, mask, cache, position_ids, position_embeddings):
        # The base class's, with the residual add and the norm after it in one launch.
        if layer.is_linear:
            def mixer(normed):
                return self._gated_delta(layer.linear_attn, normed, mask, cache)
        else:
            def mixer(normed):
                return self._attention(layer.self_attn, normed, mask, cache, position_ids, position_embeddings)
        hidden = _fused_residual_layer(layer, hidden, mixer, self._feed_forward)
        self._layers_built += 1
        if VERIFY_EVAL_EVERY and self._layers_built % VERIFY_EVAL_EVERY == 0:
            mx.async_eval(hidden)
        return hidden

    def _linear(self, linear, x):
        if isinstance(linear, HadamardQuantizedLinear):
            return _packed_linear(linear, x)
        if "bias" in linear:
            raise ExactnessError("dense verify linears with a bias are not covered")
        # Dense fp16 linears (GDN in_proj_a / in_proj_b): decode's one-row matmul.
        return dflash2_kernels.dense_rows(x, linear.weight)

    def _linears(self, linears, x):
        # Rotated linears that share x (q/k/v; in_proj_qkv and in_proj_z; gate and up): one
        # rotation launch for all where that kernel serves (dflash2_kernels.exact_linear_group).
        block = _shared_rotation_block(linears, x)
        if block and x.size <= dflash2_kernels.MAX_ROWS * x.shape[-1]:
            return _exact_linear_group(linears, x, block)
        return tuple(self._linear(linear, x) for linear in linears)

    def quantized_linear(self, linear, x):
        # The drafter's greedy head (speculative_argmax_from_hidden; stock verify, the other
        # caller, is replaced): a draft's rows through the target's packed head in one call.
        # MLX's CUDA call below 8 rows reads the head's weights once per row (248k x 5120: about
        # 0.7 ms a row on the H200, 5 ms of a block-8 draft); each row here is MLX's single-row
        # result bit for bit, as MLX's own call gives at 1-7 rows there: proposals unchanged.
        if type(linear) is HadamardQuantizedLinear and x.dtype == mx.float16:
            return _packed_linear(linear, x)
        return super().quantized_linear(linear, x)

    def _embedding_as_linear(self, embedding, x):
        return _packed_linear(embedding, x)

    def _attention(self, attention, x, mask, cache, position_ids, position_embeddings):
        batch, length, _ = x.shape
        explicit_causal = isinstance(mask, mx.array) and self._unpadded_row
        if not (mask is None or isinstance(mask, str) and mask == "causal" or explicit_causal):
            raise ExactnessError("padded or batched attention is not verified exactly")
        queries, keys, values = self._linears(
            (attention.q_proj, attention.k_proj, attention.v_proj), x
        )
        # Norms, rotary tables and their application are row-wise; one KV
        # update appends every position, as decode's would one by one.
        queries, keys, values, gate, _ = _verify_prepare_projected_qkv(
            attention, queries, keys, values, cache, position_ids, position_embeddings, None
        )
        if not isinstance(keys, mx.array):
            raise ExactnessError("quantized KV caches are not verified exactly")
        output = dflash2_kernels.decode_attention_rows(
            queries, keys, values, attention.scale, keys.shape[-2] - length + 1
        )
        output = output.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        return self._linear(attention.o_proj, output * mx.sigmoid(gate))

    def _gated_delta(self, layer, inputs, mask, cache):
        if mask is not None or cache is None:
            raise ExactnessError("padded or cache-less GatedDeltaNet verify is not exact")
        return gated_delta_positions(layer, inputs, cache, self._linear, self._linears)


def gated_delta_positions(layer, inputs, cache, linear, linears=None):
    """The GatedDeltaNet layer at each of the (B, L) positions of `inputs`, every one as
    decode's step computes it (unmasked, with a cache). linear(module, x) runs its packed
    projections: verify's exact multi-row matmul, or the module's own call in decode;
    linears((modules), x), where given, the two that share the input."""
    batch, length, _ = inputs.shape
    mixed_qkv, z = (linears((layer.in_proj_qkv, layer.in_proj_z), inputs) if linears
                    else (linear(layer.in_proj_qkv, inputs), linear(layer.in_proj_z, inputs)))
    b, a = _gate_projections(layer, inputs)
    z = z.reshape(batch, length, -1, layer.head_v_dim)
    width = layer.conv_kernel_size - 1
    conv_state = cache[0]
    if conv_state is None or conv_state.shape[0] != batch:
        conv_state = mx.zeros((batch, width, layer.conv_dim), dtype=inputs.dtype)
    conv_input, conv_out = _convolve_positions(layer, conv_state, mixed_qkv)
    # One window update records every position's window for rollback.
    cache.update_window(0, conv_input, width, lengths=cache.lengths)
    q, k, v = [
        value.reshape(batch, length, heads, head_width)
        for value, heads, head_width in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]
    # A subclass's own norms (mlx-vlm's qwen4_exp has others) are its to compute.
    own_norms = type(layer)._normalize_qk is not qwen3_5_language.Qwen3_5GatedDeltaNet._normalize_qk
    q, k = layer._normalize_qk(q, k) if own_norms else _normalize_qk(q, k)
    g, beta = dflash2_kernels.gdn_gates(layer.A_log, a, b, layer.dt_bias)
    initial = cache[1]
    if initial is None or initial.shape[0] != batch:
        initial = mx.zeros((batch, *v.shape[2:], k.shape[-1]), dtype=mx.float32)
    output, states = dflash2_kernels.gdn_recurrence(q, k, v, g, beta, initial)
    # Every position's state is recorded in one call so rollback can keep any prefix
    # without copying states per position (a no-op outside a speculative round).
    final = states[:, -1]
    cache.record_speculative_states(1, states[:, :-1] if length > 1 else None, final)
    cache[1] = final
    cache.advance(length)
    qwen3_5_language._qwen3_5_advance_left_padding_info(cache, length)
    qwen3_5_language._qwen3_5_advance_lengths_info(cache, length)
    output = _gated_norm(layer.norm, output, z)
    return linear(layer.out_proj, output.reshape(batch, length, -1))


def _gated_norm(norm, x, gate):
    """norm(x, gate); Qwen3.5's gated RMSNorm in one launch (dflash2_kernels.gated_rms_norm:
    bitwise its mx.fast.rms_norm and compiled _precise_swiglu)."""
    if type(norm) is not qwen3_5_language.Qwen3_5RMSNormGated:
        return norm(x, gate)
    return dflash2_kernels.gated_rms_norm(x, norm.weight, norm.eps, gate)


def _normalize_qk(q, k):
    """Qwen3_5GatedDeltaNet._normalize_qk in two launches instead of four: each scale
    multiplies inside its norm, as the norm's weight. Either way an element is the fp16 (or
    the activations' dtype) product of the scale, converted as MLX converts a Python
    scalar, and the weight-less norm's output, rounded once: the norm kernels multiply by
    their weight in the output dtype (CUDA rms_norm.cu:121, Metal rms_norm.metal:71, CPU's
    fallback an fp16 multiply), by 1 without one."""
    scale = k.shape[-1] ** -0.5
    return (mx.fast.rms_norm(q, _scale_weight(q.shape[-1], scale**2, q.dtype), 1e-6),
            mx.fast.rms_norm(k, _scale_weight(k.shape[-1], scale, k.dtype), 1e-6))


@functools.cache
def _scale_weight(width: int, scale: float, dtype) -> mx.array:
    weight = scale * mx.ones((width,), dtype)  # the scalar converted as stock's multiply converts it
    mx.eval(weight)
    return weight


def _gate_projections(layer, x):
    """in_proj_b(x) and in_proj_a(x), each row as decode's one-row matmul, in one
    launch: every output column depends only on its own weight row."""
    b_weight, a_weight = layer.in_proj_b.weight, layer.in_proj_a.weight
    if "bias" in layer.in_proj_b or "bias" in layer.in_proj_a:
        raise ExactnessError("GatedDeltaNet gate projections with a bias are not covered")
    weight = _derived_weight(layer, "_dflash2_gate_weight", (b_weight, a_weight),
                             lambda b, a: mx.concatenate([b, a]))
    out = dflash2_kernels.dense_rows(x, weight)
    return out[..., : b_weight.shape[0]], out[..., b_weight.shape[0] :]


def _derived_weight(layer, name: str, sources: tuple, derive):
    """derive(*sources), evaluated once and kept on the layer as `name` until one of the
    source arrays is replaced (as mlx-vlm keeps decode's convolution weight)."""
    cached = getattr(layer, name, None)
    if cached is None or any(kept is not source for kept, source in zip(cached[0], sources)):
        cached = (sources, derive(*sources))
        mx.eval(cached[1])
        setattr(layer, name, cached)
    return cached[1]


def _convolve_positions(layer, conv_state, mixed_qkv):
    """(the window the cache keeps, silu of decode's convolution at each position).

    Decode convolves the (B, K, C) window that ends at its position; with fp16 or bf16
    weights it runs `_qwen3_5_decode_depthwise_conv` on fp32 weights, which
    dflash2_kernels.conv_rows takes for every position at once (one launch on CUDA)."""
    if layer.conv1d.weight.dtype not in (mx.bfloat16, mx.float16):
        # fp32 convolution weights: decode runs nn.Conv1d on the window.
        conv_input = mx.concatenate([conv_state, mixed_qkv], axis=1)
        taps = layer.conv_kernel_size
        windows = [layer.conv1d(conv_input[:, t : t + taps]) for t in range(mixed_qkv.shape[1])]
        return conv_input, nn.silu(mx.concatenate(windows, axis=1))
    # Decode's own weight, as mlx-vlm's _causal_conv1d_decode casts it.
    weight = _derived_weight(layer, "_dflash2_conv_weight", (layer.conv1d.weight,),
                             lambda w: w[:, :, 0].T.astype(mx.float32))
    return dflash2_kernels.conv_rows(conv_state, mixed_qkv, weight)


def greedy_tokens_like_decode(logits: mx.array) -> mx.array:
    """Greedy tokens for each verify position, chosen as plain decode chooses.

    Plain decode takes the argmax of fp16 `logits - logsumexp(logits)` of one
    position (generate/ar.py); on near-ties that can differ from the argmax of
    the raw logits, which stock verify uses. Both are row-wise, so one call
    covers every position.
    """
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(logprobs, axis=-1)


def exact_verify_greedy(lm, verify_input, prompt_cache, target_layer_ids, sampler):
    """Replaces dflash._dflash_verify_greedy: exact verify, decode's token choice."""
    del sampler  # greedy only: the choice is fixed by plain decode's rule
    gdn_states = None
    try:
        verify_out, gdn_states = dflash_rounds._dflash_verify(
            lm, verify_input, prompt_cache, target_layer_ids
        )
        tokens = greedy_tokens_like_decode(verify_out.logits)
        return verify_out.hidden_states, gdn_states, tokens
    except BaseException:
        abort_speculative_round(gdn_states)
        raise


# ---------------------------------------------------------------------------
# Drafter precision: the target hands over fp16 activations; meeting bf16 drafter
# weights they promote the drafter to fp32. Running it in bf16 instead (fp16 handed
# back to the head) is faster for some drafters and slower for others, and on CUDA its
# attention then goes to cuDNN, which builds a graph for every new key length (MLX's
# sdpa_cudnn caches them by shape): serving drafts each round at a new context length.
# On CPU bf16 is emulated. So the server times both at start-up, as serving drafts
# (choose_drafter_dtype). Only the proposals can differ, never the tokens.

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


def choose_drafter_dtype(model, drafter, repeats: int = 5, passes: int = 3) -> DrafterDtypeChoice:
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
        run = drafter_passes(model, drafter, context[:, int(bf16):], bf16, block)
        return dflash2_timing.timed_ms(lambda: run(passes))

    pass_ms = dflash2_timing.interleaved_ms({"bf16": sample(True), "promoted": sample(False)}, repeats)
    bf16 = dflash2_timing.paired_ratio(pass_ms["bf16"], pass_ms["promoted"]) < 1.0  # by pass
    use_drafter_bf16(bf16)
    drafter.reset(model)
    return DrafterDtypeChoice(
        bf16, f"faster of both, {passes} passes of block {block}, each at a new context length", pass_ms
    )


def drafter_passes(model, drafter, context, bf16: bool, block: int):
    """A function that runs `count` drafter passes of `block` as serving drafts them, in bf16
    or promoted: after this reads `context`, each pass reads its last row once more, so no
    pass sees a key length any pass before it saw (a request's rounds never do either)."""
    use_drafter_bf16(bf16)
    cache = drafter.reset(model)  # its own, growing across every pass
    mx.eval(drafter.draft_block_greedy(1, context, cache, block, None))

    def passes(count):
        use_drafter_bf16(bf16)
        for _ in range(count):
            mx.eval(drafter.draft_block_greedy(1, context[:, -1:], cache, block, None))

    return passes


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
# H200; tools/bench_drafter_attention.py times both routes), and every round drafts at a
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


def _with_globals(function, **names):
    """`function`'s own code with some of its module's names bound to others (a snapshot of
    its module's names: later changes to that module are not seen)."""
    rebound = types.FunctionType(
        function.__code__, {**function.__globals__, **names}, function.__name__,
        function.__defaults__, function.__closure__,
    )
    rebound.__kwdefaults__ = function.__kwdefaults__
    return rebound


_drafter_attention_call = _with_globals(DFlashAttention.__call__, mx=_DrafterMlx())

# Verify's copy of decode's norms, rotary and KV append (audited), its rotary in one launch
# for all positions (dflash2_kernels.rope_rows, looked up at each call: element-wise, so
# any number of rows).
_verify_prepare_projected_qkv = _with_globals(
    qwen3_5_language.Qwen3_5Attention._prepare_projected_qkv,
    apply_multimodal_rotary_pos_emb=lambda q, k, cos, sin: dflash2_kernels.rope_rows(q, k, cos, sin),
)

PREFILL_CHUNKED_TARGET = "mlx_vlm.models.qwen3_5.gated_delta:gated_delta_chunked"


def prefill_chunked(inverse):
    """mlx-vlm's gated_delta_chunked, its own code, with `inverse` (a dflash2_kernels inverse)
    as its _invert_unit_lower, told how many of the chunk's rows hold tokens when the
    prompt is shorter than one chunk (the engine swaps it in)."""
    stock = dflash2_audit.stock(PREFILL_CHUNKED_TARGET)

    def gated_delta_chunked(q, k, v, g, beta, state, mask=None, C: int = 64):
        rows = q.shape[1] if q.shape[1] < C else None
        chunked = _with_globals(stock, _invert_unit_lower=functools.partial(inverse, rows=rows))
        return chunked(q, k, v, g, beta, state, mask, C)

    return gated_delta_chunked


# ---------------------------------------------------------------------------
# The replacements, by dflash2_audit.REPLACED target (that table holds their audited
# sources and why each is replaced; the engine's overrides are in dflash2_engine).

REPLACEMENTS = {
    "mlx_vlm.models.qwen3_5.language:_EXACT_SPECULATIVE_VERIFIER": ExactVerifier(),
    "mlx_vlm.speculative.dflash:_dflash_verify_greedy": exact_verify_greedy,
    "mlx_vlm.speculative.drafters.dflash2.dflash2:DFlash2DraftModel._hidden": _draft_hidden_bf16,
    "mlx_vlm.speculative.drafters.dflash2.dflash2:DFlash2DraftModel._embed_input_tokens":
        _embed_input_tokens_bf16,
    "mlx_vlm.speculative.drafters.qwen3_dflash.dflash:DFlashAttention.__call__": _drafter_attention_call,
    "mlx_vlm.models.qwen3_5.gated_delta:gated_delta_ops": _gated_delta_ops_call,
    "mlx_vlm.models.qwen3_5.language:Qwen3_5GatedDeltaNet.__call__": _gated_delta_net_call,
    "mlx_vlm.models.qwen3_5.language:apply_multimodal_rotary_pos_emb": _rotary_call,
    "mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35:HadamardQuantizedLinear.__call__":
        _hadamard_linear_call,
    "mlx_vlm.speculative.utils:_dflash_rounds": dflash2_rounds.policy_rounds,
    "mlx_vlm.models.qwen3_5.language:Qwen3_5DecoderLayer.__call__": _decoder_layer_call,
    "mlx_vlm.models.qwen3_5.language:Qwen3_5MLP.__call__": _mlp_call,
}


def apply_patches() -> None:
    """Checks every audited source (raising dflash2_audit.SourceMismatch), then replaces."""
    dflash2_audit.check_sources()
    for target, replacement in REPLACEMENTS.items():
        dflash2_audit.replace(target, replacement)


def install(model=None, verdicts: Optional[VerdictCache] = None) -> RuntimeStatus:
    """Check versions and fingerprints, patch mlx-vlm, prove exactness here.

    Every kernel is self-tested at the pack's own shapes (dflash2_kernels).

    Raises dflash2_audit.SourceMismatch if anything differs from the audited sources. A failed
    kernel self-test or verify self-check does not raise: speculation is reported
    off, with the reason, and the caller serves plain. With a model, also runs the
    verify self-check on the pack's own weights and chooses plain decode's
    replacements by measurement (choose_decode_path). verdicts: an opened VerdictCache whose
    cached kernel and decode path verdicts serve instead (the verify self-check runs always).
    """
    apply_patches()
    backend = dflash2_kernels.backend_name()
    seconds = {}
    if model is not None:
        # The verify forward's packed matmuls skip argument checks (dflash2_kernels.exact_rows).
        try:
            for module in model.language_model.modules():
                if isinstance(module, HadamardQuantizedLinear):
                    dflash2_kernels.check_packed_weights(module.weight, module.scales, module.biases)
        except (TypeError, ValueError) as error:
            return RuntimeStatus(False, f"packed-weights-unsupported: {error}", backend, {}, seconds=seconds)
    if model is None:
        started = time.perf_counter()
        result = {"qmv": dflash2_kernels.self_test()}
        seconds["kernel self-tests"] = time.perf_counter() - started
    else:
        verdicts = verdicts or VerdictCache()
        result = verdicts.check(
            "kernel self-tests",
            lambda: dflash2_kernels.verify_kernel_self_tests(dflash2_pack.kernel_shapes(model)),
            dflash2_kernels.restore_kernel_verdicts, dflash2_kernels.kernel_verdicts)
        seconds = verdicts.measured_seconds()
    # The other kernels fall back to single-position stock calls where their test
    # failed (exact, slower); a failed matmul kernel turns speculation off.
    if not result["qmv"].ok:
        reason = f"kernel-self-test-failed: {result['qmv'].reason}"
        return RuntimeStatus(False, reason, backend, result, seconds=seconds)
    if model is None:
        return RuntimeStatus(True, None, backend, result, seconds=seconds)
    check = verdicts.check("verify self-check", lambda: self_check_verify(model.language_model))
    choice = verdicts.check("plain decode path", lambda: choose_decode_path(model), DecodePathChoice.from_json)
    use_decode_arm(choice.arm)
    reason = f"verify-self-check-failed: {check.summary()}" if check.differing else None
    return RuntimeStatus(reason is None, reason, backend, result, choice, check, verdicts.measured_seconds())


# The negative control's block: stock verify's longest round, where it departs from decode
# on every GPU backend (MLX's multi-row matmul at 8 rows on CUDA; the dense gates and
# attention on Metal). One control round proves the comparison can see a difference; the
# exact rounds, which the server serves, run at every block.
STOCK_CONTROL_BLOCK = 8


@dataclass
class VerifySelfCheck:
    """Verify rounds against decode steps on the pack's own weights, as bits."""

    blocks: int
    differing: int  # elements of logits, hidden states and post-rollback caches
    stock_differing: int  # the same for stock verify at its one block (the negative control)
    seconds: float
    first_difference: Optional[str] = None
    stock_block: int = STOCK_CONTROL_BLOCK
    seconds_by_part: dict = field(default_factory=dict)  # decode steps / exact rounds / stock round

    def summary(self) -> str:
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.seconds_by_part.items())
        text = (
            f"exact verify self-check: {self.blocks} blocks, {self.differing} differing "
            f"(stock verify, block {self.stock_block}: {self.stock_differing} differing), "
            f"{self.seconds:.1f} s" + (f" ({parts})" if parts else "")
        )
        return text + (f"; first: {self.first_difference}" if self.first_difference else "")


def _differing_bits(pairs) -> list:
    """Differing elements of each (a, b) pair as raw bits, evaluated together (one wait
    for the device instead of one per array)."""
    counts = []
    for a, b in pairs:
        if a.shape != b.shape or a.dtype != b.dtype:
            counts.append(mx.array(max(a.size, b.size)))
            continue
        counts.append((dflash2_kernels.raw_bits(a) != dflash2_kernels.raw_bits(b)).sum())
    mx.eval(counts)
    return [int(count.item()) for count in counts]


def self_check_verify(language_model, prompt=(1, 2, 3, 4), block=(11, 29, 7, 101, 55, 3, 88, 140)):
    """One exact verify round per block size 2..8 against single-token decode steps.

    Compares logits, the drafter's tap hidden states and, after committing half
    the block, every cache array, bit for bit. Stock verify runs the same checks at
    STOCK_CONTROL_BLOCK as the negative control (on CPU it agrees; on GPUs it should
    not). Its seconds are logged by part: the prompt and 8 decode steps it compares
    against, the 7 exact rounds, the stock round (first use compiles on GPUs).
    """
    from mlx_vlm.speculative.cache_state import commit_speculative_round

    if len(block) < STOCK_CONTROL_BLOCK:
        raise ValueError(f"the self-check's block needs {STOCK_CONTROL_BLOCK} tokens, got {len(block)}")
    started = time.perf_counter()
    seconds = {}
    layers = language_model.model.layers
    taps = sorted({0, len(layers) // 2, len(layers) - 1})
    cache = language_model.make_cache()
    mx.eval(language_model(mx.array([list(prompt)]), cache=cache).logits)
    start = copy.deepcopy(cache)
    steps, after = [], [copy.deepcopy(cache)]
    for token in block:
        steps.append(language_model(mx.array([[token]]), cache=cache, capture_layer_ids=taps))
        mx.eval(steps[-1].logits, steps[-1].hidden_states)
        after.append(copy.deepcopy(cache))
    seconds["decode steps"] = time.perf_counter() - started

    def check(length, verifier):
        qwen3_5_language._EXACT_SPECULATIVE_VERIFIER = verifier
        try:
            trial = copy.deepcopy(start)
            out = language_model(
                mx.array([list(block[:length])]), cache=trial,
                capture_layer_ids=taps, speculative_verify=True,
            )
            accepted = length // 2
            commit_speculative_round(language_model, trial, out.gdn_states, accepted, length)
        finally:
            qwen3_5_language._EXACT_SPECULATIVE_VERIFIER = exact_verifier
        pairs = [(out.logits, mx.concatenate([s.logits for s in steps[:length]], axis=1))]
        pairs += [
            (hidden, mx.concatenate([s.hidden_states[i] for s in steps[:length]], axis=1))
            for i, hidden in enumerate(out.hidden_states)
        ]
        pairs += list(zip(dflash2_rounds.cache_arrays(trial), dflash2_rounds.cache_arrays(after[accepted + 1])))
        counts = _differing_bits(pairs)
        return sum(counts), counts

    exact_verifier = qwen3_5_language._EXACT_SPECULATIVE_VERIFIER
    differing = 0
    first = None
    part_started = time.perf_counter()
    for length in range(2, len(block) + 1):
        count, counts = check(length, exact_verifier)
        if count and first is None:
            part = next(i for i, c in enumerate(counts) if c)
            first = f"block {length}, " + ("logits" if part == 0 else f"array {part}")
        differing += count
    seconds["exact rounds"] = time.perf_counter() - part_started
    part_started = time.perf_counter()
    stock_differing = check(STOCK_CONTROL_BLOCK, exact_verifier.__dflash2_stock__)[0]
    seconds["stock round"] = time.perf_counter() - part_started
    return VerifySelfCheck(len(block) - 1, differing, stock_differing, time.perf_counter() - started,
                           first, seconds_by_part=seconds)


def time_decode_steps(language_model, arms: dict, repeats: int = 5, steps: int = 3) -> dict:
    """interleaved_ms of plain decode steps under each arm (name -> set-up function).

    Steps are pipelined as generation runs them: the next step's graph is built and
    queued (async_eval) before the previous token is read, so host work that overlaps
    the GPU is not counted twice."""
    cache = language_model.make_cache()
    mx.eval(language_model(mx.array([[1, 2, 3, 4]]), cache=cache).logits)

    def next_token(token):
        logits = language_model(token, cache=cache).logits[:, -1, :]
        return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)[:, None]

    def sample(set_up):
        def run():
            set_up()
            token = next_token(mx.array([[5]]))  # graph and kernels warm
            mx.eval(token)
            start = time.perf_counter()
            for _ in range(steps):
                following = next_token(token)
                mx.async_eval(following)
                token.item()
                token = following
            token.item()
            return 1000 * (time.perf_counter() - start) / steps

        return run

    return dflash2_timing.interleaved_ms({name: sample(set_up) for name, set_up in arms.items()}, repeats)


def use_decode_arm(arm: str) -> None:
    """Switch plain decode's replacements to one of DECODE_ARMS."""
    global _decode_path
    _decode_path = DECODE_ARMS[arm]


def decode_arm_differences(language_model, arms) -> dict:
    """Elements of one plain decode step, its logits and every cache array, that differ
    as bits from stock's (the "mlx" arm) under each arm, from the same prompt; an arm
    whose step raised maps to what it raised."""
    global _decode_path
    cache = language_model.make_cache()
    mx.eval(language_model(mx.array([[1, 2, 3, 4]]), cache=cache).logits)
    served = _decode_path

    def step(arm):
        use_decode_arm(arm)
        trial = copy.deepcopy(cache)
        arrays = [language_model(mx.array([[5]]), cache=trial).logits, *dflash2_rounds.cache_arrays(trial)]
        mx.eval(arrays)
        return arrays

    try:
        stock = step("mlx")
        differing = {}
        for arm in arms:
            try:
                arrays = step(arm)
            except Exception as error:  # a kernel that failed to build, say: the arm is left out
                differing[arm] = f"raised {type(error).__name__}: {error}"
                continue
            counts = _differing_bits(zip(arrays, stock))
            differing[arm] = sum(counts) if len(arrays) == len(stock) else "another number of cache arrays"
    finally:
        _decode_path = served
    return differing


def choose_decode_path(model) -> DecodePathChoice:
    """Give plain decode the replacements that make it fastest end to end here.

    Each arm is timed on this machine, interleaved after warm-up, among the arms whose
    decode step gives stock's bits here (decode_arm_differences: the tokens are the same
    under every arm that serves). Off CUDA no arm has a kernel to use, so decode stays
    MLX's own."""
    if dflash2_kernels.backend_name() != "cuda":
        use_decode_arm("mlx")
        return DecodePathChoice("mlx", "no decode kernel on this backend")
    differing = decode_arm_differences(model.language_model, [arm for arm in DECODE_ARMS if arm != "mlx"])
    arms = {arm: (lambda arm=arm: use_decode_arm(arm)) for arm in DECODE_ARMS if not differing.get(arm)}
    repeats = 7
    timings = time_decode_steps(model.language_model, arms, repeats=repeats, steps=4)
    # By each arm's fastest sample: the noise is one-sided (on the H200 a switch between arms
    # can rebuild CUDA graphs mid-sample), and medians there once picked stock against an arm
    # that ran 1.22x faster end to end.
    fastest = min(timings, key=lambda arm: timings[arm]["min"])
    use_decode_arm(fastest)
    why = f"fastest decode step of the arms (fastest of {repeats} interleaved samples)"
    left_out = {arm: n for arm, n in differing.items() if n}
    if left_out:
        why += "; left out, their step differing from stock's: " + ", ".join(
            f"{arm} ({n} elements)" if isinstance(n, int) else f"{arm} ({n})" for arm, n in left_out.items())
    return DecodePathChoice(fastest, why, timings)


def configure_drafter(drafter, options: RuntimeOptions) -> None:
    """Apply the experiment options to a loaded drafter.

    The verify block never exceeds the drafter's trained block nor the kernel's
    8 rows, and the round policy chooses within that; a fixed block pins it, a
    cap bounds the choice.
    """
    trained = int(drafter.config.block_size)
    ceiling = min(trained, dflash2_kernels.MAX_ROWS)
    for name, value in (("block size", options.block_size), ("block cap", options.block_cap)):
        if value is not None and not 2 <= value <= min(trained, dflash2_kernels.MAX_ROWS):
            raise ValueError(f"{name} must be 2..{min(trained, dflash2_kernels.MAX_ROWS)}, got {value}")
    if options.block_size is not None:
        drafter.prefer_requested_block_size = True
        ceiling = options.block_size
    if options.block_cap is not None:
        ceiling = min(ceiling, options.block_cap)
    # _dflash_block_total reads min(block_size, runtime_block_size) each request.
    drafter.config.runtime_block_size = ceiling
    if options.candidate_selector:
        # Stock greedy drafting bypasses the trained selector; draft_block uses it.
        drafter.draft_block_greedy = drafter.draft_block
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
