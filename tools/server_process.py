"""A pack server run as a child process on a free 127.0.0.1 port: start, wait, read its log, stop.

The tests (tests/conftest.py), the battery (tools/battery.py) and the server bench
(tools/bench_server.py) start their servers through this one class.
"""

import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Variables mlx-vlm reads at import: the servers refuse to start with any of them set.
REFUSED_PREFIXES = ("KV_", "MLX_VLM_", "APC_", "DFLASH2_")


def clean_env(**extra):
    """This process's environment without the variables the servers refuse, plus extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(REFUSED_PREFIXES)}
    env.update(extra)
    return env


def free_port() -> int:
    """A 127.0.0.1 port free now, below the ephemeral range: the system lends ephemeral ports
    to outgoing connections, and one took a test server's port in the seconds before the
    server bound it (a port 0 bind picks from that range too)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    below = range(max(1024, low - 12000), low)
    for port in random.sample(below, min(200, len(below))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all taken: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_kernel_folder(name: str):
    """A folder of the named server's own on a GPU, the same in every run on this machine (what
    it compiled, a later run's server of that name finds), for its temp folder and, in ptx/, its
    compiled CUDA kernels (ServerProcess's tmpdir and kernels: the servers would otherwise keep
    them in each run's fresh HOME); None on MLX's CPU backend.

    MLX writes the kernels it compiles (CUDA: .ptx files and their name lists) in place, where
    a server starting beside another could read one half written. On
    the CPU backend the servers take turns over their start-ups (dflash2_launch.compiling_alone),
    which takes seconds there; a GPU start measures for minutes, and the benchmarks start
    several servers on one GPU together."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return None
    return Path(tempfile.gettempdir()) / "dflash2-bench-servers" / name.replace("/", "-")


def own_kernels(name: str) -> dict:
    """ServerProcess's tmpdir and kernels for the named server: its own_kernel_folder and the
    ptx/ in it, or nothing (MLX's CPU backend)."""
    folder = own_kernel_folder(name)
    return {} if folder is None else {"tmpdir": folder, "kernels": folder / "ptx"}


class ServerFailed(RuntimeError):
    pass


class ServerProcess:
    """`python COMMAND --port PORT`, run in cwd (default workdir/cwd) with HOME set to
    workdir/home (or home), so that nothing of the user's reaches it (nor an XDG_CACHE_HOME of
    theirs: the start-up verdict cache is HOME's; servers of one HOME share it); stdout and stderr
    go to workdir/NAME.log. python=None runs COMMAND as it is written (a README's command line)."""

    def __init__(self, name, command, workdir: Path, cwd: Path = None, python=sys.executable, home: Path = None,
                 tmpdir: Path = None, kernels: Path = None):
        self.name, self.command, self.port, self.workdir = name, list(command), free_port(), workdir
        self.home, self.cwd = Path(home or workdir / "home"), Path(cwd or workdir / "cwd")
        for folder in (self.home, self.cwd, *([tmpdir] if tmpdir else [])):
            folder.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"{name.replace('.', '-')}.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [*([python] if python else []), *self.command, "--port", str(self.port)], cwd=self.cwd,
                env=clean_env(HOME=str(self.home), XDG_CACHE_HOME=str(self.home / ".cache"), PYTHONUNBUFFERED="1",
                              **({"TMPDIR": str(tmpdir)} if tmpdir else {}),
                              **({"MLX_PTX_CACHE_DIR": str(kernels)} if kernels else {})),
                stdout=log, stderr=subprocess.STDOUT)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def health(self):
        """(status, JSON body) of GET /health."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request("GET", "/health")
            reply = connection.getresponse()
            return reply.status, json.loads(reply.read() or b"null")
        finally:
            connection.close()

    def wait_ready(self, timeout=600):
        """/health's body once it answers 200; ServerFailed with the log's end if the
        process exits or does not answer in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(f"{self.name} exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                status, health = self.health()
                if status == 200:
                    return health
            except OSError:
                pass
            time.sleep(0.3)
        raise ServerFailed(f"{self.name} did not start within {timeout} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, since: int, text: str, timeout=300) -> str:
        """The first line containing text that the log gained after offset since."""
        return self.wait_for_lines(since, text, 1, timeout)[0]

    def wait_for_lines(self, since: int, text: str, count: int, timeout=300) -> list:
        """The lines containing text that the log gained after offset since, once there
        are at least count (a finish line is written just after a response's last byte)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = [line for line in self.log()[since:].splitlines() if text in line]
            if len(lines) >= count:
                return lines
            time.sleep(0.1)
        raise ServerFailed(f"{self.name} logged {text!r} fewer than {count} times:\n{self.log()[since:][-4000:]}")

    def rss_kb(self):
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return None

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
