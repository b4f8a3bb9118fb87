"""A bounded hostile-input battery against the pack's servers, on loopback only.

    python tools/battery.py --pack DIR [--out evidence] [--quick]

Starts serve_dflash2.py and serve.py from the pack folder on free 127.0.0.1 ports and
sends each one batches of hostile and malformed requests: every chat field with wrong
types, extremes, unicode, huge values and out-of-range ids; every endpoint and method;
Origin, Content-Type and Host headers; broken and huge bodies; disconnects and slow
clients; 16 concurrent clients. After every batch a good greedy request must get the
answer it got at the start. Then a bounded schemathesis pass over /openapi.json (when
schemathesis is installed) and damaged copies of the pack (--verify-pack and start).

Writes evidence/battery-<backend>.json and .md: requests sent, by status class, 5xx
for client errors (must be 0), crashes (0), local path bytes in any body, header or log
line (0), answers changed (0), timeouts under load (504s of requests queued past
--request-timeout, counted apart), the other answers of the server's own time limit or
shutdown (listed by request), RSS before and after. --quick sends a small subset.
"""

import argparse
import http.client
import json
import os
import re
import shutil
import site
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash2_requests import ChatRequest, UserMessage  # noqa: E402
from dflash2_messages_request import AnthropicUserMessage, CountTokensRequest, MessagesRequest  # noqa: E402
from dflash2_responses_request import ResponseUserMessageItem, ResponsesRequest  # noqa: E402
from records import code_digest, git_state, write_record  # noqa: E402
from server_process import ServerProcess  # noqa: E402

GOOD = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 4}
TINY = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 1}
HOSTILE_VALUES = [
    None, True, False, 0, -1, 1, 2 ** 31, 2 ** 63, 2 ** 64 + 1, -(2 ** 63) - 1, 1e308, -1e308, 0.5,
    "", "x", "\U0001f600" * 50, "\u202e\u200b\ufeff", "\ud800", "a" * 100_000, [], [1], {}, {"a": 1}, [[[[]]]],
]
QUICK_VALUES = [True, -1, 2 ** 64 + 1, "\ud800", [1], {"a": 1}]
IMAGE_URLS = [
    "file:///etc/shadow", "file:///proc/self/environ", "/etc/passwd", "/nonexistent.png", "../x.png",
    "https://example.com/x.png", "ftp://example.com/x.png", "data:image/png;base64,###",
    "data:text/plain;base64,aGk=", "data:image/png;base64,", "data:image/png,raw", "x" * 10_000,
]
PATHS = [
    "/v1/chat/completions", "/chat/completions", "/v1/models", "/v1/models/x", "/health", "/openapi.json",
    "/v1/messages", "/v1/messages/count_tokens", "/v1/completions", "/v1/responses", "/v1/embeddings",
    "/v1/settings", "/unload",
    "/v1/cache/reset", "/metrics", "/docs", "/redoc", "/v1/realtime", "/../../etc/passwd",
    "/v1/models/%2e%2e%2f%2e%2e%2fetc", "/" + "a" * 8000,
]
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"]
ORIGINS = ["https://attacker.example", "null", "http://127.0.0.1.attacker.example", "http://localhost:3000"]
CONTENT_TYPES = [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/jsonx", "application/json; charset=utf-8"]
HOSTS = ["attacker.example", "", "127.0.0.1:99999", "127.0.0.1.attacker.example", "[::1]", "localhost"]
BODIES = [b"", b"{", b"[]", b'"x"', b"1", b"null", b"\xff\xfe{}", b'{"messages": NaN}',
          b'{"messages": [], "messages": []}', b"[" * 50_000 + b"]" * 50_000, b" " * (33 * 1024 * 1024)]


# ---------------------------------------------------------------------------------------
# Probes: (label, method, path, headers, body bytes)


def chat_probe(label, body, headers=None):
    data = json.dumps(body).encode() if not isinstance(body, bytes) else body
    return label, "POST", "/v1/chat/completions", {"content-type": "application/json", **(headers or {})}, data


def field_probes(quick):
    values = QUICK_VALUES if quick else HOSTILE_VALUES
    top = [name for name in ChatRequest.model_fields if name != "messages"]
    probes = [chat_probe(f"{name}={value!r:.40}", {**TINY, name: value}) for name in top for value in values]
    probes += [chat_probe(f"messages[0].{name}={value!r:.40}",
                          {**TINY, "messages": [{"role": "user", "content": "Hi", name: value}]})
               for name in UserMessage.model_fields for value in values]
    probes += [chat_probe(f"messages={value!r:.40}", {**TINY, "messages": value}) for value in values]
    tool = {"name": "f", "parameters": {"type": "object"}}
    # A request with tools carries the template's long tools preamble; --quick (CI, on CPU)
    # leaves the fields whose hostile values may be accepted, and so prefilled, to the full run.
    tool_fields = ("name", "description") if quick else ("name", "description", "parameters", "strict")
    probes += [chat_probe(f"tools[0].function.{name}={value!r:.40}",
                          {**TINY, "tools": [{"type": "function", "function": {**tool, name: value}}]})
               for name in tool_fields for value in values]
    probes += [chat_probe(f"image_url={url:.40}", {**TINY, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}]}) for url in IMAGE_URLS]
    probes += [chat_probe(f"logit_bias key {key!r}", {**TINY, "logit_bias": {key: 1}})
               for key in ("511", "512", "999999999", "-1", "\u0661", "1e3", " 1", "01")]
    # Well-formed values the servers do not serve (serve.py once answered the first two with a 500).
    probes += [chat_probe(f"served nowhere: {name}", {**TINY, **fields}) for name, fields in (
        ("json_object", {"response_format": {"type": "json_object"}}),
        ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
        ("thinking_budget", {"thinking_budget": 4}), ("temperature 1e-7", {"temperature": 1e-7}))]
    return probes


def messages_probe(label, body, path="/v1/messages"):
    return label, "POST", path, {"content-type": "application/json"}, json.dumps(body).encode()


def messages_probes(quick):
    """field_probes for Anthropic Messages and count_tokens: every field, block and image source."""
    values = QUICK_VALUES if quick else HOSTILE_VALUES
    tiny = {"max_tokens": 1, "temperature": 0, "messages": TINY["messages"]}
    probes = [messages_probe(f"messages {name}={value!r:.40}", {**tiny, name: value})
              for name in MessagesRequest.model_fields if name != "messages" for value in values]
    probes += [messages_probe(f"count_tokens {name}={value!r:.40}", {"messages": tiny["messages"], name: value},
                              "/v1/messages/count_tokens")
               for name in CountTokensRequest.model_fields for value in values]
    probes += [messages_probe(f"messages[0].{name}={value!r:.40}",
                              {**tiny, "messages": [{"role": "user", "content": "Hi", name: value}]})
               for name in AnthropicUserMessage.model_fields for value in values]
    blocks = [{"type": "text", "text": "Hi"}, {"type": "tool_result", "tool_use_id": "t", "content": "x"},
              {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]
    probes += [messages_probe(f"block {block['type']}.{name}={value!r:.40}",
                              {**tiny, "messages": [{"role": "user", "content": [{**block, name: value}]}]})
               for block in blocks for name in block for value in values]
    probes += [messages_probe(f"image source url={url:.40}", {**tiny, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": url}}]}]}) for url in IMAGE_URLS]
    probes += [messages_probe(f"messages body {body!r}", body) for body in ([], "x", None, {})]
    return probes


def responses_probes(quick):
    """field_probes for OpenAI Responses: every field, input item, content part and image URL."""
    values = QUICK_VALUES if quick else HOSTILE_VALUES
    tiny = {"max_output_tokens": 1, "temperature": 0, "input": "Hi"}

    def probe(label, body):
        return messages_probe(label, body, "/v1/responses")

    probes = [probe(f"responses {name}={value!r:.40}", {**tiny, name: value})
              for name in [*ResponsesRequest.model_fields, "previous_response_id", "conversation"]
              for value in values]
    probes += [probe(f"input[0].{name}={value!r:.40}",
                     {**tiny, "input": [{"role": "user", "content": "Hi", name: value}]})
               for name in ResponseUserMessageItem.model_fields for value in values]
    items = [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c", "output": "x"},
             {"type": "reasoning", "summary": []}]
    probes += [probe(f"item {item['type']}.{name}={value!r:.40}",
                     {**tiny, "input": [{**item, name: value}, {"role": "user", "content": "Hi"}]})
               for item in items for name in item for value in values]
    parts = [{"type": "input_text", "text": "Hi"}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]
    probes += [probe(f"part {part['type']}.{name}={value!r:.40}",
                     {**tiny, "input": [{"role": "user", "content": [{**part, name: value}]}]})
               for part in parts for name in part for value in values]
    probes += [probe(f"input_image image_url={url:.40}", {**tiny, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": url}]}]}) for url in IMAGE_URLS]
    probes += [probe(f"function_call_output image_url={url:.40}", {**tiny, "input": [
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": url}]}]})
        for url in IMAGE_URLS]
    probes += [probe(f"responses body {body!r}", body) for body in ([], "x", None, {})]
    return probes


def endpoint_probes(quick):
    paths = PATHS[:6] if quick else PATHS
    return [(f"{method} {path:.40}", method, path, {}, b"") for path in paths for method in METHODS]


def header_probes(quick):
    good = json.dumps(TINY).encode()
    probes = [chat_probe(f"content-type {kind}", good, {"content-type": kind} if kind else {})
              for kind in CONTENT_TYPES]
    for origin in ORIGINS:
        probes.append((f"preflight {origin}", "OPTIONS", "/v1/chat/completions",
                       {"origin": origin, "access-control-request-method": "POST"}, b""))
        probes.append(chat_probe(f"origin {origin}", good, {"origin": origin}))
    probes += [(f"host {host!r}", "GET", "/health", {"host": host}, b"") for host in HOSTS]
    probes += [("huge header", "GET", "/health", {"x-junk": "a" * 60_000}, b"")]
    if not quick:
        probes += [(f"body {body[:20]!r}", "POST", "/v1/chat/completions", {"content-type": "application/json"}, body)
                   for body in BODIES]
    return probes


# ---------------------------------------------------------------------------------------
# Servers and requests


def start(name, pack, script, workdir):
    """The pack's script on a free port, its own HOME and working folder (ServerProcess);
    local_paths: what must never appear in a response or a log line."""
    server = ServerProcess(name, [pack / script, "--request-timeout", "30"], workdir)
    server.local_paths = {str(p) for p in (pack, pack.resolve(), workdir, workdir.resolve(), sys.prefix,
                                           *site.getsitepackages(), Path.home())}
    return server


def send(port, method, path, headers=None, body=b"", timeout=120):
    """(status or None, headers, body) of one request; None when no answer came."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.putrequest(method, path, skip_host="host" in (headers or {}), skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        connection.putheader("content-length", str(len(body)))
        connection.endheaders(body)
        reply = connection.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    except (OSError, http.client.HTTPException):
        return None, {}, b""
    finally:
        connection.close()


def raw_exchange(port, data: bytes, *, read_first=False, pause=0.0):
    """Sends raw bytes (in pieces with pauses when pause > 0), then closes; for
    disconnects and slow clients."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        pieces = [data[i:i + 16] for i in range(0, len(data), 16)] if pause else [data]
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(pause)
        if read_first:
            try:
                sock.recv(4096)
            except OSError:
                pass


def disconnect_probes(port):
    body = json.dumps({**GOOD, "max_tokens": 30000}).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    request = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    streamed = json.dumps({**GOOD, "max_tokens": 30000, "stream": True}).encode()
    stream_request = head + b"Content-Length: %d\r\n\r\n" % len(streamed) + streamed
    return [
        ("half the headers", lambda: raw_exchange(port, head[:30])),
        ("headers, half the body", lambda: raw_exchange(port, request[:-len(body) // 2])),
        ("slow client", lambda: raw_exchange(port, head + b"Content-Length: %d\r\n\r\n" % len(TINY_BYTES)
                                             + TINY_BYTES, read_first=True, pause=0.05)),
        ("disconnect mid-stream", lambda: raw_exchange(port, stream_request, read_first=True)),
        ("disconnect while generating", lambda: (raw_exchange(port, request), time.sleep(2))),
        ("garbage", lambda: raw_exchange(port, b"\x16\x03\x01\x00\xa5" + os.urandom(200))),
    ]


TINY_BYTES = json.dumps(TINY).encode()


# ---------------------------------------------------------------------------------------
# The battery on one server


class Tally:
    def __init__(self, server):
        self.server = server
        self.sent = 0
        self.by_class = {}
        self.client_5xx = []
        self.limit_5xx = []  # answers of the server's own time limit or shutdown, not client errors
        self.path_leaks = []
        self.answers_changed = 0
        self.crashes = 0
        self.timeouts_under_load = 0
        self.reference = None

    def note(self, label, status, headers, body):
        self.sent += 1
        kind = f"{status // 100}xx" if status else "no answer"
        self.by_class[kind] = self.by_class.get(kind, 0) + 1
        error = body[:2000].decode("utf-8", "replace")
        if status and status >= 500:
            limit = '"request-timeout"' in error or '"shutting-down"' in error
            (self.limit_5xx if limit else self.client_5xx).append(f"{label}: {status} {error[:200]}")
        text = json.dumps(headers) + body.decode("latin-1")
        self.path_leaks += [f"{label}: {path}" for path in self.server.local_paths if path in text]

    def good_answer(self):
        status, _, body = send(self.server.port, "POST", "/v1/chat/completions",
                               {"content-type": "application/json"}, json.dumps(GOOD).encode())
        return json.loads(body)["choices"][0]["message"] if status == 200 else f"status {status}"

    def check_after(self, batch):
        """The server is alive and answers the good request as before."""
        if self.server.process.poll() is not None:
            self.crashes += 1
            print(f"{self.server.name}: crashed during {batch}", file=sys.stderr)
            return
        answer = self.good_answer()
        if answer == "status 504":
            # Queued behind the batch past --request-timeout: a timeout under load, not a
            # changed answer; once the queue drains the answer must be the same.
            self.timeouts_under_load += 1
            answer = self.good_answer()
        if self.reference is None:
            self.reference = answer
        elif answer != self.reference:
            self.answers_changed += 1
            print(f"{self.server.name}: answer changed after {batch}: {answer}", file=sys.stderr)


def concurrent_clients(tally, clients=16):
    bodies = [{**GOOD, "messages": [{"role": "user", "content": f"Item {i}"}], "max_tokens": 1 + i % 3}
              for i in range(clients)]

    def ask(body):
        status, headers, data = send(tally.server.port, "POST", "/v1/chat/completions",
                                     {"content-type": "application/json"}, json.dumps(body).encode())
        tally.note(f"concurrent {body['messages'][0]['content']}", status, headers, data)
        return json.loads(data)["choices"][0]["message"] if status == 200 else status

    alone = [ask(body) for body in bodies]
    with ThreadPoolExecutor(clients) as pool:
        together = list(pool.map(ask, bodies))
    # One sequence runs at a time: on a slow backend the last in the queue reach
    # --request-timeout (504), which is counted apart from a changed answer.
    tally.timeouts_under_load += sum(b == 504 for b in together)
    tally.answers_changed += sum(a != b for a, b in zip(alone, together) if b != 504)


def run_batches(server, quick=False) -> Tally:
    """Every batch against one running server; returns the tally."""
    tally = Tally(server)
    tally.check_after("start")
    batches = [("fields", field_probes(quick)), ("messages fields", messages_probes(quick)),
               ("responses fields", responses_probes(quick)),
               ("endpoints", endpoint_probes(quick)),
               ("headers", header_probes(quick))]
    for name, probes in batches:
        for label, method, path, headers, body in probes:
            tally.note(label, *send(server.port, method, path, headers, body))
        tally.check_after(name)
    if not quick:
        for label, probe in disconnect_probes(server.port):
            probe()
            tally.sent += 1
            tally.check_after(label)
        concurrent_clients(tally)
        tally.check_after("16 concurrent clients")
    return tally


def log_leaks(server):
    log = server.log()
    return [f"{server.name} log: {path}" for path in server.local_paths if path in log]


# ---------------------------------------------------------------------------------------
# Schemathesis and damaged packs


SCHEMATHESIS_SEED = 1  # the same cases each run: a failure can be replayed


def schemathesis_pass(server, max_examples):
    """Schemathesis's negative cases for every operation and positive ones for the GET
    operations, each run bounded in examples and time. A valid chat request runs
    generation (the battery's own probes send those); tools/schemathesis_hooks.py keeps
    any that gets through short."""
    if shutil.which("schemathesis") is None:
        return {"ran": False, "note": "schemathesis is not installed (pip install -r tests/requirements.txt)"}
    record = {"ran": True}
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(REPO / "tools" / "schemathesis_hooks.py")}
    for mode, only in (("negative", []), ("positive", ["--include-method", "GET"])):
        result = subprocess.run(
            ["schemathesis", "run", f"http://127.0.0.1:{server.port}/openapi.json", "--mode", mode, *only,
             "--checks", "not_a_server_error", "--max-examples", str(max_examples), "--max-time", "300",
             "--request-timeout", "60", "--workers", "1", "--no-color", "--seed", str(SCHEMATHESIS_SEED)],
            capture_output=True, text=True, timeout=900, env=env)
        lines = [line.strip() for line in result.stdout.splitlines()]
        # What failed, as schemathesis reports it: each case, its answer and a curl line to replay it.
        report = result.stdout.partition("= FAILURES =")[2].partition("= SUMMARY =")[0]
        answers = failure_answers(report)
        record[mode] = {"exit_code": result.returncode,
                        "cases": next((line for line in lines if " generated" in line), None),
                        "failures": [line for line in lines if line.startswith("\u274c")],
                        # A 504 of --request-timeout is a timeout under load, as in the request batches.
                        "request_timeouts": sum(code == "request-timeout" for _, code in answers),
                        "failure_report": report.strip()[:20000]}
        record[mode]["failed"] = schemathesis_failed(record[mode]["failures"], answers)
    return record


def schemathesis_failed(failures: list, answers: list) -> bool:
    """Whether schemathesis's failures fail the battery: all but those whose every answer was a
    504 of --request-timeout (timeouts under load, counted apart as in the request batches)."""
    return bool(failures) and (not answers or any(code != "request-timeout" for _, code in answers))


def failure_answers(report: str) -> list:
    """(status, the error body's code or None) of each answer schemathesis's failure report shows."""
    answers = []
    for status, body in re.findall(r"^\[(\d{3})\][^\n]*:\n\n\s*`(.*?)`$", report, re.M | re.S):
        try:
            code = json.loads(body)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        answers.append((int(status), code))
    return answers


def damage_cases():
    """(name, damage(pack), whether a plain start must refuse it too)."""
    def header_digit(pack):
        path = pack / "model.safetensors"
        data = bytearray(path.read_bytes())
        at = data.index(b'"data_offsets":[0,') + len(b'"data_offsets":[0,')
        data[at] = ord("9") if data[at] != ord("9") else ord("8")
        path.write_bytes(bytes(data))

    def truncate(pack):
        path = pack / "model.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    def write(name, text):
        return lambda pack: (pack / name).write_text(text)

    return [
        ("safetensors header digit", header_digit, True),
        ("truncated weights", truncate, True),
        ("dflash2-pack.json not JSON", write("dflash2-pack.json", "{"), True),
        ("dflash2-pack.json wrong shape", write("dflash2-pack.json", '{"files": [1]}'), True),
        ("config.json not JSON", write("config.json", "{"), True),
        ("drafter config block size", write("drafter/config.json", '{"dflash_config": {"block_size": 1}}'), True),
        ("SHA256SUMS garbage", write("SHA256SUMS", "not a sums line\n"), False),
    ]


def damaged_packs(pack, workdir):
    results = []
    for name, damage, start_refuses in damage_cases():
        copy = workdir / "damaged" / name.replace(" ", "-")
        shutil.copytree(pack, copy, ignore=shutil.ignore_patterns("__pycache__"))
        damage(copy)
        runs = [["--verify-pack"]] + ([["--port", "1"]] if start_refuses else [])
        for args in runs:
            try:
                result = subprocess.run([sys.executable, "serve_dflash2.py", *args], cwd=copy,
                                        capture_output=True, text=True, timeout=300)
                output, code = result.stdout + result.stderr, result.returncode
            except subprocess.TimeoutExpired:
                output, code = "still running after 300 s", None
            results.append({"damage": name, "run": " ".join(args), "exit_code": code,
                            "refused": code not in (0, None), "traceback": "Traceback" in output})
    return results


# ---------------------------------------------------------------------------------------


def limited(answers: list) -> str:
    """How many answers of the time limit or shutdown, and which requests got them."""
    return f"{len(answers)}" + (f" ({'; '.join(answer[:80] for answer in answers)})" if answers else "")


def markdown(record):
    lines = [f"# Hostile-input battery ({record['backend']})", "", f"Command: `{record['command']}`", "",
             "| server | sent | by status | 5xx for client errors | crashes | path leaks | answers changed "
             "| timeouts under load (504) | 5xx of the time limit or shutdown | RSS before -> after (MB) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in record["servers"].items():
        lines.append(f"| {name} | {s['sent']} | {s['by_class']} | {len(s['client_5xx'])} | {s['crashes']} | "
                     f"{len(s['path_leaks'])} | {s['answers_changed']} | {s['timeouts_under_load']} | "
                     f"{limited(s['limit_5xx'])} | {s['rss_kb_before'] / 1024:.0f} -> {s['rss_kb_after'] / 1024:.0f} |")
    damaged = record["damaged_packs"]
    lines += ["", f"Damaged packs: {len(damaged)} runs, {sum(r['refused'] for r in damaged)} refused, "
                  f"{sum(r['traceback'] for r in damaged)} with a traceback.", "",
              f"Schemathesis: {json.dumps(record['schemathesis'])}"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pack", type=Path, required=True, help="a flat pack folder (tools/build_pack.py)")
    parser.add_argument("--out", type=Path, default=REPO / "evidence")
    parser.add_argument("--quick", action="store_true", help="a small subset, as CI runs it")
    parser.add_argument("--schemathesis-examples", type=int, default=100)
    args = parser.parse_args(argv)
    from dflash2_kernels import backend_name

    pack = args.pack.resolve()
    record = {"command": "python tools/battery.py " + " ".join(argv or sys.argv[1:]), "backend": backend_name(),
              "code": code_digest(), **git_state(), "servers": {}}
    with tempfile.TemporaryDirectory(prefix="battery-") as temp:
        workdir = Path(temp)
        for name, script in (("serve_dflash2.py", "serve_dflash2.py"), ("serve.py", "serve.py")):
            server = start(name, pack, script, workdir / name)
            try:
                server.wait_ready()
                before = server.rss_kb()
                tally = run_batches(server, quick=args.quick)
                if name == "serve_dflash2.py" and not args.quick:
                    record["schemathesis"] = schemathesis_pass(server, args.schemathesis_examples)
                    tally.check_after("schemathesis")
                after = server.rss_kb() if server.process.poll() is None else None
            finally:
                server.stop()
            record["servers"][name] = {
                "sent": tally.sent, "by_class": tally.by_class, "client_5xx": tally.client_5xx,
                "limit_5xx": tally.limit_5xx,
                "crashes": tally.crashes, "path_leaks": tally.path_leaks + log_leaks(server),
                "answers_changed": tally.answers_changed, "timeouts_under_load": tally.timeouts_under_load,
                "rss_kb_before": before, "rss_kb_after": after or 0}
        record.setdefault("schemathesis", {"ran": False, "note": "not run with --quick"})
        record["damaged_packs"] = [] if args.quick else damaged_packs(pack, workdir)
    write_record(args.out, f"battery-{record['backend']}", record, markdown(record))
    print(markdown(record))
    failed = any(s["client_5xx"] or s["crashes"] or s["path_leaks"] or s["answers_changed"]
                 for s in record["servers"].values())
    failed |= any(not r["refused"] or r["traceback"] for r in record["damaged_packs"])
    failed |= any(record["schemathesis"].get(mode, {}).get("failed") for mode in ("negative", "positive"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
