"""The servers' start-up refusals: options, hosts, environment, demo, launch pins.

Nearly all of these stop before any model is loaded (not Ctrl-C's, nor the start-up lock's).
Options, hosts and environment variables are refused by each entry point's main() in
process; the rest run as subprocesses.
"""

import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import json
import os
import py_compile
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import flip_byte
from server_process import REFUSED_PREFIXES, ServerProcess, clean_env, free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["serve.py", "serve_dflash2.py"]
MISSING_SHA256SUMS = "SHA256SUMS is missing from the pack folder"

# mlx-vlm server options that must not pass through, as given on a command line.
REFUSED_OPTIONS = [
    ["--kv-bits", "4"],
    ["--kv-bits=4"],
    ["--max-kv-size", "512"],
    ["--model", "/tmp/elsewhere"],
    ["--draft-model", "/tmp/elsewhere"],
    ["--adapter-path", "/tmp/adapter"],
    ["--trust-remote-code"],
    ["--api-key", "secret"],
    ["--max-num-seqs", "4"],
    ["--thinking-budget", "10"],
    ["--thinking-eos-token", "</think>"],
    ["--reload"],
    ["--max-tok", "5"],  # abbreviation of --max-tokens
    ["--enable-think"],  # abbreviation of --enable-thinking
    ["--prefill-step", "64"],
    ["-p", "9000"],
]
REFUSED_HOSTS = [["--host", "0.0.0.0"], ["--host=0.0.0.0"], ["--host", "::"], ["--host", "192.168.1.2"],
                 ["--host", "127.0.0.2"], ["--host", ""]]
REFUSED_ENVIRONMENT = ["KV_BITS", "KV_GROUP_SIZE", "MAX_KV_SIZE", "PREFILL_STEP_SIZE", "QUANTIZED_KV_START",
                       "TOP_LOGPROBS_K", "EXPERT_CACHE_GB", "MLX_TRUST_REMOTE_CODE", "MLX_VLM_MAX_NUM_SEQS",
                       "MLX_VLM_DRAFT_MODEL", "MLX_VLM_PRELOAD_MODEL", "MLX_VLM_THINKING_BUDGET",
                       "APC_ENABLED", "APC_DISK_PATH"]


def run(script, *args, env=None, cwd=REPO, timeout=60):
    return subprocess.run([sys.executable, str(Path(cwd) / script), *args], cwd=cwd,
                          env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def main_exit(capsys, monkeypatch):
    """main_exit(script, *args, **environment) -> (exit status, stderr) of the entry point's
    main() in this process, as a shell would see them, in a clean environment plus
    environment; it must stop before serving."""
    for name in os.environ:
        if name.startswith(REFUSED_PREFIXES):
            monkeypatch.delenv(name)

    def main_exit(script, *args, **environment):
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as stopped:
            importlib.import_module(Path(script).stem).main(list(args))
        stderr, code = capsys.readouterr().err, stopped.value.code
        return (1, stderr + code) if isinstance(code, str) else (code, stderr)

    return main_exit


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("argv", REFUSED_OPTIONS, ids=" ".join)
def test_refused_option(main_exit, script, argv):
    status, stderr = main_exit(script, *argv)
    assert status == 2, stderr
    assert "not accepted" in stderr and argv[0].split("=")[0] in stderr


def test_dflash2_options_are_not_plain_options(main_exit):
    status, stderr = main_exit("serve.py", "--no-dflash2")
    assert status == 2 and "not accepted: --no-dflash2" in stderr


@pytest.mark.parametrize("argv", [["--dflash2-block-size", "4"], ["--dflash2-multimodal", "plain"],
                                  ["--dflash2-round-costs", "costs.json", "--dflash2-sliding-window"]], ids=" ".join)
def test_drafter_options_are_refused_without_the_drafter(main_exit, argv):
    """--no-dflash2 serves without the drafter: options that shape its work would be ignored."""
    status, stderr = main_exit("serve_dflash2.py", "--no-dflash2", *argv)
    assert status == 2, stderr
    refusal = stderr.split("error: ")[-1]
    assert refusal.endswith(" set the drafter's work; --no-dflash2 serves without it\n"), stderr
    named = refusal.split(" set the")[0].split(", ")
    assert sorted(named) == sorted(option for option in argv if option.startswith("--"))


def test_the_demo_fixture_is_not_a_pack_to_verify(main_exit):
    status, stderr = main_exit("serve_dflash2.py", "--demo", "--verify-pack")
    assert status == 2 and "--verify-pack checks a built pack folder" in stderr


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("argv", REFUSED_HOSTS, ids=" ".join)
def test_refused_host(main_exit, script, argv):
    status, stderr = main_exit(script, *argv)
    assert status == 2, stderr
    assert "127.0.0.1 or localhost only" in stderr


@pytest.mark.parametrize("script, argv", [("serve.py", []), ("serve_dflash2.py", []),
                                          ("serve_dflash2.py", ["--no-dflash2"])])
@pytest.mark.parametrize("name", REFUSED_ENVIRONMENT)
def test_refused_environment_variable(main_exit, script, argv, name):
    status, stderr = main_exit(script, *argv, **{name: "1"})
    assert status != 0
    assert name in stderr and "unset them" in stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_refused_variable_is_listed_before_mlx_vlm_is_imported(script):
    # mlx_vlm.server reads the environment at import, so the check must come first.
    probe = (f"import runpy, sys; sys.argv = [{script!r}]\n"
             f"try:\n    runpy.run_path({script!r}, run_name='__main__')\n"
             "except SystemExit as e:\n    print('exit', e.code); print('imported', 'mlx_vlm' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                            env=clean_env(KV_BITS="4", APC_NUM_BLOCKS="8", MLX_VLM_MAX_TOKENS="9"))
    assert "imported False" in result.stdout, result.stdout + result.stderr
    assert "APC_NUM_BLOCKS, KV_BITS, MLX_VLM_MAX_TOKENS" in result.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_address_in_use_is_refused_before_anything_loads(main_exit, script):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        status, stderr = main_exit(script, "--port", str(port))
    assert status == 1 and f"cannot listen on 127.0.0.1:{port}" in stderr, stderr


@pytest.mark.parametrize("problems", [["--demo", "--pack", "."], ["--pack", "no-such-folder"]], ids=" ".join)
def test_both_servers_refuse_a_bad_start_alike(main_exit, problems):
    """One start-up sequence (dflash2_launch): the same command line, with more than one thing
    wrong, stops both servers at the same first check with the same words."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        argv = ["--port", str(taken.getsockname()[1]), *problems]
        plain, speculative = (main_exit(script, *argv) for script in SCRIPTS)
    # The refusal's line: a usage error's usage lines name each server's own options.
    said = [(status, stderr.strip().splitlines()[-1].split("error: ", 1)[-1]) for status, stderr in (plain, speculative)]
    assert said[0] == said[1], said


@pytest.mark.parametrize("script", SCRIPTS)
def test_apc_disabled_is_accepted(script, tmp_path):
    # APC_ENABLED=0 passes the environment check; the run then stops at the empty pack folder.
    result = run(script, "--pack", str(tmp_path), env=clean_env(APC_ENABLED="0"))
    assert result.returncode == 1 and "config.json: file is missing" in result.stderr, result.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_temp_folder_is_this_user_s_alone(script, tmp_path):
    """MLX compiles kernels into <tmp>/mlx and loads what it finds there: each server makes its
    temp folder <tmp>/dflash2-UID, 0700, at start-up (the run then stops at the empty pack)."""
    result = run(script, "--pack", str(tmp_path), env=clean_env(TMPDIR=str(tmp_path)))
    assert result.returncode == 1 and "config.json: file is missing" in result.stderr, result.stderr
    folder = tmp_path / f"dflash2-{os.getuid()}"
    assert folder.stat().st_mode & 0o777 == 0o700 and folder.stat().st_uid == os.getuid()


@pytest.mark.parametrize("script", SCRIPTS)
def test_kernels_compile_into_the_user_s_cache_folder(script, tmp_path):
    """With an NVIDIA driver MLX (and dflash2_kernel_cache) keep compiled kernels in
    MLX_PTX_CACHE_DIR: each server sets it, before MLX starts, to <cache>/dflash2/mlx-ptx/<mlx
    version>/<setup>, 0700, which a reboot leaves; without one it sets nothing (the run then
    stops at the empty pack)."""
    from dflash2_kernel_folder import nvidia_setup, setup_folder_name

    env = clean_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("MLX_PTX_CACHE_DIR", None)
    result = run(script, "--pack", str(tmp_path), env=env)
    assert result.returncode == 1 and "config.json: file is missing" in result.stderr, result.stderr
    versions = tmp_path / "cache" / "dflash2" / "mlx-ptx" / importlib.metadata.version("mlx")
    setup = nvidia_setup()
    if setup is None:
        assert not versions.exists()
    else:
        folder = versions / setup_folder_name(setup)
        assert folder.stat().st_mode & 0o777 == 0o700 and folder.stat().st_uid == os.getuid()


def test_the_kernels_folder_is_the_user_s_choice_or_private(tmp_path, monkeypatch, capsys):
    import dflash2_options
    from dflash2_options import use_persistent_kernel_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(dflash2_options, "nvidia_setup", lambda: '{"gpus": ["NVIDIA H100 80GB HBM3"]}')
    environ = {}
    use_persistent_kernel_folder(environ)
    version = tmp_path / "dflash2" / "mlx-ptx" / importlib.metadata.version("mlx")
    [folder] = version.iterdir()
    assert environ == {"MLX_PTX_CACHE_DIR": str(folder)}
    assert all(path.stat().st_mode & 0o777 == 0o700 for path in (folder, version, version.parent, tmp_path / "dflash2"))
    cut = bytearray(b"\x7fELF" + bytes(60))
    struct.pack_into("<QQ", cut, 0x20, 0, 4096)  # its section headers at 4096: past its end, cut
    struct.pack_into("<HHHH", cut, 0x36, 56, 0, 64, 12)
    (folder / "cut.ptx").write_bytes(bytes(cut))
    (folder / "cut.txt").write_text("mlx::core::cu::k\t_Z1kv\n")
    (folder / "whole.ptx").write_bytes(b"// PTX\0")
    (folder / "whole.txt").write_text("mlx::core::cu::w\t_Z1wv\n")
    use_persistent_kernel_folder({})  # a later start: the cut entry goes before MLX reads it
    assert sorted(path.name for path in folder.iterdir()) == ["whole.ptx", "whole.txt"]

    environ = {"MLX_PTX_CACHE_DIR": "/chosen"}
    use_persistent_kernel_folder(environ)
    assert environ == {"MLX_PTX_CACHE_DIR": "/chosen"}
    # Folders of this user's that others could write or read (a umask of 002, an older start's
    # verdict folder): what others could do there goes, and the folder serves.
    version.chmod(0o777)
    folder.chmod(0o755)
    environ = {}
    use_persistent_kernel_folder(environ)
    assert environ == {"MLX_PTX_CACHE_DIR": str(folder)}
    assert version.stat().st_mode & 0o777 == 0o755 and folder.stat().st_mode & 0o777 == 0o700
    monkeypatch.setattr(dflash2_options, "nvidia_setup", lambda: '{"gpus": ["NVIDIA A100-SXM4-80GB"]}')
    use_persistent_kernel_folder(environ := {})  # another machine's GPU on the same home: another folder
    assert Path(environ["MLX_PTX_CACHE_DIR"]) != folder and Path(environ["MLX_PTX_CACHE_DIR"]).parent == version

    capsys.readouterr()
    moved = tmp_path / "moved"
    version.rename(moved)
    version.symlink_to(moved)  # a link in the chain could be pointed elsewhere later: the temp folder
    use_persistent_kernel_folder(environ := {})
    assert environ == {} and "is not this user's alone: compiled CUDA kernels stay" in capsys.readouterr().err

    def homeless():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(dflash2_options, "user_cache_folder", homeless)  # a container's uid with no home
    use_persistent_kernel_folder(environ)
    assert environ == {} and "no user cache folder (Could not determine" in capsys.readouterr().err
    monkeypatch.setattr(dflash2_options, "nvidia_setup", lambda: None)  # no NVIDIA driver: MLX's default, quietly
    use_persistent_kernel_folder(environ)
    assert environ == {} and capsys.readouterr().err == ""


def test_mlx_compiles_into_the_private_temp_folder(tmp_path):
    """What MLX compiles after the switch (here a CPU shared library it will dlopen) lands in
    the private folder, not in the shared <tmp>/mlx."""
    probe = ("from dflash2_options import use_private_temp_folder\nuse_private_temp_folder()\n"
             "import mlx.core as mx\nmx.set_default_device(mx.cpu)\n"
             "twice_plus = mx.compile(lambda x: x * 2.5 + 1.25)\nmx.eval(twice_plus(mx.arange(7.0)))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                            env=clean_env(TMPDIR=str(tmp_path)), timeout=300)
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / f"dflash2-{os.getuid()}" / "mlx").glob("*/cpu/*.so"))
    assert not (tmp_path / "mlx").exists()


def test_servers_started_together_take_turns_compiling(built_pack, tmp_path):
    """MLX's CPU backend writes each kernel it compiles into the temp folder in place, where a
    server starting beside it could load it half written. A server waits while another holds the
    folder's start-up lock (held here by the test), then starts."""
    folder = Path(tempfile.gettempdir()) / f"dflash2-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    waiting = "waiting for the start-up of server process 4242:"
    lock = open(folder / "start-up.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    lock.write("4242")  # as a holder writes its pid
    lock.flush()
    server = ServerProcess("serve", [str(REPO / "serve.py"), "--pack", str(built_pack)], tmp_path)
    try:
        deadline = time.monotonic() + 300
        while waiting not in server.log() and server.process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                assert server.health()[0] != 200, "ready while another server held the lock"
            time.sleep(0.2)
        assert waiting in server.log(), server.log()
        time.sleep(1)
        with contextlib.suppress(OSError):
            assert server.health()[0] != 200
        lock.close()  # releases it
        server.wait_ready()
    finally:
        lock.close()
        server.stop()


def test_temp_folder_not_this_user_s_alone_gives_way_to_a_private_one(tmp_path, monkeypatch, capsys):
    import dflash2_options
    from dflash2_options import use_private_temp_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # restored after the test
    removed_at_exit = []
    monkeypatch.setattr(dflash2_options.atexit, "register", lambda *call, **kwargs: removed_at_exit.append(call[1]))
    shared = tmp_path / f"dflash2-{os.getuid()}"
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)  # as a folder another user could write to
    environ = {}
    use_private_temp_folder(environ)
    fresh = Path(environ["TMPDIR"])
    assert fresh.parent == tmp_path and fresh != shared and tempfile.gettempdir() == str(fresh)
    assert fresh.stat().st_mode & 0o777 == 0o700 and fresh.stat().st_uid == os.getuid()
    assert f"{shared} is not this user's alone" in capsys.readouterr().err and removed_at_exit == [str(fresh)]
    shared.rmdir()
    shared.symlink_to(fresh)  # a link, even to a folder of ours, could be repointed later
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    environ = {}
    use_private_temp_folder(environ)
    assert Path(environ["TMPDIR"]).parent == tmp_path and environ["TMPDIR"] not in (str(shared), str(fresh))


@pytest.mark.parametrize("script", SCRIPTS)
def test_ctrl_c_while_starting_exits_with_one_line(built_pack, tmp_path, script):
    """SIGINT once the engine's thread is loading the model: exit status 130 and one line, where
    Python's shutdown used to print a traceback and abort on MLX's running thread."""
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        # SIG_DFL: a shell that started this run in the background passes SIGINT ignored
        process = subprocess.Popen([sys.executable, str(REPO / script), "--pack", str(built_pack),
                                    "--port", str(free_port())], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                   env=clean_env(HOME=str(tmp_path), PYTHONUNBUFFERED="1"),
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while "prefill inverse" not in log_path.read_text() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # logged as start_engine starts the engine's thread
        process.send_signal(signal.SIGINT)
        try:
            status = process.wait(60)
        except subprocess.TimeoutExpired:  # say where start-up was (CI saw this once under load)
            pytest.fail("no exit 60 s after SIGINT; the log so far:\n" + log_path.read_text())
        assert status == 130, log_path.read_text()
    finally:
        process.kill()
        process.wait()
    output = log_path.read_text()
    assert output.rstrip().endswith("interrupted while starting: nothing served"), output
    assert "Traceback" not in output and "terminate called" not in output


@pytest.mark.parametrize("script", SCRIPTS)
def test_demo_without_the_fixture_says_so(tmp_path, script):
    for source in REPO.glob("*.py"):  # the files a pack folder ships, without fixtures/
        shutil.copy(source, tmp_path / source.name)
    result = run(script, "--demo", "--port", str(free_port()), cwd=tmp_path)
    assert result.returncode == 1
    assert "fixtures/tiny-pair" in result.stderr and "source repository" in result.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_demo_refuses_a_damaged_fixture(tmp_path, script):
    for source in REPO.glob("*.py"):
        shutil.copy(source, tmp_path / source.name)
    shutil.copytree(REPO / "fixtures" / "tiny-pair", tmp_path / "fixtures" / "tiny-pair")
    flip_byte(tmp_path / "fixtures" / "tiny-pair" / "drafter" / "model.safetensors", -1)
    result = run(script, "--demo", "--port", str(free_port()), cwd=tmp_path)
    assert result.returncode == 1
    assert "fixtures/tiny-pair differs from its SHA256SUMS" in result.stderr, result.stderr
    assert "drafter/model.safetensors: sha256 differs from SHA256SUMS" in result.stderr


def trained_block_of(folder, block):
    """A source-layout copy of the tiny pair in `folder` whose drafter was trained on `block`."""
    for part in ("target", "drafter"):
        shutil.copytree(REPO / "fixtures" / "tiny-pair" / part, folder / part)
    config_path = folder / "drafter" / "config.json"
    config = json.loads(config_path.read_text())
    config["dflash_config"].update(block_size=block, runtime_block_size=min(block, 5))
    config_path.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("trained, argv, refusal", [
    (8, ["--dflash2-block-size", "9"], "--dflash2-block-size 9 is outside 2..8"),
    (8, ["--dflash2-block-cap", "1"], "--dflash2-block-cap 1 is outside 2..8"),
    (6, ["--dflash2-block-size", "7"], "--dflash2-block-size 7 is outside 2..6"),
    (6, ["--dflash2-block-cap", "8"], "--dflash2-block-cap 8 is outside 2..6"),
], ids=["demo size 9", "demo cap 1", "trained 6 size 7", "trained 6 cap 8"])
def test_a_block_the_drafter_cannot_take_stops_the_start_before_loading(tmp_path, trained, argv, refusal):
    """Checked once, against the drafter's trained block (read from its config.json) and
    the exact kernels' 8 rows, before any weights load; the demo's drafter was trained on 8."""
    where = ["--demo"] if trained == 8 else ["--pack", str(trained_block_of(tmp_path, trained))]
    result = run("serve_dflash2.py", *where, *argv, "--port", str(free_port()))
    assert result.returncode == 2, result.stderr
    assert (f"error: {refusal} (the drafter was trained on blocks of {trained}; the exact kernels take "
            "up to 8 rows)") in result.stderr
    assert "DFlash2 runtime" not in result.stderr  # the engine never started


@pytest.mark.parametrize("script", SCRIPTS)
def test_demo_and_pack_exclude_each_other(tmp_path, script):
    result = run(script, "--demo", "--pack", str(tmp_path), "--port", str(free_port()))
    assert result.returncode == 2 and "--demo" in result.stderr


# ---------------------------------------------------------------------------------------
# Launch checks against dflash2-pack.json


@pytest.fixture
def pinned_pack(built_pack, tmp_path):
    """A copy of the built pack: every file pinned in its dflash2-pack.json."""
    return Path(shutil.copytree(built_pack, tmp_path / "pinned-pack"))


def start_with_pins(pack, *args):
    return run("serve_dflash2.py", "--pack", str(pack), *args)


@pytest.mark.parametrize("extra", ["model-extra.safetensors", "model.safetensors.index.json",
                                   "drafter/model-extra.safetensors"])
def test_an_unpinned_weights_file_stops_both_servers(pinned_pack, extra):
    """A weights file or index no build pinned would be loaded unchecked (an index can point the
    loader at any shard), even where every pinned file matches; serve.py checks the pins too."""
    (pinned_pack / extra).write_bytes((pinned_pack / "config.json").read_bytes())
    for script in ("serve_dflash2.py", "serve.py"):
        result = run(script, "--pack", str(pinned_pack))
        assert result.returncode == 1, result.stderr
        assert f"{extra}: a weights file not in dflash2-pack.json" in result.stderr, result.stderr


def test_a_pack_in_a_hugging_face_cache_snapshot_runs_from_its_links(pinned_pack, tmp_path):
    """hf download without --local-dir leaves snapshots/<revision>/ of links into blobs/: the
    servers import their modules and find their pack beside the links, not in blobs/."""
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    for path in sorted(pinned_pack.rglob("*")):
        if path.is_file():
            blob = blobs / hashlib.sha256(path.read_bytes()).hexdigest()
            shutil.copyfile(path, blob)
            link = snapshot / path.relative_to(pinned_pack)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(blob)
    with socket.create_server(("127.0.0.1", 0)) as serving:  # a server running there takes nothing from it
        result = run("serve_dflash2.py", "--verify-pack", "--port", str(serving.getsockname()[1]), cwd=snapshot,
                     timeout=300)
    assert result.returncode == 0 and "SHA256SUMS" in result.stdout, result.stdout + result.stderr
    (snapshot / "config.json").unlink()  # serve.py finds the pack beside it (and stops at this)
    result = run("serve.py", cwd=snapshot)
    assert result.returncode == 1 and "config.json" in result.stderr and "dflash2_" not in result.stderr, \
        result.stderr


def test_a_built_pack_without_its_pins_file_stops_both_servers(pinned_pack):
    """Deleting dflash2-pack.json would skip every launch check: a folder in the release layout
    needs it, SHA256SUMS deleted too (a source layout of target/ and drafter/ still serves
    unpinned, with a warning)."""
    (pinned_pack / "dflash2-pack.json").unlink()
    for deleted in ("dflash2-pack.json", "SHA256SUMS"):
        (pinned_pack / deleted).unlink(missing_ok=True)
        for script in SCRIPTS:
            result = run(script, "--pack", str(pinned_pack))
            assert result.returncode == 1, result.stderr
            assert "dflash2-pack.json is missing from the pack folder" in result.stderr, result.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_files_no_check_covers_never_run_from_the_pack_folder(pinned_pack, script):
    """The launch checks hash the pack's .py files, and nothing else in its folder runs: not a
    compiled file in __pycache__ in a module's place (an unchecked hash-based one runs whatever
    the source says), nor a module file that shadows the standard library's (logging.py, which
    both servers import first) or a package's. No __pycache__ is written there either."""
    cache = pinned_pack / "__pycache__"
    planted = cache / "planted_dflash2_options.py"
    cache.mkdir()
    planted.write_text("raise SystemExit('planted code ran')\n")
    compiled = cache / f"dflash2_options.{sys.implementation.cache_tag}.pyc"
    py_compile.compile(str(planted), cfile=str(compiled), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    planted.unlink()
    for shadow in ("logging.py", "uvicorn.py", "argparse.py"):
        (pinned_pack / shadow).write_text("raise SystemExit('planted code ran')\n")
    result = run(script, "--help", cwd=pinned_pack)
    assert result.returncode == 0 and "--max-prompt-chars" in result.stdout, result.stdout + result.stderr
    assert [path.name for path in cache.iterdir()] == [compiled.name]
    # Nor where a PYTHONPATH puts the folder back (an empty entry: the current folder).
    for pythonpath in (":/opt/elsewhere", "."):
        result = run(script, "--help", cwd=pinned_pack, env=clean_env(PYTHONPATH=pythonpath))
        assert result.returncode == 0 and "planted" not in result.stderr, result.stdout + result.stderr
    # the same files, where Python's own import finds them, do run: the test can fail
    for module in ("dflash2_options", "logging"):
        control = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=pinned_pack, env=clean_env(),
                                 capture_output=True, text=True, timeout=60)
        assert "planted code ran" in control.stderr, module


def test_pins_edited_config(pinned_pack):
    config = pinned_pack / "config.json"
    pins = json.loads((pinned_pack / "dflash2-pack.json").read_text())["files"]
    config.write_text(config.read_text() + " ")
    for result in (start_with_pins(pinned_pack), run("serve.py", "--pack", str(pinned_pack))):
        assert result.returncode == 1
        assert f"config.json: size expected {pins['config.json']['size']}, actual" in result.stderr


def test_pins_same_size_config_change(pinned_pack):
    flip_byte(pinned_pack / "drafter" / "config.json", 10)
    expected = json.loads((pinned_pack / "dflash2-pack.json").read_text())["files"]["drafter/config.json"]
    actual = hashlib.sha256((pinned_pack / "drafter" / "config.json").read_bytes()).hexdigest()
    result = start_with_pins(pinned_pack)
    assert result.returncode == 1
    assert f"drafter/config.json: sha256 expected {expected['sha256']}, actual {actual}" in result.stderr


def test_pins_missing_readme_and_grown_weights(pinned_pack):
    (pinned_pack / "README.md").unlink()
    weights = pinned_pack / "drafter" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "ab") as f:
        f.write(b"\0")
    result = start_with_pins(pinned_pack)
    assert result.returncode == 1
    assert "README.md: missing" in result.stderr
    assert f"drafter/model.safetensors: size expected {size}, actual {size + 1}" in result.stderr


def test_pins_safetensors_header(pinned_pack):
    flip_byte(pinned_pack / "drafter" / "model.safetensors", 12)  # inside the JSON header
    result = start_with_pins(pinned_pack)
    assert result.returncode == 1
    assert "drafter/model.safetensors: safetensors header sha256 expected" in result.stderr


# --max-tokens above the tiny pack's context stops a start just after the launch checks.
STOP_AFTER_CHECKS = ("--max-tokens", "40000")
STOPPED_AFTER_CHECKS = "--max-tokens 40000 is above the model's context length"


@pytest.fixture
def weight_hashes(tmp_path, monkeypatch):
    """The servers' user cache folder (XDG_CACHE_HOME) for this test alone; the path of the
    remembered weight hashes in it (dflash2_file_hashes)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "dflash2" / "weight-hashes.json"


def hashed_now(stderr: str) -> str:
    """The launch log's count of weights hashed now and unchanged since an earlier start."""
    line = next(line for line in stderr.splitlines() if "launch checks against" in line)
    return line.split("(")[1].split(")")[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_weights_are_hashed_once_and_again_where_they_changed(pinned_pack, weight_hashes, script):
    """A first launch hashes the weights whole (a progress bar) and remembers them; the next
    hashes none; --full-hash (--dflash2-full-hash: one option, a spelling a script) hashes every
    file all the same. A flipped weight byte, size and header intact and the modification time
    set back, still changes the file's status-change time: hashed again, and the start stops
    naming the file."""
    result = run(script, "--pack", str(pinned_pack), *STOP_AFTER_CHECKS)
    assert result.returncode == 1 and STOPPED_AFTER_CHECKS in result.stderr, result.stderr
    assert hashed_now(result.stderr) == "weights hashed now: 2, unchanged since an earlier start hashed them: 0"
    assert "sha256:" in result.stderr and weight_hashes.is_file()  # the progress bar
    assert MISSING_SHA256SUMS not in result.stderr  # the control of the missing-SHA256SUMS test
    result = run(script, "--pack", str(pinned_pack), *STOP_AFTER_CHECKS)
    assert hashed_now(result.stderr) == "weights hashed now: 0, unchanged since an earlier start hashed them: 2"
    assert "sha256:" not in result.stderr
    option = "--full-hash" if script == "serve.py" else "--dflash2-full-hash"
    result = run(script, "--pack", str(pinned_pack), option, *STOP_AFTER_CHECKS)
    assert STOPPED_AFTER_CHECKS in result.stderr and "sha256:" in result.stderr, result.stderr
    assert hashed_now(result.stderr) == "--full-hash: every file hashed now"
    weights = pinned_pack / "model.safetensors"
    before = weights.stat()
    flip_byte(weights, before.st_size - 3)  # a weight byte: size and header unchanged
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    result = run(script, "--pack", str(pinned_pack), *STOP_AFTER_CHECKS)
    assert result.returncode == 1 and STOPPED_AFTER_CHECKS not in result.stderr
    assert "model.safetensors: sha256 expected" in result.stderr, result.stderr


def test_a_weights_file_changed_while_it_is_hashed_is_hashed_again(pinned_pack, tmp_path, monkeypatch):
    """The identity remembered is the file's from before its hash: a file that changes while it
    is hashed (here: just after its bytes were read) does not match it, and the next launch
    hashes it again."""
    import dflash2_pack
    from dflash2_file_hashes import RememberedHashes

    weights = pinned_pack / "model.safetensors"
    hash_file = dflash2_pack.sha256_file

    def hash_then_change(path, progress=None):
        digest = hash_file(path, progress)
        if path == weights:
            os.utime(path, ns=(0, 0))
        return digest

    monkeypatch.setattr(dflash2_pack, "sha256_file", hash_then_change)
    remembered = RememberedHashes(tmp_path / "hashes.json")
    assert dflash2_pack.check_pins(pinned_pack, False, remembered) == [] and len(remembered.hashed) == 2
    assert remembered.save() is None
    monkeypatch.setattr(dflash2_pack, "sha256_file", hash_file)
    again = RememberedHashes(tmp_path / "hashes.json")
    assert dflash2_pack.check_pins(pinned_pack, False, again) == []
    assert again.hashed == [weights] and again.reused == [pinned_pack / "drafter" / "model.safetensors"]


@pytest.mark.parametrize("damage", ["edited", "not json"])
def test_a_damaged_weight_hashes_file_is_set_aside_and_the_weights_hashed_again(pinned_pack, weight_hashes, damage):
    run("serve.py", "--pack", str(pinned_pack), *STOP_AFTER_CHECKS)
    data = json.loads(weight_hashes.read_text())
    if damage == "edited":  # an entry changed, the file's own sha256 not
        next(iter(data["files"].values()))["identity"][2] += 1
        weight_hashes.write_text(json.dumps(data))
    else:
        weight_hashes.write_text("{")
    result = run("serve.py", "--pack", str(pinned_pack), *STOP_AFTER_CHECKS)
    assert STOPPED_AFTER_CHECKS in result.stderr, result.stderr
    warning = [line for line in result.stderr.splitlines() if "was set aside" in line]
    assert len(warning) == 1 and ("content sha256 differs" if damage == "edited" else "Expecting") in warning[0]
    assert hashed_now(result.stderr) == "weights hashed now: 2, unchanged since an earlier start hashed them: 0"
    assert json.loads(weight_hashes.read_text())["sha256"]  # written whole again


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_missing_sha256sums_is_warned_at_launch(pinned_pack, script):
    """dflash2-pack.json still pins every file, but shasum -c and --verify-pack have nothing
    to check: one log line says so (and none where it is there: the weights-hash test's first
    launch)."""
    (pinned_pack / "SHA256SUMS").unlink()
    result = run(script, "--pack", str(pinned_pack), *STOP_AFTER_CHECKS)
    assert result.returncode == 1 and STOPPED_AFTER_CHECKS in result.stderr, result.stderr
    assert len([line for line in result.stderr.splitlines() if MISSING_SHA256SUMS in line]) == 1, result.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_gives_every_default(script):
    result = run(script, "--help", env=clean_env(COLUMNS="400"))  # no line breaks inside the texts
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for default in ("(default: 8080)", "(default: mlx-vlm's, <think>)", "(default: mlx-vlm's, </think>)",
                    "(default: 600; 0: no limit)", "(default: base64 data URLs only)"):
        assert default in text, default


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "40000"], "--max-tokens 40000 is above the model's context length 32768"),
    (["--allow-image-dir", "/nonexistent/images"], "--allow-image-dir /nonexistent/images: not a folder"),
])
def test_options_checked_against_the_pack(pinned_pack, argv, message):
    result = start_with_pins(pinned_pack, *argv)
    assert result.returncode == 1 and message in result.stderr, result.stderr


def test_bad_round_cost_table_stops_the_start(pinned_pack, tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"decode_step_ms": 1.0}))
    result = start_with_pins(pinned_pack, "--dflash2-round-costs", str(costs))
    assert result.returncode == 1
    assert "--dflash2-round-costs costs.json: not a round cost table" in result.stderr


# ---------------------------------------------------------------------------------------
# Audited mlx-vlm sources


@pytest.fixture(scope="module")
def edited_mlx_vlm(tmp_path_factory):
    """A scratch copy of the installed mlx-vlm in which every function, method or object the
    pack replaces (dflash2_audit.REPLACED) has one edited source line; returns its parent."""
    import inspect

    import mlx_vlm
    import mlx_vlm.server  # noqa: F401  (the targets resolve only once it is imported)

    import dflash2_audit

    installed = Path(mlx_vlm.__file__).parent
    root = tmp_path_factory.mktemp("edited")
    shutil.copytree(installed, root / "mlx_vlm", ignore=shutil.ignore_patterns("__pycache__"))
    for row in dflash2_audit.REPLACED:
        obj = dflash2_audit.stock(row.target)
        obj = obj if inspect.isfunction(obj) or inspect.isclass(obj) else type(obj)
        path = root / "mlx_vlm" / Path(inspect.getsourcefile(obj)).relative_to(installed)
        lines = path.read_text().split("\n")
        lines[inspect.getsourcelines(obj)[1] - 1] += "  # edited"  # a comment: still valid Python
        path.write_text("\n".join(lines))
    return root


@pytest.mark.parametrize("script", SCRIPTS)
def test_edited_mlx_vlm_sources_refuse_the_start_and_are_named(script, pinned_pack, edited_mlx_vlm):
    import dflash2_audit

    result = run(script, "--pack", str(pinned_pack), env=clean_env(PYTHONPATH=str(edited_mlx_vlm)))
    assert result.returncode == 1, result.stderr
    assert "these mlx-vlm sources differ from the audited ones" in result.stderr
    named = {line.strip().split(": source sha256")[0] for line in result.stderr.splitlines()
             if ": source sha256" in line}
    assert named == {row.target for row in dflash2_audit.REPLACED}


@pytest.mark.parametrize("argv, step", [([], 256), (["--no-prefix-cache"], None),
                                        (["--prefill-step-size", "1024"], 1024),
                                        (["--no-prefix-cache", "--prefill-step-size", "512"], 512)])
def test_the_prefill_step_is_small_where_the_prefix_cache_reuses_it(argv, step):
    """With the prefix cache a next turn re-prefills from the last multiple of the step;
    without it, mlx-vlm's default (None here) stands; a given step always does."""
    from dflash2_options import make_parser, parse_args

    assert parse_args(make_parser("serve.py", ""), argv).prefill_step_size == step


@pytest.mark.parametrize("script", SCRIPTS)
def test_prefill_step_beyond_what_cuda_captures_is_refused(main_exit, script):
    status, stderr = main_exit(script, "--prefill-step-size", "16384")
    assert status == 2 and "--prefill-step-size: 16384 is outside 1..4096" in stderr, stderr
