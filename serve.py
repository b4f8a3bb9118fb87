"""Serve the pack plain: mlx-vlm's OpenAI-compatible server, locked to this folder's model.

    python serve.py [--port 8080] [--model-id NAME] [--enable-thinking] [--pack DIR]

The hardening lives here and serve_dflash2.py reuses it:
- listens on 127.0.0.1 or localhost only; options reach mlx-vlm only by exact name;
- inherited environment variables that change generation, caching or batching stop the
  server before mlx-vlm is imported (mlx_vlm.server reads them at import);
- a gateway in front of mlx-vlm's FastAPI app serves chat completions, /v1/models and
  /health only, validates every request body, answers mistakes with OpenAI-shaped 4xx
  errors, and replaces local paths with the public model ID in headers, errors and logs;
- the request's `model` can name only the public ID; one sequence runs at a time.
"""

import argparse
import base64
import binascii
import contextvars
import io
import itertools
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

logger = logging.getLogger("dflash2.server")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
DEFAULT_PORT = 8080
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
LOOPBACK_HOST_HEADER = re.compile(r"(127\.0\.0\.1|localhost|\[::1\])(:\d{1,5})?")
MODEL_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")

# Environment variables mlx-vlm reads for generation, caching or batching. An inherited
# one would silently change what the pack serves, so the server refuses to start.
REFUSED_ENV_NAMES = {
    "MAX_KV_SIZE",
    "PREFILL_STEP_SIZE",
    "QUANTIZED_KV_START",
    "TOP_LOGPROBS_K",
    "EXPERT_CACHE_GB",
    "MLX_TRUST_REMOTE_CODE",
}
REFUSED_ENV_PREFIXES = ("KV_", "MLX_VLM_", "APC_")


def refused_environment(environ) -> list:
    """Names of inherited variables the server must not run with (APC_ENABLED=0 is fine)."""
    return sorted(
        name
        for name, value in environ.items()
        if (name in REFUSED_ENV_NAMES or name.startswith(REFUSED_ENV_PREFIXES))
        and not (name == "APC_ENABLED" and value == "0")
    )


def exit_if_environment_refused():
    names = refused_environment(os.environ)
    if names:
        sys.exit(
            "error: these inherited environment variables change generation, caching or "
            "batching and are not accepted; unset them and start again: " + ", ".join(names)
        )


# ---------------------------------------------------------------------------------------
# Command line


def loopback_host(value: str) -> str:
    if value not in LOOPBACK_HOSTS:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not allowed: the server listens on 127.0.0.1 or localhost only"
        )
    return value


def int_in(low, high):
    def parse(value):
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number")
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{number} is outside {low}..{high}")
        return number

    return parse


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options both servers accept; mlx-vlm's own pass through by exact name only."""
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument("--pack", type=Path, help="pack folder (default: this script's folder)")
    parser.add_argument("--model-id", help="public model ID (default: the pack folder's name)")
    parser.add_argument("--host", type=loopback_host, default="127.0.0.1",
                        help="127.0.0.1 (default) or localhost; nothing else is accepted")
    parser.add_argument("--port", type=int_in(1, 65535), default=DEFAULT_PORT)
    mlx_vlm = parser.add_argument_group("mlx-vlm options passed through")
    mlx_vlm.add_argument("--enable-thinking", action="store_true",
                         help="think by default; a request can send \"enable_thinking\": false")
    mlx_vlm.add_argument("--log-level", default="INFO",
                         choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    mlx_vlm.add_argument("--max-tokens", type=int_in(1, 1 << 20),
                         help="default max_tokens of a request (mlx-vlm's default: 2048)")
    mlx_vlm.add_argument("--prefill-step-size", type=int_in(1, 1 << 20),
                         help="prompt tokens per prefill step (mlx-vlm's default: 2048)")
    mlx_vlm.add_argument("--thinking-start-token")
    mlx_vlm.add_argument("--thinking-end-token")
    mlx_vlm.add_argument("--top-logprobs-k", type=int_in(0, 20),
                         help="server cap on top_logprobs (default 0: off)")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args, rest = parser.parse_known_args(argv)
    if rest:
        parser.error(
            f"not accepted: {' '.join(rest)}. Options pass through to mlx-vlm only by their "
            "exact names (no abbreviations); see --help for the full list"
        )
    return args


def pass_options_to_mlx_vlm(args):
    """Hand the pass-through options to mlx-vlm the way its own CLI does: as variables.

    Runs after exit_if_environment_refused, so only these values are in effect.
    """
    os.environ["MLX_VLM_ENABLE_THINKING"] = "1" if args.enable_thinking else "0"
    if args.max_tokens is not None:
        os.environ["MLX_VLM_MAX_TOKENS"] = str(args.max_tokens)
    if args.thinking_start_token is not None:
        os.environ["MLX_VLM_THINKING_START_TOKEN"] = args.thinking_start_token
    if args.thinking_end_token is not None:
        os.environ["MLX_VLM_THINKING_END_TOKEN"] = args.thinking_end_token


def exit_if_pack_invalid(target_dir: Path, drafter_dir: Path = None):
    """dflash2_pack's checks (config, tensor headers, drafter fit), before any weight loads."""
    from dflash2_pack import PackError, check_drafter, check_target

    try:
        check_target(target_dir)
        if drafter_dir is not None:
            check_drafter(drafter_dir, target_dir)
    except PackError as error:
        sys.exit(f"error: {error}")


def public_model_id(requested, pack_dir: Path) -> str:
    model_id = requested or pack_dir.resolve().name
    if not MODEL_ID_PATTERN.fullmatch(model_id):
        what = "--model-id" if requested else f"the folder name {model_id!r}"
        sys.exit(f"error: {what} is not a usable model ID (letters, digits, . _ - and one /); "
                 "pass --model-id NAME")
    return model_id


# ---------------------------------------------------------------------------------------
# Local paths out of headers, errors and logs


class PathScrubber:
    """Replaces known local paths (and their resolved forms) with the public model ID."""

    def __init__(self, paths, replacement: str):
        forms = set()
        for path in paths:
            if path:
                for form in (str(path), os.path.abspath(path), os.path.realpath(path)):
                    form = form.rstrip("/")
                    if len(form) > 1:
                        forms.add(form)
        self.replacement = replacement
        # Longest first, so a model folder inside the home folder is replaced whole;
        # the lookahead keeps /home/a from matching inside /home/ab.
        alternatives = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
        self.pattern = re.compile(f"(?:{alternatives})(?![\\w.-])") if forms else None
        self.pattern_bytes = re.compile(self.pattern.pattern.encode()) if forms else None

    def __call__(self, text: str) -> str:
        return self.pattern.sub(self.replacement, text) if self.pattern else text

    def scrub_bytes(self, data: bytes) -> bytes:
        if not self.pattern_bytes:
            return data
        return self.pattern_bytes.sub(self.replacement.encode(), data)


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
# Per-request record: what was decided, and what generation reported


@dataclass
class RequestRecord:
    id: int
    method: str
    path: str
    mode: str = "plain"  # speculative | fallback | refused | plain
    reason: str = None
    speculative: bool = False
    status: int = None
    tokens: int = 0
    draft_rounds: int = None
    draft_n: int = None
    draft_n_accepted: int = None
    round_counts: object = None  # dflash2_policy.RoundCounts, filled by the round loop as it runs
    peak_memory_gb: float = None

    def header_value(self) -> str:
        if self.mode in ("fallback", "refused"):
            return f"{self.mode}; reason={self.reason}"
        return self.mode

    def note_token(self, token):
        self.tokens += getattr(token, "token_count", 1)
        if token.finish_reason:
            self.peak_memory_gb = token.peak_memory
            self.draft_rounds = token.draft_rounds
            self.draft_n = token.draft_n
            self.draft_n_accepted = token.draft_n_accepted

    def note_round_counts(self, counts):
        self.round_counts = counts

    def token_sources(self) -> dict:
        counts = self.round_counts
        return {"tokens_from_rounds": counts and counts.tokens_from_rounds,
                "tokens_from_plain_steps": counts and counts.tokens_from_plain_steps}

    def finish_summary(self) -> str:
        parts = [f"status={self.status}"]
        if self.tokens:
            parts.append(f"tokens={self.tokens}")
            if self.draft_rounds is not None:
                acceptance = self.draft_n_accepted / self.draft_n if self.draft_n else 0.0
                parts.append(f"rounds={self.draft_rounds} "
                             f"accepted={self.draft_n_accepted}/{self.draft_n} ({acceptance:.0%})")
            if self.round_counts is not None:
                parts.append(" ".join(f"{name}={value}" for name, value in self.token_sources().items()))
            if self.peak_memory_gb is not None:
                parts.append(f"peak_memory={self.peak_memory_gb:.3f}GB")
        return " ".join(parts)


current_request: contextvars.ContextVar = contextvars.ContextVar("current_request", default=None)


class RecordingTokens:
    """mlx-vlm's token iterator, noting counts and draft statistics on the request record."""

    def __init__(self, tokens, record):
        self._tokens = tokens
        self._record = record

    def __iter__(self):
        return self

    def __next__(self):
        token = next(self._tokens)
        if self._record is not None:
            self._record.note_token(token)
        return token

    def close(self):
        self._tokens.close()


# ---------------------------------------------------------------------------------------
# Request validation


class Refusal(Exception):
    """A request the pack does not serve: answered with an OpenAI-shaped 4xx error."""

    def __init__(self, status: int, reason: str, message: str, param: str = None):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.param = param


def invalid(param: str, message: str):
    return Refusal(400, "invalid-request", f"{param}: {message}", param)


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def number_in(low, high):
    def check(name, value):
        if not is_number(value) or not low <= value <= high:
            raise invalid(name, f"must be a number from {low} to {high}")
    return check


def int_at_least(low, high=1 << 31):
    def check(name, value):
        if not is_int(value) or not low <= value <= high:
            raise invalid(name, f"must be a whole number from {low} to {high}")
    return check


def of_type(kind, label):
    def check(name, value):
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise invalid(name, f"must be {label}")
    return check


def check_stream_options(name, value):
    of_type(dict, "an object")(name, value)
    for key, item in value.items():
        if key != "include_usage":
            raise Refusal(400, "unknown-field", f"{name}.{key} is not a known field", f"{name}.{key}")
        of_type(bool, "true or false")(f"{name}.{key}", item)


def check_logit_bias(name, value):
    of_type(dict, "an object of token id to bias")(name, value)
    for key, bias in value.items():
        if not re.fullmatch(r"\d{1,9}", key):
            raise invalid(name, f"key {key!r} is not a token id")
        number_in(-100, 100)(f"{name}.{key}", bias)


def check_tools(name, value):
    if not isinstance(value, list):
        raise invalid(name, "must be a list of tools")
    for index, tool in enumerate(value):
        where = f"{name}[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(where, 'must be {"type": "function", "function": {...}}')
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"{where}.function", "must be an object with a string name")
        if not isinstance(function.get("parameters", {}), dict):
            raise invalid(f"{where}.function.parameters", "must be a JSON schema object")


def check_tool_choice(name, value):
    if value in ("none", "auto", "required"):
        return
    if (isinstance(value, dict) and value.get("type") == "function"
            and isinstance(value.get("function"), dict)
            and isinstance(value["function"].get("name"), str)):
        return
    raise invalid(name, 'must be "none", "auto", "required" or {"type": "function", '
                        '"function": {"name": ...}}')


def check_stop(name, value):
    if value in ("", []):
        return
    raise Refusal(400, "unsupported-field", f"{name}: stop sequences are not supported", name)


def check_response_format(name, value):
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid(name, 'must be an object with a "type"')


def check_metadata(name, value):
    of_type(dict, "an object")(name, value)


def ignore(name, value):
    pass


# Every top-level field a chat request may carry; anything else is refused by name,
# because mlx-vlm would silently ignore it (or, like adapter_path, honour it).
CHAT_FIELDS = {
    "model": of_type(str, "a string"),
    "messages": ignore,  # checked by check_messages
    "max_tokens": int_at_least(1),
    "max_completion_tokens": int_at_least(1),
    "temperature": number_in(0, 2),
    "top_p": number_in(0, 1),
    "top_k": int_at_least(0),
    "min_p": number_in(0, 1),
    "seed": int_at_least(-(1 << 63), 1 << 64),
    "stream": of_type(bool, "true or false"),
    "stream_options": check_stream_options,
    "tools": check_tools,
    "tool_choice": check_tool_choice,
    "parallel_tool_calls": of_type(bool, "true or false"),
    "logprobs": of_type(bool, "true or false"),
    "top_logprobs": int_at_least(0, 20),
    "presence_penalty": number_in(-2, 2),
    "frequency_penalty": number_in(-2, 2),
    "repetition_penalty": number_in(0.01, 10),
    "logit_bias": check_logit_bias,
    "n": int_at_least(1, 128),
    "stop": check_stop,
    "enable_thinking": of_type(bool, "true or false"),
    "reasoning_effort": of_type(str, "a string"),
    "thinking_budget": int_at_least(0),
    "response_format": check_response_format,
    "user": of_type(str, "a string"),
    "metadata": check_metadata,
    "store": of_type(bool, "true or false"),
}
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning"}
MESSAGE_ROLES = {"system", "developer", "user", "assistant", "tool"}


def load_checked_image(url: str, where: str):
    """Returns the image reference mlx-vlm should load, after decoding it once here.

    Only base64 data URLs and local files: the server makes no outbound requests.
    """
    from PIL import Image

    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.startswith("data:image/") or not header.endswith(";base64") or not payload:
            raise Refusal(400, "invalid-image", f"{where}: expected data:image/<type>;base64,<data>", where)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise Refusal(400, "invalid-image", f"{where}: the base64 data is malformed", where)
        source, reference = io.BytesIO(data), url
    elif url.startswith(("http://", "https://")):
        raise Refusal(400, "remote-image",
                      f"{where}: remote image URLs are not fetched; send a base64 data URL "
                      "or a local file path", where)
    else:
        path = unquote(urlparse(url).path) if url.startswith("file://") else url
        if not os.path.isabs(path) or not os.path.isfile(path):
            raise Refusal(400, "invalid-image",
                          f"{where}: not a base64 data URL or an existing absolute file path", where)
        source, reference = path, path
    try:
        with Image.open(source) as image:
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise Refusal(400, "invalid-image", f"{where}: the image is larger than "
                                                    f"{MAX_IMAGE_PIXELS} pixels", where)
            image.load()
    except Refusal:
        raise
    except Exception as exc:
        raise Refusal(400, "invalid-image", f"{where}: not a readable image ({exc})", where)
    return reference


def check_content_parts(parts, role: str, where: str) -> list:
    """Validates a content list and returns it with image references normalised."""
    checked = []
    for index, part in enumerate(parts):
        at = f"{where}[{index}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(at, 'must be an object with a "type"')
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise invalid(f"{at}.text", "must be a string")
            checked.append(part)
        elif kind == "image_url":
            if role != "user":
                raise invalid(at, "images are accepted in user messages only")
            image_url = part.get("image_url")
            if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
                raise invalid(f"{at}.image_url", 'must be {"url": "..."}')
            reference = load_checked_image(image_url["url"], f"{at}.image_url.url")
            checked.append({**part, "image_url": {**image_url, "url": reference}})
        elif kind in ("input_audio", "audio_url", "video_url", "input_video", "video"):
            raise Refusal(400, "unsupported-input",
                          f"{at}: {kind} parts are not supported by this pack (text and images only)", at)
        else:
            raise invalid(f"{at}.type", f"unknown content part type {kind!r}")
    return checked


def check_messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list")
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(where, "must be an object")
        for key in message:
            if key not in MESSAGE_FIELDS:
                raise Refusal(400, "unknown-field", f"{where}.{key} is not a known field", f"{where}.{key}")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise invalid(f"{where}.role", f"must be one of {', '.join(sorted(MESSAGE_ROLES))}")
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": check_content_parts(content, role, f"{where}.content")}
        elif content is None:
            if role != "assistant":
                raise invalid(f"{where}.content", "is required")
        elif not isinstance(content, str):
            raise invalid(f"{where}.content", "must be a string or a list of content parts")
        for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise invalid(f"{where}.{key}", "must be a string")
        if message.get("tool_calls") is not None:
            if role != "assistant" or not isinstance(message["tool_calls"], list):
                raise invalid(f"{where}.tool_calls", "must be a list, on an assistant message")
            for call_index, call in enumerate(message["tool_calls"]):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                        or not isinstance(function.get("arguments", ""), (str, dict)):
                    raise invalid(f"{where}.tool_calls[{call_index}]",
                                  'must be {"type": "function", "function": {"name": ..., "arguments": ...}}')
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise invalid(f"{where}.tool_call_id", "is required on a tool message")
        checked.append(message)
    return checked


def check_chat_request(body, model_id: str) -> dict:
    """Validates a chat completion body; returns it normalised for mlx-vlm.

    Normalised: null fields dropped (null means unset), model filled in when absent,
    max_completion_tokens renamed to max_tokens, image references checked.
    """
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    body = {key: value for key, value in body.items() if value is not None}
    for key, value in body.items():
        check = CHAT_FIELDS.get(key)
        if check is None:
            raise Refusal(400, "unknown-field", f"{key} is not a known field", key)
        check(key, value)
    model = body.setdefault("model", model_id)
    if model != model_id:
        raise Refusal(404, "unknown-model", f"model {model!r} is not served here; this server "
                                            f"serves {model_id!r}", "model")
    if "max_completion_tokens" in body:
        body["max_tokens"] = body.pop("max_completion_tokens")
    if body.get("n", 1) > 1:
        raise Refusal(400, "n-above-1", "n > 1 is not supported: send one request per completion", "n")
    body["messages"] = check_messages(body.get("messages"))
    return body


def has_images(body: dict) -> bool:
    return any(
        isinstance(message.get("content"), list)
        and any(part["type"] == "image_url" for part in message["content"])
        for message in body["messages"]
    )


# ---------------------------------------------------------------------------------------
# The gateway: an ASGI layer in front of mlx-vlm's FastAPI app


@dataclass
class Decision:
    mode: str  # speculative | fallback | plain
    reason: str = None
    body: dict = None


def plain_decision(body: dict) -> Decision:
    return Decision("plain", None, body)


CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
MODELS_PATHS = ("/v1/models", "/models")
HEALTH_PATHS = ("/health", "/v1/health")
ANTHROPIC_PATHS = ("/v1/messages", "/messages", "/v1/messages/count_tokens", "/messages/count_tokens")


def error_payload(status: int, reason: str, message: str, param: str = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": reason}}


def inner_error_message(body: bytes) -> str:
    """The message of an error mlx-vlm produced ({"detail": ...}), without echoed input."""
    try:
        detail = json.loads(body)["detail"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:500] or "request failed"
    if isinstance(detail, list):  # FastAPI validation errors
        return "; ".join(
            f"{'.'.join(str(p) for p in item.get('loc', ())[1:])}: {item.get('msg')}"
            for item in detail if isinstance(item, dict)
        )
    return str(detail)


class Gateway:
    """Serves the pack's endpoints, decides each chat request's route, and forwards the
    request to mlx-vlm's app with a normalised body.

    decide(body) validates and routes a chat body (raising Refusal); header, when set,
    names the response header that carries each response's mode.
    """

    def __init__(self, app, *, model_id, scrubber, decide, header=None, server_mode=("plain", None),
                 health=None):
        self.app = app
        self.model_id = model_id
        self.scrub = scrubber
        self.decide = decide
        self.header = header
        self.server_mode = server_mode
        self.health = health or {}
        self.created = int(time.time())
        self.ids = itertools.count(1)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # websockets (mlx-vlm's realtime API) are not served
            await send({"type": "websocket.close", "code": 1008})
            return
        record = RequestRecord(next(self.ids), scope["method"], scope["path"])
        record.mode, record.reason = self.server_mode
        started = time.perf_counter()
        try:
            await self.handle(scope, receive, self.responder(send, record), record)
        except Refusal as refusal:
            await self.refuse(send, record, refusal)
        except ClientGone:
            record.status = "disconnected"
        except Exception:
            logger.exception("request %d failed", record.id)
            if record.status is None:  # nothing sent yet: answer it, without the traceback
                await send_json(self.responder(send, record), 500, error_payload(
                    500, "server-error", "internal error; the server log has the details"))
        finally:
            logger.info("request %d finished in %.2fs: %s", record.id,
                        time.perf_counter() - started, record.finish_summary())

    def log_arrival(self, record):
        logger.info("request %d %s %s: %s", record.id, record.method, record.path,
                    record.header_value())

    async def refuse(self, send, record, refusal: Refusal):
        record.mode, record.reason = "refused", refusal.reason
        self.log_arrival(record)
        allow = b"POST" if record.path in CHAT_PATHS else b"GET"
        headers = [(b"allow", allow)] if refusal.status == 405 else []
        payload = error_payload(refusal.status, refusal.reason, self.scrub(refusal.message), refusal.param)
        await send_json(self.responder(send, record), refusal.status, payload, headers)

    async def handle(self, scope, receive, send, record):
        method, path = scope["method"], scope["path"]
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if not LOOPBACK_HOST_HEADER.fullmatch(host):
            # A browser page reaching loopback through DNS rebinding sends a foreign Host.
            raise Refusal(421, "invalid-host", "requests must address 127.0.0.1 or localhost")
        if path in ANTHROPIC_PATHS:
            raise Refusal(404, "anthropic-messages",
                          "the Anthropic Messages API is not served; use /v1/chat/completions")
        if path in CHAT_PATHS:
            if method == "OPTIONS":  # CORS preflight, answered by mlx-vlm's CORS layer
                self.log_arrival(record)
                return await self.app(scope, receive, send)
            if method != "POST":
                raise Refusal(405, "method-not-allowed", f"{path} accepts POST only")
            return await self.chat(scope, receive, send, record)
        if method != "GET":
            if path in MODELS_PATHS + HEALTH_PATHS or path.startswith("/v1/models/"):
                raise Refusal(405, "method-not-allowed", f"{path} accepts GET only")
        if path in MODELS_PATHS:
            self.log_arrival(record)
            return await send_json(send, 200, {"object": "list", "data": [self.model_card()]})
        if path.startswith(("/v1/models/", "/models/")):
            requested = unquote(path.split("/models/", 1)[1])
            if requested != self.model_id:
                raise Refusal(404, "unknown-model", f"model {requested!r} is not served here; "
                                                    f"this server serves {self.model_id!r}")
            self.log_arrival(record)
            return await send_json(send, 200, self.model_card())
        if path in HEALTH_PATHS:
            self.log_arrival(record)
            return await send_json(send, 200, {"status": "ok", "model": self.model_id, **self.health})
        raise Refusal(404, "unsupported-endpoint",
                      f"{path} is not served; this pack serves /v1/chat/completions, /v1/models "
                      "and /health")

    def model_card(self):
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "local"}

    async def chat(self, scope, receive, send, record):
        body = await read_body(scope, receive)
        try:
            request = json.loads(body, parse_constant=reject_constant)
        except (ValueError, RecursionError) as exc:
            raise Refusal(400, "invalid-json", f"the request body is not valid JSON ({exc})")
        decision = self.decide(request)
        record.mode, record.reason = decision.mode, decision.reason
        record.speculative = decision.mode == "speculative"
        self.log_arrival(record)

        forwarded = json.dumps(decision.body).encode()
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"content-type")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(forwarded)).encode())]
        body_sent = False

        async def replay():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": forwarded, "more_body": False}
            return await receive()  # lets a streaming response notice a disconnect

        token = current_request.set(record)
        try:
            await self.app({**scope, "headers": headers}, replay,
                           self.reshaped_errors(self.with_token_sources(send, record), record))
        finally:
            current_request.reset(token)

    def responder(self, send, record):
        """Adds the mode header, scrubs header values and notes the status."""
        async def respond(message):
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [(k, self.scrub.scrub_bytes(v)) for k, v in message.get("headers", [])
                           if k.lower() != (self.header or "").encode()]
                if self.header:
                    headers.append((self.header.encode(), record.header_value().encode()))
                message = {**message, "headers": headers}
            await send(message)
        return respond

    def reshaped_errors(self, send, record):
        """mlx-vlm's error responses, rewritten in OpenAI's shape with paths scrubbed."""
        state = {"start": None, "body": b"", "stream": False}

        async def respond(message):
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                state["stream"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                if message["status"] < 400:
                    return await send(message)
                state["start"] = message
                return
            if state["start"] is None:
                if state["stream"] and message.get("body", b"").startswith(b'data: {"error"'):
                    message = {**message, "body": self.stream_error(message["body"])}
                return await send(message)
            state["body"] += message.get("body", b"")
            if message.get("more_body"):
                return
            status, code = state["start"]["status"], "server-error"
            if status < 500:  # FastAPI validation (422) and mlx-vlm's own 4xx: the client's input
                code = "invalid-request"
                record.mode, record.reason = "refused", code
                status = 400 if status == 422 else status
            message_text = self.scrub(inner_error_message(state["body"]))
            await send_json(send, status, error_payload(status, code, message_text))

        return respond

    def with_token_sources(self, send, record):
        """Adds where the tokens came from (rounds or plain steps) to mlx-vlm's timings, in a
        JSON body (sent with its new length) or in a stream's usage chunk."""
        held = {"start": None, "body": b""}

        async def respond(message):
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                if message["status"] != 200 or not content_type.startswith(b"application/json"):
                    return await send(message)
                held["start"] = message
                return
            if held["start"] is None:
                body = message.get("body", b"")
                if body.startswith(b"data: {") and b'"timings"' in body:
                    events = [b"data: " + with_timings(event[6:], record.token_sources())
                              if event.startswith(b"data: {") else event for event in body.split(b"\n\n")]
                    message = {**message, "body": b"\n\n".join(events)}
                return await send(message)
            held["body"] += message.get("body", b"")
            if message.get("more_body"):
                return
            body = with_timings(held["body"], record.token_sources())
            headers = [(k, v) for k, v in held["start"].get("headers", []) if k.lower() != b"content-length"]
            await send({**held["start"], "headers": headers + [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        return respond

    def stream_error(self, event: bytes) -> bytes:
        try:
            error = json.loads(event[len(b"data: "):]).get("error")
        except ValueError:
            error = "generation failed"
        payload = error_payload(500, "server-error", self.scrub(str(error)))
        return b"data: " + json.dumps(payload).encode() + b"\n\n"


def with_timings(payload: bytes, fields: dict) -> bytes:
    """A JSON payload whose final `timings` object (the one with predicted_n) gains fields."""
    try:
        data = json.loads(payload)
    except ValueError:
        return payload
    timings = data.get("timings") if isinstance(data, dict) else None
    if not isinstance(timings, dict) or "predicted_n" not in timings:
        return payload
    timings.update(fields)
    return json.dumps(data).encode()


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


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


async def send_json(send, status: int, payload: dict, headers=()):
    body = json.dumps(payload).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------------------------
# The engine: mlx-vlm's ResponseGenerator, one sequence at a time, locked to the pack


def start_engine(target_dir: Path, model_id: str, *, prefill_step_size=None, top_logprobs_k=None,
                 load_drafter=None):
    """Loads the target (and, through load_drafter(model), a drafter) in mlx-vlm's worker
    thread and wires mlx-vlm's server to it. Returns (generator, mlx-vlm's FastAPI app).

    A drafter is used only for requests whose record says speculative: stock mlx-vlm
    sends every request through a loaded drafter, sampling ones included.
    """
    import mlx.core as mx
    import mlx_vlm.server as server
    from fastapi import HTTPException
    from mlx_vlm.server.generation import ResponseGenerator
    from mlx_vlm.vision_cache import VisionFeatureCache

    app_module = sys.modules["mlx_vlm.server.app"]  # mlx_vlm.server.app is the FastAPI object

    class PackGenerator(ResponseGenerator):
        pack_drafter = None

        def _initialize_model(self):
            super()._initialize_model()  # the target, through mlx-vlm's own loader
            if load_drafter is not None:
                self.pack_drafter, self.draft_kind = load_drafter(self.model)

        def generate(self, prompt, images=None, audio=None, args=None, **kwargs):
            record = current_request.get()
            if args is not None:
                args.pack_record = record  # read back on the worker thread
            ctx, tokens = super().generate(prompt, images, audio, args, **kwargs)
            return ctx, RecordingTokens(tokens, record)

        def _collect_pending_requests(self, *, active, capacity=None, **kwargs):
            # Single sequence: admit the next request only when the running one has
            # finished. The worker then builds a fresh BatchGenerator for it with
            # self.draft_model, which is how each request gets its own route.
            pending, should_stop = super()._collect_pending_requests(
                active=active, capacity=0 if active else 1, **kwargs)
            if pending:
                record = getattr(pending[0].args, "pack_record", None)
                speculative = record is not None and record.speculative
                self.draft_model = self.pack_drafter if speculative else None
                if speculative:  # the round loop hands this request its token counts
                    self.draft_model.round_counts_listener = record.note_round_counts
                mx.reset_peak_memory()  # so each finish line reports its own request's peak
            return pending, should_stop

    vision_cache = VisionFeatureCache(max_size=20)
    generator = PackGenerator(
        model_path=str(target_dir),
        vision_cache=vision_cache,
        top_logprobs_k=top_logprobs_k or 0,
        prefill_step_size=prefill_step_size,
    )
    model, processor, config = generator.wait_until_ready()
    server.runtime.response_generator = generator
    server.runtime.model_cache.set("text_generation", {
        "model_path": model_id, "adapter_path": None, "model": model, "processor": processor,
        "config": config, "vision_cache": vision_cache, "model_kind": "text_generation",
        "response_generator": generator,
    })

    def get_cached_model(model_path, adapter_path=None, *, model_kind="auto"):
        # Replaces mlx-vlm's loader: a request's model field can never load a path.
        if model_path != model_id or model_kind not in ("auto", "text_generation"):
            raise HTTPException(status_code=404, detail=f"model {model_path!r} is not served here")
        return model, processor, config

    stock_template = server.apply_chat_template

    def apply_chat_template(*args, **kwargs):
        # A template that cannot render the client's messages is the client's mistake.
        try:
            return stock_template(*args, **kwargs)
        except Exception as exc:
            raise HTTPException(status_code=400,
                                detail=f"the chat template could not render these messages: {exc}")

    server.get_cached_model = app_module.get_cached_model = get_cached_model
    server.apply_chat_template = apply_chat_template
    return generator, app_module.app


def warm_up(generator, route):
    """One short generation on a route, so compilation is paid before the first request."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.server.generation import GenerationArguments

    prompt = apply_chat_template(generator.processor, generator.config,
                                 [{"role": "user", "content": "Hello"}])
    record = RequestRecord(0, "WARM-UP", route, mode=route, speculative=route == "speculative")
    token = current_request.set(record)
    started = time.perf_counter()
    try:
        _, tokens = generator.generate(prompt, args=GenerationArguments(max_tokens=4, temperature=0.0))
        for _ in tokens:
            pass
    finally:
        current_request.reset(token)
    logger.info("warm-up %s: %d tokens in %.2fs", route, record.tokens, time.perf_counter() - started)


def serve(app, args):
    import uvicorn

    logger.info("serving on http://%s:%d/v1", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False,
                log_level=args.log_level.lower(), server_header=False)


def main(argv=None):
    parser = make_parser("serve.py", "Serve the pack's model plain (no drafter) with mlx-vlm.")
    args = parse_args(parser, argv)
    exit_if_environment_refused()
    from dflash2_pack import find_pack

    pack_dir = (args.pack or Path(__file__).resolve().parent).absolute()
    target_dir, _ = find_pack(pack_dir)
    model_id = public_model_id(args.model_id, pack_dir)
    scrubber = PathScrubber([pack_dir, target_dir, Path.home(), os.environ.get("HOME"), os.getcwd()], model_id)
    setup_logging(args.log_level, scrubber)
    exit_if_pack_invalid(target_dir)
    pass_options_to_mlx_vlm(args)
    generator, inner_app = start_engine(target_dir, model_id, prefill_step_size=args.prefill_step_size,
                                        top_logprobs_k=args.top_logprobs_k)
    warm_up(generator, "plain")
    serve(Gateway(inner_app, model_id=model_id, scrubber=scrubber, decide=lambda body: plain_decision(
        check_chat_request(body, model_id))), args)


if __name__ == "__main__":
    main()
