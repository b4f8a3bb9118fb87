"""The pack's limits and refusals, the checks every API shares, and the chat request.

The chat request's typed models and the checks of every value against the pack; the
Messages and Responses requests (dflash2_messages_request.py, dflash2_responses_request.py)
take the shared checks on their own shapes."""

import base64
import binascii
import io
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union
from urllib.parse import unquote, urlparse

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema,
                      model_validator)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

MAX_IMAGE_PIXELS = 64 * 1024 * 1024
# A request's images are decoded here in full before the model sees them: these bound the
# work and memory one request can ask for (a 2 KB WebP can hold 64 M pixels).
MAX_IMAGES = 64
MAX_REQUEST_PIXELS = 4 * MAX_IMAGE_PIXELS
# Checking and templating a request's messages takes time on the server's one event loop:
# more messages or content parts than this are refused before anything else reads them.
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 4096
MAX_ASPECT_RATIO = 200  # Qwen's image resize refuses more elongated images
MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
UNSUPPORTED_PARTS = ("input_audio", "audio_url", "video_url", "input_video", "video")


class Refusal(Exception):
    """A request the pack does not serve: answered with an OpenAI-shaped 4xx error."""

    def __init__(self, status: int, reason: str, message: str, param: str = None):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.param = param


class InvalidRequest(Refusal):
    """A field whose value the pack does not accept: 400 invalid-request naming it."""

    def __init__(self, param: str, message: str):
        super().__init__(400, "invalid-request", f"{param}: {message}", param)


def context_fields(api: str = "chat") -> tuple:
    """An API's names for what must fit the context: (its prompt, its output limit)."""
    return ("input", "max_output_tokens") if api == "responses" else ("messages", "max_tokens")


def context_refusal(detail: str, api: str = "chat") -> Refusal:
    prompt, limit = context_fields(api)
    return Refusal(400, "context-length-exceeded", f"{prompt}: {detail}; shorten the {prompt} or lower {limit}",
                   prompt)


FLOAT16_MAX = 65504.0


@dataclass(frozen=True)
class PackLimits:
    """What the pack and the server's options allow a request to ask for."""

    model_id: str
    vocab_size: int
    context_length: int
    top_logprobs_k: int = 0
    image_dir: Optional[Path] = None
    max_prompt_chars: Optional[int] = None  # more characters of user text never fit the context
    prompt_chars_limit: Optional[int] = None  # the server's --max-prompt-chars: more are refused untokenized


# ---------------------------------------------------------------------------------------
# Request models: strict types, unknown fields refused


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


@dataclass(frozen=True)
class PackLimit:
    """In a field's type: a bound that the pack or the server's options set, which the checks
    enforce (check_sampling, served_model, load_checked_image, ...) and which the published
    schema states per server: PACK_LIMITS[name](limits), filled in by dflash2_openapi."""

    name: str

    def __get_pydantic_json_schema__(self, core_schema, handler):
        return {**handler(core_schema), "x-pack-limit": self.name}


SERVED_MODEL, CONTEXT, TEMPERATURE, TOP_K, TOP_LOGPROBS, TOKEN_IDS, IMAGE_URL = map(PackLimit, (
    "model", "context", "temperature", "top_k", "top_logprobs", "token_ids", "image_url"))
ServedModel = Optional[Annotated[str, SERVED_MODEL]]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: Annotated[str, IMAGE_URL]
    detail: Optional[Literal["auto", "low", "high"]] = None


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class UnsupportedPart(BaseModel):
    """Audio and video parts: recognised, then refused by name (check_message); not in the
    published schema."""

    model_config = ConfigDict(extra="allow")
    type: Literal[UNSUPPORTED_PARTS]


def misplaced(kinds, message: str):
    """A union member for parts (or blocks) of the given kinds in a role that does not take
    them: recognised, and refused with message ({kind}: the part's type; error_param names the
    part); left out of the published schema, where the role's union lists what it takes."""
    class Misplaced(BaseModel):
        model_config = ConfigDict(extra="allow")
        type: Literal[kinds]

        @model_validator(mode="after")
        def refuse(self):
            raise PydanticCustomError("misplaced", message, {"kind": self.type})

    return SkipJsonSchema[Misplaced]


UserPart = Annotated[Union[TextPart, ImagePart, SkipJsonSchema[UnsupportedPart]], Field(discriminator="type")]
MisplacedImage = misplaced("image_url", "images are accepted in user messages only")
TextOnlyPart = Annotated[Union[TextPart, MisplacedImage, SkipJsonSchema[UnsupportedPart]], Field(discriminator="type")]


class FunctionCall(Strict):
    """An earlier turn's tool call: the chat template renders its arguments, and cannot
    without them."""

    name: str
    arguments: Union[str, dict[str, Any]]


class ToolCall(Strict):
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionCall


class MessageFields(Strict):
    """What every role's message may hold; the roles below say what each requires."""

    name: Optional[str] = None
    tool_calls: None = None  # an assistant's only
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class SystemMessage(MessageFields):
    role: Literal["system", "developer"]
    content: Union[str, list[TextOnlyPart]]


class UserMessage(MessageFields):
    role: Literal["user"]
    content: Union[str, list[UserPart]]


class AssistantMessage(MessageFields):
    """Content may be left out where the turn is tool calls."""

    role: Literal["assistant"]
    content: Union[str, list[TextOnlyPart], None] = None
    tool_calls: Optional[list[ToolCall]] = None


class ToolMessage(MessageFields):
    role: Literal["tool"]
    content: Union[str, list[TextOnlyPart]]
    tool_call_id: str


MESSAGE_ROLES = (SystemMessage, UserMessage, AssistantMessage, ToolMessage)
Message = Annotated[Union[MESSAGE_ROLES], Field(discriminator="role")]

# A character str.strip() keeps: Python's \s takes \x1c-\x1f too, JSON Schema's regexes do not.
NON_BLANK = r"[^\s\x1c-\x1f]"
NON_BLANK_TEXT = {"type": "string", "pattern": NON_BLANK}


def has_text(value) -> bool:
    """Whether value is a string with more than white space in it."""
    return isinstance(value, str) and re.search(NON_BLANK, value) is not None


def nothing_to_answer(where: str) -> PydanticCustomError:
    return PydanticCustomError("nothing_to_answer", f"{where} hold no text (other than white space), image, tool call "
                                                    "or reasoning: there is nothing to answer")


def message_has_input(message) -> bool:
    """Whether mlx-vlm finds input in a chat message (its _message_has_effective_input): text
    other than white space, an image, a tool call, reasoning_content but a system or developer
    message's (mlx-vlm keeps only their content, in the system prompt); or an audio or video
    part, which check_message refuses by name."""
    content = message.content
    if has_text(content) or message.tool_calls:
        return True
    if has_text(message.reasoning_content) and not isinstance(message, SystemMessage):
        return True
    return isinstance(content, list) and any(
        isinstance(part, (ImagePart, UnsupportedPart)) or isinstance(part, TextPart) and has_text(part.text)
        for part in content)


def with_input(messages: list) -> list:
    """mlx-vlm refuses a chat request none of whose messages has input."""
    if not any(message_has_input(message) for message in messages):
        raise nothing_to_answer("the messages")
    return messages


# message_has_input, published: a message with input, among messages.
MESSAGE_WITH_INPUT = {"anyOf": [
    {"required": ["content"], "properties": {"content": {"anyOf": [NON_BLANK_TEXT, {"type": "array", "contains": {
        "anyOf": [{"required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": NON_BLANK_TEXT}},
                  {"required": ["type"], "properties": {"type": {"const": "image_url"}}}]}}]}}},
    {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
    {"required": ["role", "reasoning_content"],
     "properties": {"role": {"enum": ["user", "assistant", "tool"]}, "reasoning_content": NON_BLANK_TEXT}}]}


class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(Strict):
    name: str


class ToolChoice(Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class StreamOptions(Strict):
    include_usage: Optional[bool] = None


# Formats other than text are recognised and refused by name (structured-output).
TEXT_FORMAT_ONLY = WithJsonSchema({"type": "string", "enum": ["text"],
                                   "description": "other formats are refused: structured output is not supported"})


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Annotated[str, TEXT_FORMAT_ONLY]


def number(low, high, limit: PackLimit = None):
    return Optional[Annotated[float, Field(ge=low, le=high), *([limit] if limit else [])]]


def integral(value):
    """A JSON number without a fraction as the integer it is: JSON has one kind of number and
    JSON Schema's "integer" takes 2.0 (a serializer may write one); 2.5 is left to be refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(low, high, limit: PackLimit = None):
    # The bounds before the validator, so that they stay the integer's (and its schema's).
    return Annotated[int, Field(ge=low, le=high), *([limit] if limit else []), BeforeValidator(integral)]


def whole(low, high, limit: PackLimit = None):
    return Optional[integer(low, high, limit)]


StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]


class ChatRequest(Strict):
    """A chat completion request, as this pack serves it (OpenAI's fields it honours)."""

    # top_logprobs above 0 needs logprobs (check_sampling); tool_choice "required" needs tools (check_tools)
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "required"}}},
         "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}]})

    model: ServedModel = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES,
                                             json_schema_extra={"contains": MESSAGE_WITH_INPUT}),
                        AfterValidator(with_input)]
    max_tokens: whole(1, 1 << 31, CONTEXT) = None
    max_completion_tokens: whole(1, 1 << 31, CONTEXT) = None
    temperature: number(0, 2, TEMPERATURE) = None
    top_p: number(0, 1) = None
    top_k: whole(0, 1 << 31, TOP_K) = None
    min_p: number(0, 1) = None
    seed: whole(-(1 << 63), 1 << 64) = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    logprobs: Optional[bool] = None
    top_logprobs: whole(0, 20, TOP_LOGPROBS) = None
    presence_penalty: number(-2, 2) = None
    frequency_penalty: number(-2, 2) = None
    repetition_penalty: number(0.01, 10) = None
    logit_bias: Optional[Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], TOKEN_IDS]] = None
    n: Annotated[whole(1, 128), WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1, "maximum": 1},
                                                          {"type": "null"}],
                                                "description": "n > 1 is refused (n-above-1)"})] = None
    stop: Union[StopSequence, Annotated[list[StopSequence], Field(max_length=MAX_STOP_SEQUENCES)], None] = None
    enable_thinking: Optional[bool] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    thinking_budget: Annotated[whole(0, 1 << 31), WithJsonSchema({
        "type": "null", "description": "thinking budgets are refused (thinking-budget): use enable_thinking"})] = None
    response_format: Optional[ResponseFormat] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None


def error_param(body, error) -> str:
    """The field an error is about, written like messages[0].content: the error's location
    with pydantic's union labels (keys that are not in the request) left out."""
    value, parts = body, []
    loc = error["loc"][:-1] if error["type"] == "misplaced" else error["loc"]  # misplaced(): the part itself
    for index, key in enumerate(loc):
        if (isinstance(value, dict) and key == value.get("type") and index < len(loc) - 1
                and not isinstance(value.get(key), (dict, list))):
            continue  # a discriminated union's tag, where its field of that name cannot hold the rest
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and isinstance(key, int) and key < len(value):
            value = value[key]
        elif not (index == len(loc) - 1 and error["type"] == "missing"):
            continue
        parts.append(key)
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        discriminator = error["ctx"]["discriminator"]  # 'role', or a callable's name: response_item_kind()
        parts.append(discriminator.strip("'") if discriminator.startswith("'") else "type")
    text = ""
    for key in parts:
        text += f"[{key}]" if isinstance(key, int) else f".{key}"
    return text.lstrip(".") or "body"


def refusal_for(body, validation_error: ValidationError) -> Refusal:
    """One refusal for a failed validation: an unknown field if there is one, else the
    first field in error (its deepest location; all messages found there)."""
    errors = validation_error.errors(include_url=False, include_input=False)
    for error in errors:
        if error["type"] == "extra_forbidden":
            param = error_param(body, error)
            return Refusal(400, "unknown-field", f"{param} is not a known field", param)
    first = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
    params = [error_param(body, e) for e in first]
    param = max(params, key=lambda p: p.count(".") + p.count("["))
    messages = dict.fromkeys(e["msg"] for e, p in zip(first, params) if p == param)
    return InvalidRequest(param, " or ".join(messages))


# ---------------------------------------------------------------------------------------
# Checks against the pack


def find_lone_surrogate(value, where="body"):
    """Where a string holds half of a UTF-16 surrogate pair (not valid Unicode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict):
        items = ((f"{where}.{key}".removeprefix("body."), key, item) for key, item in value.items())
    elif isinstance(value, list):
        items = ((f"{where}[{index}]", None, item) for index, item in enumerate(value))
    else:
        return None
    for at, key, item in items:
        if key is not None and find_lone_surrogate(key):
            return where
        found = find_lone_surrogate(item, at)
        if found:
            return found
    return None


def load_checked_image(url: str, where: str, image_dir: Optional[Path], pixels_left: int) -> tuple:
    """(the image reference mlx-vlm should load, its pixels), after decoding it once here.

    Base64 data URLs, and files inside image_dir (--allow-image-dir) when it is set. A
    path is refused with one message whether or not it exists; no outbound requests. An
    image above MAX_IMAGE_PIXELS, or above the request's pixels_left, is refused from its
    header, before it is decoded.
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
                      f"{where}: remote image URLs are not fetched; send a base64 data URL", where)
    else:
        path = unquote(urlparse(url).path) if url.startswith("file://") else url
        real = os.path.realpath(path) if os.path.isabs(path) else None
        if image_dir is None or real is None or not real.startswith(f"{image_dir}{os.sep}") \
                or not os.path.isfile(real):
            raise Refusal(400, "local-image",
                          f"{where}: send images as base64 data URLs; local paths are read only "
                          "from inside the folder the server allows with --allow-image-dir", where)
        source, reference = real, real
    try:
        with Image.open(source) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise Refusal(400, "invalid-image", f"{where}: the image is larger than "
                                                    f"{MAX_IMAGE_PIXELS} pixels", where)
            if width * height > pixels_left:
                raise Refusal(400, "invalid-image", f"{where}: the request's images hold more than "
                                                    f"{MAX_REQUEST_PIXELS} pixels in all", where)
            if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
                raise Refusal(400, "invalid-image", f"{where}: the image is {width}x{height}; "
                                                    f"the aspect ratio may be at most {MAX_ASPECT_RATIO}:1", where)
            image.load()
    except Refusal:
        raise
    except Exception as exc:
        raise Refusal(400, "invalid-image", f"{where}: not a readable image ({exc})", where)
    return reference, width * height


def check_message(raw: dict, message: Message, where: str, limits: PackLimits, pixels_left: int) -> tuple:
    """A message's parts against the pack (its role's model took the rest): (the message with
    its images checked, their pixels), its images within the request's pixels_left."""
    pixels = 0
    if isinstance(message.content, list):
        parts = []
        for index, (raw_part, part) in enumerate(zip(raw["content"], message.content)):
            at = f"{where}.content[{index}]"
            if isinstance(part, UnsupportedPart):
                raise Refusal(400, "unsupported-input",
                              f"{at}: {part.type} parts are not supported by this pack (text and images only)", at)
            if isinstance(part, ImagePart):
                url, size = load_checked_image(part.image_url.url, f"{at}.image_url.url", limits.image_dir,
                                               pixels_left - pixels)
                pixels += size
                raw_part = {**raw_part, "image_url": {**raw_part["image_url"], "url": url}}
            parts.append(raw_part)
        raw = {**raw, "content": parts}
    return raw, pixels


def check_tools(request: ChatRequest):
    names = [tool.function.name for tool in request.tools or []]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise InvalidRequest(f"tools[{index}].function.name", f"{name!r} names two tools")
    if isinstance(request.tool_choice, ToolChoice) and request.tool_choice.function.name not in names:
        raise InvalidRequest("tool_choice.function.name",
                      f"{request.tool_choice.function.name!r} is not one of the request's tools")
    if request.tool_choice == "required" and not names:
        raise InvalidRequest("tool_choice", '"required" needs at least one tool in tools')


def lowest_temperature(vocab_size: int) -> float:
    """The least positive temperature whose sampling stays finite, rounded up to two digits.
    mlx-vlm scales the log-probabilities by 1 / temperature in their dtype (float16 in this
    pack; server/generation.py:196). The likeliest token's is never below -log(vocab), so
    from here (1% to spare for float16's rounding) it and 1 / temperature stay finite. Below
    it every token can overflow to -inf: the softmax is NaN and the sampler picks token 0
    each step."""
    bound = 1.01 * max(1.0, math.log(vocab_size)) / FLOAT16_MAX
    scale = 10.0 ** (1 - math.floor(math.log10(bound)))
    return math.ceil(bound * scale) / scale


def token_id_pattern(vocab_size: int) -> str:
    """A regular expression for the token ids 0 to vocab_size - 1 as decimal JSON keys
    (logit_bias's), without leading zeros."""
    top = str(vocab_size - 1)
    options = [f"0|[1-9][0-9]{{0,{len(top) - 2}}}"] if len(top) > 1 else []  # the shorter numbers
    for index, digit in enumerate(top):  # as long as top: a smaller digit here, any digits after
        low = "1" if index == 0 and len(top) > 1 else "0"
        if digit > low:
            rest = len(top) - index - 1
            options.append(f"{top[:index]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    return f"^({'|'.join([*options, top])})$"


def check_sampling(request, limits: PackLimits):
    """Sampling values against the pack: a temperature its sampler can take, and values
    that index the vocabulary."""
    lowest = lowest_temperature(limits.vocab_size)
    temperature = getattr(request, "temperature", None)
    if temperature and temperature < lowest:
        raise InvalidRequest("temperature", f"must be 0 (greedy) or at least {lowest:g}: sampling below that "
                                            "overflows the model's float16 log-probabilities")
    if getattr(request, "top_k", None) is not None and request.top_k >= limits.vocab_size:
        raise InvalidRequest("top_k", f"must be from 0 (off) to {limits.vocab_size - 1}")
    token_id = token_id_pattern(limits.vocab_size)
    for key in getattr(request, "logit_bias", None) or {}:
        if not re.fullmatch(token_id, key):
            raise InvalidRequest("logit_bias", f"key {key!r} is not a token id from 0 to {limits.vocab_size - 1}")
    if getattr(request, "top_logprobs", None):
        if not request.logprobs:
            raise InvalidRequest("top_logprobs", 'needs "logprobs": true')
        if request.top_logprobs > limits.top_logprobs_k:
            raise InvalidRequest("top_logprobs", f"this server returns at most {limits.top_logprobs_k} "
                                          "alternatives per token (its --top-logprobs-k)")


DATA_IMAGE_URL = "^data:image/[^,]*;base64,."  # load_checked_image's base64 data URL
# The published schema's bounds, by PackLimit name: what the checks above (and served_model,
# load_checked_image, check_chat_request's context check) enforce.
PACK_LIMITS = {
    "model": lambda limits: {"enum": [limits.model_id]},
    "context": lambda limits: {"maximum": limits.context_length},
    "top_k": lambda limits: {"maximum": limits.vocab_size - 1},
    "top_logprobs": lambda limits: {"maximum": min(20, limits.top_logprobs_k)},
    "temperature": lambda limits: {"anyOf": [{"maximum": 0}, {"minimum": lowest_temperature(limits.vocab_size)}]},
    "token_ids": lambda limits: {"propertyNames": {"pattern": token_id_pattern(limits.vocab_size)}},
    # With --allow-image-dir, also absolute paths and file:// URLs (of files inside that folder).
    "image_url": lambda limits: {"pattern": DATA_IMAGE_URL if limits.image_dir is None else
                                 f"({DATA_IMAGE_URL}|^/|^file://)"},
}


def rendered_text_chars(request: ChatRequest) -> int:
    """Characters of the text every chat template renders as is: the system, user and tool
    messages' (an assistant message's may be cut: templates drop earlier turns' thinking)."""
    total = 0
    for message in request.messages:
        if message.role == "assistant":
            continue
        if isinstance(message.content, str):
            total += len(message.content)
        elif message.content:
            total += sum(len(part.text) for part in message.content if isinstance(part, TextPart))
    return total


def request_text_chars(body: dict, fields=("messages", "tools"), skip=("role", "type", "image_url")) -> int:
    """Characters of every string in a request's messages and tools, whatever its role or
    field (assistant turns, tool calls' arguments, tool schemas): all the text the template
    may hand the tokenizer. Left out: roles and part types (the template's own markers) and
    image URLs (their own limits bound them)."""
    total, stack = 0, [body.get(name) for name in fields]
    while stack:  # a walk, not recursion: JSON may nest deeper than Python's stack
        value = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            stack.extend(item for key, item in value.items() if key not in skip)
        elif isinstance(value, list):
            stack.extend(value)
    return total


def check_counts(param: str, items: list, item_word: str, parts: list, part_word: str, image_type: str):
    """The counts that bound a request's checking, before it is parsed into models (every
    API's): its messages or input items, their content parts, and the images among those."""
    if len(items) > MAX_MESSAGES:
        raise InvalidRequest(param, f"{len(items)} {item_word}; this server takes at most {MAX_MESSAGES}")
    if len(parts) > MAX_CONTENT_PARTS:
        raise InvalidRequest(param, f"{len(parts)} {part_word} in all; this server takes at most {MAX_CONTENT_PARTS}")
    images = sum(isinstance(part, dict) and part.get("type") == image_type for part in parts)
    if images > MAX_IMAGES:
        raise InvalidRequest(param, f"{images} images in all; this server takes at most {MAX_IMAGES} a request")


def check_sizes(body: dict):
    """check_counts for a chat body: messages, content parts and images."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return  # the model's validation names what is wrong
    parts = [part for message in messages if isinstance(message, dict) and isinstance(message.get("content"), list)
             for part in message["content"]]
    check_counts("messages", messages, "messages", parts, "content parts", "image_url")


def json_object(body) -> dict:
    """A body every API takes further: a JSON object of valid Unicode, its null fields
    dropped (null means unset)."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    where = find_lone_surrogate(body)
    if where:
        raise InvalidRequest(where, "holds a lone UTF-16 surrogate, which is not valid Unicode")
    return {key: value for key, value in body.items() if value is not None}


def validated(body: dict, request_model):
    """The body as its API's request model, or the Refusal naming the first field wrong;
    integers sent as 2.0 go on as 2."""
    try:
        request = request_model.model_validate(body)
    except ValidationError as error:
        raise refusal_for(body, error) from None
    for name, value in body.items():
        if isinstance(value, float) and isinstance(getattr(request, name, None), int):
            body[name] = getattr(request, name)
    return request


def served_model(body: dict, limits: PackLimits) -> None:
    """Fills in the served model where the body names none; refuses any other."""
    model = body.setdefault("model", limits.model_id)
    if model != limits.model_id:
        raise Refusal(404, "unknown-model", f"model {model!r} is not served here; this server "
                                            f"serves {limits.model_id!r}", "model")


def check_chat_request(body, limits: PackLimits) -> dict:
    """Validates a chat completion body; returns it normalised for mlx-vlm.

    Normalised: null fields dropped (null means unset), model filled in when absent,
    max_completion_tokens renamed to max_tokens, stop made a list, image references
    checked.
    """
    body = json_object(body)
    check_sizes(body)
    request = validated(body, ChatRequest)
    served_model(body, limits)
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name, 0) > limits.context_length:
            raise InvalidRequest(name, f"must be at most {limits.context_length}, the model's context length")
    if "max_completion_tokens" in body:
        body["max_tokens"] = body.pop("max_completion_tokens")
    if body.get("n", 1) > 1:
        raise Refusal(400, "n-above-1", "n > 1 is not supported: send one request per completion", "n")
    check_sampling(request, limits)
    check_tools(request)
    if isinstance(body.get("stop"), str):
        body["stop"] = [body["stop"]]
    # Refused before anything tokenizes them (about a second a megabyte, one request at a time);
    # shorter prompts are measured after tokenizing.
    if limits.max_prompt_chars is not None and rendered_text_chars(request) > limits.max_prompt_chars:
        raise context_refusal(f"the system, user and tool messages hold more than {limits.max_prompt_chars} "
                              f"characters, more than the model's context of {limits.context_length} tokens can take")
    chars = request_text_chars(body)
    if limits.prompt_chars_limit is not None and chars > limits.prompt_chars_limit:
        raise Refusal(400, "prompt-too-long", f"messages: the messages and tools hold {chars} characters of text; "
                      f"this server takes at most {limits.prompt_chars_limit} (its --max-prompt-chars)", "messages")
    checked, pixels = [], 0
    for index, (raw, message) in enumerate(zip(body["messages"], request.messages)):
        raw, used = check_message(raw, message, f"messages[{index}]", limits, MAX_REQUEST_PIXELS - pixels)
        checked.append(raw)
        pixels += used
    body["messages"] = checked
    return body
