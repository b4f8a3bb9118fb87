"""The synthetic pack generator and the pack checks (tools/make_synthetic_pack.py,
dflash2_pack.py), on real files loaded by mlx-vlm's own code."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm import stream_generate
from mlx_vlm.prompt_utils import apply_chat_template
from mlx_vlm.speculative.drafters import load_drafter, validate_drafter_compatibility
from mlx_vlm.utils import prepare_inputs
from PIL import Image

from dflash2_pack import PackError, check_drafter, check_target, find_pack, load_pack
from make_synthetic_pack import make_pack, write_drafter


@pytest.fixture(scope="module")
def loaded(tiny_pack):
    return load_pack(tiny_pack["target"], tiny_pack["drafter"])


def pack_files(root):
    return {path.relative_to(root): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_same_seed_gives_identical_bytes(tiny_pack, tmp_path):
    again = make_pack(tmp_path / "again", size="tiny", seed=0)
    assert pack_files(again["root"]) == pack_files(tiny_pack["root"])

    other = pack_files(make_pack(tmp_path / "other", size="tiny", seed=1)["root"])
    original = pack_files(tiny_pack["root"])
    weights = {Path("target/model.safetensors"), Path("drafter/model.safetensors")}
    assert {name for name in original if other[name] != original[name]} == weights


def test_target_generates_varied_greedy_text(loaded):
    model, processor, _ = loaded
    prompt = apply_chat_template(processor, model.config, "Hello", enable_thinking=False)
    steps = list(stream_generate(model, processor, prompt, max_tokens=32, temperature=0.0))
    # The head never favours end tokens, so greedy runs to max_tokens, and the random
    # weights give a varied continuation rather than one token repeated.
    assert (steps[-1].finish_reason, steps[-1].generation_tokens) == ("length", 32)
    tokens = [step.token for step in steps if step.finish_reason is None]
    assert len(set(tokens)) >= 8, tokens
    assert all(char.isprintable() or char in "\n\t" for char in "".join(step.text for step in steps))


def test_image_prompt_goes_through_the_vision_tower(loaded, tmp_path):
    model, processor, _ = loaded
    prompt = apply_chat_template(
        processor, model.config, "What is in this image?", num_images=1, enable_thinking=False
    )
    rng = np.random.default_rng(0)
    embeddings = []
    for index in range(2):
        path = tmp_path / f"image{index}.png"
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
        inputs = prepare_inputs(processor, images=[str(path)], prompts=[prompt])
        features = model.get_input_embeddings(
            inputs["input_ids"], inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
        )
        embeddings.append(np.array(features.inputs_embeds[0].astype(mx.float32)))
    image_positions = np.array(inputs["input_ids"][0] == model.config.image_token_id)
    # A 64x64 image is a 4x4 patch grid, merged 2x2 into 4 image tokens.
    assert image_positions.sum() == 4
    changed = np.any(embeddings[0] != embeddings[1], axis=-1)
    assert np.array_equal(changed, image_positions)

    # And the plain mlx-vlm generate path accepts the image end to end.
    steps = list(stream_generate(model, processor, prompt, image=[str(path)], max_tokens=2, temperature=0.0))
    assert steps[-1].prompt_tokens == len(inputs["input_ids"][0])


def test_float32_dense_variant_runs_the_stream_in_float32(float32_pack):
    # The layout whose byte count matches the real 27B file: fp32 norms and GDN gates.
    check_target(float32_pack["target"])
    model, _, _ = load_pack(float32_pack["target"])
    norm = model.language_model.model.layers[0].input_layernorm.weight
    assert norm.dtype == mx.float32
    logits = model.language_model(mx.array([[100, 101]])).logits
    assert logits.dtype == mx.float32


@pytest.mark.parametrize(
    "form, codebook_names",
    [("bf16", "plain"), ("bf16", "weight"), ("4bit", "plain"), ("4bit", "weight")],
)
def test_drafter_forms_load_and_fit_the_target(loaded, tiny_pack, tmp_path, form, codebook_names):
    model = loaded[0]
    folder = tmp_path / "drafter"
    write_drafter(folder, "tiny", 0, form, codebook_names)
    check_drafter(folder, tiny_pack["target"])

    header = Path(folder / "model.safetensors").read_bytes()
    codebook = b'"candidate_selector.predecessor_codebook' + (b'.weight"' if codebook_names == "weight" else b'"')
    assert codebook in header

    drafter, kind = load_drafter(folder)
    assert kind == "dflash" and type(drafter).__name__ == "DFlash2DraftModel"
    validate_drafter_compatibility(model, drafter, kind)
    layer = drafter.layers[0]
    quantized = type(layer.self_attn.q_proj).__name__ == "QuantizedLinear"
    assert quantized == (form == "4bit")
    # The conv kernel projections and the selector stay bf16 in every form.
    assert layer.attention_conv.kernel_projection.weight.dtype == mx.bfloat16
    assert drafter.candidate_selector.predecessor_codebook.weight.dtype == mx.bfloat16


# ---------------------------------------------------------------------------------------
# Bad packs: each raises PackError naming the file and the field or tensor.


def edit_config(folder, change):
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def edit_weights(folder, change):
    path = str(Path(folder) / "model.safetensors")
    weights = mx.load(path)
    change(weights)
    mx.eval(weights)  # mx.load is lazy: read everything before overwriting the file
    mx.save_safetensors(path, weights, metadata={"format": "mlx"})


def module_record(config, path):
    return next(record for record in config["modules"] if record["path"] == path)


def set_sign(weights, name, value):
    signs = weights[name]
    weights[name] = mx.concatenate([mx.array([value], dtype=signs.dtype), signs[1:]])


TARGET_CASES = {
    "schema fields": (
        "config.json",
        lambda c: c.update(schema_version=3, tensor_namespace="other"),
        ["2 problems", "schema_version: expected 2, got 3", "tensor_namespace: expected 'mlx-vlm-qwen3_5', got 'other'"],
    ),
    "quantization": (
        "config.json",
        lambda c: c["quantization"].update(bits=4),
        ["quantization: expected", "'bits': 4"],
    ),
    "manifest block": (
        "config.json",
        lambda c: module_record(c, "lm_head").update(block=1024),
        ["(lm_head) block", "input width 512", "got 1024"],
    ),
    "manifest dtype": (
        "config.json",
        lambda c: module_record(c, "lm_head").update(dtype="bfloat16"),
        ["(lm_head) dtype: expected 'float16', got 'bfloat16'"],
    ),
    "manifest path": (
        "config.json",
        lambda c: module_record(c, "lm_head").update(path="model.lm_head"),
        ["(model.lm_head): no Linear or Embedding"],
    ),
    "missing scales": (
        "model.safetensors",
        lambda w: w.pop("language_model.lm_head.scales"),
        ["missing 1 tensor(s): language_model.lm_head.scales"],
    ),
    "missing signs": (
        "model.safetensors",
        lambda w: w.pop("language_model.model.embed_tokens.signs"),
        ["missing 1 tensor(s): language_model.model.embed_tokens.signs"],
    ),
    "wrong shape": (
        "model.safetensors",
        lambda w: w.update({"language_model.lm_head.biases": w["language_model.lm_head.biases"][:, :2]}),
        ["language_model.lm_head.biases shape: expected [512, 4], got [512, 2]"],
    ),
    "wrong dtype": (
        "model.safetensors",
        lambda w: w.update({"language_model.lm_head.scales": w["language_model.lm_head.scales"].astype(mx.float32)}),
        ["language_model.lm_head.scales dtype: expected F16, got 'F32'"],
    ),
    "signs not +-1": (
        "model.safetensors",
        lambda w: set_sign(w, "language_model.lm_head.signs", 0.5),
        ["language_model.lm_head.signs: expected only -1 and +1, got 1 other value(s)"],
    ),
}

DRAFTER_CASES = {
    "hidden size": (
        "config.json",
        lambda c: c.update(hidden_size=256),
        ["hidden_size: expected 512 (the target's hidden_size), got 256"],
    ),
    "layer count": (
        "config.json",
        lambda c: c.update(num_target_layers=64),
        ["num_target_layers: expected 2 (the target's num_hidden_layers), got 64"],
    ),
    "vocabulary": (
        "config.json",
        lambda c: c.update(vocab_size=248320),
        ["vocab_size: expected 512 (the target's vocab_size), got 248320"],
    ),
    "taps out of range": (
        "config.json",
        lambda c: c["dflash_config"].update(target_layer_ids=[5, 19, 33]),
        ["dflash_config.target_layer_ids: expected 'increasing layer ids in [0, 2)', got [5, 19, 33]"],
    ),
    "mask token outside vocab": (
        "config.json",
        lambda c: c["dflash_config"].update(mask_token_id=248070),
        ["dflash_config.mask_token_id: expected 'an id in [0, 512)', got 248070"],
    ),
    "no dflash_config": (
        "config.json",
        lambda c: c.pop("dflash_config"),
        ["dflash_config: expected 'an object', got None"],
    ),
    "missing tensor": (
        "model.safetensors",
        lambda w: w.pop("fc.weight"),
        ["missing 1 tensor(s): fc.weight"],
    ),
    "embedding in the file": (
        "model.safetensors",
        lambda w: w.update({"embed_tokens.weight": mx.zeros((512, 512), dtype=mx.bfloat16)}),
        ["unexpected 1 tensor(s): embed_tokens.weight"],
    ),
}


@pytest.fixture
def pack_copy(tiny_pack, tmp_path):
    shutil.copytree(tiny_pack["root"], tmp_path / "pack")
    return {"target": tmp_path / "pack" / "target", "drafter": tmp_path / "pack" / "drafter"}


def corrupt(folder, file_name, change):
    (edit_config if file_name == "config.json" else edit_weights)(folder, change)


@pytest.mark.parametrize("case", TARGET_CASES)
def test_bad_target_raises_pack_error(pack_copy, case):
    file_name, change, fragments = TARGET_CASES[case]
    corrupt(pack_copy["target"], file_name, change)
    with pytest.raises(PackError) as error:
        check_target(pack_copy["target"])
    assert error.value.file == f"target/{file_name}"
    message = str(error.value)
    assert message.startswith(f"target/{file_name}: ")
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize("case", DRAFTER_CASES)
def test_bad_drafter_raises_pack_error(pack_copy, case):
    file_name, change, fragments = DRAFTER_CASES[case]
    corrupt(pack_copy["drafter"], file_name, change)
    with pytest.raises(PackError) as error:
        check_drafter(pack_copy["drafter"], pack_copy["target"])
    assert error.value.file == f"drafter/{file_name}"
    for fragment in fragments:
        assert fragment in str(error.value)


def test_missing_files_are_named(pack_copy):
    (pack_copy["drafter"] / "model.safetensors").unlink()
    with pytest.raises(PackError, match=r"^drafter/model\.safetensors: file is missing$"):
        check_drafter(pack_copy["drafter"], pack_copy["target"])
    (pack_copy["target"] / "config.json").unlink()
    with pytest.raises(PackError, match=r"^target/config\.json: file is missing$"):
        check_target(pack_copy["target"])


def test_load_pack_checks_before_loading(pack_copy):
    corrupt(pack_copy["drafter"], "config.json", lambda c: c.update(num_target_layers=64))
    with pytest.raises(PackError, match="drafter/config.json"):
        load_pack(pack_copy["target"], pack_copy["drafter"])


def test_find_pack_layouts(tiny_pack, tmp_path):
    assert find_pack(tiny_pack["root"]) == (tiny_pack["target"], tiny_pack["drafter"])
    release = tmp_path / "release"
    shutil.copytree(tiny_pack["target"], release)
    assert find_pack(release) == (release, None)
    shutil.copytree(tiny_pack["drafter"], release / "drafter")
    assert find_pack(release) == (release, release / "drafter")


def test_layers_option_gives_the_real_layer_pattern(tmp_path):
    paths = make_pack(tmp_path, size="tiny4", seed=0, layers=64)
    model, _, drafter = load_pack(paths["target"], paths["drafter"])
    layers = model.language_model.model.layers
    assert len(layers) == 64 and drafter.config.num_target_layers == 64
    assert [i for i, layer in enumerate(layers) if not layer.is_linear] == list(range(3, 64, 4))
    with pytest.raises(ValueError, match="at least 4 layers, got 3"):
        make_pack(tmp_path / "short", size="tiny4", layers=3)
