"""The hardened HTTP layer both servers put in front of mlx-vlm's FastAPI app.

- the gateway serves chat completions, Anthropic Messages, OpenAI Responses, /v1/models,
  /health and /openapi.json only,
  validates and routes every chat body through the decide function it is given
  (dflash2_routing.py), answers mistakes with OpenAI-shaped 4xx errors, allows cross-origin
  use from loopback pages only, and replaces local paths with public names in headers,
  errors and logs;
- a request stops at its stop sequences, when its client disconnects, at the request
  timeout and at shutdown; each request gets one record (route, tokens, timings), logged
  at arrival and at finish.
"""

import asyncio
import itertools
import json
import logging
import os
import pwd
import re
import site
import sys
import time
from pathlib import Path
from urllib.parse import unquote

from dflash2_requests import Refusal, context_fields, context_refusal
from dflash2_openapi import openapi_schema
from dflash2_record import RequestRecord, current_request

logger = logging.getLogger("dflash2.server")

GRACEFUL_SHUTDOWN_S = 3
MAX_BODY_BYTES = 32 * 1024 * 1024
# mlx-vlm's refusal of a prompt plus max_tokens beyond its context budget (set to the
# model's context length in dflash2_engine.start_engine).
MLX_VLM_CONTEXT_BUDGET = re.compile(
    r"Request needs (\d+) context tokens \((\d+) prompt \+ (\d+) max generation\), but MAX_KV_SIZE is (\d+)\.")
LOOPBACK_HOST_HEADER = re.compile(r"(127\.0\.0\.1|localhost|\[::1\])(:\d{1,5})?", re.IGNORECASE)  # host names ignore case
LOOPBACK_ORIGIN = r"https?://(127\.0\.0\.1|localhost|\[::1\])(:\d{1,5})?"


# ---------------------------------------------------------------------------------------
# Local paths out of headers, errors and logs


def local_paths(pack_dirs, model_id: str) -> list:
    """(path, public name) for every local path a message could show: the pack folders,
    the Python installation, the home folders and the working folder."""
    python = [sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages()]
    homes = [Path.home(), os.environ.get("HOME"), pwd.getpwuid(os.getuid()).pw_dir]
    return ([(path, model_id) for path in pack_dirs] + [(path, "<python>") for path in python]
            + [(path, "~") for path in homes] + [(os.getcwd(), "<cwd>")])


class PathScrubber:
    """Replaces known local paths (and their resolved forms) with public names, and drops
    object addresses ("<... object at 0x7f...>")."""

    ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

    def __init__(self, paths):
        self.names = {}
        for path, name in paths:
            if path:
                for form in (str(path), os.path.abspath(path), os.path.realpath(path)):
                    form = form.rstrip("/")
                    if len(form) > 1:
                        self.names.setdefault(form, name)
        # Longest first, so a model folder inside the home folder is replaced whole;
        # the lookahead keeps /home/a from matching inside /home/ab.
        alternatives = "|".join(re.escape(f) for f in sorted(self.names, key=len, reverse=True))
        self.pattern = re.compile(f"(?:{alternatives})(?![\\w.-])")
        self.pattern_bytes = re.compile(self.pattern.pattern.encode())

    def __call__(self, text: str) -> str:
        text = self.pattern.sub(lambda match: self.names[match.group()], text)
        return self.ADDRESS.sub("", text)

    def scrub_bytes(self, data: bytes) -> bytes:
        return self.pattern_bytes.sub(lambda match: self.names[match.group().decode()].encode(), data)


class ScrubbedStream:
    """stdout/stderr wrapper, for what libraries print outside logging (warnings, tqdm)."""

    def __init__(self, stream, scrub):
        self._stream = stream
        self._scrub = scrub

    def write(self, text):
        self._stream.write(self._scrub(text))
        return len(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class ScrubbedFormatter(logging.Formatter):
    def __init__(self, scrub):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._scrub = scrub

    def format(self, record):
        return self._scrub(super().format(record))


def setup_logging(level: str, scrub):
    sys.stdout = ScrubbedStream(sys.stdout, scrub)
    sys.stderr = ScrubbedStream(sys.stderr, scrub)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ScrubbedFormatter(scrub))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # mlx-vlm logs several lines per request; ours are the arrival and finish lines.
    if level != "DEBUG":
        logging.getLogger("mlx_vlm").setLevel(logging.WARNING)




# ---------------------------------------------------------------------------------------
# The gateway: an ASGI layer in front of mlx-vlm's FastAPI app


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


SEED_HEADER = b"x-dflash2-seed"  # a sampled request's seed: sent again, it gives the same answer
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
MODELS_PATHS = ("/v1/models", "/models")
HEALTH_PATHS = ("/health", "/v1/health")
OPENAPI_PATHS = ("/openapi.json", "/v1/openapi.json")
MESSAGES_PATHS = ("/v1/messages", "/messages")
COUNT_TOKENS_PATHS = ("/v1/messages/count_tokens", "/messages/count_tokens")
ANTHROPIC_PATHS = MESSAGES_PATHS + COUNT_TOKENS_PATHS
RESPONSES_PATHS = ("/v1/responses", "/responses")
# The APIs whose bodies the gateway checks (dflash2_routing.REQUEST_CHECKS), by path.
API_OF_PATH = {**dict.fromkeys(CHAT_PATHS, "chat"), **dict.fromkeys(MESSAGES_PATHS, "messages"),
               **dict.fromkeys(COUNT_TOKENS_PATHS, "count_tokens"), **dict.fromkeys(RESPONSES_PATHS, "responses")}
ANTHROPIC_ERROR_TYPES = {404: "not_found_error", 413: "request_too_large", 504: "timeout_error",
                         503: "overloaded_error"}


def error_payload(status: int, reason: str, message: str, param: str = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": reason}}


def anthropic_error_payload(status: int, reason: str, message: str, param: str = None) -> dict:
    """An error in Anthropic's shape; param and code as chat's errors have them."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message, "param": param, "code": reason}}


def error_body(api: str, status: int, reason: str, message: str, param: str = None) -> dict:
    """An error in the shape of the request's API: Anthropic's for Messages, else OpenAI's."""
    payload = anthropic_error_payload if api in ("messages", "count_tokens") else error_payload
    return payload(status, reason, message, param)


def inner_error_message(body: bytes) -> str:
    """The message of an error mlx-vlm produced ({"detail": ...}, or an Anthropic-shaped
    error), without echoed input."""
    try:
        data = json.loads(body)
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return str(data["error"].get("message"))
        detail = data["detail"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:500] or "request failed"
    if isinstance(detail, list):  # FastAPI validation errors
        return "; ".join(
            f"{'.'.join(str(p) for p in item.get('loc', ())[1:])}: {item.get('msg')}"
            for item in detail if isinstance(item, dict)
        )
    return str(detail)


def with_loopback_cors(app):
    """Cross-origin use from pages served on loopback only, without credentials. Chat
    requests also need Content-Type: application/json, which no page can send to another
    origin without a preflight that this refuses. A loopback page may send any header: the
    OpenAI SDKs add their own (X-Stainless-*), and no header changes what the server does."""
    from starlette.middleware.cors import CORSMiddleware

    cors = CORSMiddleware(app, allow_origin_regex=LOOPBACK_ORIGIN, allow_methods=["GET", "HEAD", "POST"],
                          allow_headers=["*"], expose_headers=["x-dflash2", SEED_HEADER.decode()])

    async def vary_once(scope, receive, send):
        # mlx-vlm's CORS layer names Origin in Vary and this one adds it again.
        async def send_once(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"vary"]
                tokens = dict.fromkeys(token.strip() for k, v in message.get("headers", []) if k.lower() == b"vary"
                                       for token in v.split(b","))
                message = {**message, "headers": headers + ([(b"vary", b", ".join(tokens))] if tokens else [])}
            await send(message)

        await cors(scope, receive, send_once if scope["type"] == "http" else send)

    return vary_once


class Gateway:
    """Serves the pack's endpoints, decides each chat request's route, and forwards the
    request to mlx-vlm's app with a normalised body.

    decide(body) validates and routes a chat body (raising Refusal) against limits (the
    pack's PackLimits, which /openapi.json states too); header, when set, names the response
    header that carries each response's mode.
    """

    def __init__(self, app, *, limits, scrubber, decide, header=None, server_mode=("plain", None),
                 health=None, request_timeout=None):
        self.app = app
        self.model_id = limits.model_id
        self.scrub = scrubber
        self.decide = decide
        self.header = header
        self.server_mode = server_mode
        self.health = health or dict  # () -> what /health adds, read at each request
        self.request_timeout = request_timeout or None
        self.openapi = openapi_schema(limits)
        self.created = int(time.time())
        self.ids = itertools.count(1)
        self.checking = asyncio.Lock()  # one chat body parsed and checked at a time (check_body)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # websockets (mlx-vlm's realtime API) are not served
            await send({"type": "websocket.close", "code": 1008})
            return
        record = RequestRecord(next(self.ids), scope["method"], scope["path"])
        api = API_OF_PATH.get(scope["path"], "chat")
        record.mode, record.reason = self.server_mode
        started = time.perf_counter()
        try:
            await self.handle(scope, receive, self.responder(send, record), record)
        except Refusal as refusal:
            await self.refuse(send, record, refusal)
        except ClientGone:
            record.cancelled = "disconnected"
        except Exception:
            logger.exception("request %d failed", record.id)
            if record.status is None:  # nothing sent yet: answer it, without the traceback
                await send_json(self.responder(send, record), 500, error_body(
                    api, 500, "server-error", "internal error; the server log has the details"))
        finally:
            logger.info("request %d finished in %.2fs: %s", record.id,
                        time.perf_counter() - started, record.finish_summary())

    async def refuse(self, send, record, refusal: Refusal):
        record.mode, record.reason = "refused", refusal.reason
        record.log_arrival()
        allow = b"POST" if record.path in API_OF_PATH else b"GET, HEAD"
        headers = [(b"allow", allow)] if refusal.status == 405 else []
        payload = error_body(API_OF_PATH.get(record.path, "chat"), refusal.status, refusal.reason,
                             self.scrub(refusal.message), refusal.param)
        await send_json(self.responder(send, record), refusal.status, payload, headers)

    async def handle(self, scope, receive, send, record):
        method, path = scope["method"], scope["path"]
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if not LOOPBACK_HOST_HEADER.fullmatch(host):
            # A browser page reaching loopback through DNS rebinding sends a foreign Host.
            raise Refusal(421, "invalid-host", "requests must address 127.0.0.1 or localhost")
        if path in API_OF_PATH:
            if method != "POST":
                raise Refusal(405, "method-not-allowed", f"{path} accepts POST only")
            return await self.chat(scope, receive, send, record, API_OF_PATH[path])
        is_model = path.startswith(("/v1/models/", "/models/"))
        if not (is_model or path in MODELS_PATHS + HEALTH_PATHS + OPENAPI_PATHS):
            raise Refusal(404, "unsupported-endpoint",
                          f"{path} is not served; this pack serves /v1/chat/completions, /v1/messages, "
                          "/v1/messages/count_tokens, /v1/responses, /v1/models, /health and /openapi.json")
        if method not in ("GET", "HEAD"):
            raise Refusal(405, "method-not-allowed", f"{path} accepts GET and HEAD only")
        if is_model:
            requested = unquote(path.split("/models/", 1)[1])
            if requested != self.model_id:
                raise Refusal(404, "unknown-model", f"model {requested!r} is not served here; "
                                                    f"this server serves {self.model_id!r}")
            payload = self.model_card()
        elif path in MODELS_PATHS:
            payload = {"object": "list", "data": [self.model_card()]}
        elif path in HEALTH_PATHS:
            payload = {"status": "ok", "model": self.model_id, **self.health()}
        else:
            payload = self.openapi
        record.log_arrival()
        await send_json(send, 200, payload, head=method == "HEAD")

    def model_card(self):
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "local"}

    async def chat(self, scope, receive, send, record, api="chat"):
        """A chat completion, Messages or count_tokens request (api), checked, routed and forwarded."""
        content_type = dict(scope["headers"]).get(b"content-type", b"")
        if content_type.split(b";")[0].strip().lower() != b"application/json":
            raise Refusal(415, "unsupported-media-type",
                          f"{scope['path']} requests must be sent with Content-Type: application/json")
        body = await read_body(scope, receive)
        # Up to 32 MiB of JSON and its images decoded: on a thread, so the event loop keeps
        # serving the other clients meanwhile, and one at a time, so their memory does not add up.
        async with self.checking:
            decision = await asyncio.to_thread(self.check_body, body, api)
        if api == "count_tokens":  # generates nothing: the header keeps the server's mode
            record.log_arrival()
        else:
            record.mode, record.reason = decision.mode, decision.reason
        record.speculative = decision.mode == "speculative" and api != "count_tokens"
        # Stop sequences end the text here (dflash2_generator.RecordingTokens), on every route alike.
        # (The Responses API has no stop sequences.)
        record.stop = decision.body.pop({"chat": "stop", "messages": "stop_sequences"}.get(api, "stop"), [])
        record.seed = decision.body.get("seed")
        forwarded = json.dumps(decision.body).encode()
        # Origin stays out: mlx-vlm's own CORS layer would allow any origin.
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"content-type", b"origin")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(forwarded)).encode())]
        await self.generate({**scope, "headers": headers}, forwarded, receive, send, record, api)

    def check_body(self, body: bytes, api="chat"):
        """The body parsed, checked and routed (self.decide): its decision, or a Refusal."""
        try:
            request = json.loads(body, parse_constant=reject_constant)
        except (ValueError, RecursionError) as exc:
            raise Refusal(400, "invalid-json", f"the request body is not valid JSON ({exc})")
        try:
            return self.decide(request, api) if api != "chat" else self.decide(request)
        except RecursionError:
            raise Refusal(400, "invalid-json", "the request body is nested too deeply")

    async def generate(self, scope, body, receive, send, record, api="chat"):
        """Runs mlx-vlm's endpoint for the API on the checked body. Its generation stops when
        the client disconnects, at the request timeout (504) and at shutdown (503)."""
        output = ChatOutput(send, record, self.scrub, api)
        gone = asyncio.Event()
        body_sent = False

        async def replay():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()  # how a streaming response notices a disconnect
            return {"type": "http.disconnect"}

        async def watch_client():
            while (await receive())["type"] != "http.disconnect":
                pass
            if not output.complete:
                record.cancel("disconnected")
                if not record.announced:  # generation not started: the engine drops it at its turn
                    logger.info("request %d: its client left before its generation started", record.id)
            gone.set()

        token = current_request.set(record)  # tasks copy the context: mlx-vlm's threads see it
        finishing = {"chat": with_token_sources, "responses": passed_through}.get(api, with_stop_sequence)
        inner = asyncio.ensure_future(self.app(scope, replay, finishing(output.send, record)))
        watcher = asyncio.ensure_future(watch_client())
        current_request.reset(token)
        try:
            done, _ = await asyncio.wait([inner], timeout=self.request_timeout)
            if not done:
                record.cancel("timeout")
                await output.end_with_error(504, "request-timeout", "the request did not finish within "
                                            f"{self.request_timeout} s (the server's --request-timeout)")
            await inner
        except asyncio.CancelledError:
            # uvicorn's graceful-shutdown time is over: answer, and end the task quietly.
            record.cancel("shutdown")
            inner.cancel()
            await output.end_with_error(503, "shutting-down", "the server shut down before this request finished")
        finally:
            watcher.cancel()

    def responder(self, send, record):
        """Adds the mode header, scrubs header values and notes the status."""
        async def respond(message):
            if message["type"] == "http.response.start":
                record.status = message["status"]
                # mlx-vlm names itself and its version in a Server header (uvicorn's is off)
                headers = [(k, self.scrub.scrub_bytes(v)) for k, v in message.get("headers", [])
                           if k.lower() not in ((self.header or "").encode(), b"server")]
                if self.header:
                    headers.append((self.header.encode(), record.header_value().encode()))
                if record.seed is not None:
                    headers.append((SEED_HEADER, str(record.seed).encode()))
                message = {**message, "headers": headers}
            await send(message)
        return respond


class ChatOutput:
    """A response on its way out: mlx-vlm's errors in the API's shape (OpenAI's, or
    Anthropic's for Messages) with paths scrubbed, its event stream tidied, and nothing more
    once the request was answered here or its client is gone."""

    def __init__(self, send, record, scrub, api="chat"):
        self._send = send
        self.record = record
        self.scrub = scrub
        self.api = api
        self.started = False
        self.complete = False
        self.stream = None  # EventStream, for text/event-stream responses
        self.error_start = None
        self.error_body = b""

    async def send(self, message):
        if self.complete or self.record.cancelled:
            return
        if message["type"] == "http.response.start":
            if message["status"] >= 400:
                self.error_start = message
                return
            if dict(message.get("headers", [])).get(b"content-type", b"").startswith(b"text/event-stream"):
                self.stream = EventStream(self.scrub) if self.api == "chat" else \
                    ResponsesEventStream(self.scrub) if self.api == "responses" else \
                    AnthropicEventStream(self.scrub, self.record)
            self.started = True
            return await self._send(message)
        if self.error_start is not None:
            self.error_body += message.get("body", b"")
            if not message.get("more_body"):
                await self.reshape_error()
            return
        if self.stream is not None:
            message = {**message, "body": self.stream.rewrite(message.get("body", b""))}
        self.complete = not message.get("more_body", False)
        await self._send(message)

    async def reshape_error(self):
        status, code, param = self.error_start["status"], "server-error", None
        message = self.scrub(inner_error_message(self.error_body))
        # mlx-vlm's Messages stream answers its context-budget refusal with a 500 ("400: Request needs ...")
        budget = MLX_VLM_CONTEXT_BUDGET.search(message) if self.api != "chat" else None
        if status < 500 or budget:  # FastAPI validation (422) and mlx-vlm's own 4xx: the client's input
            code, status = "invalid-request", 400 if status in (422, 500) else status
            budget = budget or MLX_VLM_CONTEXT_BUDGET.fullmatch(message)
            if budget:
                refusal = context_refusal("the prompt is {1} tokens and {limit} is {2}: {0} in all, above the "
                                          "model's context length of {3}".format(*budget.groups(),
                                                                                 limit=context_fields(self.api)[1]),
                                          self.api)
                code, message, param = refusal.reason, refusal.message, refusal.param
            self.record.mode, self.record.reason = "refused", code
        self.record.log_arrival()
        self.complete = True
        await send_json(self._send, status, error_body(self.api, status, code, message, param))

    async def end_with_error(self, status: int, code: str, text: str):
        """Ends the response here: an error response, or an error event once the stream has begun."""
        if self.complete:
            return
        self.complete = True
        if not self.started:
            await send_json(self._send, status, error_body(self.api, status, code, text))
        elif self.stream is not None:
            event = b"data: " + json.dumps(error_body(self.api, status, code, text)).encode() + b"\n\n"
            if self.api != "chat":
                event = b"event: error\n" + event
            await self._send({"type": "http.response.body", "body": event, "more_body": False})


class SentEvents:
    """A server-sent event stream rewritten event by event: an event split across chunks
    waits for its end (subclasses say what event() makes of each)."""

    pending = b""

    def rewrite(self, data: bytes) -> bytes:
        *events, self.pending = (self.pending + data).split(b"\n\n")
        return b"".join(self.event(event) + b"\n\n" for event in events)


class EventStream(SentEvents):
    """mlx-vlm's server-sent events as OpenAI sends them: the role in the first delta only,
    one created time per response, errors in OpenAI's shape with paths scrubbed."""

    def __init__(self, scrub):
        self.scrub = scrub
        self.created = None
        self.role_sent = False

    def event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event
        payload = json.loads(event[len(b"data: "):])
        if "error" in payload:
            payload = error_payload(500, "server-error", self.scrub(str(payload["error"])))
        else:
            self.created = payload["created"] = self.created or payload.get("created")
            for choice in payload.get("choices", []):
                delta = choice.get("delta") or {}
                if self.role_sent:
                    delta.pop("role", None)
                self.role_sent = self.role_sent or "role" in delta
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode()


class AnthropicEventStream(SentEvents):
    """mlx-vlm's Messages events, with errors scrubbed and the stop sequence the gateway
    ended the answer at in message_delta (mlx-vlm never sees the request's stop sequences)."""

    def __init__(self, scrub, record):
        self.scrub = scrub
        self.record = record

    def event(self, event: bytes) -> bytes:
        name, _, data = event.partition(b"\ndata: ")
        if name == b"event: error":
            message = self.scrub(inner_error_message(data))
            data = json.dumps(anthropic_error_payload(500, "server-error", message)).encode()
        elif name == b"event: message_delta" and self.record.stop_sequence is not None:
            payload = json.loads(data)
            with_stop_reason(payload.get("delta", {}), self.record.stop_sequence)
            data = json.dumps(payload, ensure_ascii=False).encode()
        else:
            return event
        return name + b"\ndata: " + data


class ResponsesEventStream(SentEvents):
    """mlx-vlm's typed Responses events, passed through; its failure event (data: {"error":
    "..."}, no type) becomes an error event in OpenAI's shape with paths scrubbed, which the
    openai client raises as an APIError."""

    def __init__(self, scrub):
        self.scrub = scrub

    def event(self, event: bytes) -> bytes:
        name, _, data = event.rpartition(b"data: ")
        if not data.startswith(b"{") or b'"error"' not in data:
            return event
        try:
            payload = json.loads(data)
        except ValueError:
            return event
        if not isinstance(payload, dict) or "error" not in payload or "type" in payload:
            return event
        message = self.scrub(inner_error_message(data) if isinstance(payload["error"], dict) else str(payload["error"]))
        return b"event: error\ndata: " + json.dumps(error_payload(500, "server-error", message)).encode()


def passed_through(send, record):
    """with_token_sources for Responses: mlx-vlm's answer as it is."""
    return send


def with_stop_reason(message: dict, stop_sequence: str):
    """A Messages answer (or message_delta) that ended at stop_sequence says so, as Anthropic's do."""
    if message.get("stop_reason") in ("end_turn", None):
        message["stop_reason"] = "stop_sequence"
        message["stop_sequence"] = stop_sequence


def rewriting_json(send, rewrite_body, rewrite_chunk=None):
    """An ASGI send that holds a 200 JSON answer whole and sends rewrite_body(its bytes) with
    its new length; anything else (a stream's chunks through rewrite_chunk, if given) passes on."""
    held = {"start": None, "body": b""}

    async def respond(message):
        if message["type"] == "http.response.start":
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            if message["status"] != 200 or not content_type.startswith(b"application/json"):
                return await send(message)
            held["start"] = message
            return
        if held["start"] is None:
            return await send(rewrite_chunk(message) if rewrite_chunk else message)
        held["body"] += message.get("body", b"")
        if message.get("more_body"):
            return
        body = rewrite_body(held["body"])
        headers = [(k, v) for k, v in held["start"].get("headers", []) if k.lower() != b"content-length"]
        await send({**held["start"], "headers": headers + [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return respond


def with_stop_sequence(send, record):
    """with_token_sources for Messages: a JSON answer that ended at one of the request's
    stop sequences names it, with stop_reason stop_sequence."""
    def rewrite(body: bytes) -> bytes:
        if record.stop_sequence is None:
            return body
        try:
            data = json.loads(body)
            with_stop_reason(data, record.stop_sequence)
            return json.dumps(data, ensure_ascii=False).encode()
        except (ValueError, AttributeError):
            return body

    return rewriting_json(send, rewrite)


def with_token_sources(send, record):
    """Adds where the tokens came from (rounds or plain steps) to mlx-vlm's timings, in a
    JSON body (sent with its new length) or in a stream's usage chunk; a stream's finish
    chunk also gets the draft counts, which mlx-vlm puts in the usage chunk only."""
    def rewrite_chunk(message):
        body = message.get("body", b"")
        if not (body.startswith(b"data: {") and b'"timings"' in body):
            return message
        events = [b"data: " + with_timings(event[6:], record.token_sources(), record.draft_counts())
                  if event.startswith(b"data: {") else event for event in body.split(b"\n\n")]
        return {**message, "body": b"\n\n".join(events)}

    return rewriting_json(send, lambda body: with_timings(body, record.token_sources()), rewrite_chunk)


def with_timings(payload: bytes, fields: dict, finish_fields: dict = None) -> bytes:
    """A JSON payload whose final `timings` object (the one with predicted_n) gains fields;
    with finish_fields, a stream's finish chunk gains those and fields."""
    try:
        data = json.loads(payload)
    except ValueError:
        return payload
    timings = data.get("timings") if isinstance(data, dict) else None
    if not isinstance(timings, dict):
        return payload
    if "predicted_n" in timings:
        timings.update(fields)
    elif finish_fields is not None and any(choice.get("finish_reason") for choice in data.get("choices") or []):
        timings.update({**finish_fields, **fields})
    else:
        return payload
    return json.dumps(data).encode()


def reject_constant(name):
    raise ValueError(f"{name} is not a JSON number")


async def read_body(scope, receive) -> bytes:
    length = dict(scope["headers"]).get(b"content-length")
    if length is not None:
        if not length.isdigit():
            raise Refusal(400, "invalid-request", "malformed Content-Length header")
        if int(length) > MAX_BODY_BYTES:
            raise Refusal(413, "body-too-large", f"the request body is larger than {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise Refusal(413, "body-too-large", f"the request body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def send_json(send, status: int, payload: dict, headers=(), head=False):
    body = json.dumps(payload).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": b"" if head else body})


def serve(gateway, args):
    """Serves until SIGTERM or Ctrl-C; a request still running GRACEFUL_SHUTDOWN_S later
    is cancelled."""
    import uvicorn

    logger.info("serving on http://%s:%d/v1", args.host, args.port)
    uvicorn.run(with_loopback_cors(gateway), host=args.host, port=args.port, log_config=None,
                access_log=False, log_level=args.log_level.lower(), server_header=False,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
