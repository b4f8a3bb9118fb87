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
from dataclasses import dataclass
from typing import Optional

# Exact verify runs each position as its own small graph; at the 27B layer count
# MLX's CUDA graph cache (400 entries) thrashes and raises. Read at first use.
os.environ.setdefault("MLX_CUDA_GRAPH_CACHE_SIZE", "4096")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx_vlm  # noqa: E402
from mlx_vlm.models.base import scaled_dot_product_attention
from mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35 import (
    HadamardQuantizedLinear,
    hadamard_transform,
)
from mlx_vlm.models.qwen3_5 import language as qwen3_5_language
from mlx_vlm.models.qwen3_5.gated_delta import (
    _compute_g_beta,
    _gated_delta_step_ops,
    gated_delta_update,
)
from mlx_vlm.models.qwen3_5.speculative_verifier import Qwen3_5BatchInvariantForward
from mlx_vlm.speculative import dflash as dflash_rounds
from mlx_vlm.speculative.cache_state import abort_speculative_round
from mlx_vlm.speculative.drafters.dflash2.dflash2 import DFlash2DraftModel
from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashDraftModel
from mlx_vlm.speculative.ops.linear import _target_verify_singletons

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
class RuntimeStatus:
    speculative: bool
    reason: Optional[str]
    backend: str
    self_test: Optional[dflash2_kernels.SelfTestResult] = None


# ---------------------------------------------------------------------------
# Exact verify forward


def _packed_linear(linear: HadamardQuantizedLinear, x: mx.array) -> mx.array:
    """The packed linear of decode, for many rows, bit for bit per row."""
    if linear.block:
        x = hadamard_transform(x, linear.block, linear.signs)
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


def _hadamard_linear_call(self, x):
    """HadamardQuantizedLinear.__call__ with the one-row decode matmul on the exact kernel.

    For one row the kernel equals MLX's single-row kernel bit for bit (the
    self-test proves it at the pack's shapes), and on CUDA reads the weights
    faster, so plain decode speeds up with no token changed. Multi-row calls
    (prefill) keep MLX's own dispatch, whose arithmetic changes with the row count.
    """
    if x.dtype != mx.float16 or x.size != x.shape[-1]:
        return _stock_hadamard_linear_call(self, x)
    return _packed_linear(self, x)


def _one_position(sequence: mx.array, index: int) -> mx.array:
    return sequence[:, index : index + 1]


def _decode_recurrence(layer, q, k, v, a, b, state):
    """Yield (output, state) per position, computed as decode computes one token.

    Off Metal, decode's gated_delta_update(T=1) computes the gates, repeats the
    key heads and runs one compiled _gated_delta_step_ops; the gates and the head
    repeat are element-wise, so they are computed once for all positions here and
    only the recurrence runs position by position. On Metal decode runs a fused
    kernel, so each position calls gated_delta_update itself.
    """
    length = q.shape[1]
    use_kernel = not layer.training
    if use_kernel and mx.default_device() == mx.gpu and mx.metal.is_available():
        for index in range(length):
            output, state = gated_delta_update(
                *(_one_position(value, index) for value in (q, k, v, a, b)),
                layer.A_log,
                layer.dt_bias,
                state=state,
                use_kernel=use_kernel,
            )
            yield output, state
        return
    g, beta = _compute_g_beta(layer.A_log, a, b, layer.dt_bias)
    if state is None:
        batch, _, _, key_width = q.shape
        state = mx.zeros((batch, *v.shape[2:], key_width), dtype=mx.float32)
    if (repeat := v.shape[-2] // q.shape[-2]) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    for index in range(length):
        output, state = _gated_delta_step_ops(
            q[:, index], k[:, index], v[:, index], g[:, index], beta[:, index], state
        )
        yield output[:, None], state


def _unpadded_single_row(cache, batch: int) -> bool:
    left_padding = getattr(cache, "left_padding", None)
    return batch == 1 and (left_padding is None or int(mx.max(left_padding).item()) <= 0)


class ExactVerifier(Qwen3_5BatchInvariantForward):
    """Qwen3.5 verify forward whose every position equals a decode step."""

    def _linear(self, linear, x):
        if isinstance(linear, HadamardQuantizedLinear):
            return _packed_linear(linear, x)
        # Dense fp16 linears (GDN in_proj_a / in_proj_b): a one-row matmul per
        # position, as decode runs them.
        return _target_verify_singletons(linear, x)

    def _linears(self, linears, x):
        return tuple(self._linear(linear, x) for linear in linears)

    def _embedding_as_linear(self, embedding, x):
        return _packed_linear(embedding, x)

    def _attention(self, attention, x, mask, cache, position_ids, position_embeddings):
        batch, length, _ = x.shape
        if not (mask is None or isinstance(mask, str) and mask == "causal"):
            # The server's one-row batch cache brings an explicit causal mask;
            # without left padding, decode of that row uses no mask at all.
            if not (isinstance(mask, mx.array) and _unpadded_single_row(cache, batch)):
                raise ExactnessError("padded or batched attention is not verified exactly")
        queries, keys, values = self._linears(
            (attention.q_proj, attention.k_proj, attention.v_proj), x
        )
        outputs, gates = [], []
        for index in range(length):
            step_position_ids = (
                None if position_ids is None else position_ids[..., index : index + 1]
            )
            # Decode computes rotary tables from its own single position, in the
            # dtype of the model's input embeddings (the tables' dtype here).
            step_embeddings = (
                None
                if position_embeddings is None
                else attention.rotary_emb(position_embeddings[0], step_position_ids)
            )
            step_q, step_k, step_v, gate, _ = attention._prepare_projected_qkv(
                _one_position(queries, index),
                _one_position(keys, index),
                _one_position(values, index),
                cache,
                step_position_ids,
                step_embeddings,
                None,
            )
            output = scaled_dot_product_attention(
                step_q, step_k, step_v, cache=cache, scale=attention.scale, mask=None
            )
            outputs.append(output.transpose(0, 2, 1, 3).reshape(batch, 1, -1))
            gates.append(gate)
        output = mx.concatenate(outputs, axis=1)
        gate = mx.concatenate(gates, axis=1)
        return self._linear(attention.o_proj, output * mx.sigmoid(gate))

    def _gated_delta(self, layer, inputs, mask, cache):
        if mask is not None or cache is None:
            raise ExactnessError("padded or cache-less GatedDeltaNet verify is not exact")
        helpers = self._helpers()
        batch, length, _ = inputs.shape
        mixed_qkv, z, b, a = self._linears(
            (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a),
            inputs,
        )
        z = z.reshape(batch, length, -1, layer.head_v_dim)
        conv_state = cache[0]
        if conv_state is None or conv_state.shape[0] != batch:
            conv_state = mx.zeros(
                (batch, layer.conv_kernel_size - 1, layer.conv_dim), dtype=inputs.dtype
            )

        convolved = []
        for index in range(length):
            # Convolution window: as Qwen3_5GatedDeltaNet.__call__ at S == 1; the
            # cache records each window for rollback.
            conv_input = mx.concatenate(
                [conv_state, _one_position(mixed_qkv, index)], axis=1
            )
            conv_state = cache.update_window(
                0, conv_input, layer.conv_kernel_size - 1, lengths=cache.lengths
            )
            convolved.append(
                layer._causal_conv1d_decode(conv_input)
                if layer.conv1d.weight.dtype in (mx.bfloat16, mx.float16)
                else layer.conv1d(conv_input)
            )
        conv_out = nn.silu(mx.concatenate(convolved, axis=1))
        # Row-wise from here (silu, norms, gates): one call covers every position.
        q, k, v = [
            value.reshape(batch, length, heads, width)
            for value, heads, width in zip(
                mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
                [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
                [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
            )
        ]
        q, k = layer._normalize_qk(q, k)
        initial = cache[1]
        if initial is not None and initial.shape[0] != batch:
            initial = None
        outputs = []
        for output, state in _decode_recurrence(layer, q, k, v, a, b, initial):
            # Each position's state is recorded so rollback can keep any prefix.
            cache.record_speculative_states(1, None, state)
            cache[1] = state
            cache.advance(1)
            helpers._qwen3_5_advance_left_padding_info(cache, 1)
            helpers._qwen3_5_advance_lengths_info(cache, 1)
            outputs.append(output)

        output = layer.norm(mx.concatenate(outputs, axis=1), z)
        return self._linear(layer.out_proj, output.reshape(batch, length, -1))


def greedy_tokens_like_decode(logits: mx.array) -> mx.array:
    """Greedy tokens for each verify position, chosen as plain decode chooses.

    Plain decode takes the argmax of fp16 `logits - logsumexp(logits)` of one
    position (generate/ar.py); on near-ties that can differ from the argmax of
    the raw logits, which stock verify uses.
    """
    tokens = []
    for index in range(logits.shape[1]):
        row = logits[:, index, :]
        logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
        tokens.append(mx.argmax(logprobs, axis=-1))
    return mx.stack(tokens, axis=1)


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
        "Mirrored off Metal: gates and head repeat for all positions, then one step each.",
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


def packed_shapes(model) -> list[tuple[int, int]]:
    """(N, K) of every packed 2-bit matrix in the target, for the self-test."""
    shapes = {
        (module.weight.shape[0], module.weight.shape[1] * 16)
        for _, module in model.language_model.named_modules()
        if isinstance(module, HadamardQuantizedLinear)
    }
    return sorted(shapes)


def install(model=None) -> RuntimeStatus:
    """Check versions and fingerprints, patch mlx-vlm, self-test the kernel.

    Raises RuntimeMismatch if anything differs from the audited sources. A
    failed kernel self-test does not raise: speculation is reported off, with
    the reason, and the caller serves plain.
    """
    apply_patches()
    backend = dflash2_kernels.backend_name()
    shapes = packed_shapes(model) if model is not None else None
    result = dflash2_kernels.self_test(shapes=shapes)
    if not result.ok:
        return RuntimeStatus(False, f"kernel-self-test-failed: {result.reason}", backend, result)
    return RuntimeStatus(True, None, backend, result)


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
