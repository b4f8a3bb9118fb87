"""Adds exact DFlash 2 speculative decoding to pinned mlx-vlm 0.7.2 at run time.

`install` puts REPLACEMENTS into mlx-vlm (the exact verify forward of dflash2_verify,
plain decode's arms of dflash2_decode_arms, the drafter's calls of dflash2_drafter, the
round policy) and proves them here: the kernels' self-tests, verify rounds against decode
steps on the pack's own weights (self_check_verify), plain decode's fastest arm among
those that give stock's bits. prefill_chunked builds the prefill scan the engine swaps
in. Every replaced or mirrored mlx-vlm function is in dflash2_audit's table: if its
source differs from the audited one, `install` refuses and names it.
"""

import copy
import dataclasses
import functools
import logging
import os
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
from mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35 import HadamardQuantizedLinear
from mlx_vlm.models.qwen3_5 import language as qwen3_5_language

import dflash2_audit
import dflash2_kernel_cache
import dflash2_kernels
import dflash2_pack
import dflash2_rounds
import dflash2_timing
from dflash2_audit import _with_globals
from dflash2_decode_arms import (
    DecodePathChoice,
    _decoder_layer_call,
    _differing_bits,
    _gated_delta_net_call,
    _gated_delta_ops_call,
    _hadamard_linear_call,
    _mlp_call,
    _rotary_call,
    choose_decode_path,
    decode_arm,
    use_decode_arm,
)
from dflash2_drafter import (_draft_hidden_bf16, _drafter_attention_call, _embed_input_tokens_bf16,
                             grouped_dynamic_convolve)
from dflash2_verdicts import VerdictCache
from dflash2_verify import ExactVerifier, exact_verify_greedy

logger = logging.getLogger("dflash2.runtime")


@dataclass
class RuntimeStatus:
    speculative: bool
    reason: Optional[str]
    backend: str
    self_test: dict = field(default_factory=dict)  # kernel name -> SelfTestResult
    decode_path: Optional[DecodePathChoice] = None
    verify_check: Optional["VerifySelfCheck"] = None
    seconds: dict = field(default_factory=dict)  # start-up check -> wall seconds it took
    verify_path: Optional["VerifyPathChoice"] = None

    def log_lines(self) -> list[str]:
        """What start-up logs: kernels, the verify self-check, plain decode's and verify's paths."""
        lines = [
            "kernel self-tests: "
            + ", ".join(f"{name} {'ok' if r.ok else 'FAILED'}" + (f" ({r.reason})" if r.reason else "")
                        + (f" {r.seconds:.1f} s" if r.seconds else "") for name, r in self.self_test.items())
        ]
        if self.verify_check is not None:
            lines.append(self.verify_check.summary())
        if self.decode_path is not None:
            timings = _fastest_samples(self.decode_path.step_ms)
            lines.append(f"plain decode path: {self.decode_path.arm} ({self.decode_path.why}"
                         + (f"; fastest step: {timings}" if timings else "") + ")")
        if self.verify_path is not None:
            lines.append(self.verify_path.summary())
        if self.seconds:
            lines.append("start-up checks took: " + ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items()))
        if self.backend == "cuda":
            lines.append(dflash2_kernel_cache.summary())
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
            "verify_path": None if self.verify_path is None else dataclasses.asdict(self.verify_path),
            "plain_decode_path": None if self.decode_path is None else {
                "arm": self.decode_path.arm, "why": self.decode_path.why,
                "step_ms": self.decode_path.step_ms,
            },
            "seconds": {name: round(s, 2) for name, s in self.seconds.items()},
        }


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
    "mlx_vlm.speculative.drafters.dflash2.dflash2:_grouped_dynamic_convolve": grouped_dynamic_convolve,
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
    replacements (choose_decode_path) and the verify forward's path (choose_verify_path) by
    measurement. verdicts: an opened VerdictCache whose cached kernel, decode path and verify
    path verdicts serve instead (the verify self-check runs always, on the path served).
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
    # failed (exact, slower); a failed matmul kernel (the pack's rows': fp32's qmv32 in an
    # fp32 pack, which tests no fp16 kernel) turns speculation off.
    matmul = result.get("qmv", result.get("qmv32"))
    if matmul is not None and not matmul.ok:
        reason = f"kernel-self-test-failed: {matmul.reason}"
        return RuntimeStatus(False, reason, backend, result, seconds=seconds)
    if model is None:
        return RuntimeStatus(True, None, backend, result, seconds=seconds)
    # Compiled layer steps only where no kernel fell back to stock's element-wise calls.
    kernels_serve = all(r.ok for r in result.values())
    choice = verdicts.check("plain decode path", lambda: choose_decode_path(model, kernels_serve),
                            DecodePathChoice.from_json)
    use_decode_arm(choice.arm)
    lm, verifier = model.language_model, qwen3_5_language._EXACT_SPECULATIVE_VERIFIER
    verify_path = verdicts.check("verify path", lambda: choose_verify_path(lm, kernels_serve),
                                 VerifyPathChoice.from_json)
    verifier.use_compiled_layers(verify_path.compiled)
    # The verify path served, against stock decode steps, at every start (on the rounds'
    # stream: its compiled traces are the ones served).
    check = verdicts.check("verify self-check", lambda: self_check_verify(lm))
    if check.differing and verify_path.compiled:  # a cached choice this start disproves
        verify_path = VerifyPathChoice(False, f"the compiled forward's self-check at this start: {check.summary()}")
        verifier.use_compiled_layers(False)
        check = self_check_verify(lm)
    reason = f"verify-self-check-failed: {check.summary()}" if check.differing else None
    return RuntimeStatus(reason is None, reason, backend, result, choice, check, verdicts.measured_seconds(),
                         verify_path)


def _fastest_samples(timings: dict) -> str:
    """'arm MIN ms (median MEDIAN), ...' of interleaved_ms timings by arm."""
    return ", ".join(f"{arm} {t['min']:.2f} ms (median {t['median']:.2f})" for arm, t in timings.items())


@dataclass
class VerifyPathChoice:
    """Whether verify's GatedDeltaNet layers run compiled (dflash2_verify.CompiledLayers), and why."""

    compiled: bool
    why: str
    forward_ms: dict = field(default_factory=dict)  # "built" / "compiled" -> {"median", "min", "max"}

    @classmethod
    def from_json(cls, data: dict) -> "VerifyPathChoice":
        """A cached choice (dataclasses.asdict's); ValueError for one of another form."""
        choice = cls(**data)
        if not isinstance(choice.compiled, bool):
            raise ValueError(f"compiled is {choice.compiled!r}")
        return choice

    def summary(self) -> str:
        timings = _fastest_samples(self.forward_ms)
        return (f"verify path: {'compiled' if self.compiled else 'built at every round'} ({self.why}"
                + (f"; fastest block-8 forward: {timings}" if timings else "") + ")")


def choose_verify_path(language_model, kernels_serve: bool = True) -> VerifyPathChoice:
    """Compiled where that gives decode's bits here (the verify self-check, run with it) and
    its block-8 verify forward is faster, timed interleaved beside the forward built at every
    round; on CUDA only, with every kernel serving (CPU builds the kernels from element-wise
    ops, as a kernel that failed its self-test falls back to them, and a trace fuses those)."""
    if dflash2_kernels.backend_name() != "cuda":
        return VerifyPathChoice(False, "compiled only on CUDA")
    if not kernels_serve:
        return VerifyPathChoice(False, "a kernel self-test failed: some layer op is stock's element-wise calls")
    verifier = qwen3_5_language._EXACT_SPECULATIVE_VERIFIER
    try:
        verifier.use_compiled_layers(True)
        check = self_check_verify(language_model)
        if check.differing:
            return VerifyPathChoice(False, f"the compiled forward's self-check: {check.differing} differing")
        timings = time_verify_forwards(language_model, {"built": lambda: verifier.use_compiled_layers(False),
                                                        "compiled": lambda: verifier.use_compiled_layers(True)})
    except Exception as error:  # a trace that fails, say: verify stays built at every round
        return VerifyPathChoice(False, f"the compiled forward raised {type(error).__name__}: {error}")
    finally:
        verifier.use_compiled_layers(False)
    compiled = timings["compiled"]["min"] < timings["built"]["min"]  # by the fastest sample: see choose_decode_path
    return VerifyPathChoice(compiled, "the faster block-8 verify forward (fastest of 5 interleaved samples), "
                            "the compiled one's self-check 0 differing", timings)


def _check_taps(language_model) -> list:
    """The layers whose hidden states the start-up checks take, as a drafter's taps: the
    first, the middle and the last."""
    layers = language_model.model.layers
    return sorted({0, len(layers) // 2, len(layers) - 1})


def time_verify_forwards(language_model, arms: dict, block: int = 8, forwards: int = 3) -> dict:
    """dflash2_timing.interleaved_ms of exact verify forwards of `block` positions (greedy
    tokens included, each round aborted so the cache stays) under each arm (name -> set-up)."""
    from mlx_vlm.speculative import dflash as rounds
    from mlx_vlm.speculative.cache_state import abort_speculative_round

    taps = _check_taps(language_model)
    cache = language_model.make_cache()
    mx.eval(language_model(mx.array([[1, 2, 3, 4]]), cache=cache).logits)
    tokens = mx.array([[11 + i for i in range(block)]])

    def forward():
        hidden, transaction, chosen = rounds._dflash_verify_greedy(
            language_model, tokens, cache, taps, lambda logits: mx.argmax(logits, axis=-1))
        mx.eval(chosen, hidden)
        abort_speculative_round(transaction)

    def sample(set_up):
        def run():
            set_up()
            with mx.stream(dflash2_rounds.generation_stream):  # as rounds run
                forward()  # traced and warm
                started = time.perf_counter()
                for _ in range(forwards):
                    forward()
            return 1000 * (time.perf_counter() - started) / forwards
        return run

    return dflash2_timing.interleaved_ms({name: sample(set_up) for name, set_up in arms.items()}, repeats=5)


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
    # On the rounds' stream: the compiled traces a check makes there are the ones served
    # (MLX keeps a trace per stream).
    with mx.stream(dflash2_rounds.generation_stream):
        started = time.perf_counter()
        seconds = {}
        taps = _check_taps(language_model)
        cache = language_model.make_cache()
        mx.eval(language_model(mx.array([list(prompt)]), cache=cache).logits)
        start = copy.deepcopy(cache)
        steps, after = [], [copy.deepcopy(cache)]
        with decode_arm("mlx"):  # stock's steps, whichever arm serves
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
