"""tools/build_pack.py and the pack verification (dflash2_pack.verify_pack and
serve_dflash2.py --verify-pack) on packs built from the tiny synthetic target and drafter."""

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import openai
import pytest

from build_pack import RUNTIME_FILES, build_pack
from conftest import Server, clean_env, flip_byte, request
from dflash2_pack import verify_pack


def build(sources, out_dir, target=None):
    return build_pack(str(target or sources["target"]), str(sources["drafter"]), out_dir)


@pytest.fixture(scope="module")
def built_pack(tiny_pack, tmp_path_factory):
    """A pack built once from the tiny synthetic pack. Read-only: copy it to change it."""
    return build(tiny_pack, tmp_path_factory.mktemp("built") / "pack")


@pytest.fixture
def pack_copy(built_pack, tmp_path):
    return Path(shutil.copytree(built_pack, tmp_path / "pack"))


def verify_from_the_pack(pack_dir):
    """`python serve_dflash2.py --verify-pack` run from the pack's own copy, as a user would."""
    return subprocess.run([sys.executable, "serve_dflash2.py", "--verify-pack"], cwd=pack_dir,
                          env=clean_env(), capture_output=True, text=True, timeout=60)


def test_layout_pins_and_unchanged_target(built_pack, tiny_pack):
    pins = json.loads((built_pack / "dflash2-pack.json").read_text())
    assert pins["runtime"] == {"mlx": "0.32.2", "mlx-vlm": "0.7.2"}
    assert set(pins["config_sha256"]) == {"config.json", "drafter/config.json"}
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (built_pack / name).read_bytes() == (tiny_pack["target"] / name).read_bytes()
    assert (built_pack / "drafter" / "config.json").read_bytes() == (tiny_pack["drafter"] / "config.json").read_bytes()
    for name in (*RUNTIME_FILES, "README.md", "NOTICE.txt", "evidence"):
        assert (built_pack / name).exists(), name
    assert "Created using Bonsai by Prism ML" in (built_pack / "NOTICE.txt").read_text()


def test_readme_is_a_model_card_filled_from_evidence(built_pack, tiny_pack):
    card = (built_pack / "README.md").read_text()
    front = card.split("---\n")[1]
    for key in ("license:", "base_model:", "library_name: mlx", "pipeline_tag:", "tags:"):
        assert key in front, key
    for section in ("## Check and serve", "## Routing", "## How it works", "## Correctness",
                    "## Measured speed", "## Limitations", "## Licenses and attribution"):
        assert section in card, section
    # Figures come from the records as written: the parity record's count appears verbatim.
    parity = json.loads((built_pack / "evidence" / "parity-cuda.json").read_text())
    assert f"| exact_mismatches | {parity['exact_mismatches']} |" in card
    bench = json.loads((built_pack / "evidence" / "bench-cuda-27b.json").read_text())
    assert f"| e2e_speedup.chat | {bench['e2e_speedup']['chat']} |" in card


@pytest.mark.parametrize("tool", [["sha256sum", "-c"], ["shasum", "-a", "256", "-c"]])
def test_checksum_tools_accept_sha256sums(built_pack, tool):
    if shutil.which(tool[0]) is None:
        pytest.skip(f"{tool[0]} is not installed")
    result = subprocess.run([*tool, "SHA256SUMS"], cwd=built_pack, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_verify_passes_on_the_built_pack(built_pack):
    results = verify_pack(built_pack)
    assert all(ok for _, ok, _ in results), results
    assert any(check.startswith("kernel self-test") for check, _, _ in results)


def test_verify_twice_then_rebuild_gives_identical_sha256sums(built_pack, tiny_pack, pack_copy):
    for _ in range(2):  # the first run leaves __pycache__/ in the pack; neither run may mind
        result = verify_from_the_pack(pack_copy)
        assert result.returncode == 0, result.stdout + result.stderr
    build(tiny_pack, pack_copy)  # over a previous build
    assert (pack_copy / "SHA256SUMS").read_bytes() == (built_pack / "SHA256SUMS").read_bytes()


def flip_weight_byte(pack_dir):
    path = pack_dir / "model.safetensors"
    flip_byte(path, path.stat().st_size - 100)  # inside the weights, past the header
    return "model.safetensors"


def edit_config_field(pack_dir):
    path = pack_dir / "drafter" / "config.json"
    config = json.loads(path.read_text())
    config["dflash_config"]["block_size"] += 1
    path.write_text(json.dumps(config))
    return "drafter/config.json"


def remove_file(pack_dir):
    (pack_dir / "tokenizer.json").unlink()
    return "tokenizer.json"


def add_unexpected_file(pack_dir):
    (pack_dir / "evidence" / "notes.txt").write_text("not part of the build\n")
    return "evidence/notes.txt"


@pytest.mark.parametrize("tamper", [flip_weight_byte, edit_config_field, remove_file, add_unexpected_file])
def test_verify_pack_names_the_tampered_file(pack_copy, tamper):
    name = tamper(pack_copy)
    result = verify_from_the_pack(pack_copy)
    assert result.returncode == 1, result.stdout + result.stderr
    failing = [line for line in result.stdout.splitlines() if "  FAIL  " in line]
    assert failing and f"{name}:" in failing[0], result.stdout  # SHA256SUMS is the first row


def test_dry_run_writes_nothing(tiny_pack, tmp_path, capsys):
    build_pack(str(tiny_pack["target"]), str(tiny_pack["drafter"]), tmp_path / "pack", dry_run=True)
    assert not (tmp_path / "pack").exists()
    assert "copy  model.safetensors" in capsys.readouterr().out


def test_refuses_a_folder_it_did_not_build(tiny_pack, tmp_path):
    (tmp_path / "mine.txt").write_text("user file\n")
    with pytest.raises(SystemExit, match="not a previous pack build"):
        build(tiny_pack, tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "user file\n"


def test_derivative_target_with_4bit_drafter_builds_verifies_and_serves(tiny_pack, tmp_path):
    """Same shapes, some tensors edited, rewritten with safetensors: a valid new pack,
    built with the drafter prequantized to 4 bits."""
    target = Path(shutil.copytree(tiny_pack["target"], tmp_path / "derivative"))
    weights, metadata = mx.load(str(target / "model.safetensors"), return_metadata=True)
    edited = [name for name in sorted(weights) if name.endswith("norm.weight")][:3]
    assert edited
    for name in edited:
        weights[name] = weights[name] * 1.5
    # MLX reads lazily from the file it loaded, so write beside it and rename.
    mx.save_safetensors(str(target / "edited.safetensors"), weights, metadata=metadata)
    (target / "edited.safetensors").replace(target / "model.safetensors")
    assert (target / "model.safetensors").read_bytes() != (tiny_pack["target"] / "model.safetensors").read_bytes()

    pack_dir = build_pack(str(target), str(tiny_pack["drafter"]), tmp_path / "pack", drafter_form="4bit")
    assert (pack_dir / "model.safetensors").read_bytes() == (target / "model.safetensors").read_bytes()
    quantization = json.loads((pack_dir / "drafter" / "config.json").read_text())["quantization"]
    assert (quantization["bits"], quantization["group_size"], quantization["mode"]) == (4, 64, "affine")
    kept = sorted(path for path, value in quantization.items() if value is False)
    assert kept and all("kernel_projection" in p or "candidate_selector." in p for p in kept)
    header = json.loads((pack_dir / "drafter" / "model.safetensors").read_bytes()[8:][: int.from_bytes(
        (pack_dir / "drafter" / "model.safetensors").read_bytes()[:8], "little")])
    assert all(f"{path}.scales" not in header for path in kept)
    assert any(name.endswith(".scales") for name in header)
    results = verify_pack(pack_dir)  # the loader's drafter check accepts the 4-bit form
    assert all(ok for _, ok, _ in results), results

    # The built folder serves: launch pins pass and a greedy request runs speculative.
    workdir = tmp_path / "run"
    for folder in ("cwd", "home"):
        (workdir / folder).mkdir(parents=True)
    server = Server("derivative", pack_dir, workdir, [str(pack_dir / "serve_dflash2.py")])
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        raw = client.chat.completions.with_raw_response.create(
            model=pack_dir.name,
            messages=[{"role": "user", "content": "Hi"}],
            temperature=0,
            max_tokens=4,
        )
        assert raw.headers["x-dflash2"] == "speculative"
        assert raw.parse().usage.completion_tokens == 4
        # The round costs were measured at start-up, for every block the drafter allows.
        costs = request(server, "GET", "/health", record=False).json()["round_costs"]
        assert costs["decode_step_ms"] > 0
        assert list(costs["verify_steps_by_block"]) == [str(b) for b in range(2, 9)]
        assert all(steps > 0 for steps in costs["draft_steps_by_block"].values())
        runtime = request(server, "GET", "/health", record=False).json()["runtime"]
        check = runtime["verify_self_check"]
        assert check["blocks"] == 7 and check["differing"] == 0
        assert runtime["plain_decode_path"]["arm"] in ("mlx", "rotation", "rotation+recurrence",
                                                       "rotation+recurrence+matmul")
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------
# Damaged packs: a clear error naming the file, never a traceback


def start_from_the_pack(pack_dir):
    """`python serve_dflash2.py` run from the pack; each damage here stops it before loading."""
    return subprocess.run([sys.executable, "serve_dflash2.py"], cwd=pack_dir, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


def change_header_digit(pack_dir):
    path = pack_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    at = data.index(b'"data_offsets":[0,') + len(b'"data_offsets":[0,')  # the first tensor's end
    data[at] = ord("9") if data[at] != ord("9") else ord("8")
    path.write_bytes(bytes(data))


def truncate_weights(pack_dir):
    path = pack_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", [change_header_digit, truncate_weights])
def test_damaged_weights_are_named_at_start_and_by_verify(pack_copy, damage):
    damage(pack_copy)
    verify = verify_from_the_pack(pack_copy)
    assert verify.returncode == 1
    failing = [line for line in verify.stdout.splitlines() if "  FAIL  " in line]
    assert any(line.startswith("target schema") and "model.safetensors: not a valid safetensors file" in line
               for line in failing), verify.stdout
    start = start_from_the_pack(pack_copy)
    assert start.returncode == 1 and "model.safetensors:" in start.stderr
    (pack_copy / "dflash2-pack.json").unlink()  # past the pins, to the pack checks
    start = start_from_the_pack(pack_copy)
    assert start.returncode == 1 and "model.safetensors: not a valid safetensors file" in start.stderr
    for result in (verify, start):
        assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("pins, message", [
    ("{not json", "dflash2-pack.json: not valid JSON"),
    ('{"files": []}', 'dflash2-pack.json: expected {"files"'),
    ('{"files": {"config.json": {"size": "12"}}}', "dflash2-pack.json: files['config.json']: expected"),
    ('{"files": {"../outside": {"size": 1, "sha256": "00"}}}', "dflash2-pack.json: files['../outside']"),
])
def test_invalid_pins_file_is_named_at_start_and_by_verify(pack_copy, pins, message):
    (pack_copy / "dflash2-pack.json").write_text(pins)
    start = start_from_the_pack(pack_copy)
    assert start.returncode == 1 and message in start.stderr, start.stderr
    verify = verify_from_the_pack(pack_copy)
    assert verify.returncode == 1 and message in verify.stdout, verify.stdout
    for result in (verify, start):
        assert "Traceback" not in result.stdout + result.stderr


REPO = Path(__file__).resolve().parents[1]
# The top-level modules, entry points first: each imports only modules after it.
LAYERS = ["serve_dflash2", "serve", "dflash2_engine", "dflash2_gateway", "dflash2_options", "dflash2_http",
          "dflash2_runtime", "dflash2_policy", "dflash2_pack", "dflash2_audit", "dflash2_kernels"]


def imported_modules(path):
    tree = ast.parse(path.read_text())
    return {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
            for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                        if isinstance(node, ast.ImportFrom) and node.module}


def test_the_pack_ships_every_module_and_imports_run_downward():
    assert {f"{name}.py" for name in LAYERS} == {path.name for path in REPO.glob("*.py")}
    assert {f"{name}.py" for name in LAYERS} <= set(RUNTIME_FILES)
    for index, name in enumerate(LAYERS):
        upward = imported_modules(REPO / f"{name}.py") & set(LAYERS[:index + 1])
        assert not upward, f"{name} imports {upward}"
    for path in (REPO / "tools").glob("*.py"):
        assert not imported_modules(path) & {"serve", "serve_dflash2"}, path.name
