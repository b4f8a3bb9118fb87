"""The mlx-vlm sources the pack replaces or relies on, with their audited sha256, and the check
that the installed ones are those.

REPLACED: what the pack installs its own version of (runtime patches, the engine's overrides
and swaps); AUDITED: what it calls, mirrors or subclasses unchanged. Either kind, changed,
could make the pack serve something other than plain decoding's answer, so both servers
refuse to start and name every difference (on the audited install, found from the files'
text and each object's place in it, without re-reading each source). Importing this
module patches nothing.
"""

import hashlib
import importlib
import inspect
import json
import linecache
import os
import types
from dataclasses import dataclass
from pathlib import Path

MLX_VERSION = "0.32.2"
MLX_VLM_VERSION = "0.7.2"


class SourceMismatch(RuntimeError):
    """The installed mlx / mlx-vlm is not the audited one; nothing was replaced."""


@dataclass(frozen=True)
class Audited:
    target: str  # "module:qualname"
    sha256: str  # of its source (an object's: of its class's source)
    why: str


REPLACED = (
    Audited(
        "mlx_vlm.models.qwen3_5.language:_EXACT_SPECULATIVE_VERIFIER",
        "2fdf1228267e54774c9529ea04b390bfd220ea42ad22f49dbd0e7ca38f8bb1b5",
        "The verify forward: batched quantized matmuls, batched dense GDN gates, L==2 batched "
        "attention, full-block convolution and the with-states recurrence all round differently "
        "from decode on GPUs. Its class, Qwen3_5BatchInvariantForward, is ExactVerifier's base "
        "(model and head plumbing kept from stock; its _layer mirrored with the residual add and "
        "the norm after it in one launch; each layer's output is handed to the "
        "device every VERIFY_EVAL_EVERY layers). Its quantized_linear also serves the "
        "drafter's greedy head (speculative_argmax_from_hidden) over a draft's rows in one call.",
    ),
    Audited(
        "mlx_vlm.speculative.dflash:_dflash_verify_greedy",
        "1b472dc300554ab6017495bdeb18480be431578aa6958ff7b35c0145e8412971",
        "Stock greedy verify takes argmax of raw logits; decode takes it of fp16 logprobs. The "
        "policy's rounds call it by this name.",
    ),
    Audited(
        "mlx_vlm.speculative.drafters.dflash2.dflash2:DFlash2DraftModel._hidden",
        "e01ca795d8183f747210f41ee0e30810c99eb447c7b268186898ac14f289caa0",
        "Where start-up timing finds it faster (choose_drafter_dtype), run the drafter in bf16 "
        "and return the target's dtype to its head.",
    ),
    Audited(
        "mlx_vlm.speculative.drafters.qwen3_dflash.dflash:DFlashAttention.__call__",
        "7eaabc86f5be71f93d2c7ae79cfd3baaaa2f812885119a737c5619d9602c073d",
        "Its own code runs with its fused attention call routed through "
        "dflash2_drafter.drafter_attention: on CUDA a bf16 drafter's attention would go to "
        "cuDNN, which builds a graph for every new key length. The sliding-window option "
        "relies on it trimming the drafter's context to its window and advancing the cache's "
        "offset past what it skips, as RequestDecoder does for taps the prefill dropped.",
    ),
    Audited(
        "mlx_vlm.speculative.drafters.dflash2.dflash2:_grouped_dynamic_convolve",
        "66150dd5c65d6c3e2fe7322ca96bee08c525ae7c00f0a66c8a8c6504d1171259",
        "The drafter's grouped dynamic causal convolution, the same ops in the same order, its "
        "taps' element-wise ops compiled into one launch after one zero padding (mlx-vlm's: "
        "about 13 launches a call, four calls a drafter layer, each costing the host). Only "
        "proposals depend on it.",
    ),
    Audited(
        "mlx_vlm.speculative.drafters.dflash2.dflash2:DFlash2DraftModel._embed_input_tokens",
        "46d8b30d7519be85a0e2c3323ce7667008b85e4a2f85187216afd97bcd2e6542",
        "Where the drafter runs in bf16, the target's fp16 embeddings enter it as bf16.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.gated_delta:gated_delta_ops",
        "9751b1354ae88830f815b23c3a2ed4ec3a5154ccbbb2bbaa400f407efdd0540a",
        "Decode's single recurrence step on the recurrence kernel where measured faster (same "
        "bits: the kernel reproduces its head repeat and compiled step).",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5GatedDeltaNet.__call__",
        "0ab0be71156568f50a248f898d431b657b36b399166e29e25c16c7a45f6cc81b",
        "Decode's step, where measured faster (the convolution arm), for one unpadded row: "
        "the layer as verify runs it at one position (dflash2_verify.gated_delta_positions), "
        "its concatenated window, convolution and silu in one kernel launch, both gates in "
        "one and its gated output norm in one; every other call runs it as is. Mirrored per "
        "verify position.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:apply_multimodal_rotary_pos_emb",
        "b4de4f82007876e50d49827fc649864ec17606b719801262357e17d475c581bf",
        "Decode's rotary of queries and keys, where measured faster (the rope arm), in one "
        "kernel launch instead of twelve (dflash2_kernels.rope_rows, the same bits); verify "
        "runs it for all positions through its own copy of _prepare_projected_qkv.",
    ),
    Audited(
        "mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35:HadamardQuantizedLinear.__call__",
        "3303ee4843ce5fe54d9668368360cb8a01e90acce70773658cfc0bf0b7b642d4",
        "Decode's one-row packed matmul on the faster exact kernel (same bits), and mirrored "
        "for many rows in verify.",
    ),
    Audited(
        "mlx_vlm.speculative.utils:_dflash_rounds",
        "eee8dc9ab95a74ed87c74064607736003b7d0dafbdafc32c9fba91dc190d2b32",
        "The round loop generate_step and the server call (dflash's _dflash_rounds is the same "
        "function): each round's block, or plain decode steps, chosen from measured costs and "
        "the request's acceptance; dflash2_rounds mirrors it (draft, verify, walk, commit) for the "
        "drafter whose DrafterState it serves, and runs it as is for any other drafter and for "
        "samplers not keyed by position.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5DecoderLayer.__call__",
        "9feda6407e1129df917a478e5687d2bc7f53ea21c7986f641468b5749a90e10a",
        "During a policy plain step the drafter's tap layers also keep their outputs, which the "
        "next round hands to the drafter. Where measured faster (the residual arm), decode's "
        "residual add and post-attention norm in one kernel launch (dflash2_kernels.add_rms_norm, "
        "the same bits); verify's _layer does the same for all positions.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5MLP.__call__",
        "dc08d40bfdf18cf60619caad43c76a1094f3de1b14d2c53b9e2228fa698bc40a",
        "Where the rotation arm serves decode, gate and up rotate their shared input in one "
        "kernel launch instead of two (dflash2_kernels.rotate_group, the same bits), then each "
        "runs its own matmul; otherwise its own two calls. Verify's _feed_forward groups them "
        "likewise (exact_linear_group).",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.gated_delta:gated_delta_chunked",
        "757e303fa95c66f35d957712e9436742d2ebe9d2f507cf51863ab2a53615c6f3",
        "Swapped by the engine on every route for its own code with another _invert_unit_lower "
        "(dflash2_runtime.prefill_chunked): the prefill's forward substitution with the same "
        "matmuls on the same operands, appending each row instead of concatenating all earlier "
        "rows again (one GPU copy kernel per row: about half a second a 27B prefill chunk); on "
        "CUDA the whole substitution in one launch with cuBLASLt's row sums, calibrated per "
        "chunk count at start-up, else each row's subtraction and append in one launch, where "
        "that checks out bitwise; a prompt shorter than one chunk substitutes only its own rows "
        "(the padding rows are the identity's).",
    ),
    Audited(
        "mlx_vlm.server.generation:ResponseGenerator.__init__",
        "ee4704d8e6422ef901e58956f839b2d4185c0cb32242a66e31b5af02be38e662",
        "Extended by the engine (model path, vision cache, top_logprobs_k, prefill step size): "
        "the table of records waiting for the worker exists before the worker starts.",
    ),
    Audited(
        "mlx_vlm.server.generation:ResponseGenerator._initialize_model",
        "e47152fbf3a0708c3cdffd92997586c5c9badeec0e6501b3710feccd52cc6241",
        "Overridden by the engine: after mlx-vlm's own target load, the drafter loads on the "
        "same worker thread.",
    ),
    Audited(
        "mlx_vlm.server.generation:ResponseGenerator.generate",
        "76c27ca4e8020006c38e459acccbb5edc68a07ffb8e05511d4e0a6e71d8166d7",
        "Overridden by the engine: hands the request's route to the worker and wraps its token "
        "iterator (counts, stop sequences, cancellation).",
    ),
    Audited(
        "mlx_vlm.server.generation:ResponseGenerator._collect_pending_requests",
        "11773ed949253777ab45d32c87ad2a98ea0a1bf0a58bfd952c41b16543a64140",
        "Overridden by the engine: admits one sequence at a time and sets the drafter for the "
        "admitted request's route; a request cancelled while it waited (client gone, timeout) "
        "is not admitted: its generate() gets a context and an ended token queue, as generate's "
        "queue protocol reads them.",
    ),
    Audited(
        "mlx_vlm.server.generation:ResponseGenerator._make_sampler",
        "072847957cb5fce92efaac79e1c2e2be32b07c2bc48a56a0e3b78a645f1e1add",
        "Overridden by the engine on both servers: a sampled request draws with "
        "dflash2_sampling.PositionSampler (stock's position-keyed sampler, and the min_p stock "
        "accepts and drops), which the speculative rounds draw verify blocks with too.",
    ),
    Audited(
        "mlx_vlm.server.generation:ResponseGenerator.validate_context_budget",
        "584e9a2aedeb366fc01ca2be74fd0e42d8f2cce94b3cfaf5e4f79e9dcab64468",
        "Extended by the engine: the check before a stream opens holds the tokenizer lock.",
    ),
    Audited(
        "mlx_vlm.server.generation:ResponseGenerator._cpu_preprocess",
        "92a8c02002bab16db0b85e51c0b4aa69de3d3f6cec19f0484b0f5ba43285ce35",
        "Extended by the engine: holds the tokenizer lock (made reentrant), since Messages' "
        "count_tokens calls it directly, beside generate()'s own locked call.",
    ),
    Audited(
        "mlx_vlm.server.app:get_cached_model",
        "32f3dcea3e7c0617bc3e3c787afa6cbc329de7fb768e43128e3c76148b053bde",
        "Swapped by the engine (under this name and mlx_vlm.server's, the same function): a "
        "request's model field can never load a path.",
    ),
    Audited(
        "mlx_vlm.server:apply_chat_template",
        "b1442f9eb31f6808b86b3fa6ee31aace767ffda3a40cfc7a903209a57b9144ce",
        "Wrapped by the engine (it is mlx_vlm.prompt_utils' function, which warm-up calls): a "
        "template that cannot render the client's messages answers 400.",
    ),
    Audited(
        "mlx_vlm.generate:PromptProcessingBatch",
        "f5b45e396d60c860e9191627ca9f5c08488a2ef7acce97390c89aabe1cbbdadc",
        "Subclassed and swapped by the engine (dflash2_prefix_cache.PrefixPromptBatch): the exact "
        "prefix cache restores a stored chunk boundary as if prompt_step had prefilled up to it "
        "(cache, inputs, sequence-aligned arguments, tap chunks, processed columns, cached "
        "tokens), records the boundaries prompt_step passes and stores them before generate; "
        "with a sliding drafter, it drops the tap chunks before the drafter's window.",
    ),
    Audited(
        "mlx_vlm.generate.ar:GenerationBatch._step",
        "e5afa79043c9aa1a7fdb3321aa8b15f09a97dcf4e5c642c4aaf726ed5a4603e3",
        "Wrapped by the engine on the plain route (dflash2_engine.first_tokens_first_step): a "
        "batch's first call after its prompts hands out their first tokens (and logprobs) as "
        "stock's first call returns them, without first building the next forward; that stock "
        "step runs at the next call, at the sampling positions it would have had. Only for "
        "greedy batches and position-keyed samplers, not with forced-token criteria.",
    ),
    Audited(
        "mlx_vlm.generate.ar:GenerationBatch._eval_pending_state",
        "5332fc81fc8f9314cd1989de56c578d4a2353db45b969d6a9c4d4b8a1011ad96",
        "Wrapped by the engine: before extend or filter change a batch's rows, the stock step "
        "first_tokens_first_step held back runs, so the rows change in the state stock has them.",
    ),
)

AUDITED = (
    Audited(
        "mlx_vlm.generate.ar:GenerationBatch.next",
        "23ac24308ae4510c49e62c3cfe8bea0172793ca97301c54f5ac547ceb00c176e",
        "Relied on by first_tokens_first_step: builds each response from what _step returns "
        "(tokens, logprobs, top logprobs), and forced tokens rewrite _next_tokens after it.",
    ),
    Audited(
        "mlx_vlm.generate.ar:_sample_with_positions",
        "c65d02b3a62030d4fbe62dee5f402d541e5bcb210584e78a9927292a8c2c58fb",
        "Relied on by first_tokens_first_step: a sampler's sample_target draws by row and "
        "position (_num_tokens + 1 when the step is built), so the held step runs with the "
        "counts it would have had; other samplers draw from MLX's global key.",
    ),
    Audited(
        "mlx_vlm.server.generation:_PositionedTargetSampler",
        "10d06ea70165c390ebca1524b10f5c3cacd90213d9db504c6ed80aba41520ee1",
        "Subclassed by dflash2_sampling.PositionSampler, the server's sampler for a request with "
        "a temperature: it draws from its seed, row and position only (sample_target), never "
        "from MLX's global key, so a first token handed out early changes no draw, and a verify "
        "block's rows draw as decode's steps do.",
    ),
    Audited(
        "mlx_vlm.sample_utils:apply_min_p",
        "730cb1c008a01175c00d467a284c5802be1b6b0ec603aec5f5097435249876af",
        "Called by dflash2_sampling.PositionSampler after top_k, on every route.",
    ),
    Audited(
        "mlx_vlm.generate.ar:GenerationBatch.extend",
        "6b854e036ff16901a1c99ae58c52cf88452c18f235e1b6d6d5a78cf96b46c213",
        "Relied on by first_tokens_first_step: a non-empty batch calls _eval_pending_state before "
        "it takes new rows (an empty one holds no step held back).",
    ),
    Audited(
        "mlx_vlm.generate.ar:GenerationBatch.filter",
        "3be0b906ce17899d31526b33a043e81a7dc8cc47c7c23b76dc558aae86050788",
        "Relied on by first_tokens_first_step: calls _eval_pending_state before it drops rows.",
    ),
    Audited(
        "mlx_vlm.generate.ar:BatchGenerator._next",
        "bd54cdd3a03327bd718158b74dd44a3a99b048134c208284d4c1c561a17b9d05",
        "Relied on by the prefix cache: builds each prompt batch with the class "
        "_generate_module_override finds, then calls prompt_step until done and generate.",
    ),
    Audited(
        "mlx_vlm.generate.ar:_generate_module_override",
        "cba02480457fc79a90646ea6cd6238fd7e652cfbf55067f2d020aa0025d5d8a1",
        "Relied on by the prefix cache: the prompt batch class is looked up on mlx_vlm.generate.",
    ),
    Audited(
        "mlx_vlm.generate.ar:_slice_sequence_aligned_prompt_kwarg",
        "cbf69bb495c4ac5057c927e76f8576c2367b796658ad9068e5c600d30801d0ab",
        "Called by the prefix cache to drop the restored positions, as prompt_step drops "
        "prefilled ones.",
    ),
    Audited(
        "mlx_vlm.models.cache:KVCache",
        "3d8af32e443cc774eb246d636203075bc8560dbc475f1e45b86dbfe72e3735f0",
        "Copied by the prefix cache (plain route's attention layers): keys and values over "
        "[:offset] are the state, written by slice update into a buffer grown by concatenation.",
    ),
    Audited(
        "mlx_vlm.models.cache:BatchKVCache",
        "b86f2e9c3dd34250794d8ae670da371fc15b9a9ecdf17aa177d3330fccff8873",
        "Copied by the prefix cache (speculative route's attention layers): keys and values over "
        "[:_idx], offset and left_padding are the state.",
    ),
    Audited(
        "mlx_vlm.models.cache:ArraysCache",
        "a0a71f1acbdbb155fd9b3cb7895c982beb6492d90a205e92db81dc08cbaf61f7",
        "Copied by the prefix cache (GatedDeltaNet layers): the cache list and padding metadata "
        "are the state; updates rebind list items, never write into a stored array.",
    ),
    Audited(
        "mlx_vlm.speculative.utils:SpeculativePrefill",
        "f909df339ada560ce3d951721cb99c48bb985b7d3d3531e620dbda735c791842",
        "Relied on by the prefix cache: the drafter's context is the concatenation of the tap "
        "chunks (a restore puts the stored prefix's taps first; a sliding drafter's prompt "
        "batch drops leading chunks).",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.qwen3_5:Model.get_input_embeddings",
        "3cc43ebce94c8bd5bfc3c4c7c4fb382b609f593d2712384a90b22d96a591777e",
        "Relied on by the prefix cache: position ids for the whole prompt come with the "
        "embeddings, so a restored prefill gets its positions without the model's own state.",
    ),
    Audited(
        "mlx_vlm.apc:media_token_spans",
        "ce16d201fd8783e09e4c39cc41ba278f13d55d6f4389c2bdb8d51c4550642443",
        "Called by the prefix cache: the image and video runs whose embeddings key the prompt.",
    ),
    Audited(
        "mlx_vlm.apc:multimodal_token_ids_from_config",
        "08878dc4a0e30b7eb1181988f7a3ddce09632d41b7a4c8380c36254ff7709db2",
        "Called by the prefix cache: which tokens are media placeholders.",
    ),
    Audited(
        "mlx_vlm.server.generation:ResponseGenerator._step",
        "d7abfe591a2ab6cdd0fe4b577c29786198e00722f1f7499b53b1af41a1df657a",
        "Relied on: a prompt batch's cached tokens reach each token's cached_tokens (usage "
        "prompt_tokens_details and the finish log line).",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:LanguageModel.__call__",
        "af7f3f6427c2e59ab5266798b7518eaf026c3f7f749dd0962e38a6acece49cc9",
        "Mirrored: hands speculative_verify to the verifier with decode's position ids.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5Attention.__call__",
        "b051c66057acc90f4ed78691f90254685cfdb20d5814b0d58beec4d2bb34c184",
        "Mirrored: decode attention, reproduced per verify position.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5Attention._prepare_projected_qkv",
        "da21fd76217c72aa7ef15d4097e1fe428ff0022259f9556eb8fd95b59217c109",
        "Called per verify position: norms, rotary, KV cache append.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5RMSNormGated.__call__",
        "8dda172bb129bad4efb880d3b262212918d7ce30f9fe2d03824093e45be4b148",
        "Mirrored with a gate by dflash2_kernels.gated_rms_norm (mx.fast.rms_norm, then "
        "_precise_swiglu), whose self-test compares with them.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:_precise_swiglu",
        "728612a72c9e2c31f3e517f3167d32b8a78bd709c0573822e1e5ab783c6d03dc",
        "Mirrored by dflash2_kernels.gated_rms_norm (silu of the gate and the product in "
        "fp32, one rounding to the input's dtype); its self-test calls it as the reference.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:_qwen3_5_decode_depthwise_conv",
        "74738066cd31a354aa31fe22082c38b4b713d54925cee16a7f55886ae7cd2bfe",
        "Decode's convolution of one window (astype, multiply, column sum, astype): the "
        "convolution kernel reproduces it, and its self-test compares with it "
        "(dflash2_kernel_fused.stock_decode_conv).",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5GatedDeltaNet._causal_conv1d_decode",
        "77f9695692b994b6204f8df1ae58178dadb5ec91dd6194337a6e282c2e4bf17f",
        "Called per verify position: decode's depthwise convolution.",
    ),
    Audited(
        "mlx_vlm.models.rope_utils:apply_multimodal_rotary_pos_emb",
        "1ed432ed6f20e9e77917b813e2d554724199e4c53ebc3572be961815379c791f",
        "Relied on: Qwen3.5's interleaved rotary (unsqueeze 1, cast) goes to "
        "_apply_interleaved_rotary_pos_emb_axis1, which dflash2_kernels.rope_rows reproduces.",
    ),
    Audited(
        "mlx_vlm.models.rope_utils:_apply_interleaved_rotary_pos_emb_axis1",
        "1b337064c534c3943e53405a920c0f2c4baf67484845bf59b563563b2de2801a",
        "Mirrored by dflash2_kernels.rope_rows, whose self-test compares with it.",
    ),
    Audited(
        "mlx_vlm.models.rope_utils:rotate_half",
        "da22a0e9cc801352f613fbda8f0a478859c7fa27fcca8219bfa990f9e6985d94",
        "Mirrored by dflash2_kernels.rope_rows (the halves swapped, the second negated).",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5Model.__call__",
        "9dfc2048db0d818595bcdeb306a59e80cf1217331784fe7361c92a2dbf13ab65",
        "Relied on: one decode step calls each layer once, in order (the one-row batch cache "
        "path included), so plain steps record the taps capture_layer_ids would.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.gated_delta:_invert_unit_lower",
        "bf5313477baa147b47ae80d53cca3f1828ef6ff7280d295cf5b606ea5dff5e64",
        "Mirrored by dflash2_kernel_prefill.invert_unit_lower, whose start-up check compares with it; "
        "its row products' matmul shapes are replicated by dflash2_kernel_prefill.stock_rows_on, which "
        "calibrates the one-launch inverse.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.gated_delta:gated_delta_update",
        "66b3e98fcd83bed63869d1fcf6b3b130b8f4b7cbd25fee5988b288457c6615f0",
        "Mirrored: its test for the fused Metal kernel (dflash2_kernel_gdn.decode_recurrence_on_metal) "
        "decides which recurrence step verify reproduces. Relied on: it calls gated_delta_chunked "
        "through its module's globals, where the engine swaps it.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.gated_delta:gated_delta_kernel",
        "87dd535eba98a52b22f44ca642f8e8fbbf496446790a8a790ee626fef74a9483",
        "Decode's recurrence step on Metal: called a step at a time by dflash2_kernels."
        "stock_recurrence, the Metal verify's fallback and the self-test's reference.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.gated_delta:_make_gated_delta_kernel",
        "cf05fe954c60c7a4e40912584a19f993ce6bac5cda630890faded93660930e04",
        "The source of decode's fused Metal kernel, whose per-step statements the with-states "
        "kernel repeats.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.gated_delta:_make_gated_delta_with_states_kernel",
        "a8161134335e6e89552ad1d30f66caaf4048d9655bdad20d0e377d220cfc163e",
        "Its kernel runs all verify steps in one launch on Metal (dflash2_kernel_gdn.metal_recurrence) "
        "where the start-up self-test found it bitwise decode's fused kernel a step at a time.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.gated_delta:gated_delta_update_with_states",
        "a815e51717ae9d78e2fba99a6d5ad5d91790e9d6307a7d2cb1d551b0223a44e7",
        "Mirrored: dflash2_kernel_gdn.metal_recurrence launches the with-states kernel as it does.",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.language:Qwen3_5GatedDeltaNet._normalize_qk",
        "7e59605b8fabf61f8d799e75cd31667f48d5f0bb6dc6d4d6115e5057c4eebb3a",
        "Mirrored by dflash2_verify._normalize_qk (each scale as its norm's weight).",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.gated_delta:compute_g",
        "2557432693f6ac3904a34a185766e986d5f5e5c45b336b718b379fe2a8f0a1c9",
        "Mirrored by dflash2_kernels.gdn_gates (its fused kernel's functors, in order).",
    ),
    Audited(
        "mlx_vlm.models.qwen3_5.gated_delta:_compute_g_beta",
        "55e3a2984cc2e3ac92b7fe9cb3c1214d8360b774a426ff7906556a23d5c71429",
        "Mirrored by dflash2_kernels.gdn_gates (g and beta in one launch, for all verify "
        "positions and decode's one-row layer), whose self-test compares with it.",
    ),
    Audited(
        "mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35:hadamard_transform",
        "26f78584fe230a4dae3782c9c29ceb97bddf51bdad9afa170c857fc9fd126400",
        "Reproduced by dflash2_kernels.rotate in one launch (verify, and decode where faster).",
    ),
    Audited(
        "mlx_vlm.speculative.dflash:_dflash_verify",
        "39e4a6cd343ae7e054ae3584ff6879fc895494e413041f099ce08da14e3fc097",
        "Called by the exact greedy verify and the sampled rounds: the verify forward and its "
        "GDN states.",
    ),
    Audited(
        "mlx_vlm.speculative.dflash:_reserve_dflash_target_cache",
        "a122a70af6663e7a233554b47997e2fb177f8e971c14b6b9aaf928b7bd5e789d",
        "Called by the policy's rounds: reserves the target cache for the largest block.",
    ),
    Audited(
        "mlx_vlm.speculative.utils:run_speculative_server_rounds",
        "a97853c0faa5c672226856995b183a096c70212f915a90d9da643c877b16d0c1",
        "Relied on: the server reaches _dflash_rounds through utils' name at batch size 1.",
    ),
    Audited(
        "mlx_vlm.speculative.utils:run_speculative_rounds",
        "2f6dd995e5f8d5409cc213193aa52d065b633a2b400d595f63180c7815aa7e7c",
        "Relied on: generate_step reaches _dflash_rounds through utils' name at batch size 1.",
    ),
    Audited(
        "mlx_vlm.speculative.common:_speculative_walk",
        "4487bf2099c8d3a60917c12ac7ce18dfe7b72f727ec22571e38c0245521e7f81",
        "Relied on: the policy's rounds accept drafts up to the first mismatch, as stock.",
    ),
    Audited(
        "mlx_vlm.speculative.common:_record_speculative_round",
        "9a60e127d759c923fd307f4c2dea284fea1b6624bbcf75bf508b7419b60a01cd",
        "Called by the policy's rounds: the drafter's acceptance statistics, as stock records "
        "them.",
    ),
    Audited(
        "mlx_vlm.speculative.common:_dflash_block_total",
        "a9c660aef8d58aef0263af2de67b9b54ab464d81297379c01e504d3875a80e7a",
        "Relied on: reads min(block_size, runtime_block_size), which configure_drafter sets.",
    ),
    Audited(
        "mlx_vlm.speculative.cache_state:commit_speculative_round",
        "58c3e8cf462dea7a576f56b42d0ff38d45daea051b95bc9e9bd8d1ef3698997c",
        "Relied on: the policy's rounds keep accepted + 1 positions of the target cache.",
    ),
    Audited(
        "mlx_vlm.speculative.cache_state:abort_speculative_round",
        "642f9cc3e46734e260f3cb776398ed4a18ff361f88086cfb01fe2d704d76d69c",
        "Called when a verify fails midway: the recorded GDN states are dropped.",
    ),
    Audited(
        "mlx_vlm.speculative.drafters.qwen3_dflash.dflash:DFlashDraftModel.make_cache",
        "db5892186958bf9da98834ab163d1c09bcb424b3b71f6c9bc9cbeda400d97dae",
        "Relied on by the sliding-window option: rotating caches for sliding layers.",
    ),
    Audited(
        "mlx_vlm.speculative.drafters.qwen3_dflash.dflash:DFlashDraftModel.reset",
        "b619e3c217f435a21c989987840eb5bea65327b4805459bd7e1138964b9e6394",
        "Called by the policy's rounds: a fresh drafter cache per request.",
    ),
    Audited(
        "mlx_vlm.speculative.drafters.qwen3_dflash.dflash:DFlashDraftModel.draft_block_greedy",
        "c367cf45513db12de61a0c5201d2943d1fbda5d024d03e7fe9cca1e794cccbc1",
        "Called by the policy's rounds to draft greedily (stock bypasses the candidate "
        "selector).",
    ),
    Audited(
        "mlx_vlm.speculative.drafters.dflash2.dflash2:DFlash2DraftModel.draft_block",
        "5af196cd5861a4891a8773334693db20d64c25265a64406d1e5ee171da48a24c",
        "Called with --dflash2-candidate-selector: drafts through the trained selector.",
    ),
    Audited(
        "mlx_vlm.server.generation:ResponseGenerator._run_impl",
        "9037cf029cead985f4cf82d9e2c838d1fcc1a17161bcfed874cab260ece40431",
        "Relied on: the worker builds a fresh BatchGenerator with self.draft_model for each "
        "request admitted to an idle batch, which gives each request its own route.",
    ),
    Audited(
        "mlx_vlm.server.generation:GenerationArguments",
        "98083c9de47f873427d238f68ce5e512b18c04a93c83f18c3c70d7f057123fe3",
        "Warm-up builds its greedy request arguments with it; the engine's RoutedArguments "
        "subclasses it (adding the request's record) and copies each request's fields into one.",
    ),
    Audited(
        "mlx_vlm.server.generation:get_configured_context_limit",
        "e57421c0797ca38297d2687426afd8c0b19f9fc60ca912d058fe02b0b3951cf3",
        "Relied on: the budget is runtime.config.max_kv_size, which the engine sets to the "
        "model's context length after the model has loaded.",
    ),
    Audited(
        "mlx_vlm.server.generation:_check_configured_context_budget",
        "47ccaec08d07e22f233a514e088d3fb3c12500267dd4d75dd1dd7412d16af29d",
        "Relied on: prompt plus max_tokens above the budget is refused, with the message "
        "dflash2_gateway.MLX_VLM_CONTEXT_BUDGET reads.",
    ),
    Audited(
        "mlx_vlm.server.runtime:ServerRuntime",
        "47115b7d815f70604a4bcf356142268fe88293fe42a9378d6482762b1a788f66",
        "The engine sets its response_generator and model cache entry to the pack's loaded "
        "model.",
    ),
    Audited(
        "mlx_vlm.server.openai:chat_completions_endpoint",
        "2dbdad24e2a68aea315031cb2ac86f7465c77214dcb93822ec11948ba878272f",
        "The gateway forwards each checked chat body to it and reshapes its answers (errors, "
        "events, timings with predicted_n).",
    ),
    Audited(
        "mlx_vlm.server.schemas:ChatRequest",
        "add1641eb7503640c65547bceb977e5efe1d866ca5aed2d9807190a21d91be33",
        "dflash2_requests' request models check a subset of what it accepts; the gateway forwards "
        "the checked body to it.",
    ),
    Audited(
        "mlx_vlm.server.anthropic:anthropic_messages_endpoint",
        "b2f9d25091feeb2ff825d1fe04a70858a86db62d006b0fa2b741f3fdca6113d9",
        "The gateway forwards each checked Messages body to it (stop_sequences taken out: the "
        "engine's RecordingTokens ends the text, and the gateway names the stop sequence) and "
        "reshapes its answers (errors, events). It generates through response_generator.generate, "
        "so the engine's routing, cancellation and records hold.",
    ),
    Audited(
        "mlx_vlm.server.anthropic:anthropic_count_tokens_endpoint",
        "f5fcaac381cd9932a76ff6a36c1e4d5a3c1bb2236f31b7058411d06e32205daf",
        "The gateway forwards each checked count_tokens body to it; it tokenizes through "
        "response_generator._cpu_preprocess, which the engine locks.",
    ),
    Audited(
        "mlx_vlm.server.anthropic:_anthropic_request_with_derived_fields",
        "ea28a3331ae5ee97f5ee4e7bcb31d1f943e87e3350d502444b1a6922a54c33ae",
        "Relied on to derive nothing from a checked body: the gateway sends enable_thinking in "
        "place of thinking (so no thinking_budget, which the pack does not serve) and no output_config.",
    ),
    Audited(
        "mlx_vlm.server.anthropic:_anthropic_messages_to_internal",
        "425b4452fe7f252f1d6a245728ffc62bb41de555e381796afc7284a95e7565e2",
        "Relied on: turns the checked blocks into chat messages, images into data URLs or the "
        "checked file paths.",
    ),
    Audited(
        "mlx_vlm.server.schemas:AnthropicRequest",
        "401e401ad36c39622f5407f261457a8b8bcbf3a18c7a004678b417c2fbc8cc1c",
        "Relied on to keep unknown fields (extra=allow): the gateway's seed reaches _build_gen_args "
        "through it, so a sampled Messages request draws as a chat request with that seed does.",
    ),
    Audited(
        "mlx_vlm.server.request_normalization:_build_gen_args",
        "0b2f2c384a2b1743f11696cecfd73b12bfd6cf0cce5f6857d09863a525336c18",
        "Relied on for every API: reads seed, temperature, top_p, top_k and enable_thinking from "
        "the request (getattr, so a Messages request's extra seed too), the pack's defaults where unset.",
    ),
    Audited(
        "mlx_vlm.server.openai:responses_endpoint",
        "20586ff22a89ee6d050aa4c5fb23831b263d8a8d6642eb1b6ae66bd0d0f401fb",
        "The gateway forwards each checked Responses body to it (no previous_response_id, store "
        "false) and passes its typed events through, its failure event reshaped. It generates "
        "through response_generator.generate, so the engine's routing, cancellation and records hold.",
    ),
    Audited(
        "mlx_vlm.server.schemas:OpenAIRequest",
        "ee6c4cbb9c75dc0d515d51acc2717eb984f5635dd255d0ac080e82371d474003",
        "Relied on to keep unknown fields (extra=allow): the gateway's seed reaches _build_gen_args "
        "through it, so a sampled Responses request draws as a chat request with that seed does.",
    ),
    Audited(
        "mlx_vlm.server.responses_state:_response_chain_items",
        "9c60baa1dc6c3828046b1c0f028cda8d4aade5c4fcb55349cf61d35a8cd572b5",
        "Relied on to add nothing without previous_response_id, which the gateway refuses: the "
        "chain it reads is mlx-vlm's in-process store, beyond the gateway's checks.",
    ),
    Audited(
        "mlx_vlm.server.responses_state:_store_response",
        "bbd2f2c7edfdec0382e8ab3695a475944cd388d30838cfba06245b4dd88f5de8",
        "Relied on to store nothing when store is false, as the gateway always sends it.",
    ),
    Audited(
        "mlx_vlm.server.responses_state:_normalize_response_input",
        "15d4aeed5dceb319e270f6c7fc885a59da72e195f5e77eb038e03d67e87b0674",
        "Relied on: a string input is one user message; items without a type are messages.",
    ),
    Audited(
        "mlx_vlm.server.responses_state:_append_response_item_to_prompt",
        "96f2caf01d71ff7e4e9ed532402f267a1ed36bd0a72b7965d9ac81d0dc3b270f",
        "Relied on: turns the checked items into chat messages (function calls into tool calls, "
        "their outputs into tool messages, images to the checked references), reasoning items dropped.",
    ),
    Audited(
        "mlx_vlm.server.responses_state:_response_image_source",
        "3b5320f3cb4730f18c2a95577b67de896d0356e6769e1f3c681e94b66c822d83",
        "Relied on to load an input_image's image_url as given: the gateway has checked it.",
    ),
    Audited(
        "mlx_vlm.server.responses_state:_response_tool_output_to_text_and_images",
        "ecf1c44debbd968384c4bcc477da01de79e567d591e8787ce340e0c1d8429d7a",
        "Relied on: a function call output's text and checked images go into the prompt.",
    ),
    Audited(
        "mlx_vlm.server.responses_state:_response_tool_registry",
        "26dc9b2e919bbf9d7558fb7562232c5a12d94b65e8de2aa4fb82db864f4cf3e1",
        "Relied on: the checked function tools become chat tools for the template.",
    ),
    Audited(
        "mlx_vlm.server.responses_state:_response_tool_to_chat_tool",
        "fb6146b7ba5d1bf9b219f590aa3ffbae518d99b2f2bbf583ebe61579270f7836",
        "Relied on: a function tool keeps its name, description and parameters.",
    ),
    Audited(
        "mlx_vlm.server.openai:_normalize_instruction_messages",
        "d81d7b728d319302e8caea64574ef6d65f9704e2dbaa48f5450d5e526913ae18",
        "Relied on: instructions, system and developer messages become one leading system message.",
    ),
    Audited(
        "mlx_vlm.server.request_normalization:_standard_reasoning_control",
        "86d3597dc459d01cee43d32a975d9ae98ce6800766793beda947d568f4b90451",
        "Relied on: reasoning.effort turns thinking on or off (none: off; any other: on).",
    ),
)

def resolve(target: str):
    """(owner, attribute name) of a "module:qualname" target."""
    module_name, qualname = target.split(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def stock(target: str):
    """The audited object; once replaced, the one the replacement stands in for."""
    value = getattr(*resolve(target))
    return getattr(value, "__dflash2_stock__", value)


def _source_object(obj):
    """What the audit reads the source of: a function or class itself, an instance's class."""
    return obj if inspect.isfunction(obj) or inspect.isclass(obj) else type(obj)


def source_sha256(obj) -> str:
    return hashlib.sha256(inspect.getsource(_source_object(obj)).encode()).hexdigest()


def version_mismatches() -> list:
    import mlx.core as mx
    import mlx_vlm

    problems = []
    if mx.__version__ != MLX_VERSION:
        problems.append(f"mlx {mx.__version__} is installed; the pack needs {MLX_VERSION}")
    if mlx_vlm.__version__ != MLX_VLM_VERSION:
        problems.append(f"mlx-vlm {mlx_vlm.__version__} is installed; the pack needs {MLX_VLM_VERSION}")
    return problems


def mismatches(rows=REPLACED + AUDITED) -> list:
    """Every difference between the installed packages and the audited ones."""
    problems = version_mismatches()
    for row in rows:
        try:
            actual = source_sha256(stock(row.target))
        except (ImportError, AttributeError, OSError, TypeError) as error:
            problems.append(f"{row.target}: not found ({error})")
            continue
        if actual != row.sha256:
            problems.append(f"{row.target}: source sha256 {actual}, audited {row.sha256}")
    return problems


# sources_digest() of the audited install: mlx-vlm 0.7.2's files and the places in them that
# REPLACED and AUDITED name. Regenerate it with the sha256 rows when the pins change
# (tests/test_exact_verify.py prints the installed one).
SOURCES_DIGEST = "3f5e8cd779140aad35d3094dbb8716deffffe9d5917ba40e39ffc84a4d3fd6dd"


def _source_place(obj) -> tuple:
    """What inspect.getsource (Python 3.11, 3.12) reads for obj: (file, module, place), the
    place being a function's first line (from which it takes the block) or a class's qualname
    (by which it finds the class in the file's text)."""
    obj = inspect.unwrap(_source_object(obj))  # as getsourcelines does, a class's __wrapped__ too
    file = inspect.getsourcefile(obj)
    if file is None:
        raise OSError("no source file")
    if inspect.isfunction(obj):
        place = obj.__code__.co_firstlineno
    elif inspect.isclass(obj):
        # From 3.13 getsource finds a class by __firstlineno__: there no digest matches.
        place = [obj.__qualname__, vars(obj).get("__firstlineno__")]
    else:
        raise TypeError(f"{obj!r} unwraps to neither a function nor a class")
    return file, inspect.getmodule(obj, file), place


def _source_text_sha256(file: str, module) -> str:
    """The sha256 of the file's text as inspect.findsource reads it: through linecache,
    refreshed as it refreshes it (the disk's bytes can differ from a cached text)."""
    linecache.checkcache(file)
    lines = linecache.getlines(file, module.__dict__ if module else None)
    if not lines:
        raise OSError("source not available")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def sources_digest(rows=REPLACED + AUDITED) -> str:
    """The sha256 of every row's place (its file relative to mlx-vlm's folder, its first line
    or qualname) and of every such file's text. Equal to the audited install's, each object
    inspect.getsource would read is read from the same text at the same place, so each
    source_sha256 is the audited one: check_sources then reads no source."""
    import mlx_vlm

    root = Path(mlx_vlm.__file__).parent
    places, texts = [], {}
    for row in rows:
        try:
            file, module, place = _source_place(stock(row.target))
            if file not in texts:
                texts[file] = _source_text_sha256(file, module)
            places.append([row.target, os.path.relpath(file, root), place, texts[file]])
        except (ImportError, AttributeError, OSError, TypeError, ValueError) as error:
            places.append([row.target, f"not found ({type(error).__name__})"])
    return hashlib.sha256(json.dumps(places).encode()).hexdigest()


def check_sources():
    """Raises SourceMismatch naming every difference. On the audited install (versions and
    sources_digest as audited) no source is re-read; otherwise every row's source is."""
    if not version_mismatches() and sources_digest() == SOURCES_DIGEST:
        return
    problems = mismatches()
    if problems:
        raise SourceMismatch("refusing to start; these mlx-vlm sources differ from the audited ones:\n  "
                             + "\n  ".join(problems))


def replace(target: str, replacement) -> None:
    """Installs replacement under a REPLACED target, keeping the stock object on it
    as __dflash2_stock__ (once: installing twice changes nothing)."""
    if target not in {row.target for row in REPLACED}:
        raise KeyError(f"{target} is not in dflash2_audit.REPLACED")
    owner, name = resolve(target)
    current = getattr(owner, name)
    if getattr(current, "__dflash2_stock__", None) is None:
        replacement.__dflash2_stock__ = current
        setattr(owner, name, replacement)


# A replacement made of an audited function's own code, some names rebound (verify's
# projections, the drafter's attention, the prefill's chunked scan): the runtime's
# modules share it from here, below them all.
def _with_globals(function, **names):
    """`function`'s own code with some of its module's names bound to others (a snapshot of
    its module's names: later changes to that module are not seen)."""
    rebound = types.FunctionType(
        function.__code__, {**function.__globals__, **names}, function.__name__,
        function.__defaults__, function.__closure__,
    )
    rebound.__kwdefaults__ = function.__kwdefaults__
    return rebound
