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

import dflash2_decode_arms
from build_pack import RUNTIME_FILES, build_pack
from conftest import data_url, flip_byte, png, request
from dflash2_pack import verify_pack
from server_process import clean_env


def build(sources, out_dir, target=None):
    return build_pack(str(target or sources["target"]), str(sources["drafter"]), out_dir)


@pytest.fixture(scope="session")
def tiny_pack(float32_pack):
    """Here the pack built_pack is built from (conftest: the fp32 tiny pack)."""
    return float32_pack


@pytest.fixture
def pack_copy(built_pack, tmp_path):
    return Path(shutil.copytree(built_pack, tmp_path / "pack"))


@pytest.fixture
def file_checks(monkeypatch):
    """verify_pack(pack) -> [(check, ok, detail)] of its file checks; the kernel
    self-tests, which read no pack file (and run in full in the test before), report
    nothing here."""
    import dflash2_kernels

    monkeypatch.setattr(dflash2_kernels, "verify_kernel_self_tests", lambda shapes: {})
    return verify_pack


def failing(results):
    return [(check, detail) for check, ok, detail in results if not ok]


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


def test_verify_from_the_pack_passes_then_rebuild_gives_identical_sha256sums(built_pack, tiny_pack, pack_copy,
                                                                             file_checks):
    # `python serve_dflash2.py --verify-pack` from the pack's own copy, as a user runs it.
    result = subprocess.run([sys.executable, "serve_dflash2.py", "--verify-pack"], cwd=pack_copy,
                            env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = result.stdout.splitlines()
    assert any(row.startswith("kernel self-test qmv") and "  PASS  " in row for row in rows), result.stdout
    # Runs from the pack leave __pycache__/ in it (unless PYTHONDONTWRITEBYTECODE): ignored.
    (pack_copy / "__pycache__").mkdir(exist_ok=True)
    (pack_copy / "__pycache__" / "serve.cpython-311.pyc").write_bytes(b"\0")
    assert failing(file_checks(pack_copy)) == []
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
def test_verify_pack_names_the_tampered_file(pack_copy, file_checks, tamper):
    name = tamper(pack_copy)
    problems = failing(file_checks(pack_copy))
    assert problems and problems[0][0] == "SHA256SUMS" and f"{name}:" in problems[0][1], problems


def test_dry_run_writes_nothing(tiny_pack, tmp_path, capsys):
    build_pack(str(tiny_pack["target"]), str(tiny_pack["drafter"]), tmp_path / "pack", dry_run=True)
    assert not (tmp_path / "pack").exists()
    assert "copy  model.safetensors" in capsys.readouterr().out


def test_mistyped_sources_and_an_output_file_are_one_line_errors(tiny_pack, tmp_path):
    """A source that is neither a folder nor a Hugging Face ID found, or --out naming a file: one
    line naming it, not a traceback."""
    with pytest.raises(SystemExit, match=f"error: {tmp_path / 'missing'}: not a folder"):
        build_pack(str(tmp_path / "missing"), str(tiny_pack["drafter"]), tmp_path / "pack")
    with pytest.raises(SystemExit, match="error: nobody/no-such-pack: neither a folder here, nor downloadable"):
        build_pack("nobody/no-such-pack", str(tiny_pack["drafter"]), tmp_path / "pack")
    (tmp_path / "a-file").write_text("mine\n")
    with pytest.raises(SystemExit, match="a file, not a folder"):
        build_pack(str(tiny_pack["target"]), str(tiny_pack["drafter"]), tmp_path / "a-file")
    assert (tmp_path / "a-file").read_text() == "mine\n"


def test_refuses_a_folder_it_did_not_build(tiny_pack, tmp_path):
    (tmp_path / "mine.txt").write_text("user file\n")
    with pytest.raises(SystemExit, match="not a previous pack build"):
        build(tiny_pack, tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "user file\n"


def test_verify_leaves_out_what_git_and_hf_download_write_beside_the_pack(pack_copy, file_checks):
    for name in (".git/HEAD", ".cache/huggingface/download/model.safetensors.metadata", ".huggingface/x"):
        (pack_copy / name).parent.mkdir(parents=True, exist_ok=True)
        (pack_copy / name).write_text("bookkeeping\n")
    assert not failing(file_checks(pack_copy))
    (pack_copy / "notes.txt").write_text("not the pack's\n")
    assert failing(file_checks(pack_copy)) == [("SHA256SUMS", "notes.txt: not listed in SHA256SUMS (unexpected file)")]


def test_a_build_never_writes_into_its_sources(tiny_pack, built_pack, tmp_path, file_checks):
    """Sources are only read: a build into a source folder (or one inside it) is refused, and
    a link in the output folder to a source file is replaced, not written through (both had
    emptied the weights, with SHA256SUMS of the empty files passing)."""
    source = Path(shutil.copytree(built_pack, tmp_path / "previous"))
    weights = (source / "model.safetensors").read_bytes()
    for out_dir in (source, source / "pack"):
        with pytest.raises(SystemExit, match="overlap"):
            build_pack(str(source), str(source / "drafter"), out_dir)
    assert (source / "model.safetensors").read_bytes() == weights and not (source / "pack").exists()
    sources = {**tiny_pack, "target": Path(shutil.copytree(tiny_pack["target"], tmp_path / "target"))}
    linked = Path(shutil.copytree(built_pack, tmp_path / "linked"))
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(sources["target"] / "model.safetensors")
    target_weights = (sources["target"] / "model.safetensors").read_bytes()
    build(sources, linked)
    assert (sources["target"] / "model.safetensors").read_bytes() == target_weights
    assert not (linked / "model.safetensors").is_symlink() and not failing(file_checks(linked))


def test_derivative_target_with_4bit_drafter_builds_verifies_and_serves(tiny_pack, tmp_path, file_checks, start_server):
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
    assert failing(file_checks(pack_dir)) == []  # the loader's drafter check accepts the 4-bit form
    pins = json.loads((pack_dir / "dflash2-pack.json").read_text())  # the drafter it came from, not a temp folder
    assert pins["drafter"]["source"] == f"{tiny_pack['drafter'].name}, prequantized to 4 bits by build_pack"

    # The built folder serves: launch pins pass and a greedy request runs rounds of the
    # 4-bit drafter (a fixed block runs them whatever they cost; on a CPU no round pays);
    # with --dflash2-multimodal plain, one with an image runs plain. A fixed block decides
    # nothing by costs or acceptance: start-up measures no table and keeps no memory.
    server = start_server("derivative", [pack_dir / "serve_dflash2.py", "--dflash2-multimodal", "plain",
                                         "--dflash2-block-size", "2"])
    try:
        server.wait_ready()
        costs = request(server, "GET", "/health", record=False).json()["round_costs"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        raw = client.chat.completions.with_raw_response.create(
            model=pack_dir.name,
            messages=[{"role": "user", "content": "Hi"}],
            temperature=0,
            max_tokens=4,
        )
        assert raw.headers["x-dflash2"] == "speculative"
        assert raw.parse().usage.completion_tokens == 4
        assert raw.parse().model_extra["timings"]["draft_rounds"] >= 1
        image = [{"type": "image_url", "image_url": {"url": data_url(png())}}]
        raw = client.chat.completions.with_raw_response.create(
            model=pack_dir.name, messages=[{"role": "user", "content": image}], temperature=0, max_tokens=1)
        assert raw.headers["x-dflash2"] == "fallback; reason=multimodal-plain"
        assert costs is None
        runtime = request(server, "GET", "/health", record=False).json()["runtime"]
        check = runtime["verify_self_check"]
        assert check["blocks"] == 7 and check["differing"] == 0 and check["stock_block"] == 8
        assert list(check["seconds_by_part"]) == ["decode steps", "exact rounds", "stock round"]
        assert runtime["drafter_activations"] == "drafter activations: promoted (bf16 is emulated on CPU)"
        assert runtime["plain_decode_path"]["arm"] in dflash2_decode_arms.DECODE_ARMS
        # The log says the fixed block runs rounds, not that requests go plain.
        assert "block fixed at 2 (--dflash2-block-size): greedy and sampled requests run rounds of it" in server.log()
        assert "each request's acceptance estimate starts from the drafter's recent rounds" not in server.log()
        assert "routed plain" not in server.log()
        # Start-up says what it is running before each long check, then what each found.
        log = server.log()
        steps = [log.index(f"start-up check {n} of 7: ") for n in range(1, 8)]
        assert steps == sorted(steps) and steps[2] < log.index("DFlash2 kernel self-tests: ")
        assert "start-up check 7 of 7: round costs: not run: the block is fixed" in log
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
def test_damaged_weights_are_named_at_start_and_by_verify(pack_copy, tiny_pack, tmp_path, file_checks, damage):
    damage(pack_copy)
    problems = dict(failing(file_checks(pack_copy)))
    assert "model.safetensors: not a valid safetensors file" in problems["target schema"], problems
    pinned = start_from_the_pack(pack_copy)
    assert pinned.returncode == 1 and "model.safetensors:" in pinned.stderr
    # Past the pins, to the pack checks: a source layout (target/ and drafter/) has none.
    sources = Path(shutil.copytree(tiny_pack["root"], tmp_path / "sources"))
    damage(sources / "target")
    start = subprocess.run([sys.executable, str(REPO / "serve_dflash2.py"), "--pack", str(sources)], cwd=tmp_path,
                           env=clean_env(), capture_output=True, text=True, timeout=120)
    assert start.returncode == 1 and "model.safetensors: not a valid safetensors file" in start.stderr
    for result in (pinned, start):
        assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("pins, message", [
    ("{not json", "dflash2-pack.json: not valid JSON"),
    ('{"files": []}', 'dflash2-pack.json: expected {"files"'),
    ('{"files": {"config.json": {"size": "12"}}}', "dflash2-pack.json: files['config.json']: expected"),
    ('{"files": {"../outside": {"size": 1, "sha256": "00"}}}', "dflash2-pack.json: files['../outside']"),
])
def test_invalid_pins_file_is_named_at_start_and_by_verify(pack_copy, file_checks, pins, message):
    (pack_copy / "dflash2-pack.json").write_text(pins)
    start = start_from_the_pack(pack_copy)
    assert start.returncode == 1 and message in start.stderr, start.stderr
    assert "Traceback" not in start.stdout + start.stderr
    problems = failing(file_checks(pack_copy))
    assert any(message in detail for _, detail in problems), problems


REPO = Path(__file__).resolve().parents[1]
# The top-level modules, entry points first: each imports only modules after it.
LAYERS = [
    "serve_dflash2",
    "serve",
    "dflash2_launch",
    "dflash2_engine",
    "dflash2_generator",
    "dflash2_speculation",
    "dflash2_prefix_cache",
    "dflash2_gateway",
    "dflash2_record",
    "dflash2_options",
    "dflash2_routing",
    "dflash2_openapi",
    "dflash2_messages_request",
    "dflash2_responses_request",
    "dflash2_requests",
    "dflash2_runtime",
    "dflash2_decode_arms",
    "dflash2_drafter",
    "dflash2_verify",
    "dflash2_timing",
    "dflash2_rounds",
    "dflash2_policy",
    "dflash2_sampling",
    "dflash2_verdicts",
    "dflash2_file_hashes",
    "dflash2_pack",
    "dflash2_audit",
    "dflash2_kernels",
    "dflash2_kernel_prefill",
    "dflash2_kernel_attention",
    "dflash2_kernel_attention_metal",
    "dflash2_kernel_fused",
    "dflash2_kernel_rope",
    "dflash2_kernel_conv32",
    "dflash2_kernel_gdn",
    "dflash2_kernel_linear",
    "dflash2_kernel_rotate",
    "dflash2_kernel_qmv32",
    "dflash2_kernel_qmv",
    "dflash2_kernel_qmv_metal",
    "dflash2_kernel_base",
    "dflash2_kernel_cache",
    "dflash2_kernel_folder",
    "dflash2_source",
]


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
    for path in (REPO / "tools").rglob("*.py"):
        assert not imported_modules(path) & {"serve", "serve_dflash2"}, path.name


def test_the_round_policy_decides_without_mlx():
    # Its decisions are plain Python on measured numbers; dflash2_rounds and dflash2_timing run
    # MLX. Nor does it reach MLX through a pack module: the kernels' row limit comes as a value.
    assert not imported_modules(REPO / "dflash2_policy.py") & {"mlx", "mlx_vlm", *LAYERS}
