#!/usr/bin/env python3
"""Write a synthetic DFlash2 model pack with random weights in the real on-disk formats.

    python tools/make_synthetic_pack.py --size tiny --seed 0 --out /tmp/pack
    python tools/make_synthetic_pack.py --size tiny4 --layers 64 --out /tmp/pack64

--layers keeps a size's widths and attention interval with another layer count: tiny4's
(every 4th layer attention, as in the real model) gives tiny widths with the real 64-layer
pattern for graph counts.

DIR/target is a prism_hadamard_qwen35 pack as mlx-vlm 0.7.2 loads it: 2-bit affine packed
weights (uint32 codes, fp16 scales and biases, fp32 +-1 Hadamard signs where block > 0), a
`modules` manifest, a small fp16 vision tower, a byte-level BPE tokenizer with a Qwen-style
chat template, and the processor configs. DIR/drafter is a DFlash2DraftModel folder, bf16 or
prequantized 4-bit. The same seed gives byte-identical files.

The tensor list comes from mlx-vlm's own model classes, built lazily from the config, so the
pack always has exactly the parameters the loader expects. Packed weights are drawn as random
codes directly: nothing dense is ever quantized on the target side, which keeps the 27b size
cheap on a GPU machine.
"""

import argparse
import json
import math
import shutil
import struct
import sys
import zlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash2_pack import TARGET_SCHEMA, build_skeleton  # noqa: E402  (the format the pack's checks demand)
from synthetic_tokenizer import (  # noqa: E402
    BPE_VOCAB_SIZE, SPECIAL_TOKENS, build_tokenizer, special_token_ids, tokenizer_config,
)

# Sizes. "27b" is the real Ternary-Bonsai-2-27B / DFlash2 drafter geometry. "tiny4" keeps the
# same structure (3 GDN layers + 1 attention layer, packed embedding and head, vision tower)
# but small enough to decode on 2 CPU cores: MLX's fp16 2-bit matmul on CPU costs ~50 ns a
# weight per row, so the inner widths are minimal (~2.1M packed weights, ~0.08 s a token);
# graph counts take it to the real 64 layers. "tiny", the test suite's packs and the trained
# demo pair (fixtures/tiny-pair), has its widths with one GDN layer and one attention layer
# (~0.045 s a token on CPU: the suite's time is nearly all such rows). Hidden 512 lets every
# module that reads the hidden state, the embedding and the head included, use a 512
# Hadamard block.
SIZES = {
    "tiny4": {
        "text": {
            "hidden_size": 512,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "full_attention_interval": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "linear_num_key_heads": 1,
            "linear_key_head_dim": 64,
            "linear_num_value_heads": 2,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "vocab_size": 512,
            "max_position_embeddings": 32768,
            "mrope_section": [3, 3, 2],
        },
        "vision": {
            "depth": 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "num_position_embeddings": 64,
        },
        "drafter": {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "intermediate_size": 256,
            "target_layer_ids": [1, 2, 3],
            "selector_rank": 32,
            "selector_top_k": 8,
            "sliding_window": 256,
        },
        # Processor pixel bounds: small images keep the vision prefill to a few tokens.
        "min_pixels": 32 * 32,
        "max_pixels": 128 * 128,
        # First special token id: right after the BPE vocabulary.
        "special_base": BPE_VOCAB_SIZE,
    },
    "27b": {
        "text": {
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "full_attention_interval": 4,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_key_head_dim": 128,
            "linear_num_value_heads": 48,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "vocab_size": 248320,
            "max_position_embeddings": 262144,
            "mrope_section": [11, 11, 10],
        },
        "vision": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "num_position_embeddings": 2304,
        },
        "drafter": {
            "num_hidden_layers": 5,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 17408,
            "target_layer_ids": [5, 19, 33, 47, 61],
            "selector_rank": 256,
            "selector_top_k": 16,
            "sliding_window": 2048,
        },
        "min_pixels": 65536,
        "max_pixels": 16777216,
        # The real Qwen3.5 ids (<|endoftext|> 248044 ... </think> 248069, mask 248070);
        # the ids between the BPE vocabulary and 248044 are reserved fillers.
        "special_base": 248044,
    },
}
SIZES["tiny"] = {
    **SIZES["tiny4"],
    "text": {**SIZES["tiny4"]["text"], "num_hidden_layers": 2, "full_attention_interval": 2},
    "drafter": {**SIZES["tiny4"]["drafter"], "target_layer_ids": [0, 1]},
}

# Packed-module gains (weight std is gain / sqrt(input width)). Small residual writes keep
# the stream stable; a hot head makes the logits peaked instead of flat.
RESIDUAL_WRITE_GAIN = 0.5
LM_HEAD_GAIN = 6.0
UNUSED_ROW_GAIN = 1 / 64
# Every packed module gets the largest Hadamard block that divides its input width (the
# real pack signs all 402 of its modules); tiny's 128-wide inputs fit none and stay block 0.
HADAMARD_BLOCKS = (4096, 2048, 1024, 512)
DRAFTER_KEPT_BF16 = ("kernel_projection", "candidate_selector.")


def log(message):
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Configs


def text_sizes(size, layers=None):
    """The language model sizes of `size`, with `layers` layers if given."""
    text = dict(SIZES[size]["text"])
    if layers is not None:
        # At least one attention layer, and every layer the drafter taps.
        least = max(text["full_attention_interval"], max(SIZES[size]["drafter"]["target_layer_ids"]) + 1)
        if layers < least:
            raise ValueError(f"the {size} size needs at least {least} layers, got {layers}")
        text["num_hidden_layers"] = layers
    return text


def target_config(size, layers=None):
    sizes = SIZES[size]
    text = text_sizes(size, layers)
    mrope_section = text.pop("mrope_section")
    ids = special_token_ids(sizes["special_base"])
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    layer_types = [
        "full_attention" if (i + 1) % text["full_attention_interval"] == 0 else "linear_attention"
        for i in range(text["num_hidden_layers"])
    ]
    text_config = {
        "model_type": "qwen3_5_text",
        **text,
        "layer_types": layer_types,
        "attention_bias": False,
        "attn_output_gate": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "eos_token_id": ids["<|endoftext|>"],
        "rope_parameters": {
            "rope_type": "default",
            "mrope_interleaved": True,
            "mrope_section": mrope_section,
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
    }
    vision_config = {
        "model_type": "qwen3_5",
        **sizes["vision"],
        "out_hidden_size": text["hidden_size"],
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "in_channels": 3,
        "hidden_act": "gelu_pytorch_tanh",
        "deepstack_visual_indexes": [],
    }
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        **TARGET_SCHEMA,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vocab_size": text["vocab_size"],
        "eos_token_id": eos,
        "tie_word_embeddings": False,
        "text_config": text_config,
        "vision_config": vision_config,
    }
    config["modules"] = packed_module_manifest(config)
    return config


def packed_module_manifest(config):
    """Every Linear/Embedding of the language model (except the dense fp16 GDN gate
    projections in_proj_a / in_proj_b) is packed, embed_tokens and lm_head included."""
    dense = build_skeleton({**config, "model_type": config["base_model_type"]}, "config.json")
    records = []
    for path, module in sorted(dense.language_model.named_modules()):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        if path.endswith(("in_proj_a", "in_proj_b")):
            continue
        width = module.weight.shape[1]
        block = hadamard_block(width)
        is_embedding = isinstance(module, nn.Embedding)
        records.append(
            {"path": path, "embedding": is_embedding, "dtype": "float16", "block": block}
        )
    return records


def hadamard_block(width):
    return next((block for block in HADAMARD_BLOCKS if width % block == 0), 0)


def drafter_config(size, form="bf16", layers=None):
    sizes = SIZES[size]
    text, drafter = text_sizes(size, layers), dict(sizes["drafter"])
    # The mask token is the first id after the specials: inside the vocabulary, not a
    # tokenizer token (as in the real pack, 248070).
    mask_token_id = sizes["special_base"] + len(SPECIAL_TOKENS)
    layers = drafter.pop("num_hidden_layers")
    config = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": text["hidden_size"],
        "intermediate_size": drafter["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": drafter["num_attention_heads"],
        "num_key_value_heads": drafter["num_key_value_heads"],
        "head_dim": drafter["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": text["vocab_size"],
        "max_position_embeddings": text["max_position_embeddings"],
        "rope_theta": 10000000,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * layers,
        "sliding_window": drafter["sliding_window"],
        "torch_dtype": "bfloat16",
        "num_target_layers": text["num_hidden_layers"],
        "dflash_config": {
            "block_size": 8,
            "runtime_block_size": 5,
            "draft_window_size": None,
            "mask_token_id": mask_token_id,
            "target_layer_ids": drafter["target_layer_ids"],
            # Kernel 2, group 16 is the geometry that reproduces the real bf16 file size.
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": drafter["selector_rank"],
            "selector_top_k": drafter["selector_top_k"],
            "input_embedding_scale": 1.0,
            "output_multiplier": 1.0,
        },
    }
    if form == "4bit":
        # mlx-lm's quantization block; the matrices kept in bf16 (13 in the real 5-layer
        # drafter) are listed as false entries.
        quantization = {"group_size": 64, "bits": 4, "mode": "affine"}
        for path in drafter_bf16_modules(config):
            quantization[path] = False
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    elif form != "bf16":
        raise ValueError(f"drafter_form must be 'bf16' or '4bit', got {form!r}")
    return config


def drafter_bf16_modules(config):
    """Matrices the prequantized form keeps in bf16: conv kernel projections and the
    candidate selector (hidden projection and both codebooks)."""
    draft = build_skeleton(config, "config.json")
    return [
        path
        for path, module in sorted(draft.named_modules())
        if isinstance(module, (nn.Linear, nn.Embedding))
        and any(marker in path for marker in DRAFTER_KEPT_BF16)
    ]


def generation_config(config):
    return {
        "bos_token_id": config["text_config"]["eos_token_id"],
        "do_sample": True,
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["text_config"]["eos_token_id"],
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def processor_configs(size):
    sizes = SIZES[size]
    image = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "merge_size": 2,
        "patch_size": 16,
        "processor_class": "Qwen3VLProcessor",
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": sizes["max_pixels"], "shortest_edge": sizes["min_pixels"]},
        "temporal_patch_size": 2,
    }
    video = {
        **image,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 64,
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    del video["image_processor_type"]
    return {
        "preprocessor_config.json": dump_json(image),
        "video_preprocessor_config.json": dump_json(video),
    }


# ---------------------------------------------------------------------------------------
# Weights


def tensor_key(seed, name):
    # Keyed by name, not by order, so a tensor's values never depend on the others.
    return mx.random.key((seed << 32) | zlib.crc32(name.encode()))


def packed_scales(seed, path, rows, width, gain, live_rows=None):
    # Codes 0..3 minus 1.5 have variance 1.25: this gives the weights std gain / sqrt(width).
    group_scale = gain / math.sqrt(1.25 * width)
    key = tensor_key(seed, path + ".scales")
    scales = mx.random.uniform(0.75, 1.25, (rows, width // 128), key=key) * group_scale
    if live_rows is not None:
        # Rows of tokens that are not printable text (specials, reserved fillers, padding,
        # lone bytes) get ~zero logits: greedy output always decodes to readable text and
        # never stops early on an end token, so generations run to max_tokens.
        scales = scales * mx.where(live_rows[:, None], 1.0, UNUSED_ROW_GAIN)
    return scales.astype(mx.float16)


def packed_gain(path):
    if path == "lm_head":
        return LM_HEAD_GAIN
    if path.endswith(("o_proj", "out_proj", "down_proj")):
        return RESIDUAL_WRITE_GAIN
    return 1.0


def live_token_rows(tokenizer, vocab_size):
    """Boolean mask over the vocabulary: ids that decode to printable text."""
    live = [False] * vocab_size
    for token_id in range(BPE_VOCAB_SIZE):
        text = tokenizer.decode([token_id])
        printable = all(c.isprintable() or c == "\n" for c in text)
        live[token_id] = bool(text) and printable and "\ufffd" not in text
    return mx.array(live)


def target_weights(config, seed, live_rows, dense_dtype="float16", trained=None):
    """All target tensors, keyed as the checkpoint stores them (mlx-vlm final names).
    `dense_dtype` is that of the language model's unpacked tensors (norms, conv, GDN gate
    projections); the vision tower is always fp16. `trained` tensors (same names) replace
    the random ones."""
    language_dtype = getattr(mx, dense_dtype)
    skeleton = build_skeleton(config, "config.json")
    blocks = {record["path"]: record["block"] for record in config["modules"]}
    weights = {}
    for name, like in tree_flatten(skeleton.parameters()):
        module_path, _, leaf = name.removeprefix("language_model.").rpartition(".")
        if trained and name in trained:
            weights[name] = trained[name]
        elif module_path in blocks:
            weights[name] = packed_tensor(seed, name, module_path, leaf, like.shape, live_rows)
        else:
            dtype = language_dtype if name.startswith("language_model.") else mx.float16
            weights[name] = dense_tensor(seed, name, like.shape, dtype)
    return weights


def packed_tensor(seed, name, path, leaf, shape, live_rows):
    key = tensor_key(seed, name)
    if leaf == "weight":
        # 16 two-bit codes per uint32, drawn as two random 16-bit halves.
        halves = mx.random.randint(0, 1 << 16, (*shape, 2), dtype=mx.uint32, key=key)
        return halves[..., 0] | (halves[..., 1] << 16)
    if leaf == "signs":
        return (mx.random.randint(0, 2, shape, key=key) * 2 - 1).astype(mx.float32)
    rows, groups = shape
    head_rows = live_rows if path == "lm_head" else None
    scales = packed_scales(seed, path, rows, groups * 128, packed_gain(path), head_rows)
    if leaf == "scales":
        return scales
    # Bias -1.5 * scale centres the four code values on zero: (q - 1.5) * scale.
    return (scales * -1.5).astype(mx.float16)


def dense_tensor(seed, name, shape, dtype=mx.float16):
    key = tensor_key(seed, name)
    module_name, leaf = name.split(".")[-2:]
    if name.endswith("A_log"):
        # As mlx-vlm initialises it; kept fp32 like the model's cast predicate asks.
        return mx.log(mx.random.uniform(1, 16, shape, key=key))
    if name.endswith("dt_bias"):
        return mx.random.uniform(0.5, 1.5, shape, key=key).astype(dtype)
    if "norm" in module_name:
        if leaf == "bias":
            return (0.02 * mx.random.normal(shape, key=key)).astype(dtype)
        # Schema-2 packs store RMSNorm weights already offset (the multiplier itself).
        return (1 + 0.1 * mx.random.normal(shape, key=key)).astype(dtype)
    if leaf == "bias" or len(shape) == 1:
        return (0.02 * mx.random.normal(shape, key=key)).astype(dtype)
    fan_in = math.prod(shape[1:])
    return (mx.random.normal(shape, key=key) / math.sqrt(fan_in)).astype(dtype)


def drafter_weights(config, seed, codebook_names="plain", trained=None):
    """Drafter tensors: bf16 dense, or 4-bit group-64 affine where the config's
    quantization block does not keep a matrix in bf16. `trained` tensors (parameter
    names) replace the random ones."""
    if codebook_names not in ("plain", "weight"):
        raise ValueError(f"codebook_names must be 'plain' or 'weight', got {codebook_names!r}")
    skeleton = build_skeleton(config, "config.json")
    weights = {}
    for name, like in tree_flatten(skeleton.parameters()):
        if trained and name in trained:
            value = trained[name].astype(mx.bfloat16)
        else:
            value = dense_tensor(seed, name, like.shape, dtype=mx.bfloat16)
        path = name.rpartition(".")[0]
        if codebook_names == "plain" and path.endswith("_codebook"):
            name = path  # stored bare; mlx-vlm's sanitize adds the ".weight" back
        weights[name] = value
    quantization = config.get("quantization")
    return quantize_drafter_weights(weights, quantization) if quantization else weights


def quantize_drafter_weights(weights, quantization):
    """mlx-lm's prequantized form of bf16 drafter tensors: every 2-D `.weight` the
    quantization block does not keep in bf16 becomes affine codes, scales and biases."""
    quantized = {}
    for name, value in weights.items():
        path, _, leaf = name.rpartition(".")
        if leaf == "weight" and value.ndim == 2 and quantization.get(path, True):
            weight, scales, biases = mx.quantize(
                value, group_size=quantization["group_size"], bits=quantization["bits"]
            )
            quantized.update({name: weight, f"{path}.scales": scales, f"{path}.biases": biases})
        else:
            quantized[name] = value
    return quantized


def prequantize_drafter(source, destination):
    """Write the 4-bit form (group 64, affine, DRAFTER_KEPT_BF16 matrices in bf16) of a
    bf16 DFlash2 drafter folder; the other files are copied unchanged. Returns the
    matrices kept in bf16."""
    source, destination = Path(source), Path(destination)
    config = json.loads((source / "config.json").read_text())
    if config.get("quantization") or config.get("quantization_config"):
        raise ValueError(f"{source.name}/config.json: the drafter is already quantized")
    quantization = {"group_size": 64, "bits": 4, "mode": "affine"}
    kept = drafter_bf16_modules(config)
    quantization.update({path: False for path in kept})
    config["quantization"] = config["quantization_config"] = quantization
    weights = {}
    for shard in sorted(source.glob("*.safetensors")):
        weights.update(mx.load(str(shard)))
    destination.mkdir(parents=True, exist_ok=True)
    write_safetensors(destination / "model.safetensors", quantize_drafter_weights(weights, quantization))
    (destination / "config.json").write_text(dump_json(config))
    for extra in sorted(source.iterdir()):
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name != "config.json":
            shutil.copyfile(extra, destination / extra.name)
    return kept


# ---------------------------------------------------------------------------------------
# Files

SAFETENSORS_DTYPES = {
    mx.uint32: "U32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
}


def write_safetensors(path, tensors, verbose=False):
    """Deterministic safetensors: sorted names, fixed metadata, streamed one tensor at a
    time (the 27b target is 8+ GB)."""
    names = sorted(tensors)
    header, offset = {"__metadata__": {"format": "mlx"}}, 0
    for name in names:
        tensor = tensors[name]
        size = tensor.nbytes
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    written, next_report = 0, 0.0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name in names:
            tensor = tensors[name]
            mx.eval(tensor)
            f.write(memoryview(tensor))
            written += tensor.nbytes
            if verbose and written >= next_report * offset:
                log(f"  {path.name}: {written / 1e9:.2f} / {offset / 1e9:.2f} GB")
                next_report += 0.05


def dump_json(data):
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def write_text_files(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


# ---------------------------------------------------------------------------------------
# Entry points


def write_target(
    folder, size="tiny", seed=0, dense_dtype="float16", verbose=False, layers=None,
    tokenizer=None, trained=None,
):
    """Write a prism_hadamard_qwen35 target folder: configs, tokenizer, weights.
    tokenizer: a build_tokenizer result (default: trained on TOKENIZER_CORPUS);
    trained: tensors that replace the random ones (tools/train_tiny_pair.py)."""
    folder = Path(folder)
    config = target_config(size, layers)
    special_base = SIZES[size]["special_base"]
    tokenizer = tokenizer or build_tokenizer(special_base)
    max_length = config["text_config"]["max_position_embeddings"]
    write_text_files(
        folder,
        {
            "config.json": dump_json(config),
            "generation_config.json": dump_json(generation_config(config)),
            "tokenizer.json": tokenizer.to_str(pretty=True),
            "tokenizer_config.json": dump_json(tokenizer_config(special_base, max_length)),
            **processor_configs(size),
        },
    )
    if verbose:
        log(f"target: generating {size} weights (seed {seed})")
    live_rows = live_token_rows(tokenizer, config["vocab_size"])
    weights = target_weights(config, seed, live_rows, dense_dtype, trained)
    write_safetensors(folder / "model.safetensors", weights, verbose)


def write_drafter(
    folder, size="tiny", seed=0, form="bf16", codebook_names="plain", verbose=False, layers=None,
    trained=None,
):
    """Write a DFlash2DraftModel folder (bf16 or prequantized 4-bit) for a target of
    `layers` layers (default: the size's); `trained` tensors replace the random ones."""
    folder = Path(folder)
    config = drafter_config(size, form, layers)
    write_text_files(folder, {"config.json": dump_json(config)})
    if verbose:
        log(f"drafter: generating {form} weights (seed {seed})")
    weights = drafter_weights(config, seed, codebook_names, trained)
    write_safetensors(folder / "model.safetensors", weights, verbose)


def make_pack(
    out_dir,
    size="tiny",
    seed=0,
    drafter_form="bf16",
    codebook_names="plain",
    dense_dtype="float16",
    verbose=None,
    layers=None,
):
    """Write DIR/target and DIR/drafter. Returns {"root", "target", "drafter"} paths.
    Progress goes to stderr, by default for the 27b size only. layers: the target's layer
    count, if not the size's.

    dense_dtype is the dtype of the target's unpacked language tensors (norms, conv, GDN
    gates). The real 27B file's size (8,595,478,392 bytes) is matched to the byte by
    "float32" with every packed module signed, not by "float16". fp32 norm weights make
    the residual stream, and so the packed matmuls' activations, fp32."""
    verbose = size == "27b" if verbose is None else verbose
    root = Path(out_dir)
    write_target(root / "target", size, seed, dense_dtype, verbose, layers)
    write_drafter(root / "drafter", size, seed, drafter_form, codebook_names, verbose, layers)
    return {"root": root, "target": root / "target", "drafter": root / "drafter"}


def synthetic_prompt(length: int) -> list:
    """The prompt the tools prefill before timing or comparing: `length` fixed token ids in
    1..200."""
    return [(17 * i + 3) % 200 + 1 for i in range(length)]


def build_target_model(size="tiny", seed=0, dense_dtype="float16", layers=None):
    """The target model with its random weights loaded in memory, no files written
    (for benchmarks on a GPU machine). Same tensors as make_pack writes."""
    config = target_config(size, layers)
    tokenizer = build_tokenizer(SIZES[size]["special_base"])
    live_rows = live_token_rows(tokenizer, config["vocab_size"])
    model = build_skeleton(config, "config.json")
    weights = model.sanitize(target_weights(config, seed, live_rows, dense_dtype))
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    model.eval()
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--drafter-form", choices=["bf16", "4bit"], default="bf16")
    parser.add_argument("--codebook-names", choices=["plain", "weight"], default="plain")
    parser.add_argument("--dense-dtype", choices=["float16", "float32"], default="float16")
    parser.add_argument("--layers", type=int, help="layer count (default: the size's)")
    args = parser.parse_args()
    paths = make_pack(
        args.out,
        size=args.size,
        seed=args.seed,
        drafter_form=args.drafter_form,
        codebook_names=args.codebook_names,
        dense_dtype=args.dense_dtype,
        layers=args.layers,
    )
    print(json.dumps({key: str(value) for key, value in paths.items()}, indent=2))


if __name__ == "__main__":
    main()
