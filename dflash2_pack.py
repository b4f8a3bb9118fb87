"""Find, check and load a DFlash2 pack: a prism_hadamard_qwen35 target and its drafter.

The checks read config.json and the safetensors headers only (plus the small Hadamard
sign vectors), so a broken or mismatched pack stops with a PackError that names the file,
the field or tensor, and what was expected, before any weight is loaded. Loading itself is
mlx-vlm's own code: `mlx_vlm.utils.load` and `mlx_vlm.speculative.drafters.load_drafter`.
A built pack's files are pinned in dflash2-pack.json (checked at launch) and SHA256SUMS
(checked by --verify-pack, with everything else here).
"""

import hashlib
import json
import re
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from safetensors import SafetensorError, safe_open

TARGET_SCHEMA = {
    "model_type": "prism_hadamard_qwen35",
    "schema_version": 2,
    "base_model_type": "qwen3_5",
    "tensor_namespace": "mlx-vlm-qwen3_5",
    "gdn_activation_layout": "grouped",
    "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
}
HADAMARD_BLOCKS = (0, 512, 1024, 2048, 4096)
# The float dtypes a safetensors header names, and the arrays they load as.
MX_FLOAT_DTYPES = {"F16": mx.float16, "BF16": mx.bfloat16, "F32": mx.float32}
FLOAT_DTYPES = tuple(MX_FLOAT_DTYPES)
TEXT_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings")
DRAFTER_ARCHITECTURE = "DFlash2DraftModel"
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
MAX_LISTED = 8
PINS_FILE = "dflash2-pack.json"
# Not the pack's: what git, hf download --local-dir and Python write beside its files. Builds
# skip them in their sources; --verify-pack does not count them as unexpected files.
SKIPPED_DIRS = (".git", ".cache", ".huggingface", "__pycache__")
SUMS_FILE = "SHA256SUMS"
HASH_CHUNK = 8 * 1024 * 1024


class PackError(ValueError):
    """A pack file that mlx-vlm would reject or load wrongly. `file` is relative to the
    pack (e.g. "target/config.json"), `problems` lists every problem found in it."""

    def __init__(self, file, problems):
        self.file, self.problems = file, list(problems)
        if len(self.problems) == 1:
            message = f"{file}: {self.problems[0]}"
        else:
            message = f"{file}: {len(self.problems)} problems:\n  " + "\n  ".join(self.problems)
        super().__init__(message)


def relative_name(folder, file_name):
    return f"{Path(folder).name}/{file_name}"


def read_config(folder):
    name = relative_name(folder, "config.json")
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except FileNotFoundError:
        raise PackError(name, ["file is missing"]) from None
    except json.JSONDecodeError as error:
        raise PackError(name, [f"not valid JSON ({error})"]) from None


def read_headers(folder):
    """{tensor name: header entry} over the folder's weight files (the files mlx-vlm
    loads), and a label for error messages."""
    folder = Path(folder)
    files = sorted(
        path for path in folder.glob("*.safetensors") if path.name != "consolidated.safetensors"
    )
    if not files:
        raise PackError(relative_name(folder, "model.safetensors"), ["file is missing"])
    label = ", ".join(relative_name(folder, path.name) for path in files)
    headers = {}
    for path in files:
        try:
            with safe_open(path, framework="numpy"):  # the whole layout: offsets, sizes, file length
                pass
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (struct.error, ValueError, SafetensorError) as error:
            raise PackError(relative_name(folder, path.name),
                            [f"not a valid safetensors file, truncated or damaged ({error})"]) from None
        header.pop("__metadata__", None)
        headers.update({name: {**entry, "file": path} for name, entry in header.items()})
    return headers, label


def build_skeleton(config, name):
    """mlx-vlm's model object for a config, weights unallocated (MLX arrays are lazy)."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    try:
        module, _ = get_model_and_args(config)
        model_config = module.ModelConfig.from_dict(config)
        model_config = update_module_configs(model_config, module, config, ["text", "vision"])
        return module.Model(model_config)
    except Exception as error:  # mlx-vlm's own config validation, reworded with the file
        raise PackError(name, [f"mlx-vlm rejects this config: {error}"]) from None


def mismatch(what, expected, actual):
    return f"{what}: expected {expected!r}, got {actual!r}"


def listed(names):
    names = sorted(names)
    more = f" (and {len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more


def quantized_shapes(rows, width, bits, group_size):
    return {
        "weight": ((rows, width * bits // 32), ("U32",)),
        "scales": ((rows, width // group_size), FLOAT_DTYPES),
        "biases": ((rows, width // group_size), FLOAT_DTYPES),
    }


def tensor_problems(headers, expected):
    """Compare headers against {name: (shape, allowed dtypes)}: missing, unexpected,
    wrong shape, wrong dtype."""
    problems = []
    missing = expected.keys() - headers.keys()
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {listed(missing)}")
    unexpected = headers.keys() - expected.keys()
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {listed(unexpected)}")
    for name in sorted(expected.keys() & headers.keys()):
        shape, dtypes = expected[name]
        entry = headers[name]
        if tuple(entry["shape"]) != tuple(shape):
            problems.append(mismatch(f"{name} shape", list(shape), entry["shape"]))
        if entry["dtype"] not in dtypes:
            wanted = dtypes[0] if len(dtypes) == 1 else " or ".join(dtypes)
            problems.append(f"{name} dtype: expected {wanted}, got {entry['dtype']!r}")
    return problems


# ---------------------------------------------------------------------------------------
# Target


def target_schema_problems(config):
    problems = [
        mismatch(field, value, config.get(field))
        for field, value in TARGET_SCHEMA.items()
        if config.get(field) != value
    ]
    modules = config.get("modules")
    if not isinstance(modules, list) or not modules:
        problems.append("modules: expected a non-empty manifest list, got " + repr(modules))
    for field in ("text_config", "vision_config"):
        if not isinstance(config.get(field), dict):
            problems.append(f"{field}: expected an object, got {config.get(field)!r}")
    text = config.get("text_config") or {}
    for field in TEXT_FIELDS:
        if not isinstance(text.get(field), int) or text.get(field) <= 0:
            problems.append(mismatch(f"text_config.{field}", "a positive integer", text.get(field)))
    return problems


def manifest_problems(config, dense_language_model):
    """Check each manifest record against the unpacked model; return the problems and
    {module path: (rows, width, block)} for the records that make sense."""
    modules = dict(dense_language_model.named_modules())
    problems, packed = [], {}
    for index, record in enumerate(config["modules"]):
        where = f"modules[{index}]"
        if not isinstance(record, dict) or not isinstance(record.get("path"), str):
            problems.append(f"{where}: expected {{path, embedding, dtype, block}}, got {record!r}")
            continue
        path = record["path"]
        where = f"modules[{index}] ({path})"
        module = modules.get(path)
        if path in packed:
            problems.append(f"{where}: listed twice")
            continue
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            problems.append(f"{where}: no Linear or Embedding at this path in the language model")
            continue
        is_embedding = isinstance(module, nn.Embedding)
        if record.get("embedding") != is_embedding:
            problems.append(mismatch(f"{where} embedding", is_embedding, record.get("embedding")))
        if record.get("dtype") != "float16":
            problems.append(mismatch(f"{where} dtype", "float16", record.get("dtype")))
        rows, width = module.weight.shape
        block = record.get("block")
        if block not in HADAMARD_BLOCKS or (block and width % block):
            problems.append(
                f"{where} block: expected one of {HADAMARD_BLOCKS} dividing the input width "
                f"{width}, got {block!r}"
            )
            continue
        packed[path] = (rows, width, block)
    return problems, packed


def expected_target_tensors(dense_model, packed):
    """{tensor name: (shape, allowed dtypes)} as mlx-vlm's prism loader expects them."""
    expected = {}
    for path, (rows, width, block) in packed.items():
        for leaf, (shape, dtypes) in quantized_shapes(rows, width, 2, 128).items():
            expected[f"language_model.{path}.{leaf}"] = (shape, dtypes if leaf == "weight" else ("F16",))
        if block:
            expected[f"language_model.{path}.signs"] = ((width,), ("F32",))
    packed_prefixes = tuple(f"language_model.{path}." for path in packed)
    for name, parameter in tree_flatten(dense_model.parameters()):
        if not name.startswith(packed_prefixes):
            expected[name] = (parameter.shape, FLOAT_DTYPES)
    return expected


def sign_problems(headers, expected):
    problems = []
    for name in sorted(expected):
        entry = headers.get(name)
        if not name.endswith(".signs") or entry is None or entry["dtype"] != "F32":
            continue
        with safe_open(entry["file"], framework="numpy") as f:
            signs = f.get_tensor(name)
        bad = np.count_nonzero(np.abs(signs) != 1)
        if bad:
            problems.append(f"{name}: expected only -1 and +1, got {bad} other value(s)")
    return problems


def check_target(target_dir):
    """Check a target folder before loading; returns its config. Raises PackError."""
    target_dir = Path(target_dir)
    config_name = relative_name(target_dir, "config.json")
    config = read_config(target_dir)
    problems = target_schema_problems(config)
    if problems:
        raise PackError(config_name, problems)

    # The unpacked Qwen3.5 model gives every module's dense shape.
    dense_model = build_skeleton({**config, "model_type": config["base_model_type"]}, config_name)
    problems, packed = manifest_problems(config, dense_model.language_model)
    if problems:
        raise PackError(config_name, problems)

    headers, weights_name = read_headers(target_dir)
    expected = expected_target_tensors(dense_model, packed)
    problems = tensor_problems(headers, expected) + sign_problems(headers, expected)
    if problems:
        raise PackError(weights_name, problems)
    return config


# ---------------------------------------------------------------------------------------
# Drafter


def drafter_fit_problems(config, target_text):
    """Drafter config fields that must fit the target (and mlx-vlm's DFlash2 config)."""
    problems = []
    if DRAFTER_ARCHITECTURE not in (config.get("architectures") or []):
        problems.append(mismatch("architectures", [DRAFTER_ARCHITECTURE], config.get("architectures")))
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        problems.append(mismatch("dflash_config", "an object", dflash))
        dflash = {}
    layers, vocab = target_text["num_hidden_layers"], target_text["vocab_size"]
    fits = (
        ("hidden_size", "hidden_size"),
        ("vocab_size", "vocab_size"),
        ("num_target_layers", "num_hidden_layers"),
    )
    for field, target_field in fits:
        if config.get(field) != target_text[target_field]:
            problems.append(
                f"{field}: expected {target_text[target_field]} (the target's {target_field}), "
                f"got {config.get(field)!r}"
            )
    if not isinstance(dflash.get("block_size"), int) or dflash.get("block_size") < 2:
        problems.append(mismatch("dflash_config.block_size", "an integer >= 2", dflash.get("block_size")))
    mask = dflash.get("mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < vocab:
        problems.append(mismatch("dflash_config.mask_token_id", f"an id in [0, {vocab})", mask))
    taps = dflash.get("target_layer_ids")
    taps_fit = (
        isinstance(taps, list)
        and taps
        and all(isinstance(tap, int) and 0 <= tap < layers for tap in taps)
        and all(a < b for a, b in zip(taps, taps[1:]))
    )
    if not taps_fit:
        problems.append(
            mismatch("dflash_config.target_layer_ids", f"increasing layer ids in [0, {layers})", taps)
        )
    quantization = config.get("quantization")
    if quantization is not None and (
        quantization.get("mode", "affine") != "affine"
        or quantization.get("bits") not in (2, 3, 4, 5, 6, 8)
        or quantization.get("group_size") not in (32, 64, 128)
    ):
        problems.append(mismatch("quantization", "affine, bits 2-8, group 32/64/128", quantization))
    return problems


def drafter_trained_block(drafter_dir) -> int:
    """The block the drafter was trained on: dflash_config.block_size, which mlx-vlm's
    DFlash2Config reads as config.block_size. check_drafter has checked it."""
    return read_config(drafter_dir)["dflash_config"]["block_size"]


def normalized_drafter_names(headers):
    """Header names as mlx-vlm's DFlash2 sanitize maps them ("model." prefix dropped,
    bare codebooks get ".weight"); returns the mapping and any collisions."""
    mapped, problems = {}, []
    for name, entry in headers.items():
        key = name.removeprefix("model.")
        if key in CODEBOOKS:
            key = f"{key}.weight"
        if key in mapped:
            problems.append(f"{name}: duplicates another tensor once mlx-vlm adds '.weight'")
        mapped[key] = entry
    return mapped, problems


def expected_drafter_tensors(config, skeleton, headers):
    quantization = config.get("quantization") or {}
    expected, problems = {}, []
    for name, parameter in tree_flatten(skeleton.parameters()):
        path, _, leaf = name.rpartition(".")
        stored_packed = f"{path}.scales" in headers
        if leaf == "weight" and parameter.ndim == 2 and stored_packed:
            if not quantization or quantization.get(path, True) is False:
                reason = "no quantization block" if not quantization else "listed as false"
                problems.append(f"{path}: stored quantized, but the config has {reason}")
                continue
            shapes = quantized_shapes(
                *parameter.shape, quantization["bits"], quantization["group_size"]
            )
            expected.update({f"{path}.{key}": spec for key, spec in shapes.items()})
        else:
            expected[name] = (parameter.shape, FLOAT_DTYPES)
    return expected, problems


def check_drafter(drafter_dir, target_dir):
    """Check a DFlash2 drafter folder against its target before loading; returns the
    drafter config. Raises PackError."""
    drafter_dir = Path(drafter_dir)
    config_name = relative_name(drafter_dir, "config.json")
    config = read_config(drafter_dir)
    target_text = read_config(target_dir).get("text_config") or {}
    if not all(isinstance(target_text.get(field), int) for field in TEXT_FIELDS):
        raise PackError(
            relative_name(target_dir, "config.json"),
            [f"text_config: expected integers {', '.join(TEXT_FIELDS)}, got {target_text!r}"],
        )
    problems = drafter_fit_problems(config, target_text)
    if problems:
        raise PackError(config_name, problems)

    skeleton = build_skeleton(config, config_name)
    raw_headers, weights_name = read_headers(drafter_dir)
    headers, problems = normalized_drafter_names(raw_headers)
    expected, quantization_problems = expected_drafter_tensors(config, skeleton, headers)
    problems += quantization_problems + tensor_problems(headers, expected)
    if problems:
        raise PackError(weights_name, problems)
    return config


# ---------------------------------------------------------------------------------------
# Finding and loading


def find_pack(pack_dir):
    """(target_dir, drafter_dir) of a pack folder: DIR/target with DIR/drafter (the
    synthetic layout), or the target files in DIR itself with DIR/drafter (the release
    layout). drafter_dir is None when there is no drafter folder."""
    pack_dir = Path(pack_dir)
    nested = pack_dir / "target"
    target_dir = nested if (nested / "config.json").is_file() else pack_dir
    drafter_dir = pack_dir / "drafter"
    return target_dir, drafter_dir if drafter_dir.is_dir() else None


def load_pack(target_dir, drafter_dir=None):
    """Check, then load with mlx-vlm: returns (model, processor, drafter); drafter is None
    when no drafter folder is given."""
    from mlx_vlm.speculative.drafters import load_drafter, validate_drafter_compatibility
    from mlx_vlm.utils import load

    check_target(target_dir)
    if drafter_dir is not None:
        check_drafter(drafter_dir, target_dir)
    model, processor = load(Path(target_dir))
    drafter = None
    if drafter_dir is not None:
        drafter, kind = load_drafter(Path(drafter_dir))
        validate_drafter_compatibility(model, drafter, kind)
    return model, processor, drafter


# The linears of one module that the verify forward calls on the same input, in its order.
SHARED_INPUT_LINEARS = (("q_proj", "k_proj", "v_proj"), ("in_proj_qkv", "in_proj_z"), ("gate_proj", "up_proj"))


def typed_as_headers(skeleton, headers) -> None:
    """Gives each of a build_skeleton model's arrays that the headers name the dtype stored
    there (lazy zeros of its shape: nothing is allocated), so kernel_shapes reads the pack's
    dtypes, not the skeleton's fp32 defaults."""
    stored = {name: MX_FLOAT_DTYPES.get(entry["dtype"]) for name, entry in headers.items()}
    typed = [(name, mx.zeros(array.shape, stored[name])) for name, array in tree_flatten(skeleton.parameters())
             if stored.get(name) is not None and stored[name] != array.dtype]
    skeleton.update(tree_unflatten(typed))


def kernel_shapes(model) -> dict:
    """The pack's own shapes for dflash2_kernels.verify_kernel_self_tests (a skeleton from
    build_skeleton, typed_as_headers, is enough: only shapes and dtypes are read)."""
    import dflash2_kernels
    from mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35 import HadamardQuantizedLinear

    text = model.language_model.model
    shapes = {key: set() for key in ("packed", "rotations", "rotation_groups", "gdn", "dense", "attention", "conv",
                                     "conv_fp32", "rope", "norms", "gated_norms", "gates")}
    # fp32 norms (the real file's) make the residual stream, so every packed input, fp32.
    fp32_rows = text.norm.weight.dtype == mx.float32
    for _, module in model.language_model.named_modules():
        if isinstance(module, HadamardQuantizedLinear):
            width = dflash2_kernels.packed_width(module.weight)
            shapes["packed"].add((module.weight.shape[0], width))
            if module.block:
                shapes["rotations"].add((width, module.block))
        # Rotated linears that share their input: the exact verify rotates them in one launch.
        for names in SHARED_INPUT_LINEARS:
            group = [getattr(module, name, None) for name in names]
            if all(isinstance(linear, HadamardQuantizedLinear) for linear in group) \
                    and len({linear.block for linear in group}) == 1 and group[0].block:
                shapes["rotation_groups"].add((dflash2_kernels.packed_width(group[0].weight), group[0].block,
                                               len(group)))
    for layer in text.layers:
        shapes["norms"].add(tuple(layer.post_attention_layernorm.weight.shape))
        if layer.is_linear:
            gdn = layer.linear_attn
            shapes["gdn"].add((1, gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim))
            gates = gdn.in_proj_b.weight.shape[0] + gdn.in_proj_a.weight.shape[0]
            shapes["dense"].add((gates, gdn.in_proj_b.weight.shape[1]))
            shapes["conv"].add((1, gdn.conv_dim, gdn.conv_kernel_size))
            if gdn.conv1d.weight.dtype == mx.float32:  # the real file's: decode runs nn.Conv1d
                shapes["conv_fp32"].add((1, gdn.conv_dim, gdn.conv_kernel_size))
            shapes["gated_norms"].add((gdn.num_v_heads, gdn.head_v_dim))
            shapes["gates"].add((gdn.num_v_heads,))
        else:
            attention = layer.self_attn
            shapes["attention"].add(
                (1, attention.num_attention_heads, attention.num_key_value_heads, attention.head_dim)
            )
            shapes["rope"].add((1, attention.num_attention_heads, attention.num_key_value_heads,
                                attention.head_dim, attention.rotary_emb.dim))
    # The kernels with fp32 variants test them at the same shapes, where the rows are fp32.
    # There the fp16-only kernels never serve (the embedding's fp16 rows meet only the first
    # layer's norm and residual add, whose fp32 weight and partner keep them stock), so their
    # tests would only cost the start (a call that came would test its kernel first).
    for key in FP32_TWINS:
        shapes[f"{key}_fp32"] = shapes[key] if fp32_rows else set()
    for key in (*FP32_TWINS, "conv") if fp32_rows else ():
        shapes[key] = set()
    return {key: sorted(value) for key, value in shapes.items()}


# Shape keys of kernels with an fp32 twin (its key: this one's + "_fp32").
FP32_TWINS = ("packed", "rotations", "rotation_groups", "gdn", "attention", "rope", "norms", "gated_norms", "gates")


# ---------------------------------------------------------------------------------------
# Launch pins (dflash2-pack.json) and SHA256SUMS


def sha256_file(path: Path, progress=None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()


def safetensors_header_sha256(path: Path) -> str:
    """sha256 of the 8-byte header length and the JSON header: every tensor's name,
    dtype, shape and offsets, read without touching the weights."""
    with open(path, "rb") as f:
        length_bytes = f.read(8)
        length = int.from_bytes(length_bytes, "little")
        return hashlib.sha256(length_bytes + f.read(length)).hexdigest()


def read_pins(pack_dir: Path) -> dict:
    """dflash2-pack.json, checked for the shape the launch checks read; raises ValueError
    with a one-line message otherwise."""
    try:
        pins = json.loads((pack_dir / PINS_FILE).read_text())
    except OSError as error:
        raise ValueError(f"{PINS_FILE}: cannot be read ({error.strerror})") from None
    except ValueError as error:
        raise ValueError(f"{PINS_FILE}: not valid JSON ({error})") from None
    files = pins.get("files") if isinstance(pins, dict) else None
    if not isinstance(files, dict) or not isinstance(pins.get("runtime", {}), dict):
        raise ValueError(f'{PINS_FILE}: expected {{"files": {{...}}, "runtime": {{...}}}}')
    for name, pin in files.items():
        hashes = ("sha256", "header_sha256") if name.endswith(".safetensors") else ("sha256",)
        well_formed = (
            isinstance(pin, dict) and isinstance(pin.get("size"), int)
            and all(isinstance(pin.get(key), str) for key in hashes)
            and not Path(name).is_absolute() and ".." not in Path(name).parts
        )
        if not well_formed:
            raise ValueError(f'{PINS_FILE}: files[{name!r}]: expected a path inside the pack with '
                             f'{{"size": bytes, {", ".join(repr(h) + ": hex" for h in hashes)}}}')
    return pins


def check_pins(pack_dir: Path, full_hash: bool, remembered=None) -> list:
    """Compares the pack folder with dflash2-pack.json; returns one line per failure.

    dflash2-pack.json holds {"files": {"<path in the pack>": {"size": bytes, "sha256": hex,
    "header_sha256": hex}}} (header_sha256 for .safetensors files). Every pinned file's size
    is checked and small files (configs, README, tokenizer, template) are hashed whole. Weights
    are checked by their safetensors header and, with `remembered` (the launch's
    dflash2_file_hashes.RememberedHashes), hashed whole where it does not hold their pinned
    hash for the file as it is now, each match remembered; full_hash hashes every file."""
    from tqdm import tqdm

    try:
        pins = read_pins(pack_dir)["files"]
    except ValueError as error:
        return [str(error)]
    failures, to_hash = [], []
    # The loaders read every weights file (or those an index names) in the pack's target and
    # drafter folders (a source layout's target/ too): one no build pinned would load unchecked.
    for folder in (pack_dir, pack_dir / "target", pack_dir / "drafter"):
        for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.safetensors.index.json")):
            name = path.relative_to(pack_dir).as_posix()
            if name not in pins:
                failures.append(f"{name}: a weights file not in {PINS_FILE} (the model would load it unchecked)")
    for name, pin in sorted(pins.items()):
        path = pack_dir / name
        if not path.is_file():
            failures.append(f"{name}: missing (expected size {pin['size']})")
            continue
        size = path.stat().st_size
        if size != pin["size"]:
            failures.append(f"{name}: size expected {pin['size']}, actual {size}")
            continue
        weights = name.endswith(".safetensors")
        if weights and not full_hash:
            actual = safetensors_header_sha256(path)
            if actual != pin["header_sha256"]:
                failures.append(f"{name}: safetensors header sha256 expected {pin['header_sha256']}, "
                                f"actual {actual}")
                continue
        if not weights or full_hash or (remembered is not None and not remembered.matches(path, pin["sha256"])):
            to_hash.append((name, path, pin))
    with tqdm(total=sum(pin["size"] for _, _, pin in to_hash), unit="B", unit_scale=True, desc="sha256",
              disable=not any(name.endswith(".safetensors") for name, _, _ in to_hash)) as progress:
        for name, path, pin in to_hash:
            status = path.stat()
            actual = sha256_file(path, progress)
            if actual != pin["sha256"]:
                failures.append(f"{name}: sha256 expected {pin['sha256']}, actual {actual}")
            elif remembered is not None and name.endswith(".safetensors"):
                remembered.remember(path, actual, status)
    return failures


def read_sha256sums(pack_dir):
    """({path in the pack: sha256} listed in SHA256SUMS, [malformed-line problems])."""
    listed, problems = {}, []
    text = (Path(pack_dir) / SUMS_FILE).read_text(errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        digest, _, name = line.partition("  ")
        if line and not (re.fullmatch(r"[0-9a-f]{64}", digest) and name and not Path(name).is_absolute()
                         and ".." not in Path(name).parts):
            problems.append(f"{SUMS_FILE}: line {number} is not '<sha256>  <path in the pack>'")
        elif line:
            listed[name] = digest
    return listed, problems


# ---------------------------------------------------------------------------------------
# Verifying a built pack (python serve_dflash2.py --verify-pack)


def listed_file_problems(pack_dir):
    """({path: sha256} listed in SHA256SUMS, problems): malformed lines, and listed files
    missing or with another hash."""
    listed, problems = read_sha256sums(pack_dir)
    for name, expected in sorted(listed.items()):
        path = pack_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif sha256_file(path) != expected:
            problems.append(f"{name}: sha256 differs from SHA256SUMS")
    return listed, problems


def folder_files(folder):
    """Relative paths of every file under folder, sorted, SKIPPED_DIRS left out."""
    return sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_file() and not set(path.relative_to(folder).parts) & set(SKIPPED_DIRS)
    )


def sha256sums_problems(pack_dir):
    """Every file listed in SHA256SUMS present with its hash, and no file that is not listed."""
    if not (pack_dir / SUMS_FILE).is_file():
        return [f"{SUMS_FILE}: file is missing"]
    listed, problems = listed_file_problems(pack_dir)
    present = set(folder_files(pack_dir))
    for name in sorted(present - listed.keys() - {SUMS_FILE}):
        problems.append(f"{name}: not listed in SHA256SUMS (unexpected file)")
    return problems


def runtime_version_problems(pins):
    """The mlx / mlx-vlm versions installed against the ones the pack pins."""
    from importlib.metadata import PackageNotFoundError, version

    problems = []
    for package, pinned in sorted(pins.get("runtime", {}).items()):
        try:
            installed = version(package)
        except PackageNotFoundError:
            installed = None
        if installed != pinned:
            problems.append(f"{package}: pinned {pinned}, installed {installed}")
    return problems


def verify_pack(pack_dir):
    """Check a built pack folder without loading weights; returns [(check, ok, detail)].

    SHA256SUMS (every file hashed, missing and unlisted files), the launch pins in
    dflash2-pack.json and the installed runtime versions, the target and drafter checks,
    and the kernel self-test on this machine."""
    import dflash2_kernels

    pack_dir = Path(pack_dir)
    target_dir, drafter_dir = find_pack(pack_dir)
    results = []

    def record(check, problems):
        results.append((check, not problems, "; ".join(problems) or "ok"))

    record("SHA256SUMS", sha256sums_problems(pack_dir))
    try:
        pins = read_pins(pack_dir)
        # SHA256SUMS above hashed every file; the launch check adds sizes and headers.
        record(f"{PINS_FILE} file pins", check_pins(pack_dir, full_hash=False))
        record(f"{PINS_FILE} runtime versions", runtime_version_problems(pins))
    except ValueError as error:
        record(PINS_FILE, [str(error)])
    for check, run in (
        ("target schema", lambda: check_target(target_dir)),
        ("drafter fit", lambda: check_drafter(drafter_dir or pack_dir / "drafter", target_dir)),
    ):
        try:
            run()
            record(check, [])
        except PackError as error:
            record(check, [str(error)])
    try:  # at the pack's own shapes and dtypes, as the server's start-up runs them
        skeleton = build_skeleton(read_config(target_dir), relative_name(target_dir, "config.json"))
        typed_as_headers(skeleton, read_headers(target_dir)[0])
        tests = dflash2_kernels.verify_kernel_self_tests(kernel_shapes(skeleton))
    except PackError as error:
        record("kernel self-test", [str(error)])
        return results
    for name, test in tests.items():
        record(f"kernel self-test {name} ({test.backend})",
               [] if test.ok else [f"{test.reason or 'failed'}: {test.mismatches} differing elements"])
    return results


def format_verify_table(results):
    width = max(len(check) for check, _, _ in results)
    return "\n".join(f"{check:<{width}}  {'PASS' if ok else 'FAIL'}  {detail}" for check, ok, detail in results)
