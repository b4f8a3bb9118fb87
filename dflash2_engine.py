"""Runs mlx-vlm's server engine on the pack: the target (and drafter) loaded on its worker
thread, one sequence at a time, each request on the route its record carries.

Its ResponseGenerator is dflash2_generator's; it swaps two of mlx_vlm.server's functions and,
on every route, one function of the GatedDeltaNet prefill (same bits, fewer copies) and
plain generation's step (a request's first token handed out before its second step is built);
dflash2_audit lists each with its audited source, checked before any weight loads.
The drafter's start-up is dflash2_speculation's.
"""

import json
import logging
import sys
import time
import weakref
from pathlib import Path

import dflash2_audit
from dflash2_record import RequestRecord, current_request
from dflash2_speculation import DrafterSetup

logger = logging.getLogger("dflash2.server")


def use_exact_prefill_inverse(gdn_heads: int = 48, prefill_step: int = 2048) -> str:
    """Swaps in the fastest of dflash2_kernels.inverse_candidates() (the prefill's inverse
    with fewer GPU launches) that its start-up check finds bitwise mlx-vlm's here, on every
    route; if none is, keeps mlx-vlm's. On CUDA the one-launch inverse is first calibrated
    for the pack's GatedDeltaNet value heads and each chunk count of a prefill step (a
    prompt's last step may be any of them). Returns the log line."""
    import dflash2_kernels
    import dflash2_runtime

    started = time.perf_counter()
    failed, calibration = [], ""
    chunk_counts = -(-prefill_step // 64)
    if dflash2_kernels.backend_name() == "cuda":
        try:
            calibration = dflash2_kernels.calibrate_fused_inverse(gdn_heads, chunk_counts)
        except Exception as error:  # e.g. a kernel that does not build here
            failed.append(f"the fused one failed: {error}")
    for name, inverse in dflash2_kernels.inverse_candidates():
        try:  # at a chunk count a prefill step has (the fused one's plans are per count)
            differing = dflash2_kernels.self_test_inverse(gdn_heads, min(2, chunk_counts), kernel=inverse)
        except Exception as error:  # e.g. a kernel that does not build here
            failed.append(f"the {name} one failed: {error}")
            continue
        if differing:
            failed.append(f"the {name} one differed from it here in {differing} elements")
            continue
        dflash2_audit.replace(dflash2_runtime.PREFILL_CHUNKED_TARGET, dflash2_runtime.prefill_chunked(inverse))
        return (f"prefill inverse: {name}, bitwise mlx-vlm's at start-up"
                + (f" ({calibration})" if calibration else "")
                + "".join(f" ({reason})" for reason in failed)
                + f" ({time.perf_counter() - started:.1f} s)")
    return f"prefill inverse: mlx-vlm's ({'; '.join(failed)}), {time.perf_counter() - started:.1f} s"


# ---------------------------------------------------------------------------
# Plain generation hands out a request's first token before building its second step


# A batch's step that first_tokens_first_step held back: the batch's token counts when its
# prompts finished, until the step runs. Weakly keyed, so an entry goes with its batch.
_held_first_steps = weakref.WeakKeyDictionary()


def first_tokens_first_step(self):
    """mlx-vlm's GenerationBatch._step, except that a batch's first call after its prompts
    finished hands out their first tokens at once; the stock step that would have built the
    next forward before reading them runs at the next call (or before the batch changes:
    first_tokens_first_pending_state), then stock goes on. Stock builds and queues the second
    forward before it reads the first token, while the GPU has nothing else queued: each
    request's first token waits for a decode step's graph build and encode (at the 27B shape
    on the H200, most of a short prompt's wait beyond its prefill; the speculative route hands
    its first token out at once). The
    same forwards run on the same tokens with the same sampling positions. Only where that
    holds whatever runs in between: greedy batches and samplers keyed by position (the
    server's default; one that draws from MLX's global key would draw in another order if a
    new prompt sampled between), and not with forced-token criteria (thinking budgets:
    next() lets them rewrite the token after the one it hands out)."""
    import mlx.core as mx

    stock = first_tokens_first_step.__dflash2_stock__
    keyed_by_position = self.greedy_sampling or callable(getattr(self.sampler, "sample_target", None))
    if (self._current_tokens is None and self not in _held_first_steps and keyed_by_position
            and not any(criteria is not None for criteria in self.thinking_budget_criteria or [])):
        # No step ran since the prompts: their tokens are next. The held step samples at the
        # positions it would have had (next() counts the handed-out token before it runs).
        _held_first_steps[self] = list(self._num_tokens)
        lps = self._next_lps
        top_idx, top_lp = (self._next_top_idx, self._next_top_lp) if lps is not None else (None, None)
        mx.eval([a for a in (self._next_tokens, lps, top_idx, top_lp) if a is not None])
        return (self._next_tokens.tolist(), None if lps is None else lps.tolist(),
                None if top_idx is None else top_idx.tolist(), None if top_idx is None else top_lp.tolist())
    first_tokens_first_pending_state(self, evaluate=False)
    return stock(self)


def first_tokens_first_pending_state(self, evaluate=True):
    """mlx-vlm's GenerationBatch._eval_pending_state (extend and filter call it before they
    change the batch's rows), after the step first_tokens_first_step held back, if any."""
    counts = _held_first_steps.pop(self, None)
    if counts is not None:
        handed_out, self._num_tokens = self._num_tokens, counts
        try:
            first_tokens_first_step.__dflash2_stock__(self)  # what it returns was handed out
        finally:
            self._num_tokens = handed_out
    if evaluate:
        first_tokens_first_pending_state.__dflash2_stock__(self)


def use_first_tokens_first() -> None:
    """Plain generation hands out each request's first token at once, on every route."""
    dflash2_audit.replace("mlx_vlm.generate.ar:GenerationBatch._step", first_tokens_first_step)
    dflash2_audit.replace("mlx_vlm.generate.ar:GenerationBatch._eval_pending_state", first_tokens_first_pending_state)


def start_engine(target_dir: Path, model_id: str, context_length: int, *, prefill_step_size=None,
                 top_logprobs_k=None, drafter: DrafterSetup = None, prefix_cache_gb=None):
    """Checks the audited mlx-vlm sources, loads the target (and with a DrafterSetup, the
    drafter: generator.speculation says how that went) in mlx-vlm's worker thread and wires
    mlx-vlm's server to it. Returns (generator, mlx-vlm's FastAPI app).

    Every route prefills through dflash2_prefix_cache's prompt batch: with prefix_cache_gb,
    through its exact prefix cache with that budget; either way a sliding drafter's prompt
    keeps only the taps it reads.

    A request whose prompt plus max_tokens exceeds context_length is refused after its
    prompt is tokenized, before it reaches the worker (a stream: before it opens).

    A drafter is used only for requests routed speculative: stock mlx-vlm sends every
    request through a loaded drafter, sampling ones included.
    """
    import mlx_vlm.server as server
    from fastapi import HTTPException
    from mlx_vlm.server.generation import get_prefill_step_size
    from mlx_vlm.vision_cache import VisionFeatureCache

    from dflash2_generator import PackGenerator

    try:  # before any weight loads: the overrides below are audited there too
        dflash2_audit.check_sources()
    except dflash2_audit.SourceMismatch as mismatch:
        sys.exit(f"error: {mismatch}")
    app_module = sys.modules["mlx_vlm.server.app"]  # mlx_vlm.server.app is the FastAPI object
    text_config = json.loads((target_dir / "config.json").read_text())["text_config"]
    logger.info(use_exact_prefill_inverse(text_config["linear_num_value_heads"],
                                          prefill_step_size or get_prefill_step_size()))
    use_first_tokens_first()
    import dflash2_prefix_cache  # its prompt batch also drops the taps a sliding drafter never reads

    store = dflash2_prefix_cache.PrefixStore(prefix_cache_gb) if prefix_cache_gb else None
    dflash2_prefix_cache.PrefixPromptBatch.store = store
    dflash2_audit.replace("mlx_vlm.generate:PromptProcessingBatch", dflash2_prefix_cache.PrefixPromptBatch)

    vision_cache = VisionFeatureCache(max_size=20)
    generator = PackGenerator(
        drafter,
        model_path=str(target_dir),
        vision_cache=vision_cache,
        top_logprobs_k=top_logprobs_k or 0,
        prefill_step_size=prefill_step_size,
    )
    model, processor, config = generator.wait_until_ready()
    if prefix_cache_gb:
        logger.info("exact prefix cache: %g GB, snapshots at multiples of %d prompt tokens",
                    prefix_cache_gb, generator.prefill_step_size)
    # mlx-vlm's context budget: its loader, which also reads it, has run; from here on
    # only its prompt checks do.
    server.runtime.config.max_kv_size = context_length
    server.runtime.response_generator = generator
    server.runtime.model_cache.set("text_generation", {
        "model_path": model_id, "adapter_path": None, "model": model, "processor": processor,
        "config": config, "vision_cache": vision_cache, "model_kind": "text_generation",
        "response_generator": generator,
    })

    def get_cached_model(model_path, adapter_path=None, *, model_kind="auto"):
        # Replaces mlx-vlm's loader: a request's model field can never load a path.
        if model_path != model_id or model_kind not in ("auto", "text_generation"):
            raise HTTPException(status_code=404, detail=f"model {model_path!r} is not served here")
        return model, processor, config

    def apply_chat_template(*args, **kwargs):
        # A template that cannot render the client's messages is the client's mistake.
        try:
            return apply_chat_template.__dflash2_stock__(*args, **kwargs)
        except Exception as exc:
            raise HTTPException(status_code=400,
                                detail=f"the chat template could not render these messages: {exc}")

    dflash2_audit.replace("mlx_vlm.server.app:get_cached_model", get_cached_model)
    server.get_cached_model = get_cached_model  # the package re-exports app's function
    dflash2_audit.replace("mlx_vlm.server:apply_chat_template", apply_chat_template)
    return generator, app_module.app


def warm_up(generator, route):
    """One short generation on a route, so compilation is paid before the first request."""
    import mlx.core as mx
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.server.generation import GenerationArguments

    prompt = apply_chat_template(generator.processor, generator.config,
                                 [{"role": "user", "content": "Hello"}])
    record = RequestRecord(0, "WARM-UP", route, mode=route, speculative=route == "speculative", announced=True)
    token = current_request.set(record)
    started = time.perf_counter()
    try:
        _, tokens = generator.generate(prompt, args=GenerationArguments(max_tokens=4, temperature=0.0))
        for _ in tokens:
            pass
    finally:
        current_request.reset(token)
    state = generator.speculation.state
    memory = state and state.acceptance_memory
    if memory is not None:  # a warm-up's rounds say nothing of the requests to come
        memory.forget()
    # The generator resets MLX's peak as it admits a request: this is the warm-up's own.
    logger.info("warm-up %s: %d tokens in %.2fs; memory in use %.3f GB, its peak %.3f GB", route, record.tokens,
                time.perf_counter() - started, mx.get_active_memory() / 1e9, mx.get_peak_memory() / 1e9)
