"""Shared fixtures and helpers. Keep each one small; add yours below."""

import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SEEN = []  # every response's headers and body (request() keeps them), scanned for local paths


@pytest.fixture(scope="session")
def tiny_pack(tmp_path_factory):
    """The tiny synthetic pack (seed 0, bf16 drafter), built once per test session.
    Returns {"root", "target", "drafter"} paths. Treat it as read-only: copy it before
    changing anything."""
    from make_synthetic_pack import make_pack

    return make_pack(tmp_path_factory.mktemp("tiny_pack"), size="tiny", seed=0)


@pytest.fixture
def gpu_like_rounding(monkeypatch):
    """While active, matmuls over several rows, attention over several queries and stock
    verify's multi-step recurrence round differently from their one-row calls, as on
    GPUs; one-row calls stay MLX's own (tests/gpu_rounding.py says which ops and how)."""
    from gpu_rounding import swap_row_variant_ops

    swap_row_variant_ops(monkeypatch)


def flip_byte(path, offset: int):
    """Flips one bit of the byte at offset (negative: from the end), size unchanged."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="session")
def target(tiny_pack):
    """The tiny pack loaded, with the runtime installed: (model, processor, drafter)."""
    import dflash2_runtime
    from dflash2_pack import load_pack

    model, processor, drafter = load_pack(tiny_pack["target"], tiny_pack["drafter"])
    status = dflash2_runtime.install(model)
    assert status.speculative, status.reason
    return model, processor, drafter


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KV_", "MLX_VLM_", "APC_", "DFLASH2_"))}
    env.update(extra)
    return env


def write_pins(pack: Path):
    """dflash2-pack.json as the pack builder writes it: every file with size and sha256,
    safetensors files with the sha256 of their header too."""
    files = {}
    for path in sorted(p for p in pack.rglob("*") if p.is_file() and p.suffix != ".py"):
        name = path.relative_to(pack).as_posix()
        if name == "dflash2-pack.json":
            continue
        data = path.read_bytes()
        pin = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if name.endswith(".safetensors"):
            length = int.from_bytes(data[:8], "little")
            pin["header_sha256"] = hashlib.sha256(data[:8 + length]).hexdigest()
        files[name] = pin
    (pack / "dflash2-pack.json").write_text(json.dumps({"files": files}, indent=1))
    return files


# Server processes and a raw HTTP client


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name, pack, workdir, command):
        self.name = name
        self.workdir = workdir
        self.port = free_port()
        self.log_path = workdir / f"{name}.log"
        self.cwd = workdir / "cwd"
        self.home = workdir / "home"
        env = clean_env(HOME=str(self.home), PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            [sys.executable, *command, "--port", str(self.port)], cwd=pack if command[0] == "-c" else self.cwd,
            env=env, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout=300):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if request(self, "GET", "/health", record=False).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        pytest.fail(f"{self.name} did not start:\n{self.log()[-4000:]}")

    def log(self):
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, since: int, text: str, timeout=300) -> str:
        """The first line containing text that the log gained after offset since."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log()[since:].splitlines():
                if text in line:
                    return line
            time.sleep(0.1)
        pytest.fail(f"{self.name} never logged {text!r}:\n{self.log()[since:][-4000:]}")

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()


class Response:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)

    @property
    def mode(self):
        return self.headers.get("x-dflash2")


def request(server, method, path, body=None, headers=None, record=True, host=None):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    all_headers = {"content-type": "application/json", **(headers or {})}
    if host is not None:
        connection.putrequest(method, path, skip_host=True)
        connection.putheader("Host", host)
        for name, value in all_headers.items():
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(body or b"")))
        connection.endheaders(body)
    else:
        connection.request(method, path, body=body, headers=all_headers)
    reply = connection.getresponse()
    response = Response(reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read())
    connection.close()
    if record:
        SEEN.append((f"{server.name} {method} {path}", str(response.headers) + response.body.decode("latin-1")))
    return response
