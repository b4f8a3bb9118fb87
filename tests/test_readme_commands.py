"""README's two commands, as written: the demo serves speculatively, and CI runs the test command.

The first command's server part runs exactly as README writes it (a free port added), from a
clean copy of the repository (its tracked and unignored files), and answers through the
official openai client. If README's command changes, this runs the new one.
"""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from server_process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
PROMPT = "Write a Python function that reverses a list."


def two_commands() -> list:
    """The code blocks of README's "Two commands" section, one command each."""
    section = re.search(r"^## Two commands\n(.*?)^## ", (REPO / "README.md").read_text(), re.S | re.M).group(1)
    return [block.strip() for block in re.findall(r"^```\n(.*?)^```", section, re.S | re.M)]


def clean_copy(destination: Path) -> Path:
    """The repository's tracked and unignored files (what a fresh clone of the working tree holds)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        if (REPO / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, destination / name)
    return destination


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's server part, the same with --no-dflash2, and serve.py --demo (the plain
    server on the same fixture), started from a clean copy."""
    install, _, server = two_commands()[0].partition(" && ")
    copy = clean_copy(tmp_path_factory.mktemp("clone"))
    commands = {"demo": shlex.split(server), "demo-plain": shlex.split(server) + ["--no-dflash2"],
                "serve-demo": [sys.executable, "serve.py", "--demo"]}
    servers = {}
    try:
        for name, command in commands.items():
            servers[name] = ServerProcess(name, command, tmp_path_factory.mktemp(name), cwd=copy, python=None)
        for process in servers.values():
            process.wait_ready()
        yield install, servers
    finally:
        for process in servers.values():
            process.stop()


def ask(server, **options):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": PROMPT}],
        max_tokens=32, extra_body={"enable_thinking": False}, **options)
    return raw.headers.get("x-dflash2"), raw.http_response.json()


def test_the_first_command_installs_what_ci_installs(demo):
    install, _ = demo
    assert install == "python3 -m pip install -r requirements.txt", install
    assert "-r requirements.txt" in (REPO / ".ci" / "run").read_text()


def test_the_demo_answers_speculatively_with_accepted_drafts_and_plain_text(demo):
    _, servers = demo
    mode, body = ask(servers["demo"], temperature=0)
    plain_mode, plain_body = ask(servers["demo-plain"], temperature=0)
    assert mode == "speculative", mode
    assert body["timings"]["draft_n_accepted"] > 0, body["timings"]
    assert plain_mode == "fallback; reason=no-dflash2", plain_mode
    text = body["choices"][0]["message"]["content"]
    assert text and text == plain_body["choices"][0]["message"]["content"]


def test_both_servers_log_their_memory_after_the_warm_up(demo):
    """Each start says what memory it holds once ready and what its last warm-up request
    peaked at (MLX's active memory: weights, drafter, caches): a user and the benchmarks can
    compare the servers at rest. The speculative demo holds its drafter on top."""
    from bench_server import server_memory  # what the server benchmark records from these logs

    _, servers = demo
    held = {}
    for name, process in servers.items():
        ask(process, temperature=0)
        process.wait_for_log(0, "peak_memory=", timeout=30)  # the request's finish line
        line = next(line for line in process.log().splitlines() if "warm-up plain:" in line)
        match = re.search(r"memory in use ([0-9.]+) GB, its peak ([0-9.]+) GB", line)
        assert match, line
        memory = server_memory(process.log())
        held[name] = memory["at_rest_gb"]
        assert held[name] == float(match[1]) > 0 and memory["request_peak_gb"]["n"] >= 1, (line, memory)
        assert held[name] <= float(match[2]) <= memory["request_peak_gb"]["max"], (line, memory)
    # The plain servers hold the same, to the log's resolution (1 MB: the tiny pair's ~1.5 MB
    # at rest has rounded to 0.001 in one and 0.002 in the other under CI's load).
    assert held["demo"] > max(held["serve-demo"], held["demo-plain"]) + 0.001
    assert abs(held["serve-demo"] - held["demo-plain"]) <= 0.001 + 1e-9


def test_serve_py_demo_serves_the_same_fixture_plain(demo):
    _, servers = demo
    mode, body = ask(servers["serve-demo"], temperature=0)
    _, speculative_body = ask(servers["demo"], temperature=0)
    assert mode is None  # serve.py routes nothing: no x-dflash2 header
    assert body["model"] == speculative_body["model"] == "dflash2-demo-tiny"
    text = body["choices"][0]["message"]["content"]
    assert text and text == speculative_body["choices"][0]["message"]["content"]


def test_the_second_command_is_what_ci_runs():
    assert two_commands()[1] == "bash .ci/run"


def pack_folders() -> list:
    """Every fixture folder that holds a pack (a target config, top level or in target/)."""
    return sorted({path.parent.parent if path.parent.name == "target" else path.parent
                   for path in FIXTURES.rglob("config.json") if path.parent.name != "drafter"})


@pytest.mark.parametrize("folder", pack_folders(), ids=lambda folder: folder.name)
def test_every_fixture_pack_passes_the_launch_checks(folder):
    """A folder with SHA256SUMS needs dflash2-pack.json (dflash2_options.exit_if_pins_differ):
    each fixture pack holds both, and every file matches them, weights hashed whole."""
    from dflash2_pack import PINS_FILE, SUMS_FILE, check_pins, listed_file_problems

    assert (folder / PINS_FILE).is_file() and (folder / SUMS_FILE).is_file()
    assert check_pins(folder, full_hash=True) == []
    assert listed_file_problems(folder)[1] == []


def test_the_fixture_list_is_not_empty():
    assert [folder.name for folder in pack_folders()] == ["tiny-pair"]


def test_an_unpinned_weights_file_in_a_source_layouts_target_folder_fails_the_pins(tmp_path):
    from dflash2_pack import check_pins

    pack = Path(shutil.copytree(FIXTURES / "tiny-pair", tmp_path / "pair"))
    (pack / "target" / "model-extra.safetensors").write_bytes(b"{}")
    assert check_pins(pack, full_hash=False) == [
        "target/model-extra.safetensors: a weights file not in dflash2-pack.json (the model would load it unchecked)"]
