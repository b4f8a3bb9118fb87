"""Plain decode's arms: the exact replacements a decode step can take, and the measured choice.

Each arm (DECODE_ARMS) puts a set of plain decode's mlx-vlm calls through dflash2_kernels'
fused launches or through the verify forward's own layer pieces at one position
(dflash2_verify); each is bitwise decode's own result. An arm serves only where its step
gives stock's bits here (decode_arm_differences), and the fastest of those serves
(choose_decode_path): the choice changes speed, never tokens.
"""

import contextlib
import copy
import threading
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35 import HadamardQuantizedLinear
from mlx_vlm.models.qwen3_5 import language as qwen3_5_language
from mlx_vlm.models.qwen3_5 import gated_delta as gated_delta_module

import dflash2_kernels
import dflash2_rounds
import dflash2_timing
from dflash2_verify import (
    CompiledLayers,
    _add_and_norm,
    _exact_linear_group,
    _packed_linear,
    _residual_layer_parts,
    _shared_rotation_block,
    gated_delta_positions,
    takes_compiled_step,
)


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


# mlx-vlm's own calls, taken at import: dflash2_runtime imports this module before it
# installs the replacements in their place.
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
    "rotation+recurrence+convolution+rope+residual+compiled":
        frozenset({"rotation", "recurrence", "convolution", "rope", "residual", "compiled"}),
    "rotation+recurrence+matmul": frozenset({"rotation", "recurrence", "matmul"}),
    # Every kernel, no trace: what fp32 rows (the real file's) can take, as the compiled step is fp16's.
    "rotation+recurrence+convolution+rope+residual+matmul":
        frozenset({"rotation", "recurrence", "convolution", "rope", "residual", "matmul"}),
    "rotation+recurrence+convolution+rope+residual+matmul+compiled":
        frozenset({"rotation", "recurrence", "convolution", "rope", "residual", "matmul", "compiled"}),
}
_decode_path: frozenset = frozenset()


def _hadamard_linear_call(self, x):
    """HadamardQuantizedLinear.__call__ with the rotation as one kernel (fp16 rows, and fp32
    rows where the CUDA fp32 rotation passed its self-test) and, for one row, optionally the
    exact matmul kernel (all bitwise stock's)."""
    if "rotation" not in _decode_path or x.dtype not in (mx.float16, mx.float32):
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
    """Qwen3_5GatedDeltaNet.__call__; with the convolution, decode's one unpadded fp16 or
    fp32 row runs the layer as verify does at one position (gated_delta_positions): fp16's
    window, convolution and silu in one launch instead of six (dflash2_kernels.conv_rows;
    fp32 convolution weights keep decode's nn.Conv1d), both gate projections in one
    (dense_rows), the gates, the q and k norms and the gated norm in fewer. Each kernel is
    bitwise decode's (its self-test), and choose_decode_path compares a step of the arm with
    stock's before it can serve."""
    if ("convolution" not in _decode_path or type(self) is not qwen3_5_language.Qwen3_5GatedDeltaNet
            or self.training or mask is not None or cache is None
            or inputs.shape[:2] != (1, 1) or inputs.dtype not in (mx.float16, mx.float32)):
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
    """Qwen3_5DecoderLayer.__call__; with the residual, decode's residual adds and the norm
    after each in one launch instead of two (_add_and_norm, the same bits); compiled, a
    GatedDeltaNet layer's step replayed from its trace (dflash2_verify.CompiledLayers). During a plain
    step the drafter's tap layers keep their outputs (dflash2_rounds.keep_tap_output)."""
    if "residual" not in _decode_path or type(self) is not qwen3_5_language.Qwen3_5DecoderLayer or x.shape[1] != 1:
        output = _stock_decoder_layer_call(self, x, mask, cache, position_ids, position_embeddings)
    elif "compiled" in _decode_path and _takes_compiled_step(self, x, mask, cache):
        output = _compiled_layers.run(self, x, cache)
    else:
        if self.is_linear:
            def mixer(normed):
                return self.linear_attn(normed, mask, cache)
        else:
            def mixer(normed):
                return self.self_attn(normed, mask=mask, cache=cache, position_ids=position_ids,
                                      position_embeddings=position_embeddings)
        output = _residual_layer(self, x, mixer)
    dflash2_rounds.keep_tap_output(self, output)
    return output


def _residual_layer(layer, x, mixer):
    """The residual arm's layer step: each residual add with the norm after it in one launch.
    The second add's norm is the next layer's input norm, so the sum this step returns to
    mlx-vlm's loop stays lazy: where the next step's x is that sum, it computes it again
    with its input norm in one launch (the same Add, the same bits) and never needs the
    returned array (evaluated only where something else holds it: a drafter tap, the model's
    final norm after the last layer, a compiled step)."""
    deferred, _deferred.sum = getattr(_deferred, "sum", None), None
    normed = None
    if deferred is not None and deferred[0] is x:
        x, normed = _add_and_norm(deferred[1], deferred[2], layer.input_layernorm)
    hidden, mlp_out = _residual_layer_parts(layer, x, mixer, _module_call, normed)
    output = hidden + mlp_out
    _deferred.sum = (output, hidden, mlp_out)
    return output


# The last residual step's (its output, the two terms that sum to it), for the next step;
# per thread, as each server thread runs its own model loop.
_deferred = threading.local()


def _takes_compiled_step(layer, x, mask, cache) -> bool:
    """Whether a decoder layer's step is the compiled one: what CompiledLayers serves, at a
    one-row step outside a speculative round (the convolution arm's one-row layer)."""
    return takes_compiled_step(layer, x, mask, cache) and not cache.is_speculating and x.shape[:2] == (1, 1)


def _module_call(module, x):
    return module(x)


# Plain decode's compiled GatedDeltaNet layer steps (the compiled arm), dropped at each switch of arm.
_compiled_layers = CompiledLayers(_module_call, _decode_linears, _module_call)


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


def pipelined_decode_steps(language_model, cache):
    """steps(count): `count` plain greedy decode steps on `cache` as generation runs them:
    each step's graph built and queued (async_eval) before the token of the step before is
    read, so host work that overlaps the GPU is not counted twice."""
    def steps(count):
        token, queued = mx.array([[7]]), None
        for _ in range(count):
            logits = language_model(token, cache=cache).logits[:, -1, :]
            following = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)[:, None]
            mx.async_eval(following)
            if queued is not None:
                queued.item()
            token = queued = following
        queued.item()

    return steps


def time_decode_steps(language_model, arms: dict, repeats: int = 5, steps: int = 3) -> dict:
    """interleaved_ms of plain decode steps under each arm (name -> set-up function),
    pipelined as generation runs them (pipelined_decode_steps)."""
    cache = language_model.make_cache()
    mx.eval(language_model(mx.array([[1, 2, 3, 4]]), cache=cache).logits)
    decode = pipelined_decode_steps(language_model, cache)

    def sample(set_up):
        def run():
            set_up()
            decode(1)  # graph and kernels warm
            start = time.perf_counter()
            decode(steps)
            return 1000 * (time.perf_counter() - start) / steps

        return run

    return dflash2_timing.interleaved_ms({name: sample(set_up) for name, set_up in arms.items()}, repeats)


def use_decode_arm(arm: str) -> None:
    """Switch plain decode's replacements to one of DECODE_ARMS."""
    global _decode_path
    _decode_path = DECODE_ARMS[arm]
    _compiled_layers.clear()


@contextlib.contextmanager
def decode_arm(arm: str):
    """Plain decode under another of DECODE_ARMS for a while (the verify self-check's steps
    take stock's), then the served arm again."""
    global _decode_path
    served = _decode_path
    use_decode_arm(arm)
    try:
        yield
    finally:
        _decode_path = served
        _compiled_layers.clear()


def decode_arm_differences(language_model, arms) -> dict:
    """Elements of one plain decode step, its logits and every cache array, that differ
    as bits from stock's (the "mlx" arm) under each arm, from the same prompt; an arm
    whose step raised maps to what it raised."""
    cache = language_model.make_cache()
    mx.eval(language_model(mx.array([[1, 2, 3, 4]]), cache=cache).logits)

    def step(arm):
        use_decode_arm(arm)
        trial = copy.deepcopy(cache)
        arrays = [language_model(mx.array([[5]]), cache=trial).logits, *dflash2_rounds.cache_arrays(trial)]
        mx.eval(arrays)
        return arrays

    with decode_arm("mlx"):  # the served arm again after
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
    return differing


def choose_decode_path(model, compiled: bool = True) -> DecodePathChoice:
    """Give plain decode the replacements that make it fastest end to end here.

    Each arm is timed on this machine, interleaved after warm-up, among the arms whose
    decode step gives stock's bits here (decode_arm_differences: the tokens are the same
    under every arm that serves). Off CUDA no arm has a kernel to use, so decode stays
    MLX's own. compiled False (a kernel self-test failed, so some layer op is stock's
    element-wise calls, which a trace may fuse): no compiled arm."""
    if dflash2_kernels.backend_name() != "cuda":
        use_decode_arm("mlx")
        return DecodePathChoice("mlx", "no decode kernel on this backend")
    candidates = [arm for arm, parts in DECODE_ARMS.items() if arm != "mlx" and (compiled or "compiled" not in parts)]
    differing = decode_arm_differences(model.language_model, candidates)
    arms = {arm: (lambda arm=arm: use_decode_arm(arm)) for arm in ["mlx", *candidates] if not differing.get(arm)}
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
