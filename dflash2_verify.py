"""The exact verify forward: every position of a draft block computed as a decode step computes it.

Greedy speculative output must equal plain decoding token for token. Stock 0.7.2
verifies a draft block with batched kernels whose rounding differs from the
single-token decode step (on CUDA and Metal; CPU happens to agree). The forward
here makes every verify position use the decode step's own arithmetic: packed
2-bit linears go through dflash2_kernels' exact matmul (all rows in one pass, each
row bitwise equal to MLX's single-row kernel); the rotation, the dense gate
projections, the GatedDeltaNet recurrence and attention through its multi-position
kernels, each self-tested against decode's single-position call (per-position stock
calls where one failed); row-wise work runs once over all positions; and the greedy
token is picked the way plain decode picks it. dflash2_runtime installs it in mlx-vlm
(ExactVerifier, exact_verify_greedy) and checks it against decode steps at start-up.
"""

import contextlib
import functools
import weakref
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35 import HadamardQuantizedLinear
from mlx_vlm.models.qwen3_5 import language as qwen3_5_language
from mlx_vlm.models.qwen3_5.speculative_verifier import Qwen3_5BatchInvariantForward
from mlx_vlm.speculative import dflash as dflash_rounds
from mlx_vlm.speculative.cache_state import abort_speculative_round

import dflash2_kernels
from dflash2_audit import _with_globals


class ExactnessError(RuntimeError):
    """A verify call reached a case the exact path does not cover."""


def _packed_linear(linear: HadamardQuantizedLinear, x: mx.array) -> mx.array:
    """The packed linear of decode, for many rows, bit for bit per row.

    Its arrays are read as the module's items (linear["weight"]): attribute access on an
    nn.Module goes through a Python __getattr__, about half a microsecond each, four
    times for each of ~400 calls a forward."""
    # Packs whose dense tensors are fp32 (the real file) carry fp32 activations: their
    # rows take the fp32 kernel (MLX's qmv<float> arithmetic), other dtypes MLX's own
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
    if x.dtype == mx.float32 and x.size <= dflash2_kernels.MAX_ROWS * k:
        # The same for fp32 rows, on the (..., K) rows as they are: no reshape or slice around
        # the call, each a host node on a host-bound step (about 350 a decode step).
        rotated = dflash2_kernels.rotate(x, linear.block, linear["signs"]) if linear.block else x
        return dflash2_kernels.exact_rows_fp32(rotated, linear["weight"], linear["scales"], linear["biases"])
    if linear.block:
        x = dflash2_kernels.rotate(x, linear.block, linear["signs"])
    rows = x.reshape(-1, k)
    matmul = {mx.float16: dflash2_kernels.exact_quantized_matmul,
              mx.float32: dflash2_kernels.exact_rows_fp32}.get(rows.dtype, dflash2_kernels.stock_rows)
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


def _shared_rotation_block(linears, x) -> int:
    """The rotation block packed linears that share fp16 or fp32 x can rotate it with in one
    launch: all HadamardQuantizedLinear (not a subclass, which may call otherwise) with one
    nonzero block; else 0."""
    blocks = {getattr(linear, "block", None) for linear in linears}
    if (x.dtype not in (mx.float16, mx.float32) or len(blocks) != 1
            or not all(type(linear) is HadamardQuantizedLinear for linear in linears)):
        return 0
    return linears[0].block


def _exact_linear_group(linears, x, block):
    """dflash2_kernels.exact_linear_group of packed linears that share x (items, not
    attributes: see _packed_linear)."""
    return dflash2_kernels.exact_linear_group(
        x, block, [linear["signs"] for linear in linears],
        [(linear["weight"], linear["scales"], linear["biases"]) for linear in linears])


def _fused_residual_layer(layer, x, mixer, feed_forward):
    """A Qwen3.5 decoder layer's body (input norm, mixer(normed): its attention or
    GatedDeltaNet, residual add, post-attention norm, feed_forward(layer.mlp, normed), the
    second residual add) with the first add and the norm after it in one launch."""
    hidden, mlp_out = _residual_layer_parts(layer, x, mixer, feed_forward)
    return hidden + mlp_out


def _residual_layer_parts(layer, x, mixer, feed_forward, normed=None):
    """_fused_residual_layer up to its second residual add: (h, the MLP's output), whose sum
    (h + it, decode's order) is the layer's output. normed: layer.input_layernorm(x) where
    the layer before computed it in its own last launch."""
    normed = layer.input_layernorm(x) if normed is None else normed
    hidden, post = _add_and_norm(x, mixer(normed), layer.post_attention_layernorm)
    return hidden, feed_forward(layer.mlp, post)


def _add_and_norm(x, residual, norm):
    """(x + residual, norm(x + residual)); an nn.RMSNorm's in one launch
    (dflash2_kernels.add_rms_norm: bitwise the Add and the mx.fast.rms_norm it calls)."""
    if type(norm) is not nn.RMSNorm:
        hidden = x + residual
        return hidden, norm(hidden)
    return dflash2_kernels.add_rms_norm(x, residual, norm.weight, norm.eps)


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


# Verify's copy of decode's norms, rotary and KV append (audited), its rotary in one launch
# for all positions (dflash2_kernels.rope_rows, looked up at each call: element-wise, so
# any number of rows).
_verify_prepare_projected_qkv = _with_globals(
    qwen3_5_language.Qwen3_5Attention._prepare_projected_qkv,
    apply_multimodal_rotary_pos_emb=lambda q, k, cos, sin: dflash2_kernels.rope_rows(q, k, cos, sin),
)


@dataclass
class _NormedOutput:
    """A decoder layer's output and the next layer's input norm of it, from one launch."""

    hidden: mx.array
    normed: mx.array


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
    compiled_layers = None  # CompiledLayers where the GatedDeltaNet layers' steps run compiled
    _layers = ()  # the forward's decoder layers, in order
    _ahead = None  # _NormedOutput: the last layer's output and the next one's input norm of it

    def use_compiled_layers(self, on: bool) -> None:
        """Verify's GatedDeltaNet decoder layers traced once per block length and replayed
        (CompiledLayers), or built at every round."""
        self.compiled_layers = CompiledLayers(self._linear, self._linears, self._feed_forward) if on else None

    def verify(self, language_model, inputs, *, cache=None, **kwargs):
        # The server's one-row batch cache brings an explicit causal mask; an
        # unpadded single row decodes without one. Checked once per round.
        attention_cache = (cache or [None])[language_model.model.fa_idx]
        self._unpadded_row = _single_unpadded_row(attention_cache, inputs.shape[0])
        self._layers_built, self._layers, self._ahead = 0, language_model.model.layers, None
        try:
            return super().verify(language_model, inputs, cache=cache, **kwargs)
        finally:  # the process-wide verifier must not keep a dropped model's layers alive
            self._layers, self._ahead = (), None

    def _layer(self, layer, hidden, mask, cache, position_ids, position_embeddings):
        # The base class's, with each residual add and the norm after it in one launch: the
        # first add's post-attention norm, and the second's the next layer's input norm (the
        # next call's `hidden` is this one's output: the base class's loop hands it on).
        ahead, self._ahead = self._ahead, None
        normed = ahead.normed if ahead is not None and ahead.hidden is hidden else None
        if self.compiled_layers is not None and takes_compiled_step(layer, hidden, mask, cache):
            hidden = self.compiled_layers.run(layer, hidden, cache)
        else:
            if layer.is_linear:
                def mixer(normed):
                    return self._gated_delta(layer.linear_attn, normed, mask, cache)
            else:
                def mixer(normed):
                    return self._attention(layer.self_attn, normed, mask, cache, position_ids, position_embeddings)
            hidden, mlp_out = _residual_layer_parts(layer, hidden, mixer, self._feed_forward, normed)
            following = self._layers_built + 1
            if following < len(self._layers):
                hidden, next_normed = _add_and_norm(hidden, mlp_out, self._layers[following].input_layernorm)
                self._ahead = _NormedOutput(hidden, next_normed)
            else:
                hidden = hidden + mlp_out
        self._layers_built += 1
        if VERIFY_EVAL_EVERY and self._layers_built % VERIFY_EVAL_EVERY == 0:
            mx.async_eval(hidden)
        return hidden

    def _linear(self, linear, x):
        if isinstance(linear, HadamardQuantizedLinear):
            return _packed_linear(linear, x)
        if "bias" in linear:
            raise ExactnessError("dense verify linears with a bias are not covered")
        # Dense linears (GDN in_proj_a / in_proj_b; fp32 in the real file): decode's one-row matmul.
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
    decode's step computes it (unmasked, with a cache): gated_delta_core from the cache's
    state, then commit_gated_delta. linear(module, x) runs its packed projections: verify's
    exact multi-row matmul, or the module's own call in decode; linears((modules), x), where
    given, the two that share the input."""
    conv_state, initial = gated_delta_state(layer, cache, inputs.shape[0], inputs.dtype)
    output, conv_input, states = gated_delta_core(layer, inputs, conv_state, initial, linear, linears)
    commit_gated_delta(layer, cache, conv_input, states)
    return output


def gated_delta_state(layer, cache, batch: int, dtype) -> tuple:
    """(convolution window, recurrent state) a GatedDeltaNet step starts from: the cache's,
    or zeros where it holds none for this batch."""
    conv_state, initial = cache[0], cache[1]
    if conv_state is None or conv_state.shape[0] != batch:
        conv_state = mx.zeros((batch, layer.conv_kernel_size - 1, layer.conv_dim), dtype=dtype)
    if initial is None or initial.shape[0] != batch:
        initial = mx.zeros((batch, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), dtype=mx.float32)
    return conv_state, initial


def gated_delta_core(layer, inputs, conv_state, initial, linear, linears=None) -> tuple:
    """The GatedDeltaNet layer's arithmetic at each position from that state, touching no
    cache: (output, the convolution's input window, the recurrent state after each position)."""
    batch, length, _ = inputs.shape
    mixed_qkv, z = (linears((layer.in_proj_qkv, layer.in_proj_z), inputs) if linears
                    else (linear(layer.in_proj_qkv, inputs), linear(layer.in_proj_z, inputs)))
    b, a = _gate_projections(layer, inputs)
    z = z.reshape(batch, length, -1, layer.head_v_dim)
    conv_input, conv_out = _convolve_positions(layer, conv_state, mixed_qkv)
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
    output, states = dflash2_kernels.gdn_recurrence(q, k, v, g, beta, initial)
    output = _gated_norm(layer.norm, output, z)
    return linear(layer.out_proj, output.reshape(batch, length, -1)), conv_input, states


def commit_gated_delta(layer, cache, conv_input, states) -> None:
    """Writes a GatedDeltaNet step's window and final state into its cache and advances it.
    One window update records every position's window for rollback, and every position's
    state is recorded in one call so rollback can keep any prefix without copying states
    per position (both no-ops outside a speculative round)."""
    length = states.shape[1]
    cache.update_window(0, conv_input, layer.conv_kernel_size - 1, lengths=cache.lengths)
    final = states[:, -1]
    cache.record_speculative_states(1, states[:, :-1] if length > 1 else None, final)
    cache[1] = final
    cache.advance(length)
    qwen3_5_language._qwen3_5_advance_left_padding_info(cache, length)
    qwen3_5_language._qwen3_5_advance_lengths_info(cache, length)


def takes_compiled_step(layer, x, mask, cache) -> bool:
    """Whether CompiledLayers serves a decoder layer's step: Qwen3.5's own GatedDeltaNet
    decoder layer (a subclass may compute otherwise), unmasked, with a cache, on fp16
    activations that stay fp16 through its input norm (where the exact kernels serve: an
    fp32 norm weight would hand the layer fp32 rows, whose stock element-wise ops a trace
    could fuse)."""
    return (type(layer) is qwen3_5_language.Qwen3_5DecoderLayer and layer.is_linear
            and type(layer.linear_attn) is qwen3_5_language.Qwen3_5GatedDeltaNet
            and not layer.linear_attn.training and mask is None and cache is not None
            and x.dtype == mx.float16 and layer.input_layernorm.weight.dtype == mx.float16)


class CompiledLayers:
    """Each GatedDeltaNet decoder layer's step under mx.compile: Python builds its graph
    once per input shape and stream (the trace), and MLX replays it at every step after.

    At the 27B shape a step is host-bound (uncompiled, Python built a decode step's graph in
    about 10 of its 37 ms on the H200). A trace holds the ops the layer's
    uncompiled step builds, with its weights as constants. Where every kernel the layer uses
    serves (fp16 activations, every kernel self-test passed: what the callers require), no
    element-wise ops meet, so nothing fuses; a compiled step serves only where a check of its
    bits against stock decode's passed here. A layer's trace lives as long as the store
    (clear() drops them all: at a switch of decode arm, or a new store for the verifier);
    weights replaced in place after the first step are not seen (a pack's are loaded once).
    linear(module, x), linears(modules, x): the projections the step runs, as
    gated_delta_positions takes them; feed_forward(mlp, x): its MLP."""

    def __init__(self, linear, linears, feed_forward):
        self._linear, self._linears, self._feed_forward = linear, linears, feed_forward
        self._steps = {}  # id(layer) -> (weak reference to the layer, compiled step)

    def run(self, layer, x, cache):
        """The decoder layer's output at x's positions: its compiled step from the cache's
        state, then the cache commit (outside the trace: a speculative round records there)."""
        conv_state, initial = gated_delta_state(layer.linear_attn, cache, x.shape[0], x.dtype)
        output, conv_input, states = self.step(layer)(x, conv_state, initial)
        commit_gated_delta(layer.linear_attn, cache, conv_input, states)
        return output

    def step(self, layer):
        """The decoder layer's compiled step: (hidden, convolution window, recurrent state) ->
        (output, the convolution's input window, the state after each position)."""
        kept = self._steps.get(id(layer))
        if kept is None or kept[0]() is not layer:
            # Steps of layers gone (their id may be another's now) go with their weights.
            self._steps = {key: entry for key, entry in self._steps.items() if entry[0]() is not None}
            kept = self._steps[id(layer)] = (weakref.ref(layer), mx.compile(self._layer_step(weakref.ref(layer))))
        return kept[1]

    def clear(self):
        self._steps.clear()

    def _layer_step(self, layer_ref):
        """The layer's step as a function of arrays alone (the layer by weak reference: the
        trace keeps its weights, not the layer)."""
        linear, linears, feed_forward = self._linear, self._linears, self._feed_forward

        def step(x, conv_state, initial):
            layer, kept = layer_ref(), []

            def mixer(normed):
                output, *window_and_states = gated_delta_core(
                    layer.linear_attn, normed, conv_state, initial, linear, linears)
                kept.extend(window_and_states)
                return output

            return (_fused_residual_layer(layer, x, mixer, feed_forward), *kept)

        return step


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
    weight = _derived_weights.get(layer, "gate projections", (b_weight, a_weight),
                                  lambda b, a: mx.concatenate([b, a]))
    out = dflash2_kernels.dense_rows(x, weight)
    return out[..., : b_weight.shape[0]], out[..., b_weight.shape[0] :]


class DerivedWeights:
    """Weights the kernels take in another form than the layer keeps them (a GatedDeltaNet's
    two gate projections as one matrix, decode's fp32 convolution weight), derived once per
    layer and kept here, not on mlx-vlm's layer, until one of the source arrays is replaced
    (as mlx-vlm keeps decode's convolution weight)."""

    def __init__(self):
        self._kept = {}  # (id(layer), name) -> (weak reference to the layer, sources, derived)

    def get(self, layer, name: str, sources: tuple, derive):
        """derive(*sources), evaluated, as kept for this layer."""
        kept = self._kept.get((id(layer), name))
        if kept is None or kept[0]() is not layer or any(a is not b for a, b in zip(kept[1], sources)):
            # Entries of layers gone (their id may be another's now) go with their arrays.
            self._kept = {key: entry for key, entry in self._kept.items() if entry[0]() is not None}
            derived = derive(*sources)
            mx.eval(derived)
            kept = self._kept[id(layer), name] = (weakref.ref(layer), sources, derived)
        return kept[2]


_derived_weights = DerivedWeights()


def _convolve_positions(layer, conv_state, mixed_qkv):
    """(the window the cache keeps, silu of decode's convolution at each position).

    Decode convolves the (B, K, C) window that ends at its position; with fp16 or bf16
    weights it runs `_qwen3_5_decode_depthwise_conv` on fp32 weights, which
    dflash2_kernels.conv_rows takes for every position at once (one launch on CUDA)."""
    if layer.conv1d.weight.dtype not in (mx.bfloat16, mx.float16):
        # fp32 convolution weights (the real file's): decode runs nn.Conv1d on the window.
        conv_input = mx.concatenate([conv_state, mixed_qkv], axis=1)
        return conv_input, nn.silu(dflash2_kernels.conv1d_rows(layer.conv1d, conv_input, mixed_qkv.shape[1]))
    # Decode's own weight, as mlx-vlm's _causal_conv1d_decode casts it.
    weight = _derived_weights.get(layer, "decode convolution", (layer.conv1d.weight,),
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
