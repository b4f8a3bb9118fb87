"""Adds exact DFlash 2 speculative decoding to pinned mlx-vlm 0.7.2 at run time.

Greedy speculative output must equal plain decoding token for token. Stock 0.7.2
verifies a draft block with batched kernels whose rounding differs from the
single-token decode step (on CUDA and Metal; CPU happens to agree). The patches
below make every verify position use the decode step's own arithmetic: packed
2-bit linears go through `dflash2_kernels.exact_quantized_matmul` (all rows in one
pass, each row bitwise equal to MLX's single-row kernel); dense linears,
convolution, GatedDeltaNet recurrence and attention run one position at a time
through the same functions decode calls; and the greedy token is picked the way
plain decode picks it. Every patched or mirrored mlx-vlm function is fingerprinted:
if its source differs from the audited one, `install` refuses and names it.
"""

import hashlib
import importlib
import inspect
import os
import statistics
import time
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
import mlx_vlm  # noqa: E402
from mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35 import HadamardQuantizedLinear
from mlx_vlm.models.qwen3_5 import language as qwen3_5_language
from mlx_vlm.models.qwen3_5 import gated_delta as gated_delta_module
from mlx_vlm.models.qwen3_5.gated_delta import _compute_g_beta
from mlx_vlm.models.qwen3_5.speculative_verifier import Qwen3_5BatchInvariantForward
from mlx_vlm.speculative import dflash as dflash_rounds
from mlx_vlm.speculative.cache_state import abort_speculative_round
from mlx_vlm.speculative.drafters.dflash2.dflash2 import DFlash2DraftModel
from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashDraftModel

import dflash2_kernels
import dflash2_policy

MLX_VERSION = "0.32.2"
MLX_VLM_VERSION = "0.7.2"
MAX_KERNEL_ROWS = 8


class RuntimeMismatch(RuntimeError):
    """The installed mlx / mlx-vlm is not the audited one; nothing was patched."""


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


@dataclass
class RuntimeStatus:
    speculative: bool
    reason: Optional[str]
    backend: str
    self_test: dict = field(default_factory=dict)  # kernel name -> SelfTestResult
    decode_path: Optional[DecodePathChoice] = None
    verify_check: Optional["VerifySelfCheck"] = None


# ---------------------------------------------------------------------------
# Exact verify forward


def _packed_linear(linear: HadamardQuantizedLinear, x: mx.array) -> mx.array:
    """The packed linear of decode, for many rows, bit for bit per row."""
    if linear.block:
        x = dflash2_kernels.rotate(x, linear.block, linear.signs)
    rows = x.reshape(-1, x.shape[-1])
    # The kernels reproduce MLX's fp16 single-row arithmetic. Packs whose dense
    # tensors are fp32 carry fp32 activations: those rows take MLX's own
    # single-row call one by one, exact by construction, only slower.
    matmul = (
        dflash2_kernels.exact_quantized_matmul
        if rows.dtype == mx.float16
        else dflash2_kernels.stock_rows
    )
    outputs = [
        matmul(
            rows[start : start + MAX_KERNEL_ROWS],
            linear.weight,
            linear.scales,
            linear.biases,
        )
        for start in range(0, rows.shape[0], MAX_KERNEL_ROWS)
    ]
    out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)
    return out.reshape(*x.shape[:-1], out.shape[-1])


_stock_hadamard_linear_call = HadamardQuantizedLinear.__call__
_stock_gated_delta_ops = gated_delta_module.gated_delta_ops

# Plain decode's replacements in use, chosen by choose_decode_path from an
# end-to-end measurement on this machine. Each is bitwise decode's own result
# (their self-tests prove it), so the choice changes speed, never tokens.
DECODE_ARMS = {
    "mlx": frozenset(),
    "rotation": frozenset({"rotation"}),
    "rotation+recurrence": frozenset({"rotation", "recurrence"}),
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
        x = dflash2_kernels.rotate(x, self.block, self.signs)
    return mx.quantized_matmul(
        x, self.weight, self.scales, self.biases, transpose=True,
        group_size=self.group_size, bits=self.bits,
    )


def _gated_delta_ops_call(q, k, v, g, beta, state=None, mask=None):
    """gated_delta_ops with decode's single step on the recurrence kernel."""
    if "recurrence" not in _decode_path or mask is not None or q.shape[1] != 1 or state is None:
        return _stock_gated_delta_ops(q, k, v, g, beta, state, mask)
    y, states = dflash2_kernels.gdn_recurrence(q, k, v, g, beta, state)
    return y, states[:, -1]


def _single_unpadded_row(cache, batch: int) -> bool:
    left_padding = getattr(cache, "left_padding", None)
    return batch == 1 and (left_padding is None or max(left_padding.tolist()) <= 0)


class ExactVerifier(Qwen3_5BatchInvariantForward):
    """Qwen3.5 verify forward whose every position equals a decode step.

    Row-wise work (norms, rotations, rotary tables, gates, silu, the
    convolution over strided windows, one KV update per layer) runs once for
    all positions: those kernels take their launch shape from the row, never
    from the row count. What decode runs through kernels that are not
    row-invariant (packed and dense matmuls, the GatedDeltaNet recurrence,
    attention) goes through dflash2_kernels' multi-position equivalents.
    """

    def verify(self, language_model, inputs, *, cache=None, **kwargs):
        # The server's one-row batch cache brings an explicit causal mask; an
        # unpadded single row decodes without one. Checked once per round.
        attention_cache = (cache or [None])[language_model.model.fa_idx]
        self._unpadded_row = _single_unpadded_row(attention_cache, inputs.shape[0])
        return super().verify(language_model, inputs, cache=cache, **kwargs)

    def _linear(self, linear, x):
        if isinstance(linear, HadamardQuantizedLinear):
            return _packed_linear(linear, x)
        if "bias" in linear:
            raise ExactnessError("dense verify linears with a bias are not covered")
        # Dense fp16 linears (GDN in_proj_a / in_proj_b): decode's one-row matmul.
        return dflash2_kernels.dense_rows(x, linear.weight)

    def _linears(self, linears, x):
        return tuple(self._linear(linear, x) for linear in linears)

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
        queries, keys, values, gate, _ = attention._prepare_projected_qkv(
            queries, keys, values, cache, position_ids, position_embeddings, None
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
        batch, length, _ = inputs.shape
        mixed_qkv, z = self._linears((layer.in_proj_qkv, layer.in_proj_z), inputs)
        b, a = _gate_projections(layer, inputs)
        z = z.reshape(batch, length, -1, layer.head_v_dim)
        width = layer.conv_kernel_size - 1
        conv_state = cache[0]
        if conv_state is None or conv_state.shape[0] != batch:
            conv_state = mx.zeros((batch, width, layer.conv_dim), dtype=inputs.dtype)
        conv_input = mx.concatenate([conv_state, mixed_qkv], axis=1)
        # One window update records every position's window for rollback.
        cache.update_window(0, conv_input, width, lengths=cache.lengths)
        conv_out = nn.silu(_decode_convolution(layer, conv_input, length))
        q, k, v = [
            value.reshape(batch, length, heads, head_width)
            for value, heads, head_width in zip(
                mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
                [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
                [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
            )
        ]
        q, k = layer._normalize_qk(q, k)
        g, beta = _compute_g_beta(layer.A_log, a, b, layer.dt_bias)
        initial = cache[1]
        if initial is None or initial.shape[0] != batch:
            initial = mx.zeros((batch, *v.shape[2:], k.shape[-1]), dtype=mx.float32)
        output, states = dflash2_kernels.gdn_recurrence(q, k, v, g, beta, initial)
        # Every position's state is recorded in one call so rollback can keep
        # any prefix without copying states per position.
        final = states[:, -1]
        cache.record_speculative_states(1, states[:, :-1] if length > 1 else None, final)
        cache[1] = final
        cache.advance(length)
        helpers = self._helpers()
        helpers._qwen3_5_advance_left_padding_info(cache, length)
        helpers._qwen3_5_advance_lengths_info(cache, length)
        output = layer.norm(output, z)
        return self._linear(layer.out_proj, output.reshape(batch, length, -1))


def _gate_projections(layer, x):
    """in_proj_b(x) and in_proj_a(x), each row as decode's one-row matmul, in one
    launch: every output column depends only on its own weight row."""
    b_weight, a_weight = layer.in_proj_b.weight, layer.in_proj_a.weight
    if "bias" in layer.in_proj_b or "bias" in layer.in_proj_a:
        raise ExactnessError("GatedDeltaNet gate projections with a bias are not covered")
    cached = getattr(layer, "_dflash2_gate_weight", None)
    if cached is None or cached[0] is not b_weight or cached[1] is not a_weight:
        cached = (b_weight, a_weight, mx.concatenate([b_weight, a_weight]))
        layer._dflash2_gate_weight = cached
    out = dflash2_kernels.dense_rows(x, cached[2])
    return out[..., : b_weight.shape[0]], out[..., b_weight.shape[0] :]


def _decode_convolution(layer, conv_input, length):
    """Decode's depthwise convolution for each of the last `length` positions.

    Decode convolves one (B, K, C) window; here every position's window is a
    strided view of the block's input and one call reduces them all (the
    reduction keeps each output's order, whatever the number of outputs).
    """
    batch, total, channels = conv_input.shape
    taps = layer.conv_kernel_size
    if layer.conv1d.weight.dtype not in (mx.bfloat16, mx.float16):
        # fp32 convolution weights: decode runs nn.Conv1d on the window.
        return mx.concatenate(
            [layer.conv1d(conv_input[:, t : t + taps]) for t in range(length)], axis=1
        )
    windows = mx.as_strided(
        conv_input,
        (batch, length, taps, channels),
        (total * channels, channels, channels, 1),
    ).reshape(batch * length, taps, channels)
    return layer._causal_conv1d_decode(windows).reshape(batch, length, channels)


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
# Drafter precision: the target hands over fp16 activations; meeting bf16
# drafter weights they would promote the whole drafter to fp32 (and upcast its
# weights on every call). Run the drafter in bf16, hand fp16 back to the head.

_stock_draft_hidden = DFlashDraftModel._hidden
_stock_embed_input_tokens = DFlash2DraftModel._embed_input_tokens


def _draft_hidden_bf16(self, inputs, target_hidden, cache):
    hidden = _stock_draft_hidden(self, inputs, target_hidden.astype(mx.bfloat16), cache)
    return hidden.astype(target_hidden.dtype)


def _embed_input_tokens_bf16(self, inputs):
    return _stock_embed_input_tokens(self, inputs).astype(mx.bfloat16)


# ---------------------------------------------------------------------------
# The patch table: every mlx-vlm function this runtime replaces or mirrors, with
# the sha256 of its audited 0.7.2 source. `replacement` None means the exact path
# reproduces that function's arithmetic step for step, so it must not change.


@dataclass(frozen=True)
class Patch:
    target: str  # "module:qualname"
    sha256: str
    why: str
    replacement: object = None


PATCHES = (
    Patch(
        "mlx_vlm.models.qwen3_5.language:_EXACT_SPECULATIVE_VERIFIER",
        "2fdf1228267e54774c9529ea04b390bfd220ea42ad22f49dbd0e7ca38f8bb1b5",
        "The verify forward: batched quantized matmuls, batched dense GDN gates, "
        "L==2 batched attention, full-block convolution and the with-states "
        "recurrence all round differently from decode on GPUs.",
        ExactVerifier(),
    ),
    Patch(
        "mlx_vlm.speculative.dflash:_dflash_verify_greedy",
        "1b472dc300554ab6017495bdeb18480be431578aa6958ff7b35c0145e8412971",
        "Stock greedy verify takes argmax of raw logits; decode takes it of fp16 logprobs.",
        exact_verify_greedy,
    ),
    Patch(
        "mlx_vlm.speculative.drafters.dflash2.dflash2:DFlash2DraftModel._hidden",
        "e01ca795d8183f747210f41ee0e30810c99eb447c7b268186898ac14f289caa0",
        "Run the bf16 drafter in bf16 and return the target's dtype to its head.",
        _draft_hidden_bf16,
    ),
    Patch(
        "mlx_vlm.speculative.drafters.dflash2.dflash2:DFlash2DraftModel._embed_input_tokens",
        "46d8b30d7519be85a0e2c3323ce7667008b85e4a2f85187216afd97bcd2e6542",
        "The target's fp16 embeddings enter the drafter as bf16.",
        _embed_input_tokens_bf16,
    ),
    Patch(
        "mlx_vlm.models.qwen3_5.language:LanguageModel.__call__",
        "af7f3f6427c2e59ab5266798b7518eaf026c3f7f749dd0962e38a6acece49cc9",
        "Mirrored: hands speculative_verify to the verifier with decode's position ids.",
    ),
    Patch(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5Attention.__call__",
        "b051c66057acc90f4ed78691f90254685cfdb20d5814b0d58beec4d2bb34c184",
        "Mirrored: decode attention, reproduced per verify position.",
    ),
    Patch(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5Attention._prepare_projected_qkv",
        "da21fd76217c72aa7ef15d4097e1fe428ff0022259f9556eb8fd95b59217c109",
        "Called per verify position: norms, rotary, KV cache append.",
    ),
    Patch(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5GatedDeltaNet.__call__",
        "0ab0be71156568f50a248f898d431b657b36b399166e29e25c16c7a45f6cc81b",
        "Mirrored: decode GatedDeltaNet step, reproduced per verify position.",
    ),
    Patch(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5GatedDeltaNet._causal_conv1d_decode",
        "77f9695692b994b6204f8df1ae58178dadb5ec91dd6194337a6e282c2e4bf17f",
        "Called per verify position: decode's depthwise convolution.",
    ),
    Patch(
        "mlx_vlm.models.qwen3_5.gated_delta:gated_delta_update",
        "66b3e98fcd83bed63869d1fcf6b3b130b8f4b7cbd25fee5988b288457c6615f0",
        "Mirrored: decode's recurrence call; on Metal called per verify position.",
    ),
    Patch(
        "mlx_vlm.models.qwen3_5.gated_delta:gated_delta_ops",
        "9751b1354ae88830f815b23c3a2ed4ec3a5154ccbbb2bbaa400f407efdd0540a",
        "Decode's single recurrence step on the recurrence kernel where measured faster "
        "(same bits: the kernel reproduces its head repeat and compiled step).",
        _gated_delta_ops_call,
    ),
    Patch(
        "mlx_vlm.models.qwen3_5.gated_delta:_compute_g_beta",
        "55e3a2984cc2e3ac92b7fe9cb3c1214d8360b774a426ff7906556a23d5c71429",
        "Called once for all verify positions (element-wise).",
    ),
    Patch(
        "mlx_vlm.models.qwen3_5.speculative_verifier:Qwen3_5BatchInvariantForward",
        "2fdf1228267e54774c9529ea04b390bfd220ea42ad22f49dbd0e7ca38f8bb1b5",
        "Base class of ExactVerifier: layer, model and head plumbing kept from stock.",
    ),
    Patch(
        "mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35:HadamardQuantizedLinear.__call__",
        "3303ee4843ce5fe54d9668368360cb8a01e90acce70773658cfc0bf0b7b642d4",
        "Decode's one-row packed matmul on the faster exact kernel (same bits), and "
        "mirrored for many rows in verify.",
        _hadamard_linear_call,
    ),
    Patch(
        "mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35:hadamard_transform",
        "26f78584fe230a4dae3782c9c29ceb97bddf51bdad9afa170c857fc9fd126400",
        "Reproduced by dflash2_kernels.rotate in one launch (verify, and decode where faster).",
    ),
    Patch(
        "mlx_vlm.speculative.drafters.qwen3_dflash.dflash:DFlashAttention.__call__",
        "7eaabc86f5be71f93d2c7ae79cfd3baaaa2f812885119a737c5619d9602c073d",
        "Relied on by the sliding-window option: trims the drafter's context to its window.",
    ),
    Patch(
        "mlx_vlm.speculative.drafters.qwen3_dflash.dflash:DFlashDraftModel.make_cache",
        "db5892186958bf9da98834ab163d1c09bcb424b3b71f6c9bc9cbeda400d97dae",
        "Relied on by the sliding-window option: rotating caches for sliding layers.",
    ),
    Patch(
        "mlx_vlm.speculative.dflash:_dflash_rounds",
        "eee8dc9ab95a74ed87c74064607736003b7d0dafbdafc32c9fba91dc190d2b32",
        "Mirrored by dflash2_policy's rounds (draft, _dflash_verify_greedy, walk, commit); "
        "runs as is for sampling and when no cost table was measured.",
    ),
    Patch(
        "mlx_vlm.speculative.utils:_dflash_rounds",
        "eee8dc9ab95a74ed87c74064607736003b7d0dafbdafc32c9fba91dc190d2b32",
        "The round loop both generate_step and the server call: each round's block, or plain "
        "decode steps, chosen from measured costs and the request's acceptance.",
        dflash2_policy.policy_rounds,
    ),
    Patch(
        "mlx_vlm.speculative.utils:run_speculative_server_rounds",
        "a97853c0faa5c672226856995b183a096c70212f915a90d9da643c877b16d0c1",
        "Relied on: the server reaches _dflash_rounds through utils' name at batch size 1.",
    ),
    Patch(
        "mlx_vlm.speculative.utils:run_speculative_rounds",
        "2f6dd995e5f8d5409cc213193aa52d065b633a2b400d595f63180c7815aa7e7c",
        "Relied on: generate_step reaches _dflash_rounds through utils' name at batch size 1.",
    ),
    Patch(
        "mlx_vlm.speculative.common:_speculative_walk",
        "4487bf2099c8d3a60917c12ac7ce18dfe7b72f727ec22571e38c0245521e7f81",
        "Relied on: the policy's rounds accept drafts up to the first mismatch, as stock.",
    ),
    Patch(
        "mlx_vlm.speculative.cache_state:commit_speculative_round",
        "58c3e8cf462dea7a576f56b42d0ff38d45daea051b95bc9e9bd8d1ef3698997c",
        "Relied on: the policy's rounds keep accepted + 1 positions of the target cache.",
    ),
    Patch(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5DecoderLayer.__call__",
        "9feda6407e1129df917a478e5687d2bc7f53ea21c7986f641468b5749a90e10a",
        "Unchanged arithmetic; during a policy plain step the drafter's tap layers also keep "
        "their outputs, which the next round hands to the drafter.",
        dflash2_policy._decoder_layer_call,
    ),
    Patch(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5Model.__call__",
        "9dfc2048db0d818595bcdeb306a59e80cf1217331784fe7361c92a2dbf13ab65",
        "Relied on: one decode step calls each layer once, in order (the one-row batch cache "
        "path included), so plain steps record the taps capture_layer_ids would.",
    ),
    # The servers' engine (serve.py's PackGenerator subclasses mlx-vlm's ResponseGenerator;
    # serve.py itself runs without this runtime, on the pinned mlx-vlm).
    Patch(
        "mlx_vlm.server.generation:ResponseGenerator._initialize_model",
        "e47152fbf3a0708c3cdffd92997586c5c9badeec0e6501b3710feccd52cc6241",
        "Extended by PackGenerator: loads the drafter right after the target.",
    ),
    Patch(
        "mlx_vlm.server.generation:ResponseGenerator.generate",
        "76c27ca4e8020006c38e459acccbb5edc68a07ffb8e05511d4e0a6e71d8166d7",
        "Extended by PackGenerator: the request's record, stop sequences and cancellation "
        "around the token stream; relied on to check the context budget before queueing.",
    ),
    Patch(
        "mlx_vlm.server.generation:ResponseGenerator._collect_pending_requests",
        "11773ed949253777ab45d32c87ad2a98ea0a1bf0a58bfd952c41b16543a64140",
        "Extended by PackGenerator: one sequence at a time, each with its own route.",
    ),
    Patch(
        "mlx_vlm.server.generation:ResponseGenerator.validate_context_budget",
        "584e9a2aedeb366fc01ca2be74fd0e42d8f2cce94b3cfaf5e4f79e9dcab64468",
        "Extended by PackGenerator: the check before a stream opens holds the tokenizer lock.",
    ),
    Patch(
        "mlx_vlm.server.generation:get_configured_context_limit",
        "e57421c0797ca38297d2687426afd8c0b19f9fc60ca912d058fe02b0b3951cf3",
        "Relied on: the budget is runtime.config.max_kv_size, which start_engine sets to the "
        "model's context length after the model has loaded.",
    ),
    Patch(
        "mlx_vlm.server.generation:_check_configured_context_budget",
        "47ccaec08d07e22f233a514e088d3fb3c12500267dd4d75dd1dd7412d16af29d",
        "Relied on: prompt plus max_tokens above the budget is refused, with the message "
        "serve.MLX_VLM_CONTEXT_BUDGET reads.",
    ),
)


def _resolve(target: str):
    module_name, qualname = target.split(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _audited_object(owner, name):
    """The stock object; after install, the one our replacement wraps."""
    value = getattr(owner, name)
    return getattr(value, "__dflash2_stock__", value)


def source_sha256(obj) -> str:
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        obj = type(obj)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


def fingerprint_mismatches(patches=PATCHES) -> list[str]:
    """Every difference between the installed packages and the audited ones."""
    problems = []
    if mx.__version__ != MLX_VERSION:
        problems.append(f"mlx {mx.__version__} is installed; the pack needs {MLX_VERSION}")
    if mlx_vlm.__version__ != MLX_VLM_VERSION:
        problems.append(
            f"mlx-vlm {mlx_vlm.__version__} is installed; the pack needs {MLX_VLM_VERSION}"
        )
    for patch in patches:
        try:
            owner, name = _resolve(patch.target)
            actual = source_sha256(_audited_object(owner, name))
        except (ImportError, AttributeError, OSError, TypeError) as error:
            problems.append(f"{patch.target}: not found ({error})")
            continue
        if actual != patch.sha256:
            problems.append(
                f"{patch.target}: source sha256 {actual}, audited {patch.sha256}"
            )
    return problems


def apply_patches(patches=PATCHES) -> None:
    problems = fingerprint_mismatches(patches)
    if problems:
        raise RuntimeMismatch(
            "refusing to patch mlx-vlm; these differ from the audited versions:\n  "
            + "\n  ".join(problems)
        )
    for patch in patches:
        if patch.replacement is None:
            continue
        owner, name = _resolve(patch.target)
        current = getattr(owner, name)
        if getattr(current, "__dflash2_stock__", None) is not None:
            continue  # already installed
        patch.replacement.__dflash2_stock__ = current
        setattr(owner, name, patch.replacement)


def kernel_shapes(model) -> dict:
    """The pack's own shapes for dflash2_kernels.verify_kernel_self_tests."""
    text = model.language_model.model
    shapes = {key: set() for key in ("packed", "rotations", "gdn", "dense", "attention")}
    for _, module in model.language_model.named_modules():
        if isinstance(module, HadamardQuantizedLinear):
            width = module.weight.shape[1] * 16
            shapes["packed"].add((module.weight.shape[0], width))
            if module.block:
                shapes["rotations"].add((width, module.block))
    for layer in text.layers:
        if layer.is_linear:
            gdn = layer.linear_attn
            shapes["gdn"].add((1, gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim))
            gates = gdn.in_proj_b.weight.shape[0] + gdn.in_proj_a.weight.shape[0]
            shapes["dense"].add((gates, gdn.in_proj_b.weight.shape[1]))
        else:
            attention = layer.self_attn
            shapes["attention"].add(
                (1, attention.num_attention_heads, attention.num_key_value_heads, attention.head_dim)
            )
    return {key: sorted(value) for key, value in shapes.items()}


def install(model=None) -> RuntimeStatus:
    """Check versions and fingerprints, patch mlx-vlm, prove exactness here.

    Every kernel is self-tested at the pack's own shapes (dflash2_kernels).

    Raises RuntimeMismatch if anything differs from the audited sources. A failed
    kernel self-test or verify self-check does not raise: speculation is reported
    off, with the reason, and the caller serves plain. With a model, also runs the
    verify self-check on the pack's own weights and chooses plain decode's
    replacements by measurement (choose_decode_path).
    """
    apply_patches()
    backend = dflash2_kernels.backend_name()
    if model is None:
        result = {"qmv": dflash2_kernels.self_test()}
    else:
        result = dflash2_kernels.verify_kernel_self_tests(kernel_shapes(model))
    # The other kernels fall back to single-position stock calls where their test
    # failed (exact, slower); a failed matmul kernel turns speculation off.
    if not result["qmv"].ok:
        reason = f"kernel-self-test-failed: {result['qmv'].reason}"
        return RuntimeStatus(False, reason, backend, result)
    if model is None:
        return RuntimeStatus(True, None, backend, result)
    check = self_check_verify(model.language_model)
    choice = choose_decode_path(model)
    if check.differing:
        reason = f"verify-self-check-failed: {check.summary()}"
        return RuntimeStatus(False, reason, backend, result, choice, check)
    return RuntimeStatus(True, None, backend, result, choice, check)


@dataclass
class VerifySelfCheck:
    """Verify rounds against decode steps on the pack's own weights, as bits."""

    blocks: int
    differing: int  # elements of logits, hidden states and post-rollback caches
    stock_differing: int  # the same for stock verify (the negative control)
    seconds: float
    first_difference: Optional[str] = None

    def summary(self) -> str:
        text = (
            f"exact verify self-check: {self.blocks} blocks, {self.differing} differing "
            f"(stock verify: {self.stock_differing} differing), {self.seconds:.1f} s"
        )
        return text + (f"; first: {self.first_difference}" if self.first_difference else "")


def _differing_bits(a: mx.array, b: mx.array) -> int:
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.size, b.size)
    bits = {2: mx.uint16, 4: mx.uint32}.get(a.dtype.size, mx.uint8)
    return int((a.view(bits) != b.view(bits)).sum().item())


def _cache_arrays(cache) -> list:
    """The state a cache carries forward: KV up to its offset, recurrent states."""
    arrays = []
    for layer in cache:
        if getattr(layer, "keys", None) is not None:
            arrays += [layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]]
        elif hasattr(layer, "cache"):
            arrays += [state for state in layer.cache if state is not None]
    return arrays


def self_check_verify(language_model, prompt=(1, 2, 3, 4), block=(11, 29, 7, 101, 55, 3, 88, 140)):
    """One verify round per block size 2..8 against single-token decode steps.

    Compares logits, the drafter's tap hidden states and, after committing half
    the block, every cache array, bit for bit. Stock verify runs the same checks
    as the negative control (on CPU it agrees; on GPUs it should not). Costs about
    three decode steps per block size.
    """
    import copy

    from mlx_vlm.speculative.cache_state import commit_speculative_round

    started = time.perf_counter()
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
        pairs += list(zip(_cache_arrays(trial), _cache_arrays(after[accepted + 1])))
        counts = [_differing_bits(a, b) for a, b in pairs]
        return sum(counts), counts

    exact_verifier = qwen3_5_language._EXACT_SPECULATIVE_VERIFIER
    stock_verifier = exact_verifier.__dflash2_stock__
    differing = stock_differing = 0
    first = None
    for length in range(2, len(block) + 1):
        count, counts = check(length, exact_verifier)
        if count and first is None:
            part = next(i for i, c in enumerate(counts) if c)
            first = f"block {length}, " + ("logits" if part == 0 else f"array {part}")
        differing += count
        stock_differing += check(length, stock_verifier)[0]
    return VerifySelfCheck(len(block) - 1, differing, stock_differing, time.perf_counter() - started, first)


def interleaved_ms(arms: dict, repeats: int = 5) -> dict:
    """Median, min and max ms of each arm, measured side by side.

    arms: name -> function that runs one sample and returns its ms. One warm-up
    pass first, then the arms interleaved (ABAB...) `repeats` times.
    """
    samples = {name: [] for name in arms}
    for repeat in range(repeats + 1):
        for name, sample in arms.items():
            ms = sample()
            if repeat:  # the first pass is the warm-up
                samples[name].append(ms)
    return {
        name: {"median": statistics.median(s), "min": min(s), "max": max(s)}
        for name, s in samples.items()
    }


def time_decode_steps(language_model, arms: dict, repeats: int = 5, steps: int = 3) -> dict:
    """interleaved_ms of plain decode steps under each arm (name -> set-up function)."""
    cache = language_model.make_cache()
    mx.eval(language_model(mx.array([[1, 2, 3, 4]]), cache=cache).logits)
    token = mx.array([[5]])

    def sample(set_up):
        def run():
            set_up()
            mx.eval(language_model(token, cache=cache).logits)  # graph and kernels warm
            start = time.perf_counter()
            for _ in range(steps):
                mx.eval(language_model(token, cache=cache).logits)
            return 1000 * (time.perf_counter() - start) / steps

        return run

    return interleaved_ms({name: sample(set_up) for name, set_up in arms.items()}, repeats)


def use_decode_arm(arm: str) -> None:
    """Switch plain decode's replacements to one of DECODE_ARMS."""
    global _decode_path
    _decode_path = DECODE_ARMS[arm]


def choose_decode_path(model) -> DecodePathChoice:
    """Give plain decode the replacements that make it fastest end to end here.

    Each arm is timed on this machine, interleaved after warm-up; the tokens are
    the same under every arm. Off CUDA no arm has a kernel to use, so decode
    stays MLX's own."""
    if dflash2_kernels.backend_name() != "cuda":
        use_decode_arm("mlx")
        return DecodePathChoice("mlx", "no decode kernel on this backend")
    arms = {arm: (lambda arm=arm: use_decode_arm(arm)) for arm in DECODE_ARMS}
    timings = time_decode_steps(model.language_model, arms)
    fastest = min(timings, key=lambda arm: timings[arm]["median"])
    use_decode_arm(fastest)
    return DecodePathChoice(fastest, "fastest median decode step of the arms", timings)


def configure_drafter(drafter, options: RuntimeOptions) -> None:
    """Apply the experiment options to a loaded drafter.

    The verify block never exceeds the drafter's trained block nor the kernel's
    8 rows, and the round policy chooses within that; a fixed block pins it, a
    cap bounds the choice.
    """
    trained = int(drafter.config.block_size)
    ceiling = min(trained, MAX_KERNEL_ROWS)
    for name, value in (("block size", options.block_size), ("block cap", options.block_cap)):
        if value is not None and not 2 <= value <= min(trained, MAX_KERNEL_ROWS):
            raise ValueError(f"{name} must be 2..{min(trained, MAX_KERNEL_ROWS)}, got {value}")
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
