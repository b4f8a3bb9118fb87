"""Shared fixtures and helpers. Keep each one small; add yours below."""

import base64
import hashlib
import http.client
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from PIL import Image

from server_process import ServerProcess

# The slowest files, slowest first: with --no-loadscope-reorder (.ci/run) xdist hands files to
# its workers in collection order, so these start early and the two workers end together
# (xdist's own order is by test count, which puts the many quick gateway tests first).
SLOWEST_FILES = ("test_server_cli.py", "test_verdict_cache.py", "test_openapi_schemathesis.py",
                 "test_server.py", "test_prefix_cache.py", "test_exact_tokens.py")


def pytest_collection_modifyitems(items):
    rank = {name: place for place, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order


SEEN = []  # every response's headers and body (request() keeps them), scanned for local paths


@pytest.fixture(scope="session")
def tiny_pack(tmp_path_factory):
    """The tiny synthetic pack (seed 0, bf16 drafter), built once per test session.
    Returns {"root", "target", "drafter"} paths. Treat it as read-only: copy it before
    changing anything."""
    from make_synthetic_pack import make_pack

    return make_pack(tmp_path_factory.mktemp("tiny_pack"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def float32_pack(tmp_path_factory):
    """The tiny synthetic pack with fp32 dense tensors (the real 27B file's layout; seed 1),
    built once per session. Read-only, like tiny_pack."""
    from make_synthetic_pack import make_pack

    return make_pack(tmp_path_factory.mktemp("float32_pack"), size="tiny", seed=1, dense_dtype="float32")


@pytest.fixture(scope="session")
def built_pack(float32_pack, tmp_path_factory):
    """The fp32 tiny pack as tools/build_pack.py builds it, once per session: a flat pack
    folder with the shipped modules, pins and SHA256SUMS (fp32 dense tensors, as the 27B
    file's: its servers' activations run fp32, on a CPU many times faster than fp16's).
    Read-only: copy it to change it."""
    from build_pack import build_pack

    return build_pack(str(float32_pack["target"]), str(float32_pack["drafter"]),
                      tmp_path_factory.mktemp("built") / "tiny-dflash2-pack")


@pytest.fixture
def gpu_like_rounding(monkeypatch):
    """While active, matmuls over several rows, attention over several queries and stock
    verify's multi-step recurrence round differently from their one-row calls, as on
    GPUs; one-row calls stay MLX's own (tests/gpu_rounding.py says which ops and how)."""
    from gpu_rounding import swap_row_variant_ops

    swap_row_variant_ops(monkeypatch)


@pytest.fixture
def on_cpu():
    """The test's arrays on MLX's CPU device, also on a GPU machine: for tests that stand a
    CPU in for another backend (Metal here), whose stand-ins assume CPU arithmetic
    (float64; multi-query attention equal to single-query calls)."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


def per_server(servers, run) -> dict:
    """{name: run(name)}: the first server alone, then the rest at once, a thread each. The
    SDKs build a union's type map on first use, and threads that race there cache a partial
    one (openai 3.57: a completed event parsed as another event, its response left a dict)."""
    first, *rest = servers
    answers = {first: run(first)}
    with ThreadPoolExecutor(len(rest)) as pool:
        answers.update(zip(rest, pool.map(run, rest)))
    return answers


def png(size=(32, 32), color=(200, 40, 40)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def flip_byte(path, offset: int):
    """Flips one bit of the byte at offset (negative: from the end), size unchanged."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def assert_verify_self_check_sees_rounding(server):
    """A server under the GPU-like rounding wrapper ran its start-up verify self-check there:
    0 differing, the stock control above 0. On fp32 packs the wrapper's rounding changes
    verify's bits but seldom a token, so this bitwise check, which turns a broken verify's
    rounds off (its answers then lose the `speculative` header), is what can fail."""
    check = server.health()[1]["runtime"]["verify_self_check"]
    assert check["differing"] == 0 and check["stock_differing"] > 0, (server.name, check)


def load_installed(pack):
    """A synthetic pack's {"target", "drafter"} loaded, with the runtime installed: (model,
    processor, drafter). install() without the model: the tests check exactness themselves,
    so the model's self-tests and decode timing (install(model), which the servers run) add
    nothing."""
    import dflash2_runtime
    from dflash2_pack import load_pack

    model, processor, drafter = load_pack(pack["target"], pack["drafter"])
    status = dflash2_runtime.install()
    assert status.speculative, status.reason
    return model, processor, drafter


@pytest.fixture(scope="session")
def target(tiny_pack):
    """The tiny pack (fp16) loaded, with the runtime installed: (model, processor, drafter)."""
    return load_installed(tiny_pack)


def load_fp16_pair():
    """fixtures/tiny-pair loaded, its unpacked language tensors cast to fp16 (A_log stays fp32):
    bit for bit the pair as written before commit 13b5f14 (the file holds the trained values in
    fp32, as the 27B's; cast, they are what the fp16 file held). The exactness tests run it in
    fp16, where the GPU-like rounding backend's batched rounding changes tokens, so their
    comparisons can fail (in fp32 it changes bits, not tokens); the servers run the file as is.
    Returns (model, processor, drafter)."""
    from mlx.utils import tree_flatten, tree_unflatten

    from acceptance import PAIR
    from dflash2_pack import load_pack

    model, processor, drafter = load_pack(PAIR / "target", PAIR / "drafter")
    lm = model.language_model
    cast = [(name, value.astype(mx.float16)) for name, value in tree_flatten(lm.parameters())
            if value.dtype == mx.float32 and not name.endswith("A_log")]
    lm.update(tree_unflatten(cast))
    assert cast and lm.model.norm.weight.dtype == mx.float16
    return model, processor, drafter


@pytest.fixture(scope="session")
def float32_target(float32_pack):
    """The fp32 tiny pack loaded, as `target`: for tests whose subject is not arithmetic
    (memory, routing), where fp32's CPU speed is free."""
    return load_installed(float32_pack)


# Greedy tokens of the exactness checks' runs: on the 2-layer tiny pack stock verify's batched
# rounding (the negative controls) first changes a token of tools/parity.py's prompts at the
# 15th, 15th and 29th (at 12 none of the oracle or sampled token cases could fail under it;
# at 20, four of the eleven oracle cases and six of the nine sampled ones do).
GENERATED = 20


def raw_ids(processor, text):
    """A short prompt without the chat template: the bitwise checks prefill it often."""
    return mx.array([processor.tokenizer.encode(text, add_special_tokens=False)])


@pytest.fixture(scope="session")
def raw_plain(target):
    """Plain greedy tokens (GENERATED) of each tools/parity.py prompt, raw, on the GPU-like
    backend as gpu_like_rounding makes it: the exactness checks' reference, decoded once."""
    from gpu_rounding import swap_row_variant_ops
    from parity import PROMPTS, greedy

    model, processor, _ = target
    with pytest.MonkeyPatch.context() as patch:
        swap_row_variant_ops(patch)
        return [greedy(model, raw_ids(processor, text), GENERATED) for text in PROMPTS]


# Server processes and a raw HTTP client


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(name, command, cwd=None) -> a ServerProcess (tools/server_process.py),
    not yet waited for (servers started together take turns over their start-ups' compiles by
    themselves: dflash2_launch.compiling_alone). One process per command and cwd for the
    session (per worker under xdist): a test file asking for a server another already started
    gets that one (started again if it was stopped), so give equal servers equal commands.
    All stop at the end."""
    started = {}
    # Under xdist the workers' temp folders share a parent of this run's own.
    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared

    def home(command):
        # One HOME, so one start-up verdict cache (dflash2_verdicts), for the run's servers: a
        # server whose pack, modules and options an earlier one checked starts in seconds, as a
        # user's second start does (tests/test_verdict_cache.py tests the cache itself). A server
        # run under a wrapper (python -c: the GPU-like rounding backend) gets a HOME of its
        # wrapper's: the cache's key does not see a backend patched in the same process.
        wrapper = hashlib.sha256(str(command[1]).encode()).hexdigest()[:12] if str(command[0]) == "-c" else ""
        return shared / f"home{'-' + wrapper if wrapper else ''}"

    def start(name, command, cwd=None):
        key = (tuple(map(str, command)), str(cwd))
        if key not in started or started[key].process.poll() is not None:
            started[key] = ServerProcess(name, command, tmp_path_factory.mktemp(name), cwd, home=home(command))
        return started[key]

    yield start
    for server in started.values():
        server.stop()


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
